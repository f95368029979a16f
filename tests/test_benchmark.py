"""Benchmark stage (benchmark.py, utils/bench): scoring correctness, CLI outputs, bad data.

- Scoring functions on hand-computed cases and a toy model whose log-probabilities are known.
- An oracle written from lm-evaluation-harness's documented rules (HellaSwag preprocessing,
  acc / acc_norm with character-length normalization, LAMBADA context/target split and its
  perplexity aggregation, ARC prompts) computed straight from the model's logits; our runner
  must give the same per-item log-likelihoods and the same aggregates on the sample data.
- The CLI the way a user runs it: two tiny checkpoints plus the first one converted to a
  Hugging Face LlamaForCausalLM folder (``--hf-model``), ``--test --per-item``; the files, the
  ranking, and identical scores for the checkpoint and its HF conversion.
- Bad data: wrong number of endings, bad labels, missing/empty fields, empty and truncated
  files are skipped and counted, or refused with a clear message; accuracy is never NaN.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOK_NAME = "data/samples/tokenizers/mistral-v1/tokenizer.model"
SAMPLES = ROOT / "data" / "samples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "NO_COLOR": "1"}

# The samples are fetched when missing (conftest); a missing sample is a failure, never a skip.
pytestmark = pytest.mark.usefixtures("samples")


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    from utils.data.tok import load_tokenizer_from
    return load_tokenizer_from(str(ROOT / TOK_NAME))


def _make_checkpoint(path: Path, tok, seed: int):
    from model import ModelArgs, create_model
    from utils.training.checkpoint import FORMAT_VERSION, save_checkpoint
    from utils.data.tok import describe
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=len(tok), d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     max_seq_len=64, bos_id=tok.bos_token_id)
    model = create_model(args).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, {"format_version": FORMAT_VERSION, "kind": "pretrain",
                           "model": model.state_dict(), "model_args": args.to_dict(), "step": 0,
                           "tokenizer": describe(tok, TOK_NAME)})
    return model


def _to_hf(model, tok, out: Path):
    from transformers import LlamaForCausalLM
    from utils.hf.mapping import hf_config, to_hf_state_dict
    hf = LlamaForCausalLM(hf_config(model.args, eos_id=tok.eos_token_id))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("bench_models")
    a = _make_checkpoint(d / "run_a" / "checkpoint_best.pt", tok, 0)
    _make_checkpoint(d / "run_b" / "checkpoint_best.pt", tok, 1)
    _to_hf(a, tok, d / "hf_a")
    return {"dir": d, "a": d / "run_a" / "checkpoint_best.pt", "b": d / "run_b" / "checkpoint_best.pt",
            "hf": d / "hf_a", "model_a": a}


# Items per task in the CLI run (below --test's cap of 6, to keep the three models quick).
LIMITS = {"perplexity": 3, "lambada": 4, "hellaswag": 3, "arc_easy": 3, "arc_challenge": 3,
          "completion": 2}


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "main.py", "benchmark", *map(str, args)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cli_run(models):
    """One real run: two checkpoints + the HF conversion of the first, all tasks, --per-item."""
    out = models["dir"] / "results"
    r = run_cli("--test", "--config", "configs/offline.json", models["a"], models["b"],
                "--hf-model", models["hf"], "--per-item", "--output-dir", out,
                *[f"--limit={t}={n}" for t, n in LIMITS.items()])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jsons = sorted(out.glob("benchmark_*.json"))
    assert len(jsons) == 1
    stem = jsons[0].stem
    return {"r": r, "out": out, "json": json.loads(jsons[0].read_text()),
            "txt": (out / f"{stem}.txt").read_text(),
            "items": [json.loads(x) for x in (out / f"{stem}_items.jsonl").read_text().splitlines()]}


# --------------------------------------------------------------------------- oracle (lm-eval rules)
def oracle_hellaswag_preprocess(text):
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def oracle_hellaswag_doc(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": oracle_hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [oracle_hellaswag_preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"])}


def oracle_loglikelihood(model, tok, context, continuation):
    """lm-eval HFLM._encode_pair + _loglikelihood_tokens, with our BOS-prefixed contexts."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    whole, ctx = enc(context + continuation), enc(context)
    cont = whole[len(ctx):]
    ids = [tok.bos_token_id] + ctx + cont
    ids = ids[-(model.args.max_seq_len + 1):]
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    logp = torch.log_softmax(logits[0].float(), -1)[-len(cont):]
    tgt = torch.tensor(cont)
    ll = float(logp.gather(1, tgt[:, None]).sum())
    greedy = bool((logp.argmax(-1) == tgt).all())
    return ll, greedy


