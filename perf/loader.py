"""Loader start-up, memory and throughput on a synthetic 1-billion-token shard set.

    python perf/loader.py [--tokens 1000000000] [--shards 10] [--seconds 10] [--dir TMP]

Writes a valid shard set (uint16 random token ids with BOS/EOS every 1,000 tokens, chunked
writes through ``np.lib.format.open_memmap`` so creation is fast and memory stays low; about
2 GB of disk for 1e9 tokens) plus metadata.json into a temporary directory, then measures in
a fresh subprocess:

- import time of torch + numpy + dataloader (reported separately, not part of start-up);
- start-up: from calling ``dataloader.build_loaders`` to holding the first batch (metadata
  read and validated, shards memory-mapped, split and sampler built) — target < 1 s;
- peak RSS of that process at the first batch (VmHWM; ``resource.getrusage`` where there is no
  /proc) — target < 300 MB;
- windows/s (and tokens/s) of the shuffled training loader for ``--seconds``, with the
  resident memory split into anonymous and file-backed (page-cache pages of the memory map,
  which the kernel reclaims freely) at the end.

The same start-up is also measured on a 1/100 size set to show it does not grow with size.
That start-up gets the tokenizer's description precomputed (the trainer passes its loaded
tokenizer). The "user path" line times what a user's first batch costs on top: loading the
configured tokenizer (the offline sample's Llama-style SentencePiece model by default) and
fingerprinting it, then build_loaders and the first batch, in a fresh process (imports not
counted). The shard files were just written, so
they are in the page cache (warm reads). The temporary directory is removed at the end.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TARGET_S = 1.0
RSS_TARGET_MB = 300.0
SAMPLE_TOKENIZER = ROOT / "data/samples/tokenizers/mistral-v1/tokenizer.model"


def synthetic_tokenizer() -> dict:
    return {"name": "synthetic-perf", "vocab_size": 32000, "bos_id": 1, "eos_id": 2, "unk_id": 0,
            "pad_id": None, "fingerprint": hashlib.sha256(b"synthetic-perf").hexdigest()}


def make_shard_set(directory: Path, tokens: int, n_shards: int, doc_len: int = 1000,
                   tokenizer: dict | None = None) -> dict:
    """Write n_shards uint16 shards totalling ``tokens`` tokens, then metadata.json.

    The shards are filled through a memory map in blocks (a 1e9-token set never sits in
    memory); the metadata comes from the real writer's ``shard_set_metadata`` with each
    shard's ``max_token_id``, as prep records it, so the loader validates the set from
    metadata alone, as it does a set built by `prepare`."""
    import numpy as np
    from utils.data.shards import shard_name, shard_set_metadata, write_metadata
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per = [tokens // n_shards + (1 if i < tokens % n_shards else 0) for i in range(n_shards)]
    per = [n - n % doc_len if n >= doc_len else n for n in per]  # whole documents
    chunk = 16 * 1024 * 1024
    shards = []
    for i, n in enumerate(per):
        name = shard_name(i)
        tmp = directory / f".{name}.tmp"
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=(n,))
        top = 0
        for a in range(0, n, chunk):
            block = rng.integers(3, 32000, size=min(chunk, n - a), dtype=np.uint16)
            block[0::doc_len] = 1            # BOS ... EOS every doc_len tokens (chunk is a
            block[doc_len - 1::doc_len] = 2  # multiple of doc_len only roughly: content is synthetic)
            mm[a:a + len(block)] = block
            top = max(top, int(block.max()))
        mm.flush()
        del mm
        os.replace(tmp, directory / name)
        shards.append({"file": name, "tokens": n, "documents": max(1, n // doc_len),
                       "max_token_id": top})
    meta = shard_set_metadata(shards, dtype=np.uint16, tokenizer_info=tokenizer or synthetic_tokenizer(),
                              source={"kind": "synthetic", "inputs": [], "filters": {}, "test": False},
                              window=512, stride=256, shard_tokens=None, stats={})
    write_metadata(directory, meta)
    return meta


def _status_mb() -> dict:
    out = {}
    try:
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) / 1024
    except OSError:
        pass
    return out


def child(cfg_path: str, seconds: float, batch_size: int, user_path: bool = False) -> None:
    """Runs in a fresh process: import, build, first batch, iterate. Prints one JSON line."""
    import resource
    t0 = time.perf_counter()
    import numpy
    import torch
    sys.path.insert(0, str(ROOT))
    import dataloader as dl
    from utils.config import load_config
    t_import = time.perf_counter() - t0
    def rss() -> float:
        """Peak RSS in MB of this process image: VmHWM (reset at exec). ru_maxrss would also
        count the parent's pages at fork time (Linux keeps that high-water mark across exec)."""
        return _status_mb().get("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_import = rss()
    cfg = load_config(cfg_path)
    torch.set_num_threads(1)
    if user_path:
        # What a user's first batch costs (dataloader.py / train): load the configured
        # tokenizer, fingerprint it, build the loaders, take a batch.
        from utils.data.tok import describe, load_tokenizer
        t1 = time.perf_counter()
        tok = load_tokenizer(cfg)
        t_load = time.perf_counter() - t1
        desc = describe(tok, cfg.tokenizer.name)
        t_fp = time.perf_counter() - t1 - t_load
        train, val, info = dl.build_loaders(cfg, desc, batch_size=batch_size)
        x, y = next(iter(train))
        print(json.dumps({"total_s": time.perf_counter() - t1, "load_s": t_load,
                          "fingerprint_s": t_fp, "rss_first_batch_mb": rss()}))
        return

    shard_dir = Path(json.loads(Path(cfg_path).read_text())["dataset"]["wikipedia_full_dir"])
    described = json.loads((shard_dir / "metadata.json").read_text())["tokenizer"]  # precomputed
    t1 = time.perf_counter()
    train, val, info = dl.build_loaders(cfg, described, batch_size=batch_size)
    it = iter(train)
    x, y = next(it)
    t_start = time.perf_counter() - t1
    rss_first, status_first = rss(), _status_mb()
    assert x.shape == (batch_size, cfg.dataset.window)

    n, t2 = 0, time.perf_counter()
    while time.perf_counter() - t2 < seconds:
        for _ in range(50):
            try:
                x, y = next(it)
            except StopIteration:  # small sets: next epoch
                it = iter(train)
                x, y = next(it)
            n += x.shape[0]
    dt = time.perf_counter() - t2
    vx, _ = next(iter(val))
    print(json.dumps({"import_s": t_import, "startup_s": t_start, "rss_import_mb": rss_import,
                      "rss_first_batch_mb": rss_first, "rss_peak_end_mb": rss(),
                      "status_first": status_first, "status_end": _status_mb(), "windows_per_s": n / dt,
                      "tokens_per_s": n * cfg.dataset.window / dt, "iter_seconds": dt,
                      "windows": n, "torch": torch.__version__, "numpy": numpy.__version__,
                      "info": {k: v for k, v in info.items() if k != "split"},
                      "split": info["split"]}))


def measure(shard_dir: Path, work: Path, seconds: float, batch_size: int, window: int,
            tokenizer_name: str | None = None) -> dict:
    cfg_path = work / f"config_{shard_dir.name}_{'user' if tokenizer_name else 'loader'}.json"
    cfg = {"paths": {"root": str(work)},
           "dataset": {"source": "wikipedia", "wikipedia_full_dir": str(shard_dir), "window": window},
           "model": {"vocab_size": 32000, "max_seq_len": window},
           "training": {"batch_size": batch_size, "num_workers": 0}}
    if tokenizer_name:
        cfg["tokenizer"] = {"name": tokenizer_name}
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, HF_HUB_OFFLINE="1", LLM_PIPELINE_BASE_CONFIG="none")
    proc = subprocess.run([sys.executable, __file__, "--child", str(cfg_path), "--seconds",
                           str(seconds), "--batch-size", str(batch_size)]
                          + (["--user-path"] if tokenizer_name else []),
                          capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.exit(f"child failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    mem = ""
    try:
        kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GB RAM"
    except (OSError, StopIteration):
        pass
    from perf.machine import cpu_model
    cpu = cpu_model()
    return f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} cores{mem}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=1e9, help="tokens in the synthetic set")
    ap.add_argument("--shards", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0, help="iteration time for windows/s")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--dir", default=None, help="parent of the temporary directory")
    ap.add_argument("--tokenizer", default=str(SAMPLE_TOKENIZER),
                    help="tokenizer for the user-path measurement (default: the offline sample's "
                         "Llama-style SentencePiece model; '' skips it)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--user-path", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.seconds, args.batch_size, args.user_path)
        return 0

    sys.path.insert(0, str(ROOT))
    tokens = int(args.tokens)
    work = Path(tempfile.mkdtemp(prefix="perf-loader-", dir=args.dir))
    try:
        user_tok = None
        if args.tokenizer and Path(args.tokenizer).exists():
            # The shard set is labelled with the real tokenizer, so the user path validates it
            # exactly as it would a set built by `prepare` (ids stay below its 32,000).
            from utils.data.tok import describe, load_tokenizer_from
            user_tok = describe(load_tokenizer_from(args.tokenizer), args.tokenizer)
        t0 = time.perf_counter()
        big = work / "big"
        make_shard_set(big, tokens, args.shards, tokenizer=user_tok)
        t_make = time.perf_counter() - t0
        small = work / "small"
        make_shard_set(small, max(tokens // 100, 100_000), args.shards)
        disk = sum(f.stat().st_size for f in big.iterdir()) / 2**30

        r_small = measure(small, work, 1.0, args.batch_size, args.window)
        r = measure(big, work, args.seconds, args.batch_size, args.window)
        r_user = (measure(big, work, 0, args.batch_size, args.window, args.tokenizer)
                  if user_tok else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    info, split = r["info"], r["split"]
    ok_start = r["startup_s"] < STARTUP_TARGET_S
    ok_rss = r["rss_first_batch_mb"] < RSS_TARGET_MB
    st, sf = r["status_end"], r["status_first"]
    print("perf/loader.py: dataloader start-up, memory and throughput on a synthetic shard set")
    print(f"  date     : {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"  machine  : {machine()}")
    print(f"  software : Python {platform.python_version()}, torch {r['torch']}, numpy {r['numpy']}")
    print(f"  data     : {info['total_tokens']:,} uint16 tokens in {info['shards']} shards "
          f"({disk:.2f} GB, written in {t_make:.1f} s; warm page cache), window {info['window']}, "
          f"stride {info['stride']}, batch {info['batch_size']}, num_workers 0")
    print(f"  split    : train {info['train_windows']:,} windows / val {info['val_windows']:,} "
          f"windows ({split['val_fraction']:.2%} of tokens; {split['blocks']:,} blocks of "
          f"{split['block_tokens']:,} tokens)")
    print(f"  import   : torch + numpy + dataloader {r['import_s']:.2f} s (not part of start-up), "
          f"RSS after import {r['rss_import_mb']:.0f} MB")
    print(f"  start-up : build_loaders -> first batch {r['startup_s'] * 1000:.0f} ms "
          f"(1/100 size set: {r_small['startup_s'] * 1000:.0f} ms)   target < {STARTUP_TARGET_S:.0f} s: "
          f"{'PASS' if ok_start else 'FAIL'}")
    if r_user:
        print(f"  user path: load tokenizer + fingerprint + build_loaders -> first batch "
              f"{r_user['total_s'] * 1000:.0f} ms (load {r_user['load_s'] * 1000:.0f} ms, fingerprint "
              f"{r_user['fingerprint_s'] * 1000:.0f} ms; {Path(args.tokenizer).name}), peak RSS "
              f"{r_user['rss_first_batch_mb']:.0f} MB   target < {STARTUP_TARGET_S:.0f} s: "
              f"{'PASS' if r_user['total_s'] < STARTUP_TARGET_S else 'FAIL'}")
    else:
        print("  user path: skipped (no tokenizer: run `python main.py samples` or pass --tokenizer)")
    print(f"  peak RSS : {r['rss_first_batch_mb']:.0f} MB at the first batch (loader's share "
          f"{r['rss_first_batch_mb'] - r['rss_import_mb']:.0f} MB; 1/100 size set: "
          f"{r_small['rss_first_batch_mb']:.0f} MB)   target < {RSS_TARGET_MB:.0f} MB: "
          f"{'PASS' if ok_rss else 'FAIL'}")
    print(f"  iterate  : {r['windows_per_s']:,.0f} windows/s = {r['tokens_per_s'] / 1e6:.1f} M tokens/s "
          f"(shuffled, {r['iter_seconds']:.1f} s, {r['windows']:,} windows)")
    print(f"  RSS      : first batch {sf.get('RssAnon', 0):.0f} MB anonymous + {sf.get('RssFile', 0):.0f} MB "
          f"file-backed; after iterating {st.get('RssAnon', 0):.0f} MB anonymous + "
          f"{st.get('RssFile', 0):.0f} MB file-backed (the growth is touched pages of the "
          "memory-mapped shards: page cache, reclaimable, not heap)")
    print(f"  result   : {'PASS' if ok_start and ok_rss else 'FAIL'}")
    return 0 if ok_start and ok_rss else 1


if __name__ == "__main__":
    sys.exit(main())
