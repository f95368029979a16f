#!/usr/bin/env python3
"""Throughput of `prepare` against its real limit and named baselines, as ratios in one run.

    python perf/prep_throughput.py [--mb 50] [--workers 0] [--repeat 3]

Corpus: the cleaned offline Wikipedia sample (``python main.py clean`` on data/samples/enwiki,
run into a temp dir; if that stage is missing or fails, the offline news sample, and the
output says so) replicated to ``--mb`` MB of cleaned text. Tokenizer: the Llama-style
SentencePiece sample (stands in for CodeLlama offline). Every measurement runs in its own
fresh process with the same cores (N = all CPUs this process may use) and the library's
default threading, and excludes loading the tokenizer:

  (L) limit     the real ceiling for N cores: N forked single-threaded processes
                (TOKENIZERS_PARALLELISM=false), each running ``encode_batch_fast`` on its
                share of the text, already in memory. Timed: from releasing them to the last
                one finishing. Nothing else is in it (no reading, no start-up, no writing).
  (a) engine    prepare's engine (utils.data.packing via dataset_prep.make_job) end to end.
                Timed: reading the cleaned files, starting N worker processes, tokenizing,
                packing and writing the shards and metadata. So a/L <= 1 by construction
                and 1 - a/L is everything the engine spends beyond encoding.
  (c) map       seeds/003's recipe: ``datasets.Dataset.map(batched=True, num_proc=N)`` with
                the join-with-EOS-and-chunk function (chunks of 512). Timed: the map.
  (d) old way   seeds/002's "old way": tokenize (datasets.map, num_proc=N), then one Python
                list extended document by document, then sliced into 512-token windows
                (without saving the windows, which only makes it look better). Timed: all.

Tokens are counted the same way everywhere: content tokens, i.e. ids that are not special
tokens (the engine's own count excludes the BOS/EOS framing it adds; the recipes' counts
exclude whatever special ids their ``tokenizer(...)`` call added). Each contender runs
``--repeat`` times, interleaved; min / median / max are printed and the headline ratios use
medians. Peak memory is VmHWM from /proc for the measuring process and for each worker
(sampled every 20 ms until it exits; the largest is printed), never ru_maxrss, which a
forked worker inherits from its parent.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
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
def vm_hwm_mb(pid="self") -> float:
    """Peak resident memory of one process (VmHWM), in MB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    if pid == "self":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return 0.0


class ChildPeaks:
    """Samples the VmHWM of this process's children every ``every`` seconds (a thread)."""

    def __init__(self, every: float = 0.02):
        import threading
        self.every, self.peaks, self._stop = every, {}, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _children(self) -> list[int]:
        me, out = os.getpid(), []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(d.name))
                except (OSError, ValueError, IndexError):
                    continue
        return out

    def _run(self):
        while not self._stop.is_set():
            for pid in self._children():
                self.peaks[pid] = max(self.peaks.get(pid, 0.0), vm_hwm_mb(pid))
            self._stop.wait(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def largest(self) -> float:
        return max(self.peaks.values(), default=0.0)


def machine_info() -> str:
    import numpy
    import tokenizers
    import transformers
    from perf.machine import cpu_model
    cpu = cpu_model()
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"{dt.datetime.now().isoformat(timespec='seconds')} | {platform.platform()} | {cpu} | "
            f"{os.cpu_count()} cores ({cores()} usable){mem} | Python {platform.python_version()}, tokenizers "
            f"{tokenizers.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}")


def load_tok():
    sys.path.insert(0, str(ROOT))
    from utils.data.tok import load_tokenizer_from
    return load_tokenizer_from(str(SPM_MODEL))