def oracle_mc(lls, choices, gold):
    lls = np.array(lls)
    return {"acc": float(np.argmax(lls) == gold),
            "acc_norm": float(np.argmax(lls / np.array([len(c) for c in choices])) == gold)}


class ModelAdapter:
    """Build a utils.bench Adapter around an in-memory model of ours."""

    @staticmethod
    def make(model, tok):
        from utils.bench.adapters import Adapter

        class A(Adapter):
            def logits(self, idx):
                return model(idx)[0]
        a = A()
        a.name, a.tok, a.add_bos, a.max_length = "oracle", tok, True, model.args.max_seq_len
        return a


def _rows_from_disk(name, n):
    import datasets
    ds = datasets.load_from_disk(str(SAMPLES / name / "validation"))
    return [ds[i] for i in range(n)]


def test_hellaswag_matches_oracle(models, tok):
    from utils.bench import runner, tasks as T
    rows = _rows_from_disk("hellaswag", 8)
    items = [T.hellaswag_item(r, i) for i, r in enumerate(rows)]
    model = models["model_a"]
    records: list = []
    res, skipped, scored = runner.run_loglikelihood_task("hellaswag", ModelAdapter.make(model, tok),
                                                         items, 4, "t", records)
    assert scored == 8 and not skipped
    acc, acc_norm = [], []
    for row, item, rec in zip(rows, items, records):
        doc = oracle_hellaswag_doc(row)
        assert (item.context, item.choices, item.gold) == (doc["query"], doc["choices"], doc["gold"])
        lls = [oracle_loglikelihood(model, tok, doc["query"], " " + c)[0] for c in doc["choices"]]
        np.testing.assert_allclose(rec["lls"], lls, rtol=0, atol=2e-4)
        o = oracle_mc(lls, doc["choices"], doc["gold"])
        acc.append(o["acc"])
        acc_norm.append(o["acc_norm"])
    assert res["metrics"]["acc"]["value"] == pytest.approx(np.mean(acc))
    assert res["metrics"]["acc_norm"]["value"] == pytest.approx(np.mean(acc_norm))
    se = np.std(acc, ddof=1) / math.sqrt(len(acc))
    assert res["metrics"]["acc"]["stderr"] == pytest.approx(se)


def test_hellaswag_preprocessing_rules():
    from utils.bench import tasks as T
    row = {"activity_label": "Making tea", "ctx_a": "A man pours water [header] into a cup.",
           "ctx_b": "then he", "endings": ["adds sugar [title] Stir well.", "b", "c", "d"],
           "label": "2", "ind": 7}
    it = T.hellaswag_item(row, 0)
    assert it.context == oracle_hellaswag_doc(row)["query"]
    assert it.context == "Making tea: A man pours water into a cup. Then he"
    assert it.choices[0] == "adds sugar. Stir well."
    assert it.gold == 2 and it.id == "7"


def lambada_rows(n: int) -> list[dict]:
    """The first ``n`` rows of the offline LAMBADA sample (OLMo request records)."""
    rows = []
    with gzip.open(SAMPLES / "lambada" / "requests.jsonl.gz", "rt") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


