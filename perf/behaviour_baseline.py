#!/usr/bin/env python3
"""Per-step losses of `train --test` and `sft train --test` with a fixed seed, CPU fp32, to
show that a refactoring kept the training behaviour bit for bit.

    python perf/behaviour_baseline.py record BASELINE.json    # before the change
    python perf/behaviour_baseline.py compare BASELINE.json   # after: exit 1 on any difference

What runs (each stage as a user runs it, in a temporary root): the real news sample encoded
with the Llama-style SentencePiece sample tokenizer into a shard set (utils.data.shards' writer);
`main.py train --test` (tiny model, 24 steps of 4 x 32 tokens, seed 0, validation every 8
steps); `main.py sft prepare --test --dataset samples --limit 64`; `main.py sft train --test`
from that run's best checkpoint (12 steps). Recorded: every logged training loss, learning
rate and gradient norm, and every validation loss, as exact float reprs (JSON round-trips
floats exactly). `compare` lists every step that differs, per stage and field.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
SPM_MODEL = SAMPLES / "tokenizers" / "mistral-v1" / "tokenizer.model"
NEWS = SAMPLES / "news" / "lee_background.cor"
COMMON = ["--device", "cpu", "--dtype", "fp32", "--seed", "0", "--log-every", "1"]


def _stage(root: Path, *args: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               LLM_PIPELINE_BASE_CONFIG="none")
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), *args, "--config",
                           str(root / "config.json")], capture_output=True, text=True, env=env,
                          cwd=root, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"main.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")


def _shards(directory: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from utils.data.shards import write_shard_set
    from utils.data.tok import describe, encode_plain, load_tokenizer_from
    tok = load_tokenizer_from(str(SPM_MODEL))
    texts = list(dict.fromkeys(x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines()
                               if x.strip()))[:200]
    docs = [np.asarray([tok.bos_token_id, *ids, tok.eos_token_id]) for ids in encode_plain(tok, texts)]
    write_shard_set(directory, docs, describe(tok, str(SPM_MODEL)), shard_tokens=20_000,
                    source={"kind": "test", "inputs": [str(NEWS)], "test": True},
                    window=32, stride=16)


def _curves(log: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from utils.training.logging_utils import latest_per_step, read_jsonl
    recs = read_jsonl(log)
    train = {str(r["step"]): {k: r.get(k) for k in ("loss", "lr", "grad_norm")}
             for r in latest_per_step(recs, "train")}
    val = {str(r["step"]): r.get("val_loss") for r in latest_per_step(recs, "val")}
    return {"train": train, "val": val}


def measure() -> dict:
    if not SPM_MODEL.exists():
        sys.exit("the offline samples are missing: run `python main.py samples` first")
    root = Path(tempfile.mkdtemp(prefix="behaviour-baseline-"))
    try:
        _shards(root / "shards")
        (root / "config.json").write_text(json.dumps({
            "paths": {"root": str(root), "samples_dir": str(SAMPLES), "cache_dir": str(ROOT / ".cache")},
            "tokenizer": {"name": str(SPM_MODEL)},
            "dataset": {"wikipedia_test_dir": str(root / "shards")},
            "logging": {"tensorboard": False}}))
        _stage(root, "train", "--test", "--name", "base", "--window", "32", "--batch-size", "4",
               "--max-steps", "24", "--eval-steps", "8", "--eval-batches", "2",
               "--sample-tokens", "4", *COMMON)
        _stage(root, "sft", "prepare", "--test", "--dataset", "samples", "--limit", "64")
        _stage(root, "sft", "train", "--test", "--name", "base", "--checkpoint",
               str(root / "checkpoints" / "base" / "checkpoint_best.pt"), "--max-steps", "12",
               "--batch-size", "4", "--sample-tokens", "4", *COMMON)
        logs = root / "logs" / "raw_metrics"
        sft_log = next(logs.glob("sft_base_*.jsonl"))
        return {"train": _curves(logs / "base.jsonl"), "sft": _curves(sft_log)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def differences(old: dict, new: dict) -> list[str]:
    out = []
    for stage in ("train", "sft"):
        for kind in ("train", "val"):
            a, b = old[stage][kind], new[stage][kind]
            for step in sorted(set(a) | set(b), key=int):
                if a.get(step) != b.get(step):
                    out.append(f"{stage} {kind} step {step}: {a.get(step)} -> {b.get(step)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["record", "compare"])
    ap.add_argument("baseline", type=Path)
    a = ap.parse_args()
    got = measure()
    n = sum(len(got[s][k]) for s in got for k in got[s])
    if a.action == "record":
        a.baseline.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"recorded {n} values (train and sft: per-step loss, lr, grad norm; validation "
              f"losses) in {a.baseline}")
        return 0
    diff = differences(json.loads(a.baseline.read_text()), got)
    if diff:
        print(f"{len(diff)} of {n} values differ:\n" + "\n".join(diff))
        return 1
    print(f"all {n} values are bit-identical to {a.baseline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
