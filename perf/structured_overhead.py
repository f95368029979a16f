"""Structured output's cost on CPU: the constrained-decoding candidates' step per token, and the
engine's decoding under a JSON schema against without one (utils/generation/constrained.py).

    python perf/structured_overhead.py [--repeats 5] [--tokens 48] [--no-smollm2]

1. Libraries, per tokenizer (SmolLM2-135M-Instruct's, 49,152 tokens; the sample SentencePiece
   Mistral v1, 32,000; a byte-level BPE of 4,000 trained on the news sample): the one-off
   vocabulary build and schema compile, then, along the same byte-exact token ids of one valid
   JSON document, the next-token mask plus the advance, in microseconds per token (interleaved
   repeats, min / median / max). llguidance is what serve uses (requirements.txt); outlines-core
   and xgrammar are measured when they import, and are not project requirements (xgrammar's
   wheel requires torch, transformers and triton): put them in a folder of their own,
   ``pip install --no-deps --target DIR outlines-core==0.2.14 xgrammar==0.2.9
   apache-tvm-ffi==0.1.15.post2``, and run with ``PYTHONPATH=DIR``.
2. Engine: greedy decoding of SmolLM2-135M (imported from data/samples/smollm2, fp32) and of a
   7m random model (the sample SentencePiece vocabulary), batches of 1 and 4 rows, free against
   constrained by ``RECORDS`` (an array of at least 1,000 ``SCHEMA`` records, which no row
   completes: every row of both runs decodes ``--tokens`` tokens, the free ones with EOS off),
   the same prompts: milliseconds per decoded token after the first (prefill excluded),
   interleaved repeats, and the ratio constrained / free (min / median / max over repeats);
   and, since a loaded machine's noise can exceed the difference, the constrained row's own
   work (its mask computed and applied, its token taken) replayed along the tokens it decoded,
   in microseconds and as a share of a free token.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SMOLLM2 = ROOT / "data" / "samples" / "smollm2" / "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags", "scores", "author"],
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "scores": {"type": "array", "items": {"type": "number"}},
                         "author": {"type": "object", "required": ["name", "alive"],
                                    "properties": {"name": {"type": "string"}, "alive": {"type": "boolean"},
                                                   "genre": {"enum": ["novel", "poem", "essay"]}}}}}
DOC = {"title": "The history of the \"long\" river, told in full", "year": 1925,
       "tags": ["history", "rivers", "naturaleza", "日本"], "scores": [4.5, -0.25, 1e3, 7],
       "author": {"name": "Ada Lovelace-Smith", "alive": False, "genre": "essay"}}
RECORDS = {"type": "array", "minItems": 1000, "items": SCHEMA}     # never complete within --tokens
PROMPT = "Write a JSON record of a famous book: its title, year, tags, scores and author.\n"


def spread(xs, fmt: str) -> str:
    return f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  max {format(max(xs), fmt)}"


def tokenizers() -> dict:
    from transformers import AutoTokenizer

    from tests.conftest import SPM_MODEL, news_lines
    from tokenizer import train_bpe
    from utils.data.tok import load_tokenizer_from
    return {"SmolLM2 (HF, 49k)": AutoTokenizer.from_pretrained(SMOLLM2),
            "sample SentencePiece (32k)": load_tokenizer_from(str(SPM_MODEL)),
            "byte-level BPE (4k, trained)": train_bpe(news_lines(3000), 4000)}


# --------------------------------------------------------------------------- 1. the libraries
def llguidance_case(tok, table, path):
    import llguidance
    import numpy as np

    from utils.generation.constrained import Grammars, json_grammar
    t = time.perf_counter()
    lt = Grammars().vocabulary(tok, len(table))
    built = time.perf_counter() - t
    t = time.perf_counter()
    grammar = json_grammar(SCHEMA)
    llguidance.LLMatcher(lt, grammar, log_level=0)
    compiled = time.perf_counter() - t

    mask = np.zeros((len(table) + 31) // 32, dtype=np.int32)

    def run():
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        for tok_id in path:
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            assert m.consume_token(tok_id), m.get_error()
    return built, compiled, run


def outlines_case(tok, table, path):
    import numpy as np
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    from utils.generation.constrained import WHITESPACE
    t = time.perf_counter()
    words: dict = {}
    specials = set(tok.all_special_ids)
    for i, b in enumerate(table):
        if b and i not in specials and i != tok.eos_token_id:
            words.setdefault(b, []).append(i)
    vocab = outlines_core.Vocabulary(tok.eos_token_id, words)
    built = time.perf_counter() - t
    t = time.perf_counter()
    index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA), WHITESPACE), vocab)
    compiled = time.perf_counter() - t
    mask = np.zeros((len(table) + 31) // 32, dtype=np.int32)

    def run():
        g = outlines_core.Guide(index)
        for tok_id in path:
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            g.advance(tok_id, return_tokens=False)
    return built, compiled, run


def xgrammar_case(tok, table, path):
    import xgrammar
    t = time.perf_counter()
    info = xgrammar.TokenizerInfo(table, vocab_type=xgrammar.VocabType.RAW, vocab_size=len(table),
                                  stop_token_ids=[tok.eos_token_id])
    compiler = xgrammar.GrammarCompiler(info)
    built = time.perf_counter() - t
    t = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compiled = time.perf_counter() - t
    mask = xgrammar.allocate_token_bitmask(1, len(table))

    def run():
        m = xgrammar.GrammarMatcher(compiled_grammar)
        for tok_id in path:
            m.fill_next_token_bitmask(mask)
            assert m.accept_token(tok_id)
    return built, compiled, run


def libraries(toks: dict, repeats: int) -> None:
    import importlib.util

    from utils.generation.constrained import Grammars
    from utils.generation.vocab import vocab_bytes
    cases = {"llguidance": llguidance_case, "outlines-core": outlines_case, "xgrammar": xgrammar_case}
    missing = [n for n, mod in (("outlines-core", "outlines_core"), ("xgrammar", "xgrammar"))
               if importlib.util.find_spec(mod) is None]
    for name in missing:
        print(f"  {name}: not importable here, not measured (see the module docstring)")
        cases.pop(name)
    text = json.dumps(DOC, separators=(",", ":"), ensure_ascii=False)
    for label, tok in toks.items():
        table = vocab_bytes(tok, len(tok))
        path = Grammars().vocabulary(tok, len(table)).tokenize_str(text)     # byte-exact ids
        assert b"".join(table[i] for i in path) == text.encode()
        print(f"\n  {label}: a {len(path)}-token document")
        runs = {}
        for name, case in cases.items():
            built, compiled, runs[name] = case(tok, table, path)
            print(f"    {name:14s} vocabulary {built * 1e3:7.0f} ms   schema compile {compiled * 1e3:7.1f} ms")
        times = {name: [] for name in runs}
        for _ in range(repeats):                                          # interleaved
            for name, run in runs.items():
                t = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - t) / len(path) * 1e6)
        for name, xs in times.items():
            print(f"    {name:14s} mask + advance, us/token: {spread(xs, '7.1f')}")


# --------------------------------------------------------------------------- 2. the engine
def decode_ms_per_token(engine, tok, prompts, tokens: int, grammar) -> tuple[float, list]:
    """Greedy decoding of ``prompts`` together: ms per new token after each row's first, and
    the rows' tokens."""
    from utils.generation.engine import SamplingParams, Sequence
    b = engine.batcher(len(prompts), max(len(p) for p in prompts) + tokens + 1)
    stops = frozenset({tok.eos_token_id}) if grammar else frozenset()
    seqs = [b.add(Sequence(p, SamplingParams(tokens, 0.0, stop_ids=stops, grammar=grammar), tok=tok))
            for p in prompts]
    steps = engine.run(b)
    next(steps)                                                          # the prefills' first tokens
    t = time.perf_counter()
    for _ in steps:
        pass
    decoded = sum(len(s.tokens) - 1 for s in seqs)
    assert decoded == len(seqs) * (tokens - 1), [s.finish for s in seqs]
    return (time.perf_counter() - t) / max(1, decoded) * 1e3, [s.tokens for s in seqs]