def test_lambada_matches_oracle(models, tok):
    from utils.bench import runner, tasks as T
    rows = lambada_rows(10)
    items = [T.lambada_item(r, i) for i, r in enumerate(rows)]
    model = models["model_a"]
    records: list = []
    res, _, scored = runner.run_loglikelihood_task("lambada", ModelAdapter.make(model, tok), items,
                                                   3, "t", records)
    assert scored == 10
    lls, greedy = [], []
    for row, item, rec in zip(rows, items, records):
        text = row["request"]["context"] + row["request"]["continuation"]
        words = text.split(" ")
        ctx, tgt = " ".join(words[:-1]), " " + words[-1]
        assert (item.context, item.target) == (ctx, tgt)
        ll, g = oracle_loglikelihood(model, tok, ctx, tgt)
        assert rec["ll"] == pytest.approx(ll, abs=2e-4) and rec["is_greedy"] == g
        lls.append(ll)
        greedy.append(float(g))
    assert res["metrics"]["acc"]["value"] == pytest.approx(np.mean(greedy))
    assert res["metrics"]["perplexity"]["value"] == pytest.approx(math.exp(-np.mean(lls)), rel=1e-4)


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_matches_oracle(models, tok, name):
    from utils.bench import runner, tasks as T
    rows = _rows_from_disk(name, 6)
    items = [T.arc_item(r, i) for i, r in enumerate(rows)]
    model = models["model_a"]
    records: list = []
    res, _, scored = runner.run_loglikelihood_task(name, ModelAdapter.make(model, tok), items, 8,
                                                   "t", records)
    acc, acc_norm = [], []
    for row, rec in zip(rows, records):
        ctx = "Question: " + row["question"] + "\nAnswer:"
        choices = row["choices"]["text"]
        gold = row["choices"]["label"].index(row["answerKey"])
        lls = [oracle_loglikelihood(model, tok, ctx, " " + c)[0] for c in choices]
        np.testing.assert_allclose(rec["lls"], lls, atol=2e-4)
        assert rec["gold"] == gold
        o = oracle_mc(lls, choices, gold)
        acc.append(o["acc"])
        acc_norm.append(o["acc_norm"])
    assert res["metrics"]["acc"]["value"] == pytest.approx(np.mean(acc))
    assert res["metrics"]["acc_norm"]["value"] == pytest.approx(np.mean(acc_norm))


# --------------------------------------------------------------------------- toy model, pure scoring
def test_toy_model_scores_are_exact(tok):
    """A model whose next-token distribution is fixed: log-likelihoods are hand-computable."""
    from utils.bench.adapters import Adapter
    V = 10
    table = torch.log_softmax(torch.arange(V, dtype=torch.float32), -1)   # token 9 most likely

    class Toy(Adapter):
        def logits(self, idx):
            return table.expand(idx.shape[0], idx.shape[1], V).clone()
    ad = Toy()
    ad.name, ad.tok, ad.max_length = "toy", tok, 16
    s = ad.score([[1, 9, 9], [1, 2, 3, 4], [5, 9]], [2, 3, 1], batch_size=2)
    assert s[0].ll == pytest.approx(2 * float(table[9])) and s[0].greedy and s[0].n == 2
    assert s[1].ll == pytest.approx(float(table[2] + table[3] + table[4])) and not s[1].greedy
    assert s[1].topk == {1: 0, 5: 0, 10: 3}
    assert s[2].topk == {1: 1, 5: 1, 10: 1}


def test_scoring_functions_by_hand():
    from utils.bench import scoring as S, tasks as T
    # acc picks the raw argmax; acc_norm divides by the ending's length in characters.
    r = S.multiple_choice([-10.0, -12.0], ["ab", "abcdefgh"], gold=1)
    assert (r["pred"], r["pred_norm"], r["acc"], r["acc_norm"]) == (0, 1, 0.0, 1.0)
    assert S.multiple_choice([-1.0, -1.0], ["a", "b"], gold=0)["pred"] == 0     # ties: first
    assert T.lambada_split("the cat sat on the mat") == ("the cat sat on the", " mat")
    assert S.lambada_perplexity([-1.0, -3.0]) == pytest.approx(math.exp(2.0))
    assert S.lambada_perplexity([]) is None and S.mean([]) is None
    assert S.mean_stderr([1.0]) is None
    assert S.perplexity(0.0, 0) is None and S.bits_per_byte(0.0, 0) is None
    m = S.text_metrics([4 * math.log(2)], [4], [2])
    assert m["perplexity"] == pytest.approx(2.0) and m["bits_per_byte"] == pytest.approx(2.0)
    # rolling windows: every token predicted exactly once
    toks = list(range(100, 125))
    wins = S.rolling_windows(toks, 1, 8)
    predicted = [t for w, n in wins for t in w[-n:]]
    assert predicted == toks and all(len(w) - 1 <= 8 for w, _ in wins)


