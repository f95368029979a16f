#!/usr/bin/env python3
"""Throughput of `prepare` against named baselines, printed as ratios in one run.

    python perf/prep_throughput.py [--mb 50] [--workers 0]

Corpus: the cleaned offline Wikipedia sample (``python main.py clean`` on data/samples/enwiki,
run into a temp dir; if that stage is missing or fails, the offline news sample, and the
output says so) replicated to ``--mb`` MB of cleaned text. Tokenizer: the Llama-style
SentencePiece sample (stands in for CodeLlama offline). Every measurement runs in its own
fresh process on the same cores and excludes loading the tokenizer and reading the text:

  (a) engine    prepare's engine (utils.packing via dataset_prep.make_job) end to end:
                read the cleaned files, tokenize in worker processes, pack, write shards
  (b) ceiling   the raw fast-tokenizer batch encoder on the same text with all cores
                (``backend.encode_batch``; ``encode_batch_fast`` is shown too)
  (c) map       seeds/003's recipe: ``datasets.Dataset.map(batched=True, num_proc=cores)`` with
                the join-with-EOS-and-chunk function (chunks of 512)
  (d) old way   seeds/002's "old way": tokenize (datasets.map, num_proc=cores), then one Python
                list extended document by document, then sliced into 512-token windows
                (without saving the windows, which only makes it look better)

Tokens/s counts content tokens (what the tokenizer produced). Peak RSS of the engine's
parent process is measured at two corpus sizes (--mb / 4 and --mb) with the same shard size,
to show it does not grow with the corpus.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
SPM_MODEL = SAMPLES / "tokenizers" / "mistral-v1" / "tokenizer.model"
ENWIKI = SAMPLES / "enwiki"
NEWS = SAMPLES / "news" / "lee_background.cor"
CONTEXT = 512
SHARD_TOKENS = 1_000_000
BATCH = 1_000


# --------------------------------------------------------------------------- helpers
def rss_mb(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0   # Linux: KiB


def machine_info() -> str:
    import numpy
    import tokenizers
    import transformers
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"{dt.datetime.now().isoformat(timespec='seconds')} | {platform.platform()} | {cpu} | "
            f"{os.cpu_count()} cores{mem} | Python {platform.python_version()}, tokenizers "
            f"{tokenizers.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}")


def load_tok():
    sys.path.insert(0, str(ROOT))
    from utils.tok import load_tokenizer_from
    return load_tokenizer_from(str(SPM_MODEL))


def read_texts(corpus: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from utils.textio import iter_articles
    return list(iter_articles(sorted(corpus.glob("cleaned_*.txt"))))


# --------------------------------------------------------------------------- corpus
def cleaned_lines(tmp: Path) -> tuple[list[str], str]:
    """Escaped article lines of the cleaned enwiki sample (or the news sample) + a label."""
    cfg = tmp / "clean_config.json"
    out = tmp / "cleaned_sample"
    cfg.write_text(json.dumps({"paths": {"root": str(tmp)}, "wikipedia": {"raw_dir": str(ENWIKI)},
                               "cleaning": {"output_dir": str(out)}}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if (ROOT / "cleaner.py").exists():
        proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "clean", "--config", str(cfg)],
                              capture_output=True, text=True, env=env)
        lines = [ln for p in sorted(out.glob("cleaned_*.txt"))
                 for ln in p.read_text(encoding="utf-8").splitlines() if ln]
        if proc.returncode == 0 and lines:
            return lines, f"cleaned enwiki sample ({len(lines)} articles, `main.py clean`)"
        why = f"`main.py clean` failed (exit {proc.returncode})"
    else:
        why = "cleaner.py does not exist yet"
    from utils.textio import escape_article
    lines = [escape_article(ln.strip()) for ln in NEWS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines, f"FALLBACK: news sample ({len(lines)} docs) because {why}"


def build_corpus(lines: list[str], mb: float, directory: Path, file_mb: float = 8.0) -> int:
    """Replicate ``lines`` into cleaned_*.txt files until ``mb`` MB; returns bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    block = ("\n".join(lines) + "\n").encode("utf-8")
    target, written, i = int(mb * 1e6), 0, 0
    f = None
    while written < target:
        if f is None or f.tell() >= file_mb * 1e6:
            if f:
                f.close()
            f = open(directory / f"cleaned_{i:03d}.txt", "wb")
            i += 1
        f.write(block)
        written += len(block)
    f.close()
    return written


