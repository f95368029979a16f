#!/usr/bin/env python3
"""Generation memory and speed of an Infini-attention model against the same model with
standard attention, as the context grows (utils/generation/engine.py, utils/infini.py).

    python perf/infini_generation.py [--contexts 512,2048,8192] [--new-tokens 64]
                                     [--repeats 3] [--segment 64] [--size 7m]

Both models have the same shape and weights (the infini one adds its gates; fp32, CPU,
random weights, greedy, EOS off). For each context length L a prompt of L tokens is
generated from (``Engine.generate``, one sequence). Each measurement runs in a fresh
subprocess, standard and infini alternating per repeat, and reports:

- the KV cache the batcher allocated for the sequence (bytes, exact: the tensors' sizes;
  for the infini model its segment of keys, values and sigma(K) plus the float32 memory),
- the process's peak resident memory (ru_maxrss) minus its resident memory before the call,
- prefill seconds and decode milliseconds per new token.

The claim checked: the infini model's cache is the same at every L (one segment), the
standard model's grows linearly with L; decode time per token stays flat for infini.
Prints machine, date, min / median / max over repeats and the ratios standard / infini.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SIZES = {"7m": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2),
         "50m": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4)}
VOCAB = 32_000


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def one(kind: str, context: int, new: int, segment: int, size: str) -> dict:
    """One measurement in this (fresh) process."""
    import torch
    import model as M
    from utils.generation.engine import Engine
    extra = dict(attention="infini", segment_length=segment) if kind == "infini" else {}
    torch.manual_seed(0)
    m = M.create_model(M.ModelArgs(vocab_size=VOCAB, max_seq_len=segment * 4, **SIZES[size],
                                   **extra)).eval()
    prompt = torch.randint(0, VOCAB, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = Engine(m)
    eng.generate([prompt[:16]], 2, temperature=0)                      # warm-up (decode pack)
    before = _rss_kb()
    b = eng.batcher(1, context + new)
    from utils.generation.engine import SamplingParams, Sequence
    seq = b.add(Sequence(prompt, SamplingParams(new, temperature=0)))
    t0 = time.perf_counter()
    steps = eng.run(b)
    next(steps)                                                         # the prefill's step
    t1 = time.perf_counter()
    for _ in steps:
        pass
    t2 = time.perf_counter()
    held = sum(t.numel() * t.element_size() for kv in b.kv for t in kv)
    held += sum(t.numel() * t.element_size() for mem in (b.mem or []) for t in mem)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss           # kB on Linux
    return {"kind": kind, "context": context, "cache_bytes": held, "bytes_per_slot": b.bytes_per_slot,
            "peak_rss_growth_mb": max(0, peak - before) / 1024, "prefill_s": t1 - t0,
            "decode_ms_per_token": 1000 * (t2 - t1) / max(1, len(seq.tokens) - 1),
            "tokens": len(seq.tokens)}


def spread(xs, fmt=".3g") -> str:
    return (f"min {format(min(xs), fmt)}  median {format(statistics.median(xs), fmt)}  "
            f"max {format(max(xs), fmt)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--segment", type=int, default=64)
    ap.add_argument("--size", default="7m", choices=sorted(SIZES))
    ap.add_argument("--one", nargs=2, metavar=("KIND", "CONTEXT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), a.new_tokens, a.segment, a.size)))
        return 0
    from perf.machine import cpu_model
    import torch
    print(f"machine: {cpu_model()}, {platform.system()} {platform.release()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; date {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"model {a.size} ({SIZES[a.size]}), vocab {VOCAB}, fp32 CPU, segment {a.segment}, "
          f"{a.new_tokens} new tokens, {a.repeats} repeats (each in a fresh process, alternating)")
    contexts = [int(x) for x in a.contexts.split(",")]
    res: dict = {}
    for r in range(a.repeats):
        for L in contexts:
            for kind in ("standard", "infini"):
                cmd = [sys.executable, __file__, "--one", kind, str(L), "--new-tokens", str(a.new_tokens),
                       "--segment", str(a.segment), "--size", a.size]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
                res.setdefault((kind, L), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    for L in contexts:
        print(f"\ncontext {L} tokens:")
        for kind in ("standard", "infini"):
            rs = res[(kind, L)]
            print(f"  {kind:8s} cache {rs[0]['cache_bytes'] / 2 ** 20:8.2f} MiB   "
                  f"peak RSS growth MiB {spread([x['peak_rss_growth_mb'] for x in rs])}")
            print(f"  {'':8s} prefill s {spread([x['prefill_s'] for x in rs])}   "
                  f"decode ms/token {spread([x['decode_ms_per_token'] for x in rs])}")
        s, i = res[("standard", L)], res[("infini", L)]
        med = lambda rs, k: statistics.median(x[k] for x in rs)   # noqa: E731
        print(f"  ratio standard / infini: cache {s[0]['cache_bytes'] / i[0]['cache_bytes']:.1f}x, "
              f"decode {med(s, 'decode_ms_per_token') / med(i, 'decode_ms_per_token'):.2f}x, "
              f"prefill {med(s, 'prefill_s') / med(i, 'prefill_s'):.2f}x")
    flat = len({res[("infini", L)][0]["cache_bytes"] for L in contexts}) == 1
    print(f"\ninfini cache the same at every context: {flat}")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
