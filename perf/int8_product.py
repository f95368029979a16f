"""The int8 weight-only product of a decode step at batch 1 on CPU: the engine's
``torch._weight_int8pack_mm`` (utils/quant.py ``int8_mm``) against inductor's own kernel for
it (``torch.compile`` with max-autotune and frozen weights: its C++ GEMM template with the
scales as an epilogue, the "fused dequantize-and-multiply"), on SmolLM2-135M's four block
matrices and its head, with a memory-bandwidth reference (one read of the same int8 bytes).

    python perf/int8_product.py [--quick] [--repeats 50]

torchao's int8 weight-only config needs no contender of its own: on CPU its product is
``mm(x, w.to(x.dtype)) * scale`` (torchao 0.18 ``Int8Tensor``), which eagerly widens the
whole matrix per call and under ``torch.compile`` is rewritten by inductor's weight-only
pattern (torch/_inductor/fx_passes/quantization.py) into the same ``_weight_int8pack_mm``
lowering measured here. Each contender runs ``--repeats`` products per round, rounds
alternating; printed: microseconds per product min / median / max and GB/s of int8 weights.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHAPES = {"qkv": (960, 576), "wo": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="gate_up and head, 3 rounds")
    a = ap.parse_args()
    if a.quick:
        a.shapes, a.rounds = "gate_up,head", 3
    import torch
    import torch._inductor.config as ic
    from utils.quant import Int8Weight, int8_mm

    class Product(torch.nn.Module):
        def __init__(self, w: Int8Weight):
            super().__init__()
            self.register_buffer("q", w.qweight)
            self.register_buffer("unit", w.unit)
            self.register_buffer("scales", w.scales)

        def forward(self, x):
            return torch._weight_int8pack_mm(x, self.q, self.unit).float() * self.scales

    print(f"perf/int8_product.py  load average {os.getloadavg()[0]:.1f} at start, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; batch 1, bf16 activations")
    for name in a.shapes.split(","):
        out, inp = SHAPES[name]
        w = Int8Weight.quantize(torch.randn(out, inp))
        x = torch.randn(1, inp)
        xb = x.to(torch.bfloat16)
        t0 = time.perf_counter()
        with torch.no_grad(), ic.patch(freezing=True, max_autotune=True):
            comp = torch.compile(Product(w).eval())
            comp(xb)
        compile_s = time.perf_counter() - t0
        big = torch.ones(w.qweight.numel() // 4)        # as many bytes, fp32: a vectorized read
        runs = {"int8_mm (engine)": lambda: int8_mm(x, w), "inductor max-autotune": lambda: comp(xb),
                "read the bytes (sum)": lambda: big.sum()}
        times = {k: [] for k in runs}
        with torch.no_grad():
            for _ in range(a.rounds):
                for k, f in runs.items():
                    t0 = time.perf_counter()
                    for _ in range(a.repeats):
                        f()
                    times[k].append((time.perf_counter() - t0) / a.repeats)
        nbytes = w.qweight.numel()
        print(f"\n{name} ({out} x {inp} int8, {nbytes / 2 ** 20:.1f} MiB; inductor compile {compile_s:.0f} s):")
        for k, ts in times.items():
            us = [t * 1e6 for t in ts]
            print(f"  {k:<22} us {min(us):,.0f} / {statistics.median(us):,.0f} / {max(us):,.0f};  "
                  f"{nbytes / min(ts) / 1e9:.1f} GB/s at best")
        with torch.no_grad():
            torch.testing.assert_close(comp(xb), int8_mm(x, w), rtol=2e-2, atol=1e-2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
