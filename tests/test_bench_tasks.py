"""The benchmark's lm-eval tasks beyond HellaSwag/ARC/LAMBADA, its presets and its contamination
check (benchmark.py, utils/bench/{tasks,data,runner,core,contamination}.py).

- Prompts: the first real rows of each offline sample, turned into requests by an oracle
  written from lm-evaluation-harness 0.4's task YAMLs (piqa.yaml, winogrande's
  preprocess_winogrande.py, super_glue/copa/utils.py, ...); ours must be identical.
- Scoring: a tiny model's per-item predictions on real items, ours against the oracle's
  log-likelihoods (test_benchmark.oracle_loglikelihood); generation against a plain greedy
  loop cut at lm-eval's stop strings; exact match's normalisation by hand.
- Few-shot: the examples are other items of the split (never the item), the same on every
  run; MMLU's are its dev split's first k of the same subject.
- The CLI as a user runs it: ``--preset core --contamination`` on two checkpoints side by
  side (the CORE-style mean recomputed from the per-task results and DCLM's baselines), and
  a planted set of items copied from the run's training text found, clean ones not.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import NEWS, SAMPLES
from tests.test_benchmark import ModelAdapter, _make_checkpoint, oracle_loglikelihood

pytestmark = pytest.mark.usefixtures("samples")


def _first(task_dir: str, n: int = 2, split: str = "validation") -> list:
    import datasets
    ds = datasets.load_from_disk(str(SAMPLES / task_dir / split))
    return [ds[i] for i in range(n)]


def _requests(task: str, n: int = 2):
    from utils.bench import data as D, runner
    d = D.load_task(task, None, SAMPLES, SAMPLES.parent.parent)
    items = D.attach_shots(task, d, d.items[:n], 0)
    return items, [runner.requests_of(it) for it in items if task not in runner.GEN_TASKS]


# --------------------------------------------------------------------------- prompts (lm-eval YAMLs)
def _oracle(task: str, row: dict):
    """(requests, gold) exactly as lm-eval 0.4's task YAML renders them (target delimiter " ")."""
    if task == "piqa":
        ctx = f"Question: {row['goal']}\nAnswer:"
        return [(ctx, " " + row["sol1"]), (ctx, " " + row["sol2"])], int(row["label"])
    if task == "winogrande":
        i = row["sentence"].index("_")
        cont = " " + row["sentence"][i + 1:].strip()
        return [(row["sentence"][:i] + o, cont) for o in (row["option1"], row["option2"])], \
            {"1": 0, "2": 1}[row["answer"]]
    if task == "copa":
        conn = {"cause": "because", "effect": "therefore"}[row["question"]]
        low = lambda c: c[0].lower() + c[1:]     # noqa: E731
        ctx = row["premise"].strip()[:-1] + f" {conn}"
        return [(ctx, "  " + low(row["choice1"])), (ctx, "  " + low(row["choice2"]))], int(row["label"])
    if task == "boolq":
        ctx = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
        return [(ctx, " no"), (ctx, " yes")], int(row["answer"] in (True, "True"))
    if task == "openbookqa":
        c = row["choices"]
        return [(row["question_stem"], " " + t) for t in c["text"]], c["label"].index(row["answerKey"].lstrip())
    if task == "commonsense_qa":
        t = row["choices"]["text"]
        ctx = (f"Question: {row['question'].strip()}\nA. {t[0]}\nB. {t[1]}\nC. {t[2]}\nD. {t[3]}\n"
               f"E. {t[4]}\nAnswer:")
        return [(ctx, " " + L) for L in "ABCDE"], row["choices"]["label"].index(row["answerKey"])
    if task == "social_iqa":
        ctx = f"Q: {row['context']} {row['question']}\nA:"
        return [(ctx, " " + row[k]) for k in ("answerA", "answerB", "answerC")], int(row["label"]) - 1
    raise KeyError(task)


@pytest.mark.parametrize("task,folder", [("piqa", "piqa"), ("winogrande", "winogrande"), ("copa", "copa"),
                                         ("boolq", "boolq"), ("openbookqa", "openbookqa"),
                                         ("commonsense_qa", "commonsense_qa"), ("social_iqa", "social_iqa")])
def test_multiple_choice_prompts_are_lm_evals(task, folder):
    items, reqs = _requests(task)
    for row, it, req in zip(_first(folder), items, reqs):
        want, gold = _oracle(task, row)
        assert req == want and it.gold == gold