# --------------------------------------------------------------------------- CLI, files, HF
def test_cli_files_and_ranking(cli_run):
    p = cli_run["json"]
    assert p["format"] == "llm-pipeline-benchmark"
    assert {"settings", "versions", "models", "ranking", "data", "created"} <= set(p)
    assert p["settings"]["test"] is True and p["settings"]["per_item"] is True
    assert [m["identity"]["kind"] for m in p["models"]] == ["checkpoint", "checkpoint", "huggingface"]
    tasks = {"perplexity", "next_token", "lambada", "hellaswag", "arc_easy", "arc_challenge",
             "completion"}
    for m in p["models"]:
        assert set(m["results"]) == tasks
        assert len(m["identity"]["fingerprint"]) == 64
        for t, res in m["results"].items():
            assert res["items"]["scored"] >= 1
            for name, v in res["metrics"].items():
                assert v["value"] is not None and math.isfinite(v["value"]), (t, name)
    assert p["models"][0]["identity"]["fingerprint"] != p["models"][1]["identity"]["fingerprint"]
    assert p["ranking"] and len(p["ranking"]) == 3
    assert "sacrebleu" in json.dumps(p["versions"]) or "sacrebleu" in str(p["versions"])
    txt = cli_run["txt"]
    for word in ("hellaswag acc", "lambada", "completion bleu", "run_a", "run_b", "hf_a"):
        assert word in txt
    assert "\033[" not in txt
    assert "*" in txt and "Ranking" in txt            # best value per metric marked, ranking shown
    assert "Wrote" in cli_run["r"].stdout


def test_cli_per_item_and_same_items_for_every_model(cli_run):
    by_model: dict = {}
    for rec in cli_run["items"]:
        by_model.setdefault(rec["model"], {}).setdefault(rec["task"], []).append(rec["id"])
    assert len(by_model) == 3
    ids = list(by_model.values())
    assert ids[0] == ids[1] == ids[2]
    assert {t: len(v) for t, v in ids[0].items()} == LIMITS       # --limit per task
    assert cli_run["json"]["settings"]["limits"]["lambada"] == 4


def test_hf_conversion_scores_identically(cli_run):
    """Our checkpoint and its Hugging Face conversion, run with --hf-model, score the same."""
    recs: dict = {}
    for rec in cli_run["items"]:
        recs.setdefault(rec["model"], []).append(rec)
    names = list(recs)
    ours, hf = recs[names[0]], recs[names[2]]
    assert len(ours) == len(hf)
    for a, b in zip(ours, hf):
        assert (a["task"], a["id"]) == (b["task"], b["id"])
        if "lls" in a:
            np.testing.assert_allclose(a["lls"], b["lls"], atol=1e-3)
            assert a["pred"] == b["pred"] and a["pred_norm"] == b["pred_norm"]
        if "ll" in a:
            assert a["ll"] == pytest.approx(b["ll"], abs=1e-3)
        if "nll" in a:
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-4)
        if "generated" in a:
            assert a["generated"] == b["generated"]
    m = cli_run["json"]["models"]
    for task in ("hellaswag", "arc_easy", "lambada"):
        assert m[0]["results"][task]["metrics"]["acc"]["value"] == m[2]["results"][task]["metrics"]["acc"]["value"]