# --------------------------------------------------------------------------- measurements (children)
def child_engine(corpus: Path, out: Path, workers: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from dataset_prep import make_job
    from utils.config import load_config
    from utils.packing import pack
    cfg_file = out.parent / f"{out.name}_config.json"
    cfg_file.write_text(json.dumps({
        "paths": {"root": str(out.parent), "cleaned_dir": str(corpus)},
        "tokenizer": {"name": str(SPM_MODEL)},
        "dataset": {"shard_tokens": SHARD_TOKENS, "batch": BATCH, "workers": workers}}))
    cfg = load_config(cfg_file)
    job = make_job(cfg, output_dir=out, force=True, progress_bar=False)
    rss_before = rss_mb()
    t = time.perf_counter()
    meta = pack(job, log=lambda s: None)
    sec = time.perf_counter() - t
    return {"tokens": meta["stats"]["content_tokens"], "seconds": sec, "shards": len(meta["shards"]),
            "rss_mb": rss_mb(), "rss_before_mb": rss_before,
            "rss_workers_mb": rss_mb(resource.RUSAGE_CHILDREN)}


def child_ceiling(corpus: Path, fast: bool) -> dict:
    tok = load_tok()
    texts = read_texts(corpus)
    backend = tok.backend_tokenizer
    enc = backend.encode_batch_fast if fast else backend.encode_batch
    t = time.perf_counter()
    n = 0
    for i in range(0, len(texts), BATCH):
        n += sum(len(e) for e in enc(texts[i:i + BATCH], add_special_tokens=False))
    return {"tokens": n, "seconds": time.perf_counter() - t, "rss_mb": rss_mb()}


def child_map(corpus: Path) -> dict:
    """seeds/003: join with EOS, tokenize, chunk; datasets.map(batched=True, num_proc=all cores)."""
    import datasets
    datasets.disable_progress_bars()
    tok = load_tok()
    texts = read_texts(corpus)
    ds = datasets.Dataset.from_dict({"text": texts})
    context_length = CONTEXT

    def tokenize_cd(elements):
        concatenated_text = tok.eos_token.join(elements["text"])
        outputs = tok(concatenated_text, truncation=False, return_tensors="pt")
        input_ids = outputs["input_ids"][0]
        total_length = input_ids.size(0)
        chunks = []
        for i in range(0, total_length, context_length):
            chunk = input_ids[i:i + context_length].tolist()
            if len(chunk) >= 0.5 * context_length:
                chunks.append(chunk)
        return {"input_ids": chunks}

    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        out = ds.map(tokenize_cd, batched=True, num_proc=os.cpu_count(), remove_columns=ds.column_names,
                     cache_file_name=str(Path(cache) / "map.arrow"))
        sec = time.perf_counter() - t
        n = int(sum(len(x) for x in out["input_ids"]))
    return {"tokens": n, "seconds": sec, "rss_mb": rss_mb()}


def child_oldway(corpus: Path) -> dict:
    """seeds/002's old way: tokenize, extend one list doc by doc, slice into windows."""
    import datasets
    datasets.disable_progress_bars()
    tok = load_tok()
    texts = read_texts(corpus)
    ds = datasets.Dataset.from_dict({"text": texts})
    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        ds_tokenized = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=os.cpu_count(),
                              remove_columns=ds.column_names, cache_file_name=str(Path(cache) / "tok.arrow"))
        all_ids = []
        for example in ds_tokenized:
            all_ids.extend(example["input_ids"])
        chunks = [all_ids[i:i + CONTEXT] for i in range(0, len(all_ids), CONTEXT)]
        sec = time.perf_counter() - t
    n = len(all_ids) - len(texts)   # content tokens: tok() added a BOS per document
    del chunks
    return {"tokens": n, "seconds": sec, "rss_mb": rss_mb()}