def constraint_us_per_token(engine, tok, grammar, tokens: list, vocab: int) -> float:
    """The constrained row's own work per token (mask computed, applied to a logits row,
    token taken), replayed along ``tokens``: microseconds."""
    import torch
    row = torch.zeros(vocab)
    c = engine.grammars.start(grammar, tok, vocab, frozenset({tok.eos_token_id}))
    t = time.perf_counter()
    for tok_id in tokens:
        c.mask(row, c.allowed())
        c.advance(tok_id)
    return (time.perf_counter() - t) / len(tokens) * 1e6


def engine_overhead(models: dict, repeats: int, tokens: int) -> None:
    from utils.data.tok import encode_plain
    from utils.generation.constrained import json_grammar
    from utils.generation.engine import Engine
    grammar = json_grammar(RECORDS)
    for label, (model, tok) in models.items():
        engine = Engine(model)
        base = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + encode_plain(tok, [PROMPT])[0]
        for batch in (1, 4):
            prompts = [base + encode_plain(tok, [f"Book {i}:"])[0] for i in range(batch)]
            decode_ms_per_token(engine, tok, prompts, 4, grammar)          # warm-up: pack, vocabulary
            free, held, own = [], [], []
            for _ in range(repeats):
                free.append(decode_ms_per_token(engine, tok, prompts, tokens, None)[0])
                ms, rows = decode_ms_per_token(engine, tok, prompts, tokens, grammar)
                held.append(ms)
                own.append(constraint_us_per_token(engine, tok, grammar, rows[0], model.args.vocab_size))
            ratio = [h / f for f, h in zip(free, held)]
            print(f"  {label}, batch {batch}: free {spread(free, '.2f')} ms/token; constrained "
                  f"{spread(held, '.2f')} ms/token; ratio {spread(ratio, '.2f')}")
            if batch == 1:
                share = [u / 1e3 / f for u, f in zip(own, free)]
                print(f"    a constrained row's own work (mask, apply, advance; replayed): {spread(own, '.0f')} "
                      f"us/token = {spread([x * 100 for x in share], '.2f')} % of a free token")


def engine_models(smollm2: bool, toks: dict) -> dict:
    import torch

    import model as M
    out = {}
    if smollm2:
        from utils.hf.import_hf import load_hf_llama
        imp = load_hf_llama(SMOLLM2)
        out["SmolLM2-135M fp32"] = (imp.model, imp.tok)
    tok = toks["sample SentencePiece (32k)"]
    torch.manual_seed(0)
    tiny = M.create_model(M.ModelArgs(vocab_size=len(tok), d_model=192, n_layers=4, n_heads=6, n_kv_heads=2,
                                      max_seq_len=512, bos_id=tok.bos_token_id)).eval()
    out["7m random (32k SentencePiece)"] = (tiny, tok)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per row at most (engine part)")
    ap.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2 in the engine part")
    a = ap.parse_args()
    import torch
    print(f"perf/structured_overhead.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    toks = tokenizers()
    print("1. constrained-decoding libraries: the JSON schema's mask + advance per token")
    libraries(toks, a.repeats)
    print("\n2. engine decoding, greedy: free against constrained by the schema")
    with torch.no_grad():
        engine_overhead(engine_models(not a.no_smollm2, toks), a.repeats, a.tokens)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