def test_presets_limits_and_seeded_selection():
    import benchmark
    from utils.bench import data as D
    from utils.cli import UsageError
    assert benchmark.PRESETS["quick"]["perplexity"] == 50 and benchmark.PRESETS["quick"]["lambada"] == 20
    assert benchmark.PRESETS["standard"]["hellaswag"] == 20
    assert benchmark.PRESETS["comprehensive"]["lambada"] == 100
    assert all(v is None for v in benchmark.PRESETS["full"].values())
    assert benchmark.parse_limits(["hellaswag=7", "lambada=all"]) == {"hellaswag": 7, "lambada": None}
    for bad in ("hellaswag=0", "nope=3", "hellaswag", "lambada=x"):
        with pytest.raises(UsageError):
            benchmark.parse_limits([bad])
    items = list(range(1000))
    a, b = D.select(items, 20, 1234), D.select(items, 20, 1234)
    assert a == b and a == sorted(a) and len(set(a)) == 20
    assert D.select(items, 20, 99) != a
    assert D.select(items, None, 1) == items and D.select(items[:5], 20, 1) == items[:5]


# --------------------------------------------------------------------------- bad data
def _hs(**kw):
    row = {"ind": 1, "activity_label": "Cooking", "ctx_a": "A cook stirs.", "ctx_b": "she",
           "endings": ["adds salt.", "runs.", "sings.", "sleeps."], "label": "0"}
    row.update(kw)
    return row


def test_bad_hellaswag_rows_are_skipped_and_counted(tmp_path):
    from utils.bench import data as D
    rows = [_hs(), _hs(endings=["a", "b", "c"]), _hs(label="7"), _hs(label="x"), _hs(label=None),
            _hs(endings=["a", "", "c", "d"]), _hs(ctx_a="", ctx_b=""), _hs(label=True), _hs(label=2.0)]
    del rows[-1]["ctx_b"]
    f = tmp_path / "hs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n\n" + "[" * 100_000 + "\n"
                 + '{"label": 1' + "0" * 5000 + "}\n")        # too deep; a 5,001-digit integer
    d = D.load_task("hellaswag", str(f), SAMPLES, ROOT)
    assert len(d.items) == 1 and d.rows == 12
    assert d.skipped == Counter({"wrong_number_of_endings": 1, "label_out_of_range": 1,
                                 "label_not_a_number": 2, "missing_label": 1, "empty_ending": 1,
                                 "empty_ctx": 1, "missing_ctx_b": 1, "invalid_json": 3})


@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "jsonl.gz"])
def test_lambada_reads_every_published_shape(tmp_path, models, tok, gz):
    """{"text"}, {"context", "continuation"} and the OLMo request shape of the same 6 real
    items, read from local files by the benchmark's loader: identical items and scores."""
    from utils.bench import data as D, runner
    rows = lambada_rows(6)
    shapes = {
        "text": [{"text": r["request"]["context"] + r["request"]["continuation"]} for r in rows],
        "context_continuation": [{"context": r["request"]["context"],
                                  "continuation": r["request"]["continuation"]} for r in rows],
        "olmo_request": rows,
    }
    got = {}
    for name, shaped in shapes.items():
        f = tmp_path / (f"{name}.jsonl" + (".gz" if gz else ""))
        body = "\n".join(json.dumps(r) for r in shaped) + "\n"
        if gz:
            with gzip.open(f, "wt", encoding="utf-8") as out:
                out.write(body)
        else:
            f.write_text(body, encoding="utf-8")
        data = D.load_task("lambada", str(f), SAMPLES, ROOT)
        assert not data.skipped and len(data.items) == 6, (name, data.skipped)
        records: list = []
        res, _, scored = runner.run_loglikelihood_task(
            "lambada", ModelAdapter.make(models["model_a"], tok), data.items, 3, "t", records)
        assert scored == 6
        got[name] = ([(it.context, it.target) for it in data.items], [r["ll"] for r in records])
    assert got["text"] == got["context_continuation"] == got["olmo_request"]
    assert all(t.startswith(" ") and " " not in t[1:] for _, t in got["text"][0])


