"""Passkey retrieval (utils/bench/passkey.py, ``benchmark --tasks passkey``): the prompt text,
needle depth and token-length fitting on hand-checked examples with the sample Llama-style
tokenizer, scoring by the first integer, seeded keys, the grid with a model that can and a
model that cannot answer (beyond-context lengths reported, not truncated), and the CLI's
files (JSON grid, text table, heat-map PNGs) for a standard and an infini checkpoint."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, SPM_MODEL, offline_env, write_config
from utils.bench import passkey as P

INSTR = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize them. I will quiz you about the important information there.")


@pytest.fixture(scope="module")
def tok():
    from utils.data.tok import load_tokenizer_from
    return load_tokenizer_from(str(SPM_MODEL))


def test_prompt_text_and_needle_depth_by_hand():
    assert P.prompt_text(12345, 0, 50) == (
        INSTR + "\nThe pass key is 12345. Remember it. 12345 is the pass key.\n"
        "What is the pass key? The pass key is")
    assert P.prompt_text(70001, 7, 0) == (
        INSTR + "\nThe pass key is 70001. Remember it. 70001 is the pass key.\n"
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
        "again. The grass is green. The sky is blue.\nWhat is the pass key? The pass key is")
    assert P.prompt_text(70001, 7, 100) == (
        INSTR + "\nThe grass is green. The sky is blue. The sun is yellow. Here we go. There and "
        "back again. The grass is green. The sky is blue.\nThe pass key is 70001. Remember it. "
        "70001 is the pass key.\nWhat is the pass key? The pass key is")
    # depth 30% of 10 sentences: the needle after 3 of them, the cycle continues after it
    text = P.prompt_text(55555, 10, 30)
    before, after = text.split("\nThe pass key is 55555. Remember it. 55555 is the pass key.\n")
    assert before == INSTR + "\nThe grass is green. The sky is blue. The sun is yellow."
    assert after == ("Here we go. There and back again. The grass is green. The sky is blue. The "
                     "sun is yellow. Here we go. There and back again.\nWhat is the pass key? "
                     "The pass key is")
    assert [round(10 * d / 100) for d in P.DEPTHS] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_first_integer_scoring():
    assert P.first_integer(" 12345. Remember it.") == "12345"
    assert P.first_integer(" 1234 5") == "1234"              # a split number is wrong
    assert P.first_integer("the key: -42, then 7") == "42"
    assert P.first_integer(" 123456") == "123456"            # != "12345": wrong
    assert P.first_integer(" the pass key") is None
    assert P.first_integer("") is None


def test_keys_are_seeded_and_have_their_digits():
    keys = [P.key_for(1234, L, d, i) for L in (256, 512) for d in P.DEPTHS for i in range(3)]
    assert keys == [P.key_for(1234, L, d, i) for L in (256, 512) for d in P.DEPTHS for i in range(3)]
    assert all(10_000 <= k <= 99_999 for k in keys) and len(set(keys)) > 60
    assert P.key_for(1, 256, 0, 0) != P.key_for(2, 256, 0, 0)
    assert 100 <= P.key_for(1, 256, 0, 0, digits=3) <= 999


def test_fit_fills_the_length_in_tokens_of_the_tokenizer(tok):
    """BOS + prompt tokens + the answer budget <= L, and one more filler sentence would not fit."""
    def count(text):
        return 1 + len(tok.encode(text, add_special_tokens=False))
    for L in (128, 256, 1000):
        for depth in (0, 50, 100):
            text, n, tokens = P.fit(count, 31415, depth, L - 9)
            assert text == P.prompt_text(31415, n, depth) and tokens == count(text)
            assert tokens <= L - 9 < count(P.prompt_text(31415, n + 1, depth))
            assert tokens > L - 9 - 12                         # a sentence is at most ~7 tokens
    # the fixed parts alone, counted piece by piece with this tokenizer: BOS 1 + instructions 31
    # + "\n" 1 + needle 25 ("The pass key is" 4, "▁" and five single digits 6, "." 1,
    # "Remember it." 3, "▁" + digits 6, "is the pass key." 5) + "\n" 1 + question 10 = 69
    assert count(P.prompt_text(31415, 0, 0)) == 69
    assert P.fit(count, 31415, 0, 68) is None and P.fit(count, 31415, 0, 69)[1] == 0


class _Fake:
    """An adapter over the real tokenizer whose "model" reads the key back out of the prompt
    (``reads``) or answers a fixed wrong number; ``max_length``: a standard model's context."""

    def __init__(self, tok, reads=True, max_length=300, long_context=False):
        self.tok, self.reads, self.max_length, self.long_context = tok, reads, max_length, long_context
        self.prompts = []

    def encode(self, texts):
        return [self.tok.encode(t, add_special_tokens=False) for t in texts]

    def _framed(self, ids):
        return [self.tok.bos_token_id] + ids

    def generate_greedy(self, ids, n):
        self.prompts.append(ids)
        text = self.tok.decode(ids)
        key = re.search(r"The pass key is (\d+)\.", text).group(1) if self.reads else "11111"
        return self.tok.encode(f" {key}. Remember", add_special_tokens=False)[:n]


