#!/usr/bin/env python3
"""The RL study: pass@1 on the held-out split of the arithmetic task before and after GRPO, on a
model trained on a CPU in minutes (docs/rl.md has the numbers and what they show).

    python examples/rl_study.py [--work DIR] [--rl-steps 20] [--verbose 0.7] [--rl-lr 2e-4]

What it runs, each step through ``python main.py`` as a user would:

1. a small Llama-style model (model.py; the offline Mistral SentencePiece tokenizer, which
   writes every digit as its own token), freshly initialized and saved as a checkpoint;
2. ``sft prepare`` + ``sft train`` on the task's *training* prompts with their answers (a
   JSONL file in LIMA's schema written from utils/rl/tasks.py: the held-out prompts are never
   shown). The prompts say "Answer with the number only.", but a share ``--verbose`` of the
   SFT replies is worded ("The answer is 12."), as chat data mixes styles;
3. ``rl --checkpoint <the SFT run>`` with the *exact* checker (the instruction, enforced: a
   worded reply scores 0 even when its number is right): GRPO on the same training prompts,
   pass@1 on the held-out ones at step 0 (the SFT model: "before") and every
   ``rl.eval_every`` steps;
4. ``report`` of the RL run: the reward curve and pass@1 (reports/<run>/).

It prints the before/after pass@1, the wall time of each stage and where the report is.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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
           "training": {"seed": a.seed},
           "tokenizer": {"name": str(TOKENIZER)},
           "logging": {"tensorboard": False, "log_every": 1},
           "sft": {"max_length": 64, "batch_size": 32, "lr": a.sft_lr, "val_split": 0.05,
                   "warmup_ratio": 0.05},
           "rl": {"task": "arithmetic", "max_operand": a.max_operand, "max_addend": a.max_addend,
                  "checker": "exact", "val_prompts": a.val_prompts,
                  "steps": a.rl_steps, "eval_every": a.eval_every, "lr": a.rl_lr,
                  "group_size": a.group_size, "prompts_per_step": a.prompts_per_step,
                  "max_new_tokens": 8, "temperature": a.temperature, "advantage": a.advantage}}
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


def write_sft_data(work: Path, cfg_path: Path, a) -> Path:
    """SFT data from the task's *training* split only (the held-out prompts are never shown), in
    LIMA's schema; a share ``a.verbose`` of the replies is worded ("The answer is N."), the rest
    bare ("N"), as chat data mixes styles: the SFT model writes either, and only the bare one
    passes the task's exact checker."""
    from utils.config import load_config
    from utils.rl.tasks import load_task
    cfg = load_config(cfg_path)
    task = load_task(cfg.rl, cfg.training.seed, cfg.resolve)
    rng = random.Random(0)
    items = task.train * a.sft_repeat
    lines = [{"conversations": [i.prompt, f"The answer is {i.answer}." if rng.random() < a.verbose else i.answer]}
             for i in items]
    path = work / "arithmetic_sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def sft_steps(a, cfg: Path) -> dict:
    """The base model and its SFT on the task's training prompts; the stages' wall times."""
    base = make_base(a.work, a.d_model, a.layers)
    data = write_sft_data(a.work, cfg, a)
    return {"sft prepare": run("sft", "prepare", "--config", cfg, "--dataset", data),
            "sft train": run("sft", "train", "--config", cfg, "--checkpoint", base, "--name", "study",
                             "--epochs", a.sft_epochs, "--eval-every", "0.5", "--sample-tokens", "0")}


def pass_at_1(work: Path, run: str) -> list[tuple[int, float]]:
    log = work / "logs" / "raw_metrics" / f"{run}.jsonl"
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_pass_at_1"]) for r in recs if r.get("type") == "val" and "val_pass_at_1" in r]


def breakdown(cfg_path: Path, checkpoint: Path) -> dict:
    """The held-out greedy replies of ``checkpoint`` split into what RL can change here: how many
    are a bare number (the format the exact checker wants), how many carry the right number
    anywhere (the numeric checker: the content), how many pass the exact checker (pass@1)."""
    # torch and the stage's helpers: loaded here, as in make_base, so --help does not wait for them
    import types
    import torch
    import model as model_lib
    import rl
    from utils import stage
    from utils.config import load_config
    from utils.rl import grpo
    from utils.rl.tasks import exact_match, load_task, numeric_match, parse_number
    cfg = load_config(cfg_path)
    task = load_task(cfg.rl, cfg.training.seed, cfg.resolve)
    ckpt = rl.load_checkpoint(checkpoint, purpose="weights")
    m = model_lib.create_model(rl.model_args_of(ckpt, checkpoint))
    m.load_state_dict(ckpt["model"])
    tok, _ = rl.tokenizer_for_checkpoint(ckpt, cfg, checkpoint)
    rules = rl.run_rules(stage.kept_rules(tok, None, ckpt), types.SimpleNamespace(ckpt=ckpt), tok)
    decode, prompts = rl.reply_decoder(tok, rules), rl.prompt_ids(tok, rules, task.val)
    with torch.no_grad():
        out = grpo.generate_replies(grpo.Engine(m.eval()), prompts, 1, cfg.rl.max_new_tokens, 0.0, 0,
                                    rules.stop_ids, 0)
    replies = [decode(p, ids) for p, (ids, _) in zip(prompts, out)]
    return {"bare number": sum(parse_number(r) is not None for r in replies),
            "right number": sum(numeric_match(r, i.answer) for r, i in zip(replies, task.val)),
            "exact (pass@1)": sum(exact_match(r, i.answer) for r, i in zip(replies, task.val)),
            "example": replies[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "rl_study")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=42, help="training.seed: the split, the SFT order, the rollouts")
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--max-addend", type=int, default=9)
    p.add_argument("--val-prompts", type=int, default=40)
    p.add_argument("--sft-repeat", type=int, default=12, help="copies of each training item in the SFT data")
    p.add_argument("--verbose", type=float, default=0.7, help="share of worded replies in the SFT data")
    p.add_argument("--sft-epochs", type=int, default=8)
    p.add_argument("--reuse-sft", action="store_true",
                   help="start RL from the newest sft_study_* run in --work (made by an earlier call)")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-lr", type=float, default=2e-4)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--advantage", default="grpo")
    a = p.parse_args()
    a.work = a.work.resolve()
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
    for name, ck in (("SFT (before)", sft_run / "checkpoint_best.pt"), ("RL (after)", rl_run / "checkpoint_latest.pt")):
        print(f"{name}: held-out replies of {a.val_prompts}: " + ", ".join(f"{k} {v}" for k, v in breakdown(cfg, ck).items()))
    print(f"report: {a.work / 'reports' / rl_run.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