def run_child(kind: str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", kind] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT))
    env.pop("TOKENIZERS_PARALLELISM", None)   # every contender gets the library default
    env.pop("RAYON_NUM_THREADS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise SystemExit(f"measurement {kind} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB of cleaned text")
    ap.add_argument("--workers", type=int, default=0, help="engine worker processes (0 = all cores)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs per measurement, interleaved; the fastest counts (shared machines are noisy)")
    ap.add_argument("--skip-baselines", action="store_true", help="only measure the engine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--fast", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        corpus = Path(args.corpus)
        res = {"engine": lambda: child_engine(corpus, Path(args.out), args.workers),
               "ceiling": lambda: child_ceiling(corpus, bool(args.fast)),
               "map": lambda: child_map(corpus), "oldway": lambda: child_oldway(corpus)}[args.child]()
        print(json.dumps(res))
        return 0

    sys.path.insert(0, str(ROOT))
    cores = os.cpu_count() or 1
    workers = args.workers or cores
    print("prep throughput:", machine_info())
    with tempfile.TemporaryDirectory(prefix="prep-perf-") as tmp:
        tmp = Path(tmp)
        lines, label = cleaned_lines(tmp)
        small, large = tmp / "small", tmp / "large"
        nb_small = build_corpus(lines, args.mb / 4, small)
        nb_large = build_corpus(lines, args.mb, large)
        print(f"corpus: {label}, replicated to {nb_large / 1e6:.1f} MB (and {nb_small / 1e6:.1f} MB for the "
              f"memory check); tokenizer: SPM sample {SPM_MODEL.name} (32,000 pieces, stands in for "
              f"CodeLlama); engine: {workers} worker process(es), batch {BATCH}, shard_tokens {SHARD_TOKENS:,}")

        def rate(r):
            return r["tokens"] / r["seconds"]

        def show(name, r):
            print(f"  {name:<34} {r['tokens']:>12,} tokens {r['seconds']:>8.2f} s {rate(r):>12,.0f} tok/s"
                  f"   peak RSS {r['rss_mb']:>7.0f} MB", flush=True)

        print(f"measurements (each in a fresh process; best of {args.repeat}, interleaved):")
        a_small = run_child("engine", corpus=small, out=tmp / "shards_small", workers=workers)
        show("(a) engine, small corpus", a_small)
        plan = {"a": dict(kind="engine", corpus=large, out=tmp / "shards_large", workers=workers)}
        if not args.skip_baselines:
            plan.update(b=dict(kind="ceiling", corpus=large, fast=0), bf=dict(kind="ceiling", corpus=large, fast=1),
                        c=dict(kind="map", corpus=large), d=dict(kind="oldway", corpus=large))
        best: dict = {}
        for _ in range(max(1, args.repeat)):
            for key, spec in plan.items():
                spec = dict(spec)
                r = run_child(spec.pop("kind"), **spec)
                if key not in best or r["seconds"] < best[key]["seconds"]:
                    best[key] = r
        shutil.rmtree(tmp / "shards_small", ignore_errors=True)
        shutil.rmtree(tmp / "shards_large", ignore_errors=True)
        a = best["a"]
        show("(a) engine", a)
        if args.skip_baselines:
            return 0
        b, bf, c, d = best["b"], best["bf"], best["c"], best["d"]
        show("(b) ceiling: encode_batch", b)
        show("(b') encode_batch_fast (no offsets)", bf)
        show("(c) seeds/003 datasets.map recipe", c)
        show("(d) seeds/002 old way", d)

        print("ratios:")
        print(f"  a/b  engine / raw encode_batch ceiling   = {rate(a) / rate(b):5.2f}   (target >= 0.8)")
        print(f"  a/b' engine / raw encode_batch_fast      = {rate(a) / rate(bf):5.2f}   (stricter ceiling)")
        print(f"  a/c  engine / seeds/003 datasets.map     = {rate(a) / rate(c):5.2f}   (target >= 1.5)")
        print(f"  a/d  engine / seeds/002 old way          = {rate(a) / rate(d):5.2f}   (reported)")
        print(f"peak RSS of the engine's parent process: {a_small['rss_mb']:.0f} MB at {nb_small / 1e6:.1f} MB "
              f"of text, {a['rss_mb']:.0f} MB at {nb_large / 1e6:.1f} MB (after loading the tokenizer: "
              f"{a_small['rss_before_mb']:.0f} / {a['rss_before_mb']:.0f} MB); largest worker "
              f"{a_small['rss_workers_mb']:.0f} / {a['rss_workers_mb']:.0f} MB. Growth with 4x the corpus: "
              f"{a['rss_mb'] - a_small['rss_mb']:+.0f} MB.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