def test_grid_scores_and_reports_lengths_beyond_the_context(tok):
    plan = P.PasskeyPlan(lengths=(128, 256, 512), depths=(0, 50, 100), samples=2, seed=7)
    records = []
    ad = _Fake(tok, reads=True, max_length=300)
    res = P.run(ad, plan, records)
    g = res["grid"]
    assert g["status"] == {"128": "ok", "256": "ok", "512": "beyond_context"}
    assert g["acc"] == [[1.0, 1.0, None]] * 3 and res["metrics"]["acc"]["value"] == 1.0
    assert len(records) == res["samples_scored"] == 12
    assert all(len(p) + plan.new_tokens <= 256 for p in ad.prompts)      # never truncated, never over
    assert max(len(p) for p in ad.prompts) > 256 - plan.new_tokens - 8
    assert {r["key"] for r in records} == {P.key_for(7, r["length"], r["depth"], r["sample"]) for r in records}
    wrong = P.run(_Fake(tok, reads=False, long_context=True), plan, [])
    assert wrong["grid"]["status"] == {"128": "ok", "256": "ok", "512": "ok"}
    assert wrong["metrics"]["acc"]["value"] == 0.0 and wrong["context"] is None
    short = P.run(_Fake(tok), P.PasskeyPlan(lengths=(40, 128), depths=(0,), samples=1), [])
    assert short["grid"]["status"] == {"40": "too_short", "128": "ok"}
    assert short["grid"]["acc"] == [[None, 1.0]]


def _checkpoint(path, tok, **extra):
    import model as M
    from utils.data.tok import describe
    from utils.training.checkpoint import save_checkpoint
    a = M.ModelArgs(vocab_size=len(tok), d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    max_seq_len=128, bos_id=tok.bos_token_id, **extra)
    torch.manual_seed(0)
    m = M.create_model(a)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, {"kind": "pretrain", "model": m.state_dict(), "model_args": a.to_dict(),
                           "tokenizer": describe(tok, str(SPM_MODEL)), "step": 1})
    return path


def test_cli_passkey_test_grid_files(tmp_path, tok):
    """`benchmark --tasks passkey --test` on a standard checkpoint (context 128) and an infini
    one: the quick grid (128 and 256 tokens x 0/50/100%), 256 beyond the standard model's
    context, both run for infini; the JSON grid, the text table and a PNG per model."""
    std = _checkpoint(tmp_path / "checkpoints" / "std" / "checkpoint_best.pt", tok)
    inf = _checkpoint(tmp_path / "checkpoints" / "inf" / "checkpoint_best.pt", tok,
                      attention="infini", segment_length=32)
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)}})
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "main.py", "benchmark", "--config", str(cfg), "--tasks",
                        "passkey", "--test", str(std), str(inf), "--per-item", "--output-dir", str(out)],
                       cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "context unbounded (Infini-attention)" in r.stdout
    (js,) = out.glob("benchmark_*[0-9].json")
    data = json.loads(js.read_text())
    by = {m["name"]: m["results"]["passkey"] for m in data["models"]}
    s, i = by["std/checkpoint_best"], by["inf/checkpoint_best"]
    assert s["grid"]["lengths"] == [128, 256] and s["grid"]["depths"] == [0, 50, 100]
    assert s["grid"]["status"] == {"128": "ok", "256": "beyond_context"} and s["context"] == 128
    assert [row[1] for row in s["grid"]["acc"]] == [None] * 3
    assert all(row[0] is not None for row in s["grid"]["acc"])
    assert i["grid"]["status"] == {"128": "ok", "256": "ok"} and i["context"] is None
    assert s["items"]["skipped"] == {"beyond_context": 3} and i["items"]["scored"] == 6
    for res in (s, i):
        png = res["heatmap"]
        assert png.endswith(".png") and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    txt = js.with_suffix(".txt").read_text()
    assert "Passkey retrieval, std/checkpoint_best" in txt
    assert "256: beyond the model's context (128 tokens): not run, never truncated" in txt
    items = [json.loads(x) for x in js.with_name(js.stem + "_items.jsonl").read_text().splitlines()]
    assert sum(x["task"] == "passkey" for x in items) == 9
    assert all(x["prompt_tokens"] + 9 <= x["length"] for x in items)
