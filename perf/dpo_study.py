"""What DPO moves on this machine: held-out reward accuracy and margin, the model's own preference
between the pairs' answers, and the benchmark's ARC scores, before and after a short DPO run.

    python perf/dpo_study.py --sft checkpoints/sft_demo_<time>/checkpoint_best.pt     the demo's SFT model
    python perf/dpo_study.py --hf data/samples/smollm2/SmolLM2-135M-Instruct --pairs 200 --steps 20 \\
        --lr 5e-6 --batch-size 4
    python perf/dpo_study.py --hf data/samples/smollm2/SmolLM2-135M-Instruct --lora --lr 5e-5 ...

Every stage runs as `python main.py ...` (a user's commands) under a config in --workdir:
``dpo prepare --dataset samples --limit PAIRS`` (the first PAIRS of the offline substitute are
SciQ questions, so no ARC question is trained on and ARC measures transfer), ``benchmark
--tasks arc_easy,arc_challenge`` before, ``dpo train``, the same benchmark after. From the run
it reads the held-out reward accuracy and margin the trainer logged (0 before by definition:
the policy starts as the reference) and measures, on the held-out pairs, how often the model
itself gives the chosen answer a higher log-probability than the rejected one (before: the
reference log-probabilities the run stored; after: the final checkpoint). Prints a table and
one JSON line (``result: {...}``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stage(*args: str) -> None:
    print("$ python main.py " + " ".join(args), flush=True)
    subprocess.run([sys.executable, str(ROOT / "main.py"), *args], check=True)


def write_config(a, tokenizer: str) -> Path:
    a.workdir.mkdir(parents=True, exist_ok=True)
    cfg = a.workdir / "config.json"
    cfg.write_text(json.dumps({
        "paths": {"root": str(a.workdir.resolve()), "samples_dir": str(ROOT / "data" / "samples")},
        "tokenizer": {"name": tokenizer},
        "logging": {"log_every": 5, "tensorboard": False},
        "dpo": {"max_length": 256, "val_split": a.val_split, "beta": a.beta, "lr": a.lr,
                "batch_size": a.batch_size, "warmup_ratio": 0.1}}, indent=2))
    return cfg


def arc(cfg: Path, model: list[str], out: Path, limit: int) -> dict:
    """ARC-Easy and ARC-Challenge acc / acc_norm of one model (the benchmark stage's JSON)."""
    stage("benchmark", "--config", str(cfg), *model, "--tasks", "arc_easy,arc_challenge",
          "--limit", f"arc_easy={limit}", "--limit", f"arc_challenge={limit}", "--output-dir", str(out),
          "--no-color")
    data = json.loads(sorted(out.glob("benchmark_*.json"))[-1].read_text())
    res = data["models"][0]["results"]
    return {f"{t}_{m}": res[t]["metrics"][m]["value"] for t in ("arc_easy", "arc_challenge")
            for m in ("acc", "acc_norm")}


def own_preference(run: Path, data_dir: Path, ckpt: Path) -> tuple[float, float]:
    """Held-out pairs where log p(chosen) > log p(rejected): (the reference, the final model)."""
    import torch
    from utils.data import preference
    from utils.run import load_model
    from utils.training.dpo import sequence_logps
    pairs = preference.load_pairs(data_dir)
    held = pairs.heldout_indices
    ref = np.load(run / "reference_logps.npy")
    before = float(np.mean(ref[2 * held] > ref[2 * held + 1]))
    model = load_model(ckpt)[0].eval()
    pad = json.loads((run / "dpo_config.json").read_text())["tokenizer"].get("eos_id") or 0
    wins = []
    with torch.no_grad():
        for batch in preference.PairValData(pairs.examples, held, 8, pad):
            lp = sequence_logps(model, batch)
            n = len(lp) // 2
            wins += (lp[:n] > lp[n:]).tolist()
    return before, float(np.mean(wins))


def held_out_rewards(root: Path, run: Path) -> dict:
    recs = [json.loads(x) for x in (root / "logs" / "raw_metrics" / f"{run.name}.jsonl").read_text().splitlines()]
    val = [r for r in recs if r.get("type") == "val"]
    first, last = val[0], val[-1]
    return {"steps": last["step"],
            **{f"{k}_{when}": r.get(f"val_{k}") for when, r in (("before", first), ("after", last))
               for k in ("reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sft", type=Path, help="an SFT checkpoint of this project")
    src.add_argument("--hf", type=Path, help="a Hugging Face Llama folder (imported with --init-from-hf)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "dpo-study")
    ap.add_argument("--pairs", type=int, default=1000, help="first N pairs of the substitute (1000: SciQ only)")
    ap.add_argument("--val-split", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--arc-limit", type=int, default=200, help="ARC items per task")
    ap.add_argument("--eval-every", type=float, default=1.0, help="validate every F of an epoch (dpo train's flag)")
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (the lora config section) "
                    "instead of every weight")
    a = ap.parse_args()
    t0 = time.time()
    tokenizer = str(a.hf.resolve()) if a.hf else str(a.sft.resolve().parent / "tokenizer")
    cfg = write_config(a, tokenizer)
    stage("dpo", "prepare", "--config", str(cfg), "--dataset", "samples", "--limit", str(a.pairs))
    model = [str(a.hf or a.sft)]        # an HF folder is imported through our model, as after DPO
    before = arc(cfg, model, a.workdir / "bench_before", a.arc_limit)
    start = ["--init-from-hf", str(a.hf)] if a.hf else ["--checkpoint", str(a.sft)]
    stage("dpo", "train", "--config", str(cfg), *start, "--max-steps", str(a.steps),
          "--eval-every", str(a.eval_every), "--name", "study", *(["--lora"] if a.lora else []))
    run = sorted((a.workdir / "checkpoints").glob("dpo_study_*"))[-1]
    after = arc(cfg, [str(run / "checkpoint_latest.pt")], a.workdir / "bench_after", a.arc_limit)
    pref = own_preference(run, a.workdir / "data" / "preference", run / "checkpoint_latest.pt")
    result = {"model": str(a.hf or a.sft), "pairs": a.pairs, "lr": a.lr, "beta": a.beta,
              "batch_size": a.batch_size, "lora": a.lora, **held_out_rewards(a.workdir, run),
              "own_preference_before": pref[0], "own_preference_after": pref[1],
              **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
              "arc_items_per_task": a.arc_limit, "wall_s": round(time.time() - t0, 1), "run": str(run)}
    for k in ("reward_accuracy", "reward_margin", "arc_easy_acc", "arc_easy_acc_norm", "arc_challenge_acc",
              "arc_challenge_acc_norm"):
        print(f"{k:<24} {result[k + '_before']:.4f} -> {result[k + '_after']:.4f}")
    print(f"{'own_preference':<24} {pref[0]:.4f} -> {pref[1]:.4f}")
    print("result: " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
