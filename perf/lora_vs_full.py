"""LoRA against full fine-tuning of a real model on this machine: trainable parameters, peak
memory and step time (docs/lora.md quotes its output).

    python perf/lora_vs_full.py [--model data/samples/smollm2/SmolLM2-135M-Instruct]
                                [--repeats 2] [--steps 3] [--batch 2] [--seq 128] [--threads N]

The model is imported as ``sft train --init-from-hf`` imports it (utils.hf.import_hf), in fp32.
Two contenders, each in its own fresh subprocess (so each peak is its own), alternating
(full, lora, full, lora, ...) ``--repeats`` times so background load hits both alike:

- full: every parameter trains (what ``sft train`` does without ``--lora``);
- lora: ``utils.lora.apply`` with the ``lora`` section's defaults (r 8, alpha 16, dropout
  0.05, the seven attention and MLP projections), the rest frozen (``sft train --lora``).

Both use the trainer's optimizer (``build_optimizers``: fused AdamW over the parameters that
require gradients), the same fixed random batch of ``--batch`` x ``--seq`` tokens and the
trainer's loss call (``model(x, y, return_logits=False)``, the fused chunked loss). Timed: one
whole optimizer step (forward, loss, backward, AdamW step, zero_grad), ``--steps`` times after
one warm-up step; printed per contender as min / median / max over every timed step of every
repeat, in wall-clock seconds and in the process's CPU seconds (which the machine's other
load disturbs less than the wall clock when the cores are shared). Peak memory: the process's VmHWM (/proc) after its steps, its peak reset once the
model is loaded (the import's own transient copies are not counted), in total and minus the
resident memory of the loaded model (what training adds: gradients, optimizer state,
activations, the adapter).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "data" / "samples" / "smollm2" / "SmolLM2-135M-Instruct"


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> float:
    """The resident MB now, with the peak (VmHWM) reset to it (Linux's clear_refs "5"), so the
    peak read later is training's, not the import's."""
    Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args) -> None:
    """One contender: load, (LoRA), time the steps, print one JSON line."""
    sys.path.insert(0, str(ROOT))
    import torch

    from utils import lora
    from utils.hf.import_hf import load_hf_llama
    from utils.training.trainer import OptimizerSpec
    torch.set_num_threads(args.threads)
    model = load_hf_llama(args.model).model.float().train()
    loaded = reset_peak()
    if args.mode == "lora":
        lora.apply(model, lora.LoraSettings())
    trainable, total = lora.parameter_counts(model)
    opt = OptimizerSpec(lr=1e-4).build(model, torch.device("cpu"))["adamw"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.args.vocab_size, (args.batch, args.seq + 1), generator=g)
    times, cpu = [], []
    for i in range(args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = model(x[:, :-1], x[:, 1:], return_logits=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:                                          # the first step warms up
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    print(json.dumps({"mode": args.mode, "trainable": trainable, "total": total, "times": times, "cpu": cpu,
                      "loaded_mb": loaded, "peak_mb": vm_hwm_mb(), "loss": float(loss)}))


def run(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", str(args.model), "--steps",
           str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def three(xs) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["full", "lora"], default=None)
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    got: dict = {"full": [], "lora": []}
    for _ in range(args.repeats):
        for mode in ("full", "lora"):
            got[mode].append(run(args, mode))
    print(f"{Path(args.model).name}, fp32 on CPU ({args.threads} threads), batch {args.batch} x "
          f"{args.seq} tokens, {args.steps} timed steps x {args.repeats} repeats (interleaved)\n")
    print("| | trainable parameters | peak memory (MB): total / added by training | "
          "step time (s): min / median / max | CPU seconds per step: min / median / max |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode in ("full", "lora"):
        rs = got[mode]
        r = rs[0]
        peak = statistics.median(x["peak_mb"] for x in rs)
        added = statistics.median(x["peak_mb"] - x["loaded_mb"] for x in rs)
        times = [t for x in rs for t in x["times"]]
        print(f"| {'full fine-tuning' if mode == 'full' else 'LoRA r=8 (7 projections)'} | "
              f"{r['trainable']:,} of {r['total']:,} ({100 * r['trainable'] / r['total']:.2f}%) | "
              f"{peak:,.0f} / {added:,.0f} | {three(times)} | {three([c for x in rs for c in x['cpu']])} |")
    for key, what in (("times", "step time"), ("cpu", "CPU seconds per step")):
        full = statistics.median(t for x in got["full"] for t in x[key])
        low = statistics.median(t for x in got["lora"] for t in x[key])
        print(f"\nLoRA / full, {what}: {low / full:.2f} (medians)")


if __name__ == "__main__":
    main()