def test_mmlu_both_forms_arithmetic_and_generation_prompts():
    from utils.bench import tasks as T
    row = _first("mmlu/abstract_algebra", 1, "test")[0]
    subj = "The following are {} questions (with answers) about abstract algebra.\n\n"
    (lettered,), reqs = _requests("mmlu", 1)
    q, c = row["question"].strip(), row["choices"]
    assert reqs[0] == [(subj.format("multiple choice") + f"{q}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\n"
                        f"D. {c[3]}\nAnswer:", " " + L) for L in "ABCD"]
    (cloze,), reqs = _requests("mmlu_cloze", 1)
    assert reqs[0] == [(subj.replace("{} ", "") + f"Question: {q}\nAnswer:", " " + x) for x in c]
    assert lettered.gold == cloze.gold == int(row["answer"])
    arith = _first("arithmetic", 1)[0]
    (item,), reqs = _requests("arithmetic", 1)
    key = arith["choices"]["label"].index(arith["answerKey"])
    assert reqs[0] == [(f"Question: {arith['question']}\nAnswer:", " " + arith["choices"]["text"][key])]
    tq, nq = _first("triviaqa", 1)[0], _first("nq_open", 1)[0]
    (ti,), _ = _requests("triviaqa", 1)
    (ni,), _ = _requests("nq_open", 1)
    assert ti.context == f"Question: {tq['question']}?\nAnswer:" and ti.targets == tq["answer"]["aliases"]
    assert ni.context == f"Answer these questions:\n\nQ: {nq['question']}?\nA:" and ni.targets == nq["answer"]
    assert T.GEN_UNTIL == ("\n", ".", ",")


def test_exact_match_normalisation_by_hand():
    from utils.bench import tasks as T
    assert T.cut_at_stops(" Sunset Boulevard, in LA.\nQ:") == " Sunset Boulevard"
    assert T.exact_match("  SUNSET blvd ", ["Sunset Blvd."]) == 1.0          # case, punctuation, strip
    assert T.exact_match("Sunset", ["Sunset Blvd"]) == 0.0
    assert T.exact_match("x", ["y", "X!"]) == 1.0                            # any target
    assert T.exact_match("the Beatles", ["Beatles"]) == 0.0                  # TriviaQA keeps articles
    assert T.exact_match("the Beatles", ["Beatles"], (T.NQ_ARTICLES,)) == 1.0
    assert T.exact_match("Beatles", ["The Beatles"], (T.NQ_ARTICLES,)) == 1.0


# --------------------------------------------------------------------------- scoring
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from utils.data.tok import load_tokenizer_from
    tok = load_tokenizer_from(str(SAMPLES / "tokenizers/mistral-v1/tokenizer.model"))
    model = _make_checkpoint(tmp_path_factory.mktemp("tiny") / "r" / "checkpoint_best.pt", tok, 3)
    return model, tok


@pytest.mark.parametrize("task", ["piqa", "winogrande", "copa", "boolq", "commonsense_qa",
                                  "social_iqa", "mmlu", "mmlu_cloze", "arithmetic"])
def test_predictions_match_the_oracle(tiny, task):
    from utils.bench import data as D, runner, scoring as S
    model, tok = tiny
    ad = ModelAdapter.make(model, tok)
    d = D.load_task(task, None, SAMPLES, SAMPLES.parent.parent, fewshot=1)
    items = D.attach_shots(task, d, d.items[:3], 1)
    records: list = []
    res, skipped, scored = runner.run_loglikelihood_task(task, ad, items, 4, task, records)
    assert scored == 3 and not skipped
    for it, rec in zip(items, records):
        ref = [oracle_loglikelihood(model, tok, c, t) for c, t in runner.requests_of(it)]
        if task == "arithmetic":
            assert rec["is_greedy"] == ref[0][1] and rec["ll"] == pytest.approx(ref[0][0], abs=1e-4)
            continue
        assert rec["lls"] == pytest.approx([r[0] for r in ref], abs=1e-4)
        assert rec["pred"] == S.argmax_first([r[0] for r in ref]) and rec["gold"] == it.gold
    assert set(res["metrics"]) == ({"acc", "acc_norm"} if task in ("piqa", "mmlu_cloze") else {"acc"})


