"""Speed of the benchmark's contamination check (utils/bench/contamination.py) on a large shard set.

    python perf/contamination_speed.py [--tokens 200_000_000] [--shards 8] [--items 5000] [--repeats 3]

Writes a synthetic shard set (uint16 token ids drawn uniformly from a 32,000-id vocabulary,
``--shards`` .npy files, memory-mapped when read, as the check reads real shards) into a
temporary folder, builds the 13-grams of ``--items`` eval items (40 tokens each, a tenth of
them planted in the shards), and times ``contamination.check`` over the whole set
(``--repeats`` runs; min / median / max). Prints tokens/s, the time extrapolated to 1e9
tokens, the peak resident memory, and checks that exactly the planted items were found.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perf.machine import cpu_model                      # noqa: E402
from utils.bench import contamination as C              # noqa: E402
from utils.bench import tasks as T                      # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000_000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    per = args.tokens // args.shards
    items = rng.integers(3, 32000, size=(args.items, 40))
    planted = set(range(0, args.items, 10))
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for s in range(args.shards):
            arr = rng.integers(3, 32000, size=per, dtype=np.uint16)
            for i in planted:
                if i % args.shards == s:
                    at = int(rng.integers(0, per - 40))
                    arr[at:at + 40] = items[i]
            p = Path(tmp) / f"tokens_{s:05d}.npy"
            np.save(p, arr)
            paths.append(p)
            del arr
        shards = [np.load(p, mmap_mode="r") for p in paths]
        enc = {str(i): [items[i].tolist()] for i in range(args.items)}
        tasks = {"synthetic": [T.TextItem(str(i), str(i)) for i in range(args.items)]}
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = C.check(tasks, lambda texts: enc[texts[0]], shards, 13, 0.8)
            times.append(time.perf_counter() - t0)
        cov = out["synthetic"]["coverage"]
        found = {i for i, c in enumerate(cov) if c and c >= 0.8}
        ok = found == planted
    best, med, worst = min(times), statistics.median(times), max(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"contamination check: {args.tokens:,} tokens in {args.shards} shards, {args.items:,} items "
          f"({len(planted)} planted), 13-grams, chunks of {C.DEFAULT_CHUNK:,} tokens")
    print(f"  time min / median / max: {best:.2f} / {med:.2f} / {worst:.2f} s over {args.repeats} runs")
    print(f"  throughput (median): {args.tokens / med / 1e6:.1f} M tokens/s; 1e9 tokens: "
          f"{1e9 / (args.tokens / med):.0f} s")
    print(f"  peak resident memory of the process: {rss:.0f} MiB (the shards are memory-mapped)")
    print(f"  planted items found exactly: {ok}")
    print(f"  machine: {cpu_model()}, {platform.python_version()}, numpy {np.__version__}; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
