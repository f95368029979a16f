"""Structured output (``response_format`` json_schema / json_object, utils/generation/
constrained.py) in the engine: a constrained row's mask leaves its batch neighbours' tokens as
they are alone, and its reply validates (`jsonschema`) on tiny random models whose text is JSON
only because the mask makes it so; schemas the grammar compiler cannot enforce are named; the
vocabulary adapter's bytes are each tokenizer's own (SentencePiece, byte-level BPE, SmolLM2's).
Through the official `openai` client against a live server (chat and completions, streamed and
not, a 400 naming an unsupported feature, 32 mixed concurrent requests each equal to its lone
run): tests/test_serve.py, on its module's server, with the schemas below."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tests.conftest import SAMPLES, bpe_tokenizer, spm_tokenizer

NAME_AGE = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
SCHEMAS = {
    "required_fields": NAME_AGE,
    "nested": {"type": "object", "additionalProperties": False, "required": ["person", "ok"],
               "properties": {"person": NAME_AGE, "ok": {"type": "boolean"}}},
    "enum_and_array": {"type": "object", "additionalProperties": False, "required": ["colors", "size"],
                       "properties": {"colors": {"type": "array", "maxItems": 3,
                                                 "items": {"enum": ["red", "green", "blue"]}},
                                      "size": {"enum": ["S", "M", "L", 42, None]}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["x", "n"],
                "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                               "n": {"type": "integer", "minimum": 10, "maximum": 99}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2,
                         "items": {"type": "object", "additionalProperties": False, "required": ["id"],
                                   "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "tag": {"type": "string", "maxLength": 6}}}},
}
MAX_TOKENS = 160


def _tiny(tok, seed: int = 0):
    import model as model_lib
    torch.manual_seed(seed)
    return model_lib.create_model(model_lib.ModelArgs(vocab_size=len(tok), d_model=64, n_layers=1, n_heads=4,
                                                      n_kv_heads=2, max_seq_len=256, bos_id=tok.bos_token_id))


@pytest.mark.parametrize("tok_kind", ["sentencepiece", "byte_level_bpe"])
def test_a_masked_row_leaves_its_batch_neighbours_tokens_as_they_are_alone(tok_kind):
    """In one batcher step after step: a free row (greedy, then sampled) beside a constrained
    one gets exactly its lone run's tokens; the constrained row gets its lone run's too, and its
    text is valid JSON."""
    from utils.generation.constrained import json_grammar
    from utils.generation.engine import Engine, SamplingParams, Sequence
    tok = spm_tokenizer() if tok_kind == "sentencepiece" else bpe_tokenizer()
    engine = Engine(_tiny(tok))
    grammar, stops = json_grammar(SCHEMAS["nested"]), frozenset({tok.eos_token_id})

    def run(*params) -> list[list[int]]:
        b = engine.batcher(2, 256)
        seqs = [b.add(Sequence([tok.bos_token_id, 11, 12], p, tok=tok)) for p in params]
        for _ in engine.run(b):
            pass
        return [s.tokens for s in seqs]
    for temperature in (0.0, 1.0):
        free = SamplingParams(40, temperature, seed=3, stop_ids=stops)
        held = SamplingParams(MAX_TOKENS, temperature, seed=4, stop_ids=stops, grammar=grammar)
        together = run(free, held)
        assert together == [run(free)[0], run(held)[0]]
        jsonschema.validate(json.loads(tok.decode(together[1])), SCHEMAS["nested"])
        assert len(together[0]) == 40


def test_the_vocabulary_bytes_are_each_tokenizer_s_own():
    """Every token id's bytes (utils/generation/vocab.py), joined over a text's ids, are the
    text's UTF-8 (a SentencePiece text: with the space its first word piece carries), for the
    sample SentencePiece tokenizer, a trained byte-level BPE and SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from utils.data.tok import encode_plain
    from utils.generation.vocab import vocab_bytes
    text = 'Grüße {"a": [1, 2.5e3, "日本🧪"]}\n\t  end'
    smol = AutoTokenizer.from_pretrained(SAMPLES / "smollm2" / "SmolLM2-135M-Instruct")
    for tok, lead in ((spm_tokenizer(), " "), (bpe_tokenizer(), ""), (smol, "")):
        table = vocab_bytes(tok, len(tok) + 5)
        ids = encode_plain(tok, [text])[0]
        assert b"".join(table[i] for i in ids) == (lead + text).encode("utf-8"), type(tok)
        assert table[-5:] == [b""] * 5


def test_a_grammar_that_fails_ends_its_own_sequence_with_an_error_and_no_other():
    """A grammar llguidance cannot build (not one serve makes: it compiles each request's schema
    first) ends that sequence with ``finish == "error"`` naming it; its batch neighbour runs on."""
    from utils.generation.engine import Engine, SamplingParams, Sequence
    tok = spm_tokenizer()
    engine = Engine(_tiny(tok))
    b = engine.batcher(2, 256)
    free = b.add(Sequence([tok.bos_token_id, 11], SamplingParams(6, 0.0), tok=tok))
    bad = b.add(Sequence([tok.bos_token_id, 12], SamplingParams(6, 0.0, grammar='{"grammars": 7}'), tok=tok))
    for _ in engine.run(b):
        pass
    assert bad.finish == "error" and bad.tokens == [] and "the output grammar failed" in bad.error
    assert free.finish == "length" and len(free.tokens) == 6