@pytest.mark.parametrize("task", ["triviaqa", "nq_open"])
def test_generation_matches_a_plain_greedy_loop(monkeypatch, task):
    from model import ModelArgs, create_model
    from utils.bench import data as D, runner, tasks as T
    from utils.bench.adapters import Adapter
    from utils.data.tok import load_tokenizer_from
    tok = load_tokenizer_from(str(SAMPLES / "tokenizers/mistral-v1/tokenizer.model"))
    torch.manual_seed(5)
    model = create_model(ModelArgs(vocab_size=len(tok), d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                   max_seq_len=320, bos_id=tok.bos_token_id)).eval()

    class A(Adapter):
        def logits(self, idx):
            return model(idx)[0]
    ad = A()
    ad.name, ad.tok, ad.add_bos, ad.max_length, ad.model = "tiny", tok, True, 320, model
    monkeypatch.setattr(T, "GEN_MAX_TOKENS", 20)     # lm-eval's 256: an untrained model seldom stops
    d = D.load_task(task, None, SAMPLES, SAMPLES.parent.parent)
    items = D.attach_shots(task, d, d.items[:2], 0)
    records: list = []
    res, _, scored = runner.run_generation(task, ad, items, 2, task, records)
    assert scored == 2 and res["max_new_tokens"] == 20
    for it, rec in zip(items, records):
        ids = [tok.bos_token_id] + tok(it.context, add_special_tokens=False)["input_ids"]
        ids, new = ids[-(320 - T.GEN_MAX_TOKENS):], []
        with torch.no_grad():
            while len(new) < T.GEN_MAX_TOKENS:
                nxt = int(model(torch.tensor([ids + new]))[0][0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
                if any(s in tok.decode(new) for s in T.GEN_UNTIL):
                    break
        want = T.cut_at_stops(tok.decode(new, skip_special_tokens=True))
        assert rec["generated"] == want
        assert rec["exact_match"] == T.exact_match(want, it.targets, (T.NQ_ARTICLES,) if task == "nq_open" else ())
    assert res["metrics"]["exact_match"]["value"] == np.mean([r["exact_match"] for r in records])


def test_fewshot_examples_are_other_items_and_fixed():
    from utils.bench import data as D
    d = D.load_task("piqa", None, SAMPLES, SAMPLES.parent.parent, fewshot=3)
    a = D.attach_shots("piqa", d, d.items[:4], 3)
    b = D.attach_shots("piqa", d, d.items[:4], 3)
    assert [x.context for x in a] == [x.context for x in b]
    for it, shot in zip(d.items[:4], a):
        assert shot.context.endswith(it.context) and shot.context.count("Question:") == 4
        assert shot.context.count(it.context) == 1                  # never its own example
    m = D.load_task("mmlu", None, SAMPLES, SAMPLES.parent.parent, fewshot=2)
    dev = _first("mmlu/anatomy", 2, "dev")
    item = next(it for it in m.items if it.id.startswith("anatomy/"))
    ctx = D.attach_shots("mmlu", m, [item], 2)[0].context
    assert ctx.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n"
                          + dev[0]["question"].strip())
    assert ctx.count("about anatomy") == 1 and dev[1]["question"].strip() in ctx
    assert "ABCD"[int(dev[0]["answer"])] == ctx.split("Answer: ")[1][0]
    # the examples of item i, in prompt order: nanochat's random.Random(1234 + i).sample(others, k)
    import random
    first = D.attach_shots("piqa", d, d.items[:1], 3)[0].context.split("\n\n")
    picks = random.Random(1234).sample(range(1, len(d.items)), 3)
    assert first[:3] == [d.items[j].context + " " + d.items[j].choices[d.items[j].gold] for j in picks]


# --------------------------------------------------------------------------- CORE's table
# DCLM's 22 CORE tasks: (name, shots, random baseline in %), as copied from the sources, which
# a test cannot read offline. Shots: mlfoundations/dclm eval/mmlu_and_lowvar.yaml (commit
# 361714bdd60b). Baselines: DCLM's eval/eval_meta_data.csv at c7ed275feacc (= eval_meta_data_v1.csv
# at 361714bdd60b), the same rows as nanochat's eval bundle (Milpo1/nanochat-pl
# eval_bundle/eval_meta_data.csv, 0acdfa053442), the table of nanochat's GPT-2 XL bar 0.256525.
DCLM_CORE_V1 = [
    ("hellaswag_zeroshot", 0, 25), ("jeopardy", 10, 0), ("bigbench_qa_wikidata", 10, 0),
    ("arc_easy", 10, 25), ("arc_challenge", 10, 25), ("copa", 0, 50), ("commonsense_qa", 10, 20),
    ("piqa", 10, 50), ("openbook_qa", 0, 25), ("lambada_openai", 0, 0), ("hellaswag", 10, 25),
    ("winograd", 0, 50), ("winogrande", 0, 50), ("bigbench_dyck_languages", 10, 0),
    ("agi_eval_lsat_ar", 3, 20), ("bigbench_cs_algorithms", 10, 0), ("bigbench_operators", 10, 0),
    ("bigbench_repeat_copy_logic", 10, 0), ("squad", 10, 0), ("coqa", 0, 0), ("boolq", 10, 62),
    ("bigbench_language_identification", 10, 9.1)]


def test_core_table_is_dclms():
    from utils.bench import core as CORE
    assert [(t.name, t.shots) for t in CORE.CORE_TASKS] == [(n, k) for n, k, _ in DCLM_CORE_V1]
    assert [t.baseline for t in CORE.CORE_TASKS] == pytest.approx([b / 100 for *_, b in DCLM_CORE_V1])
    assert CORE.GPT2_CORE == pytest.approx(0.256525, abs=5e-5)
    ours = {t.name: t.task for t in CORE.included()}
    assert ours == {"hellaswag_zeroshot": "hellaswag", "arc_easy": "arc_easy", "arc_challenge": "arc_challenge",
                    "copa": "copa", "commonsense_qa": "commonsense_qa", "piqa": "piqa",
                    "openbook_qa": "openbookqa", "lambada_openai": "lambada", "hellaswag": "hellaswag",
                    "winogrande": "winogrande", "boolq": "boolq"}
    # centered on the baseline: chance -> 0, perfect -> 1 (commonsense_qa: 5 options, chance 0.20)
    r = CORE.core_score({"commonsense_qa:10": {"metrics": {"acc": {"value": 0.2, "stderr": 0.01}}},
                         "boolq:10": {"metrics": {"acc": {"value": 1.0, "stderr": 0.0}}}})
    assert [t["centered"] for t in r["tasks"]] == pytest.approx([0.0, 1.0])
    assert r["value"] == pytest.approx(0.5) and r["stderr"] == pytest.approx(0.01 / 0.8 / 2)


# --------------------------------------------------------------------------- contamination
def test_contamination_scan_is_exact_across_chunk_boundaries():
    from utils.bench import contamination as C, tasks as T
    rng = np.random.default_rng(0)
    shard = rng.integers(100, 30000, size=5000).astype(np.uint16)
    planted = rng.integers(100, 30000, size=40)
    shard[1990:2030] = planted                                     # spans the chunk boundary at 2000
    enc = {"p": planted.tolist(), "c": rng.integers(100, 30000, size=40).tolist(), "s": [5, 6, 7]}
    items = [T.TextItem("0", "p"), T.TextItem("1", "c"), T.TextItem("2", "s")]
    for chunk in (2000, 1 << 20):
        out = C.check({"t": items}, lambda texts: [enc[t] for t in texts], [shard], 13, 0.8, chunk=chunk)
        r = out["t"]
        assert r["coverage"] == [1.0, 0.0, None] and (r["contaminated"], r["judged"], r["too_short"]) == (1, 2, 1)
        assert out["_tokens"] == 5000


def _write_planted_piqa(path: Path) -> tuple[int, int]:
    """Three PIQA rows copied from the training text (the first news lines: train_shards holds
    them) and three written here; (planted, clean)."""
    lines = [x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines() if x.strip()]
    rows = []
    for line in lines[:3]:
        words = line.split()
        rows.append({"goal": " ".join(words[:25]), "sol1": " ".join(words[25:45]), "sol2": "no", "label": 0})
    for k in range(3):
        rows.append({"goal": f"How would a careful walrus number {k} arrange seven violet umbrellas "
                             "along the frozen harbour wall before the midnight ferry departs",
                     "sol1": "one by one from the lighthouse towards the old customs office gate",
                     "sol2": "no", "label": 0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return 3, 3


def test_cli_core_preset_two_checkpoints_and_contamination(trained_run, tmp_path, capsys, monkeypatch):
    import benchmark
    from utils.bench import core as CORE
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    run = trained_run["run"]
    limits = [x for t in ("hellaswag", "arc_easy", "arc_challenge", "copa", "commonsense_qa", "piqa",
                          "openbookqa", "lambada", "winogrande", "boolq") for x in ("--limit", f"{t}=2")]
    out_dir = tmp_path / "core"
    assert benchmark.main(["--config", str(trained_run["cfg"]), "--test", str(run / "checkpoint_best.pt"),
                           str(run / "checkpoint_latest.pt"), "--preset", "core", "--contamination",
                           "--output-dir", str(out_dir), *limits]) == 0
    text = capsys.readouterr().out
    assert "over 11 of DCLM's 22 CORE tasks" in text and "jeopardy" in text and "not comparable" in text
    assert "hellaswag 10-shot acc_norm" in text and "Contamination, base/checkpoint_best:" in text
    data = json.loads(next(out_dir.glob("benchmark_*.json")).read_text())
    assert len(data["models"]) == 2
    for m in data["models"]:
        r = m["results"]
        centered = []
        for name, key, metric, base in [("hellaswag_zeroshot", "hellaswag", "acc_norm", .25),
                                        ("arc_easy", "arc_easy:10", "acc_norm", .25),
                                        ("arc_challenge", "arc_challenge:10", "acc_norm", .25),
                                        ("copa", "copa", "acc", .5), ("commonsense_qa", "commonsense_qa:10", "acc", .20),
                                        ("piqa", "piqa:10", "acc_norm", .5), ("openbook_qa", "openbookqa", "acc_norm", .25),
                                        ("lambada_openai", "lambada", "acc", 0.0), ("hellaswag", "hellaswag:10", "acc_norm", .25),
                                        ("winogrande", "winogrande", "acc", .5), ("boolq", "boolq:10", "acc", .62)]:
            assert r[key]["items"]["scored"] == 2
            centered.append((r[key]["metrics"][metric]["value"] - base) / (1 - base))
        assert r["core"]["metrics"]["core"]["value"] == pytest.approx(np.mean(centered))
        assert [t["random_baseline"] for t in r["core"]["tasks"]] == [t.baseline for t in CORE.included()]
        assert m["contamination"]["checked"] and m["contamination"]["tokens"] > 0
        assert set(m["contamination"]["tasks"]) == set(data["settings"]["tasks"])


def test_cli_contamination_finds_planted_items(trained_run, train_shards, tmp_path, capsys, monkeypatch):
    import benchmark
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = tmp_path / "piqa_planted.jsonl"
    planted, clean = _write_planted_piqa(rows)
    out_dir = tmp_path / "contam"
    assert benchmark.main(["--config", str(trained_run["cfg"]), "--test", "base", "--tasks", "piqa",
                           "--source", f"piqa={rows}", "--contamination", "--output-dir", str(out_dir)]) == 0
    text = capsys.readouterr().out
    c = json.loads(next(out_dir.glob("benchmark_*.json")).read_text())["models"][0]["contamination"]
    r = c["tasks"]["piqa"]
    assert (r["contaminated"], r["touched"], r["judged"]) == (planted, planted, planted + clean)
    assert all(x >= 0.8 for x in r["coverage"][:planted]) and r["coverage"][planted:] == [0.0] * clean
    assert c["shards"] == str(train_shards) and c["tokens"] > 10_000
    assert "piqa 50.0% (3/6)" in text
    # the same line in the model card's rows (export) and in the run report
    import report
    from utils.bench.report import scored_results
    fp = json.loads(next(out_dir.glob("benchmark_*.json")).read_text())["models"][0]["identity"]["fingerprint"]
    rows, _ = scored_results(out_dir, fp)
    assert any(t == "contamination" and "piqa 50.0% (3/6)" in v for t, _, v in rows), rows
    layer = tmp_path / "layer.json"
    layer.write_text(json.dumps({"paths": {"benchmark_dir": str(out_dir)}}))
    assert report.main(["base", "--config", str(trained_run["cfg"]), "--config", str(layer),
                        "--out", str(tmp_path / "rep")]) == 0
    md = next((tmp_path / "rep").rglob("report.md")).read_text()
    assert "Contamination, base/checkpoint" in md and "piqa 50.0% (3/6)" in md


def test_training_shards_are_found_through_the_run_chain(trained_run, train_shards, tmp_path):
    """A post-training run's base is followed back to its pre-training run's data record;
    a run with no base of this project, or a missing base, is reported with the reason."""
    import shutil
    from utils.bench import contamination as C
    from utils.config import load_config
    cfg = load_config(base_file=None)
    ck = tmp_path / "checkpoints"
    shutil.copytree(trained_run["run"], ck / "base", ignore=shutil.ignore_patterns("*.pt"))
    for name, base in (("sft_base_1", "base"), ("dpo_sft_1", "sft_base_1"), ("sft_gone_1", "gone")):
        (ck / name).mkdir()
        (ck / name / f"{name.split('_')[0]}_config.json").write_text(json.dumps(
            {"base": {"run": base, "file": "checkpoint_best.pt", "path": "x", "imported": False}}))
    where, how = C.training_shard_dir(ck / "dpo_sft_1" / "checkpoint_best.pt", cfg)
    assert where == train_shards and how.startswith("dpo_sft_1 <- sft_base_1 <- base: dataset.wikipedia_test_dir")
    where, how = C.training_shard_dir(ck / "sft_gone_1" / "checkpoint_best.pt", cfg)
    assert where is None and "gone is not under" in how