def test_bad_arc_and_lambada_rows(tmp_path):
    from utils.bench import data as D
    good = {"id": "q1", "question": "Q?", "choices": {"text": ["x", "y"], "label": ["A", "B"]},
            "answerKey": "B"}
    rows = [good, {**good, "answerKey": "E"}, {**good, "question": ""},
            {**good, "choices": {"text": ["x"], "label": ["A"]}}, {**good, "choices": None}]
    f = tmp_path / "arc.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    d = D.load_task("arc_easy", str(f), SAMPLES, ROOT)
    assert len(d.items) == 1 and d.items[0].gold == 1 and sum(d.skipped.values()) == 4
    f2 = tmp_path / "lam.jsonl"
    f2.write_text("\n".join(json.dumps(r) for r in [{"text": "a b c"}, {"text": ""}, {"text": "one"},
                                                    {"foo": 1}, [1, 2]]))
    d2 = D.load_task("lambada", str(f2), SAMPLES, ROOT)
    assert len(d2.items) == 1 and d2.items[0].target == " c" and sum(d2.skipped.values()) == 4


def test_accuracy_never_nan_without_items():
    from utils.bench import scoring as S
    assert S.mean([]) is None and S.mean_stderr([]) is None and S.topk_accuracy([], 0) is None


def test_unreadable_files_are_refused(tmp_path):
    from utils.bench import data as D
    from utils.cli import PipelineError
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PipelineError, match="empty"):
        D.load_task("hellaswag", str(empty), SAMPLES, ROOT)
    blob = gzip.compress(("\n".join(json.dumps(_hs()) for _ in range(2000))).encode())
    trunc = tmp_path / "trunc.jsonl.gz"
    trunc.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(PipelineError, match="truncated or damaged"):
        D.load_task("hellaswag", str(trunc), SAMPLES, ROOT)
    allbad = tmp_path / "allbad.jsonl"
    allbad.write_text(json.dumps(_hs(label="9")) + "\n")
    with pytest.raises(PipelineError, match="none of its 1 rows"):
        D.load_task("hellaswag", str(allbad), SAMPLES, ROOT)
    with pytest.raises(PipelineError, match="does not exist"):
        D.load_task("hellaswag", str(tmp_path / "nope" / "x.jsonl"), SAMPLES, ROOT)


def test_cli_refuses_bad_data_file_clearly(models, tmp_path):
    empty = tmp_path / "hellaswag.jsonl"
    empty.write_text("")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"tokenizer": {"name": str(ROOT / TOK_NAME)},
                               "benchmark": {"hellaswag_source": str(empty)}}))
    r = run_cli("--test", "--config", cfg, models["a"], "--tasks", "hellaswag",
                "--output-dir", tmp_path / "out")
    assert r.returncode == 1, r.stdout + r.stderr
    assert str(empty) in (r.stdout + r.stderr) and "empty" in (r.stdout + r.stderr)
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_bad_seed_output_folder_and_hf_paths_are_refused_before_scoring(models, tmp_path):
    """benchmark.seed -1 was an unexpected NumPy error; an --output-dir that is a file, and an
    --hf-model path that does not exist or holds no model, failed only after every model was
    scored (the results lost). Each is exit 2 naming the flag, before any model loads."""
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["--seed", "-1"], "benchmark.seed"),
             (["--output-dir", a_file], str(a_file)),
             (["--output-dir", a_file / "sub"], str(a_file)),
             (["--hf-model", tmp_path / "missing"], "no such file or folder"),
             (["--hf-model", empty], "holds no config.json")]
    for extra, needle in cases:
        r = run_cli("--test", "--config", "configs/offline.json", models["a"], *extra,
                    "--tasks", "perplexity", timeout=120)
        assert r.returncode == 2, (extra, r.stdout[-2000:], r.stderr[-2000:])
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "Model " not in r.stdout                       # nothing was scored
    assert a_file.read_text() == "keep"


