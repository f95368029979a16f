"""Learning check: the train stage learns like transformers' LlamaForCausalLM.

Contract: on the sample shard set, ``python main.py train --test`` (our model, our loop) and a
plain PyTorch loop over ``transformers.LlamaForCausalLM`` started from the same initial
weights (converted with utils.hf.mapping.to_hf_state_dict), fed the same batches in the same order, with
the same AdamW parameter groups (weight decay on matrices only), betas, gradient clipping and
the same warm-up + cosine schedule, reach the same validation loss (within 0.02) at every
evaluation, and the loss goes well down on the way. A broken piece on either side (attention,
RoPE, loss shift, optimizer groups, schedule, data order) shows up as a gap.

How the two sides are lined up, without re-implementing the stage (the reference loop is
perf/reference_loop.py, which perf/optimizer_study.py also runs):

- ours is the real CLI run (fp32, one process); its JSONL log gives the validation losses,
  the train losses and the learning rate of every step; its resolved config.json gives every
  setting the reference loop uses (data split, batch size, optimizer, schedule, seed);
- initial weights: the stage seeds (training.seed) and then builds the model; the test does
  the same, and the step-0 validation losses of both sides (logged before any update) must
  agree to 1e-4, which proves they started from the same weights;
- batches: dataloader.build_loaders with that config, iterated from the start, as the stage
  does; validation: the first ``training.eval_batches`` batches, token-weighted.

The fast variant (20 steps of 8 x 32 tokens, about 20 s) runs by default; a longer one is marked slow.
"""
from __future__ import annotations

import pytest

from perf.reference_loop import reference_run
from tests.conftest import SPM_MODEL, run_stage, write_config
from utils.training.logging_utils import latest_per_step, read_jsonl

TOL = 0.02


def _flags(steps: int, eval_steps: int) -> list[str]:
    return ["--window", "32", "--batch-size", "8", "--max-steps", str(steps), "--dtype", "fp32",
            "--eval-steps", str(eval_steps), "--eval-batches", "3", "--warmup-steps", "5",
            "--sample-tokens", "0", "--log-every", "1", "--device", "cpu"]


@pytest.mark.parametrize("steps,eval_steps", [
    pytest.param(20, 10, id="20-steps"),
    pytest.param(150, 50, id="150-steps", marks=pytest.mark.slow),
])
def test_same_validation_loss_as_llama_for_causal_lm(tmp_path, train_shards, steps, eval_steps):
    from model import ModelArgs
    from utils.run import load_checkpoint
    from utils.config import load_config

    cfg_path = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)},
                                       "dataset": {"wikipedia_test_dir": str(train_shards)}})
    proc = run_stage("train", "--test", "--config", cfg_path, *_flags(steps, eval_steps),
                    "--name", "ours", timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    run_dir = tmp_path / "checkpoints" / "ours"
    recs = read_jsonl(tmp_path / "logs" / "raw_metrics" / "ours.jsonl")
    ours_val = {r["step"]: r["val_loss"] for r in latest_per_step(recs, "val")}
    ours_lr = {r["step"]: r["lr"] for r in latest_per_step(recs, "train")}
    assert sorted(ours_val) == list(range(0, steps + 1, eval_steps)), ours_val

    cfg = load_config(run_dir / "config.json", test=True)        # the run's resolved settings
    args = ModelArgs.from_dict(dict(load_checkpoint(run_dir / "checkpoint_latest.pt")["model_args"]))
    ref_val, ref_lr = reference_run(cfg, args, steps, eval_steps)

    assert ref_lr.keys() == ours_lr.keys()
    assert all(ref_lr[k] == pytest.approx(ours_lr[k], rel=1e-9) for k in ref_lr)
    assert ref_val.keys() == ours_val.keys()
    assert abs(ours_val[0] - ref_val[0]) < 1e-4, (ours_val[0], ref_val[0])   # same start
    gaps = {k: abs(ours_val[k] - ref_val[k]) for k in ours_val}
    assert max(gaps.values()) < TOL, f"ours {ours_val}\nllama {ref_val}"
    assert ours_val[steps] < ours_val[0] - 0.8, ours_val              # it really learned
