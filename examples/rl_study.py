#!/usr/bin/env python3
"""The RL study: pass@1 on the held-out split of the arithmetic task before and after GRPO, on a
model that learns it on a CPU in minutes (docs/rl.md has the numbers).

    python examples/rl_study.py [--work DIR] [--sft-epochs 6] [--rl-steps 60] [--d-model 128]

What it runs, each step through ``python main.py`` as a user would:

1. a small Llama-style model (model.py; the offline Mistral SentencePiece tokenizer, which
   writes every digit as its own token), freshly initialized and saved as a checkpoint;
2. ``sft prepare`` + ``sft train`` on the task's *training* prompts with their answers (a
   JSONL file in LIMA's schema written from utils/rl/tasks.py: the held-out prompts are never
   shown), a few epochs: enough to learn the format and some of the sums;
3. ``rl --checkpoint <the SFT run>``: GRPO on the same training prompts, pass@1 on the held-out
   ones at step 0 (the SFT model: "before") and every ``rl.eval_every`` steps;
4. ``report`` of the RL run: the reward curve and pass@1 (reports/<run>/).

It prints the before/after pass@1, the wall time of each stage and where the report is.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOKENIZER = ROOT / "data" / "samples" / "tokenizers" / "mistral-v1" / "tokenizer.model"


def run(*args) -> float:
    """``python main.py ARGS``; its wall time (seconds). A failure stops the study."""
    t = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", LLM_PIPELINE_BASE_CONFIG="none")
    print("$ python main.py " + " ".join(map(str, args)), flush=True)
    p = subprocess.run([sys.executable, str(ROOT / "main.py"), *map(str, args)], env=env, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"rl_study: `main.py {args[0]}` failed (exit {p.returncode}).")
    return time.perf_counter() - t


def write_config(work: Path, a) -> Path:
    cfg = {"paths": {"root": str(work), "samples_dir": str(ROOT / "data" / "samples")},
           "tokenizer": {"name": str(TOKENIZER)},
           "logging": {"tensorboard": False, "log_every": 1},
           "sft": {"max_length": 64, "batch_size": 32, "lr": a.sft_lr, "val_split": 0.05,
                   "warmup_ratio": 0.05},
           "rl": {"task": "arithmetic", "max_operand": a.max_operand, "max_addend": a.max_addend,
                  "val_prompts": a.val_prompts,
                  "steps": a.rl_steps, "eval_every": a.eval_every, "lr": a.rl_lr,
                  "group_size": a.group_size, "prompts_per_step": a.prompts_per_step,
                  "max_new_tokens": 8}}
    path = work / "config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def make_base(work: Path, d_model: int, layers: int) -> Path:
    """A freshly initialized model saved as a checkpoint the pipeline loads."""
    import torch
    import model as model_lib
    from utils.data.tok import describe, load_tokenizer_from
    from utils.training.checkpoint import save_checkpoint
    tok = load_tokenizer_from(str(TOKENIZER))
    args = model_lib.ModelArgs(vocab_size=len(tok), d_model=d_model, n_layers=layers, n_heads=4,
                               n_kv_heads=4, max_seq_len=64, bos_id=tok.bos_token_id)
    torch.manual_seed(0)
    m = model_lib.create_model(args)
    path = work / "checkpoints" / "base" / "checkpoint_best.pt"
    save_checkpoint(path, {"kind": "pretrain", "model": m.state_dict(), "model_args": args.to_dict(),
                           "tokenizer": describe(tok, str(TOKENIZER)), "chat_template": None, "step": 0})
    return path


def write_sft_data(work: Path, cfg_path: Path, repeat: int) -> Path:
    """The task's training prompts with their answers as LIMA-schema conversations, each
    ``repeat`` times (an SFT epoch of a few steps would validate and checkpoint after each)."""
    from utils.config import load_config
    from utils.rl.tasks import load_task
    cfg = load_config(cfg_path)
    task = load_task(cfg.rl, cfg.training.seed, cfg.resolve)
    path = work / "arithmetic_sft.jsonl"
    path.write_text("".join(json.dumps({"conversations": [i.prompt, i.answer]}) + "\n" for i in task.train) * repeat)
    return path


def sft_steps(a, cfg: Path) -> dict:
    """The base model and its SFT on the task's training prompts; the stages' wall times."""
    base = make_base(a.work, a.d_model, a.layers)
    data = write_sft_data(a.work, cfg, a.sft_repeat)
    return {"sft prepare": run("sft", "prepare", "--config", cfg, "--dataset", data),
            "sft train": run("sft", "train", "--config", cfg, "--checkpoint", base, "--name", "study",
                             "--epochs", a.sft_epochs, "--eval-every", "0.5", "--sample-tokens", "0")}


def pass_at_1(work: Path, run: str) -> list[tuple[int, float]]:
    log = work / "logs" / "raw_metrics" / f"{run}.jsonl"
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_pass_at_1"]) for r in recs if r.get("type") == "val" and "val_pass_at_1" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "rl_study")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--max-addend", type=int, default=None)
    p.add_argument("--val-prompts", type=int, default=20)
    p.add_argument("--sft-epochs", type=int, default=4)
    p.add_argument("--sft-repeat", type=int, default=10, help="copies of each training item in the SFT data")
    p.add_argument("--reuse-sft", action="store_true",
                   help="start RL from the newest sft_study_* run in --work (made by an earlier call)")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--rl-steps", type=int, default=80)
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    cfg = write_config(a.work, a)
    times = {} if a.reuse_sft else sft_steps(a, cfg)
    sft_run = sorted((a.work / "checkpoints").glob("sft_study_*"))[-1]
    times["rl"] = run("rl", "--config", cfg, "--checkpoint", sft_run / "checkpoint_best.pt", "--name", "study")
    rl_run = sorted((a.work / "checkpoints").glob("rl_study_*"))[-1]
    times["report"] = run("report", rl_run.name, "--config", cfg)
    curve = pass_at_1(a.work, rl_run.name)
    print(f"\nheld-out pass@1 (greedy, {a.val_prompts} prompts): " + ", ".join(f"step {s}: {v:.3f}" for s, v in curve))
    print(f"before RL {curve[0][1]:.3f} -> after {curve[-1][1]:.3f}")
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    print(f"report: {a.work / 'reports' / rl_run.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