def test_a_damaged_tokenizer_file_of_an_hf_folder_is_named(models, tmp_path):
    """--hf-model DIR whose tokenizer_config.json is damaged: exit 1 naming the file, the key and
    what to do (it was transformers' error naming only the model), nothing scored."""
    import shutil
    bad = tmp_path / "hf_bad"
    shutil.copytree(models["hf"], bad)
    conf = json.loads((bad / "tokenizer_config.json").read_text())
    conf["bos_token"] = 5
    (bad / "tokenizer_config.json").write_text(json.dumps(conf))
    r = run_cli("--test", "--config", "configs/offline.json", "--hf-model", bad, "--tasks", "perplexity",
                "--output-dir", tmp_path / "out", timeout=300)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert f"{bad / 'tokenizer_config.json'}" in r.stderr and "'bos_token' = number" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not list((tmp_path / "out").glob("benchmark_*"))


def test_ranking_orders_models_and_marks_best():
    from utils.bench import report

    def model(name, acc, ppl):
        return {"name": name, "results": {
            "hellaswag": {"metrics": {"acc": {"value": acc, "stderr": None},
                                      "acc_norm": {"value": acc, "stderr": None}}},
            "lambada": {"metrics": {"acc": {"value": acc, "stderr": None},
                                    "perplexity": {"value": ppl, "stderr": None}}}}}
    models = [model("weak", 0.25, 900.0), model("strong", 0.5, 40.0), model("mid", 0.3, 100.0)]
    rank = report.ranking(models)
    assert [d["model"] for d in rank] == ["strong", "mid", "weak"]
    assert rank[0]["mean_rank"] == 1.0 and rank[0]["metrics_won"] == 4
    table = report.render_table(models, color=False)
    ppl_row = next(line for line in table.splitlines() if line.startswith("lambada perplexity"))
    assert "40.00 *" in ppl_row and "900.00 *" not in ppl_row
    colored = report.render_table(models, color=True)
    assert report.BOLD_GREEN in colored


def test_lone_surrogates_in_task_rows_are_text(models, tmp_path):
    """A row holding a lone surrogate (a JSON "\\ud800" escape: legal JSON, not Unicode text)
    aborted the whole run with a TypeError from the tokenizers library. Such text is data: it
    reads as U+FFFD, the rows so repaired are counted, and every row is scored."""
    arc = {"id": "q1", "question": "What is 2+2?", "choices": {"text": ["3", "4"], "label": ["A", "B"]},
           "answerKey": "B"}
    files = {
        "lambada": [{"text": "hello \ud800 world and the end"}, {"text": "the cat sat on the mat"}],
        "hellaswag": [_hs(ctx_a="A cook \udfff stirs."), _hs(endings=["adds \ud800.", "b", "c", "d"]), _hs()],
        "arc_easy": [{**arc, "question": "Why \udc80?"}, {**arc, "choices": {"text": ["\ud800", "4"],
                                                                            "label": ["A", "B"]}}, arc],
    }
    cfg = {"tokenizer": {"name": str(ROOT / TOK_NAME)}, "benchmark": {}}
    for task, rows in files.items():
        f = tmp_path / f"{task}.jsonl"
        f.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="ascii")
        assert "\\ud800" in f.read_text() or "\\udfff" in f.read_text() or "\\udc80" in f.read_text()
        cfg["benchmark"][f"{task}_source"] = str(f)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = run_cli("--test", "--config", tmp_path / "cfg.json", models["a"], "--tasks",
                ",".join(files), "--per-item", "--output-dir", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr
    assert "(1 rows with lone surrogates, read as U+FFFD)" in r.stdout
    payload = json.loads(next(out.glob("benchmark_*.json")).read_text())
    for task, rows in files.items():
        d = payload["data"][task]
        assert d["valid"] == len(rows) and not d["skipped"], (task, d)
        assert d["repaired"] == len(rows) - 1, (task, d)
        items = payload["models"][0]["results"][task]["items"]
        assert items["scored"] == len(rows), (task, items)
