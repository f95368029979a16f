#!/usr/bin/env python3
"""Muon vs AdamW on the same model and data, and our loop vs transformers' LlamaForCausalLM.

    python perf/optimizer_study.py [--steps 300] [--eval-steps 20] [--sweep-steps 150]
                                   [--adamw-lrs 1e-3,3e-3,1e-2] [--muon-lrs 3e-3,1e-2,3e-2]

Data: the real offline Wikipedia sample dump, cleaned and tokenized by the stages themselves
(``main.py clean`` then ``main.py prepare`` with the Llama-style SentencePiece sample
tokenizer) into a temporary folder. Model: a small Llama (d_model 128, 4 layers, 4 heads, 2 KV
heads, tied embeddings; set by ``--d-model`` / ``--layers``) trained in fp32 on the CPU by
the real train stage (``main.py train``, one subprocess per run), 128-token windows, batch 16,
warm-up + cosine schedule, seed 0 for every run.

1. Sweep: each learning rate of each optimizer for ``--sweep-steps`` steps (runs alternate
   AdamW, Muon, AdamW, ... so background load hits both alike); the best is the one with the
   lowest final validation loss.
2. Study: both optimizers at their best rate for ``--steps`` steps, validation every
   ``--eval-steps``. Printed: AdamW's final validation loss, the first evaluated step at which
   each optimizer reaches it (Muon's speed-up is AdamW's steps / Muon's), and wall time per
   step (min / median / max over the run's logged steps, from the stage's own tokens/s).
3. Loop-level parity: transformers' ``LlamaForCausalLM`` with the same initial weights,
   batches, AdamW settings and schedule, trained by a plain PyTorch loop
   (perf/reference_loop.py) for the same steps as the AdamW study run; printed: its
   validation loss at every evaluation against ours, and the largest gap (goal: < 0.02).

Muon here is ``torch.optim.Muon`` for the 2-D hidden matrices (``adjust_lr_fn=
"match_rms_adamw"``, so both share one learning-rate scale) and AdamW for embeddings, norms
and an untied head (utils.training.trainer.build_optimizers).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
WINDOW, BATCH = 128, 16


def stage(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               LLM_PIPELINE_BASE_CONFIG="none")
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), *args,
                           "--config", str(root / "config.json")],
                          capture_output=True, text=True, env=env, cwd=root,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"main.py {' '.join(args)} failed ({proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def write_config(root: Path, a) -> None:
    shards = root / "data" / "tokenized_datasets" / "wikipedia_test"
    cfg = {
        "paths": {"root": str(root), "samples_dir": str(SAMPLES), "cache_dir": str(ROOT / ".cache")},
        "tokenizer": {"name": str(SPM_MODEL)},
        "wikipedia": {"raw_dir": str(ENWIKI)},
        "dataset": {"window": WINDOW, "wikipedia_full_dir": str(shards)},
        "model": {"preset": "custom", "d_model": a.d_model, "n_layers": a.layers, "n_heads": 4,
                  "n_kv_heads": 2, "tie_embeddings": True, "max_seq_len": WINDOW},
        "training": {"batch_size": BATCH, "dtype": "fp32", "device": "cpu", "seed": 0,
                     "warmup_steps": 20, "eval_batches": 8, "sample_tokens": 0,
                     "checkpoint_every": 100_000, "keep_checkpoints": 0},
        "logging": {"log_every": 1},
    }
    (root / "config.json").write_text(json.dumps(cfg, indent=2))


def prepare_data(root: Path) -> str:
    stage(root, "clean", "--test")
    stage(root, "prepare", "--test")
    meta = json.loads((root / "data" / "tokenized_datasets" / "wikipedia_test" /
                       "metadata.json").read_text())
    t = meta["totals"]
    return f"{t['documents']} articles, {t['tokens']:,} tokens"


def train(root: Path, name: str, optimizer: str, lr: float, steps: int, eval_steps: int) -> dict:
    from utils.training.logging_utils import latest_per_step, read_jsonl
    t0 = time.perf_counter()
    stage(root, "train", "--name", name, "--optimizer", optimizer, "--lr", repr(lr),
          "--min-lr", repr(lr / 10), "--max-steps", str(steps), "--eval-steps", str(eval_steps))
    wall = time.perf_counter() - t0
    recs = read_jsonl(root / "logs" / "raw_metrics" / f"{name}.jsonl")
    val = {r["step"]: r["val_loss"] for r in latest_per_step(recs, "val")}
    rates = [r["tokens_per_s"] for r in latest_per_step(recs, "train")
             if r.get("tokens_per_s") and r["step"] > 5]           # past the first steps' warm-up
    ms = sorted(1000 * WINDOW * BATCH / x for x in rates)
    return {"val": val, "final": val[max(val)], "ms": ms, "wall": wall,
            "run_dir": root / "checkpoints" / name}


def first_step_reaching(val: dict, target: float):
    hits = [s for s in sorted(val) if val[s] <= target]
    return hits[0] if hits else None


def mmm(xs) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-steps", type=int, default=20)
    ap.add_argument("--sweep-steps", type=int, default=150)
    ap.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from perf.machine import cpu_model

    if not (SPM_MODEL.exists() and ENWIKI.is_dir()):
        sys.exit("the offline samples are missing: run `python main.py samples` first")
    root = Path(tempfile.mkdtemp(prefix="optimizer-study-"))
    try:
        print(f"# optimizer study, {datetime.date.today()}, {cpu_model()}, "
              f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
        write_config(root, a)
        print(f"data: offline enwiki sample, cleaned + prepared by the stages: {prepare_data(root)}")
        print(f"model: d_model {a.d_model}, {a.layers} layers, window {WINDOW}, batch {BATCH}, fp32, CPU\n")

        lrs = {"adamw": [float(x) for x in a.adamw_lrs.split(",")],
               "muon": [float(x) for x in a.muon_lrs.split(",")]}
        print(f"1. sweep ({a.sweep_steps} steps, final validation loss)")
        sweep: dict = {"adamw": {}, "muon": {}}
        for i in range(max(map(len, lrs.values()))):
            for opt in ("adamw", "muon"):
                if i < len(lrs[opt]):
                    lr = lrs[opt][i]
                    r = train(root, f"sweep_{opt}_{i}", opt, lr, a.sweep_steps, a.sweep_steps)
                    sweep[opt][lr] = r["final"]
                    print(f"   {opt:6s} lr {lr:<8g} val {r['final']:.4f}")
        best = {opt: min(sweep[opt], key=sweep[opt].get) for opt in sweep}
        for opt in sweep:
            edge = best[opt] in (min(lrs[opt]), max(lrs[opt]))
            print(f"   best {opt}: lr {best[opt]:g}" + ("  (at the edge of the sweep)" if edge else ""))

        print(f"\n2. study ({a.steps} steps at the best rates, validation every {a.eval_steps})")
        runs = {opt: train(root, f"study_{opt}", opt, best[opt], a.steps, a.eval_steps)
                for opt in ("adamw", "muon")}
        target = runs["adamw"]["final"]
        print("   step " + "".join(f"{opt:>10s}" for opt in runs))
        for s in sorted(runs["adamw"]["val"]):
            print(f"   {s:4d} " + "".join(f"{runs[o]['val'].get(s, float('nan')):10.4f}" for o in runs))
        reach = {o: first_step_reaching(runs[o]["val"], target) for o in runs}
        print(f"   AdamW's final validation loss {target:.4f}: reached by AdamW at step "
              f"{reach['adamw']}, by Muon at step {reach['muon']}"
              + (f" ({reach['adamw'] / reach['muon']:.2f}x fewer steps)" if reach["muon"] else
                 " (Muon never reached it)"))
        print(f"   Muon's final validation loss {runs['muon']['final']:.4f} "
              f"({runs['muon']['final'] - target:+.4f} vs AdamW)")
        for o in runs:
            print(f"   {o:6s} ms per step min / median / max: {mmm(runs[o]['ms'])}")
        print(f"   Muon / AdamW median step time: "
              f"{statistics.median(runs['muon']['ms']) / statistics.median(runs['adamw']['ms']):.2f}")

        print(f"\n3. loop-level parity: LlamaForCausalLM in a plain PyTorch loop vs ours (AdamW, "
              f"lr {best['adamw']:g}, {a.steps} steps)")
        from model import ModelArgs
        from perf.reference_loop import reference_run
        from utils.run import load_checkpoint
        from utils.config import load_config
        os.environ["LLM_PIPELINE_BASE_CONFIG"] = "none"
        run_dir = runs["adamw"]["run_dir"]
        cfg = load_config(run_dir / "config.json")
        args = ModelArgs.from_dict(dict(load_checkpoint(run_dir / "checkpoint_latest.pt")["model_args"]))
        ref, _ = reference_run(cfg, args, a.steps, a.eval_steps)
        ours = runs["adamw"]["val"]
        gaps = {s: abs(ours[s] - ref[s]) for s in ours if s in ref}
        print("   step      ours     llama       gap")
        for s in sorted(gaps):
            print(f"   {s:4d} {ours[s]:9.4f} {ref[s]:9.4f} {gaps[s]:9.2e}")
        print(f"   largest gap {max(gaps.values()):.2e} (goal < 0.02): "
              + ("within" if max(gaps.values()) < 0.02 else "NOT within"))
    finally:
        if a.keep:
            print(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