def read_texts(corpus: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from utils.data.textio import iter_articles
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
    from utils.data.textio import escape_article
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
    from utils.data.packing import pack
    cfg_file = out.parent / f"{out.name}_config.json"
    cfg_file.write_text(json.dumps({
        "paths": {"root": str(out.parent), "cleaned_dir": str(corpus)},
        "tokenizer": {"name": str(SPM_MODEL)},
        "dataset": {"shard_tokens": SHARD_TOKENS, "batch": BATCH, "workers": workers}}))
    cfg = load_config(cfg_file)
    job = make_job(cfg, output_dir=out, force=True, progress_bar=False)
    rss_before = vm_hwm_mb()
    with ChildPeaks() as peaks:
        t = time.perf_counter()
        meta = pack(job, log=lambda s: None)
        sec = time.perf_counter() - t
    return {"tokens": meta["stats"]["content_tokens"], "seconds": sec, "shards": len(meta["shards"]),
            "rss_mb": vm_hwm_mb(), "rss_before_mb": rss_before, "rss_workers_mb": peaks.largest}


def child_limit(corpus: Path, n: int) -> dict:
    """N forked single-threaded encoders over in-memory text, released together."""
    tok = load_tok()                       # TOKENIZERS_PARALLELISM=false: one thread each
    texts = read_texts(corpus)
    backend = tok.backend_tokenizer
    special = set(tok.all_special_ids)
    total = sum(len(t) for t in texts)
    parts, cur, acc = [], [], 0            # contiguous shares of about total / n characters
    for t in texts:
        cur.append(t)
        acc += len(t)
        if acc >= total / n * (len(parts) + 1) and len(parts) < n - 1:
            parts.append(cur)
            cur = []
    parts.append(cur)
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pids = []
    for part in parts:
        pid = os.fork()
        if pid == 0:                       # worker: wait for the start, encode, report, exit
            os.close(go_w)
            os.read(go_r, 1)
            k = 0
            for i in range(0, len(part), BATCH):
                for e in backend.encode_batch_fast(part[i:i + BATCH], add_special_tokens=False):
                    k += sum(1 for x in e.ids if x not in special) if special & set(e.ids) else len(e.ids)
            os.write(res_w, (json.dumps({"tokens": k, "hwm": vm_hwm_mb()}) + "\n").encode())
            os._exit(0)
        pids.append(pid)
    os.close(go_r)
    os.close(res_w)
    t = time.perf_counter()
    os.write(go_w, b"x" * len(parts))
    buf = b""
    with os.fdopen(res_r, "rb") as f:
        for _ in parts:
            buf += f.readline()
    sec = time.perf_counter() - t
    for pid in pids:
        os.waitpid(pid, 0)
    rows = [json.loads(x) for x in buf.decode().splitlines()]
    return {"tokens": sum(r["tokens"] for r in rows), "seconds": sec, "rss_mb": vm_hwm_mb(),
            "rss_workers_mb": max(r["hwm"] for r in rows), "processes": len(parts)}


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
        with ChildPeaks() as peaks:
            out = ds.map(tokenize_cd, batched=True, num_proc=cores(), remove_columns=ds.column_names,
                         cache_file_name=str(Path(cache) / "map.arrow"))
        sec = time.perf_counter() - t
        n = count_content(out["input_ids"], tok)
    return {"tokens": n, "seconds": sec, "rss_mb": vm_hwm_mb(), "rss_workers_mb": peaks.largest}


def child_oldway(corpus: Path) -> dict:
    """seeds/002's old way: tokenize, extend one list doc by doc, slice into windows."""
    import datasets
    datasets.disable_progress_bars()
    tok = load_tok()
    texts = read_texts(corpus)
    ds = datasets.Dataset.from_dict({"text": texts})
    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        with ChildPeaks() as peaks:
            ds_tokenized = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=cores(),
                                  remove_columns=ds.column_names,
                                  cache_file_name=str(Path(cache) / "tok.arrow"))
        all_ids = []
        for example in ds_tokenized:
            all_ids.extend(example["input_ids"])
        chunks = [all_ids[i:i + CONTEXT] for i in range(0, len(all_ids), CONTEXT)]
        sec = time.perf_counter() - t
    n = count_content([all_ids], tok)
    del chunks
    return {"tokens": n, "seconds": sec, "rss_mb": vm_hwm_mb(), "rss_workers_mb": peaks.largest}


