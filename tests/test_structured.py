"""Structured output (``response_format`` json_schema / json_object): a live `main.py serve` on
127.0.0.1 driven by the official `openai` client, chat and completions, streamed and not, on
tiny random models (whose replies are JSON only because the grammar's mask makes them so),
each reply parsed and validated with `jsonschema`; a 400 naming an unsupported schema feature;
the engine's per-row masks leave a free neighbour's tokens as they are alone; the vocabulary
adapter's bytes are each tokenizer's own (SentencePiece, byte-level BPE, SmolLM2's). Every
request loop is bounded in count and time."""
from __future__ import annotations

import concurrent.futures as cf
import json

import jsonschema
import openai
import pytest
import torch

from tests.conftest import SAMPLES, bpe_tokenizer, spm_tokenizer, write_config
from tests.test_serve import Server
from tests.test_sft import TOK_NAME, make_checkpoint

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


@pytest.fixture(scope="module")
def work(tmp_path_factory, samples):
    from utils.data import sft
    root = tmp_path_factory.mktemp("structured")
    cfg = write_config(root, {"tokenizer": {"name": TOK_NAME}, "serve": {"max_batch": 4}})
    ck = root / "checkpoints"
    chat = make_checkpoint(ck / "sft_chat" / "checkpoint_best.pt", kind="sft", seed=3,
                           chat_template=sft.default_template())
    base = make_checkpoint(ck / "base" / "checkpoint_best.pt", seed=1)
    return {"root": root, "cfg": cfg, "chat": chat, "base": base}


@pytest.fixture(scope="module")
def server(work):
    s = Server(work["root"], work["cfg"], "--checkpoint", work["chat"].parent, "--checkpoint", work["base"])
    yield s
    s.client.close()                    # its kept-alive connection would hold the shutdown up
    assert s.stop() == 130, s.stderr()


def _fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _chat(server, fmt, stream: bool, seed: int, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kw = dict(model="sft_chat", messages=[{"role": "user", "content": "Describe someone as JSON."}],
              max_tokens=max_tokens, temperature=1.0, seed=seed, response_format=fmt)
    if not stream:
        r = server.client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in server.client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return text, reason


def _completion(server, fmt, stream: bool, seed: int, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kw = dict(model="base", prompt="The record:", max_tokens=max_tokens, temperature=1.0, seed=seed,
              extra_body={"response_format": fmt})      # the client's completions take it as an extra
    if not stream:
        r = server.client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in server.client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            reason = ch.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_reply_is_json_valid_against_its_schema_chat_and_completions_streamed_and_not(server, name):
    """A random model under the grammar's mask: chat and completions, streamed and not, each reply
    parses and validates, and ends by itself ("stop") well within max_tokens; a streamed reply
    is the same text as the plain one of the same seed."""
    for ask in (_chat, _completion):
        plain, plain_reason = ask(server, _fmt(name), False, seed=7)
        streamed, streamed_reason = ask(server, _fmt(name), True, seed=7)
        assert plain_reason == streamed_reason == "stop", (ask.__name__, plain)
        assert streamed == plain
        jsonschema.validate(json.loads(plain), SCHEMAS[name])


def test_json_object_replies_parse_and_a_cut_off_is_length(server):
    """json_object: any JSON object; a max_tokens cut-off before the JSON is complete finishes
    "length" with the text as far as it got (as OpenAI's API does)."""
    for seed in (1, 2):
        text, reason = _chat(server, {"type": "json_object"}, False, seed=seed, max_tokens=230)
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)
    text, reason = _completion(server, _fmt("nested"), False, seed=7, max_tokens=3)
    assert reason == "length" and text.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_unsupported_schema_features_and_bad_formats_get_a_400_naming_them(server):
    c = server.client
    msgs = [{"role": "user", "content": "Hi"}]
    bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="sft_chat", messages=msgs, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "unsupported_schema", err
    assert err["param"] == "response_format.json_schema.schema" and '"not"' in err["message"], err
    for fmt, param in (({"type": "yaml"}, "response_format.type"),
                       ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
                        "response_format.json_schema.schema")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="base", prompt="x", max_tokens=4, extra_body={"response_format": fmt})
        assert e.value.body["param"] == param, e.value.body


def test_mixed_concurrent_requests_each_equal_their_lone_run(server):
    """32 concurrent requests on 4 slots, free and constrained, greedy and sampled: each equals
    the same request sent alone (a constrained neighbour changes no free row's tokens)."""
    reqs = [dict(model="base", prompt=f"Item {i}:", max_tokens=50 if i % 2 else 10 + (i * 5) % 20,
                 temperature=0 if i % 3 == 0 else 0.9, seed=50 + i,
                 extra_body={"response_format": _fmt("required_fields")} if i % 2 else {})
            for i in range(32)]

    def ask(kw):
        r = server.client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(32) as ex:
        together = list(ex.map(ask, reqs))
    alone = [ask(kw) for kw in reqs]
    assert together == alone
    for kw, (text, reason) in zip(reqs, together):
        if kw["extra_body"]:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS["required_fields"])


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
