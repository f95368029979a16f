"""Where one token of SmolLM2-135M goes at batch 1 on CPU: the engine's whole decode token,
the products of that token alone (the decode pack's weights, replayed with the engine's own
kernels: 4 per block and the head), and what is left (everything but the products: norms,
RoPE, attention over the cache, sampling, Python and per-operation dispatch), next to
llama.cpp's whole token at the same precision and thread count, in one run. "torch's
product": the same engine with its fp32 products always torch's (``Engine(product="torch")``),
where the engine's own choice (``auto``, utils/generation/pack.py) took NumPy's BLAS for steps
on one thread; for int8 it is the same engine.

    python perf/decode_split.py [--repeats 3] [--threads 1,2] [--cache DIR]

A token's time is measured as (time of N2 new tokens - time of N1) / (N2 - N1) from the same
prompt, for ours and llama.cpp alike, so the prompt's prefill and the call's set-up cancel
out. The products are timed over ``--tokens`` tokens' worth of products on random rows (the
weights are read from memory each time: 540 MB fp32 / 136 MB int8 do not fit in any cache).
GB/s: the weights' bytes a token reads (perf/smollm2_decode.py ``weight_bytes``) over the
time; the read bandwidth is the same script's probe. Contenders alternate within each repeat;
min / median / max over repeats. This answers issue 40's "docs say what bounds it": if our
products alone take longer than llama.cpp's whole token, no cut of the rest can reach it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N1, N2 = 8, 40          # new tokens of the short and the long call: a token = their difference / 32


def per_token(gen) -> float:
    """Seconds per new token of ``gen(n)`` (returns the tokens made), prefill cancelled."""
    t0 = time.perf_counter()
    a = len(gen(N1))
    t1 = time.perf_counter()
    b = len(gen(N2))
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (b - a)


def products_runner(engine, threads: int, tokens: int):
    """Seconds per token of the decode pack's products alone (one row, random), on ``threads``."""
    import torch
    from utils.generation import threads as thread_policy
    pack = engine.decode_pack()
    args = engine.model.args
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.d_model, generator=g)
    y = torch.randn(1, args.n_heads * args.head_dim, generator=g)
    z = torch.randn(1, args.ffn_hidden, generator=g)

    def run() -> float:
        with thread_policy.step_mode(threads):
            t0 = time.perf_counter()
            for _ in range(tokens):
                for p in pack.layers:
                    p.mm(x, p.qkv), p.mm(y, p.wo), p.mm(x, p.gate_up), p.mm(z, p.down)
                pack.mm(x, pack.head)
            return (time.perf_counter() - t0) / tokens
    return run


def spread(xs: list, scale: float = 1.0, fmt: str = ".1f") -> str:
    xs = sorted(x * scale for x in xs)
    return f"min {xs[0]:{fmt}}  median {xs[len(xs) // 2]:{fmt}}  max {xs[-1]:{fmt}}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="thread counts, ours and llama.cpp's alike")
    ap.add_argument("--tokens", type=int, default=20, help="tokens' worth of products per timing")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "smollm2")
    a = ap.parse_args()
    import torch
    from perf.smollm2_decode import FREE, chat_ids, llama_generator, read_bandwidth, smollm2_models, weight_bytes
    from utils.generation.engine import Engine

    fp32, int8, tok, ggufs = smollm2_models(a.cache)
    ids = chat_ids(tok, FREE)
    bw = read_bandwidth()
    print(f"perf/decode_split.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, "
          f"torch {torch.__version__}; SmolLM2-135M-Instruct, batch 1, greedy, a token = (tokens {N2} - "
          f"tokens {N1}) / {N2 - N1}; {a.repeats} repeats, contenders alternating; read bandwidth {bw / 1e9:.1f} GB/s")
    for threads in [int(t) for t in a.threads.split(",")]:
        for prec, model, gg in (("fp32", fp32, "f32"), ("int8", int8, "q8_0")):
            engine = Engine(model, threads=threads)
            nbytes = weight_bytes(model)
            contenders = {
                "ours, whole token": lambda e=engine: per_token(lambda n: e.generate([ids], n, temperature=0)[0]),
                "ours, torch's product": (lambda e=Engine(model, threads=threads, product="torch"):
                                          per_token(lambda n: e.generate([ids], n, temperature=0)[0])),
                "ours, products alone": products_runner(engine, threads, a.tokens),
                f"llama.cpp {gg}, whole token": (lambda g=llama_generator(ggufs[gg], threads, ids): per_token(g)),
            }
            times = {k: [] for k in contenders}
            for f in contenders.values():
                f()                                                  # warm-up (packs, threads)
            for _ in range(a.repeats):
                for k, f in contenders.items():
                    times[k].append(f())
            print(f"\n{prec}, {threads} thread(s), {nbytes / 1e6:.0f} MB of weights per token "
                  f"(bandwidth bound {bw / nbytes:.0f} tokens/s, {nbytes / bw * 1e3:.1f} ms):")
            for k, ts in times.items():
                print(f"  {k:<28} ms {spread(ts, 1e3)};  GB/s {spread([nbytes / t for t in ts], 1e-9)}")
            rest = [w - p for w, p in zip(times["ours, whole token"], times["ours, products alone"])]
            print(f"  {'ours, the rest':<28} ms {spread(rest, 1e3)}")
            llama = sorted(times[f"llama.cpp {gg}, whole token"])[a.repeats // 2]
            prods = sorted(times["ours, products alone"])[a.repeats // 2]
            print(f"  our products alone / llama.cpp's whole token (median): {prods / llama:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