def count_content(rows, tok) -> int:
    """Ids that are not special tokens (what the tokenizer made of the text itself)."""
    special = set(tok.all_special_ids)
    return int(sum(len(r) - sum(1 for x in r if x in special) for r in rows))


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_child(kind: str, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", kind] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT))
    env.pop("TOKENIZERS_PARALLELISM", None)   # every contender gets the library default ...
    env.pop("RAYON_NUM_THREADS", None)
    if kind == "limit":                        # ... except the limit's single-threaded encoders
        env["TOKENIZERS_PARALLELISM"] = "false"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise SystemExit(f"measurement {kind} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB of cleaned text")
    ap.add_argument("--workers", type=int, default=0, help="engine worker processes (0 = all cores)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per measurement, interleaved; min / median / max are printed")
    ap.add_argument("--skip-baselines", action="store_true", help="only measure the engine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        corpus = Path(args.corpus)
        res = {"engine": lambda: child_engine(corpus, Path(args.out), args.workers),
               "limit": lambda: child_limit(corpus, args.n),
               "map": lambda: child_map(corpus), "oldway": lambda: child_oldway(corpus)}[args.child]()
        print(json.dumps(res))
        return 0

    sys.path.insert(0, str(ROOT))
    workers = args.workers or cores()
    print("prep throughput:", machine_info())
    with tempfile.TemporaryDirectory(prefix="prep-perf-") as tmp:
        tmp = Path(tmp)
        lines, label = cleaned_lines(tmp)
        small, large = tmp / "small", tmp / "large"
        nb_small = build_corpus(lines, args.mb / 4, small)
        nb_large = build_corpus(lines, args.mb, large)
        print(f"corpus: {label}, replicated to {nb_large / 1e6:.1f} MB (and {nb_small / 1e6:.1f} MB for the "
              f"memory check); tokenizer: SPM sample {SPM_MODEL.name} (32,000 pieces, stands in for "
              f"CodeLlama); N = {workers} process(es); engine batch {BATCH}, shard_tokens {SHARD_TOKENS:,}")

        def rate(r):
            return r["tokens"] / r["seconds"]

        def med(rs):
            return statistics.median(rate(r) for r in rs)

        def show(name, rs):
            rates = sorted(rate(r) for r in rs)
            print(f"  {name:<30} {rs[0]['tokens']:>11,} tokens  tok/s min {rates[0]:>10,.0f}  median "
                  f"{statistics.median(rates):>10,.0f}  max {rates[-1]:>10,.0f}   peak MB: process "
                  f"{max(r['rss_mb'] for r in rs):>5.0f}, largest worker "
                  f"{max(r.get('rss_workers_mb', 0) for r in rs):>5.0f}", flush=True)

        plan = {"L": dict(kind="limit", corpus=large, n=workers),
                "a": dict(kind="engine", corpus=large, out=tmp / "shards_large", workers=workers)}
        if not args.skip_baselines:
            plan.update(c=dict(kind="map", corpus=large), d=dict(kind="oldway", corpus=large))
        runs: dict = {k: [] for k in plan}
        for _ in range(max(1, args.repeat)):
            for key, spec in plan.items():
                spec = dict(spec)
                runs[key].append(run_child(spec.pop("kind"), **spec))
                shutil.rmtree(tmp / "shards_large", ignore_errors=True)
        a_small = run_child("engine", corpus=small, out=tmp / "shards_small", workers=workers)
        shutil.rmtree(tmp / "shards_small", ignore_errors=True)
        counts = {k: {r["tokens"] for r in v} for k, v in runs.items()}
        print(f"measurements (each in a fresh process; {args.repeat} interleaved runs each):")
        show("(L) limit: N x encode_batch_fast", runs["L"])
        show("(a) engine (prepare)", runs["a"])
        if not args.skip_baselines:
            show("(c) seeds/003 datasets.map", runs["c"])
            show("(d) seeds/002 old way", runs["d"])
        per_run = [rate(a) / rate(lim) for a, lim in zip(runs["a"], runs["L"])]
        print("ratios (medians; per interleaved run in brackets):")
        print(f"  a/L  engine / real limit            = {med(runs['a']) / med(runs['L']):5.2f}   "
              f"[{', '.join(f'{x:.2f}' for x in per_run)}]   (goal >= 0.95)")
        if not args.skip_baselines:
            print(f"  a/c  engine / seeds/003 datasets.map = {med(runs['a']) / med(runs['c']):5.2f}   (target >= 1.5)")
            print(f"  a/d  engine / seeds/002 old way      = {med(runs['a']) / med(runs['d']):5.2f}   (reported)")
        if len(counts["a"] | counts["L"]) > 1:
            print(f"  note: content-token counts differ: limit {sorted(counts['L'])}, engine {sorted(counts['a'])}")
        a = runs["a"][-1]
        print(f"engine memory (VmHWM): parent {a_small['rss_mb']:.0f} MB at {nb_small / 1e6:.1f} MB of text, "
              f"{a['rss_mb']:.0f} MB at {nb_large / 1e6:.1f} MB ({a['rss_before_mb']:.0f} MB before packing: "
              f"the loaded tokenizer); largest worker {a_small['rss_workers_mb']:.0f} / "
              f"{a['rss_workers_mb']:.0f} MB. Growth with 4x the corpus: {a['rss_mb'] - a_small['rss_mb']:+.0f} MB.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
