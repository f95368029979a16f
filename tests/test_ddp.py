"""DDP through torchrun: two CPU processes (gloo) train exactly like one process with the
doubled batch; only rank 0 writes; Ctrl-C and resume work with the same world size.

Contract checked here (docs/training.md, "Several processes"):

- ``python -m torch.distributed.run --nproc_per_node=2 --standalone train.py ...`` (the
  torchrun launch the README shows) with ``--batch-size B`` gives, after every optimizer
  step, the training of ``python main.py train ... --batch-size 2B`` in one process: rank r
  reads windows ``perm[r::2]`` of the same permutation, so the two ranks' micro-batches
  together are the single process's batch, and DDP averages the gradients. The two sum the
  same numbers in another order, so what is compared is held to what float arithmetic
  guarantees (:func:`assert_same_training`): the first step's loss and gradients to float32
  rounding; the weights to a bound derived from the learning rate (Adam divides each
  gradient by its own magnitude, so a last-bit difference of a gradient near zero can move
  that weight by up to twice the learning rate); logged learning rates exactly.
- Only rank 0 writes: one JSONL log with one record per step, one TensorBoard event file,
  the same checkpoint files as the single-process run, each holding both ranks' RNG states.
- Ctrl-C (SIGINT to the launch's whole process group, as a terminal sends it) stops both
  ranks at the same step, saves checkpoint_latest.pt and prints a torchrun resume command;
  resuming with the same world size reproduces the uninterrupted run bit for bit; resuming
  with another world size is refused (exit 1, a message saying so).

Same tiny model and shard set as tests/test_train.py; the checkpoints compared are
checkpoint_step_N.pt files written every step (``--checkpoint-every 1``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import (NEWS, ROOT, SPM_MODEL, default_signals, main_command, run_stage,
                            paused_env, run_main, wait_for_line, write_config)
from tests.test_cleaner import descendants
from tests.test_train import FLAGS, allocator_env, log_of, losses, ok, train, weights
from utils.run import load_checkpoint
from utils.training.logging_utils import latest_per_step

STEPS = 8          # optimizer steps of the compared runs
B = 2              # windows per rank per step (the single process takes 2 * B)
# A gradient summed in another order (per-rank sums, then the all-reduce): the error of a float32
# sum is at most n * 2**-24 of the sum of its terms' magnitudes; with cancellation between
# tokens that is bounded here relative to the tensor's largest gradient.
GRAD_RTOL = 1e-4
# Later steps start from weights that differ (see adam_step_bound), so their losses agree to
# the first order only: the weights that differ are those whose gradient was near zero.
LATER_LOSS_RTOL = 1e-4
VAL_RTOL = 1e-4    # validation: up to --eval-batches x 2B windows of 32 tokens per mean
EVERY_STEP = ["--checkpoint-every", "1", "--keep-checkpoints", str(STEPS + 1)]


def torchrun_command(*args, script=ROOT / "train.py") -> list[str]:
    """The user's launch: torchrun (as `python -m torch.distributed.run`) on train.py."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
            str(script), "--test", *map(str, args)]


def torchrun(cfg, *args, timeout: float = 300, script=ROOT / "train.py") -> subprocess.CompletedProcess:
    """The launch in the user's environment, without the malloc tunables the suite presets
    (each rank then notes the defaults it keeps: ranks never re-execute). A launch that does
    not end in ``timeout`` seconds is killed whole (its ranks too) and fails with the end of
    its output: pytest's report of a TimeoutExpired cuts the output it holds to a few lines."""
    cmd = torchrun_command("--config", cfg, *FLAGS, *args, script=script)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=allocator_env(), stdin=subprocess.DEVNULL, preexec_fn=default_signals)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(p.pid), p.pid]:     # the ranks run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the launch did not end in {timeout:g} s; the end of its output:\n"
                    f"{out[-3000:]}\n----- stderr\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# train.py's stage as a rank program that leaves one more all-reduce with gloo's worker thread when
# training ends, rank 1 joining it 2 s later: rank 0's stage then ends while that worker still has
# to free the all-reduce's tensor, which takes the GIL (torch hands a tensor's last reference to
# the worker when Python drops it first). What a worker descheduled between finishing a collective
# and freeing it does under load; a rank that then freed the process group with the GIL held
# (utils/training/distributed.py shutdown) waited for that worker forever.
GLOO_WORKER_BUSY_AT_THE_END = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import torch
import torch.distributed as tdist
import train
from utils.cli import run_stage
from utils.training.trainer import Trainer

fit = Trainer.fit


def fit_then_leave_an_all_reduce_in_flight(self):
    result = fit(self)
    if self.dist.rank == 1:
        time.sleep(2)
    tdist.all_reduce(torch.ones(1), async_op=True)   # the work and its tensor are dropped at once
    return result


Trainer.fit = fit_then_leave_an_all_reduce_in_flight
run_stage(train.main)
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ddp_root")


@pytest.fixture(scope="module")
def cfg(root, train_shards):
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(train_shards)}})


@pytest.fixture(scope="module")
def ddp_run(cfg):
    """Two ranks x batch B, STEPS steps, a checkpoint after every step (run "ddp")."""
    return ok(torchrun(cfg, "--batch-size", B, "--name", "ddp", "--max-steps", STEPS, *EVERY_STEP))


@pytest.fixture(scope="module")
def single_run(cfg):
    """One process x batch 2B, otherwise the same run (run "single")."""
    return ok(train(cfg, "--batch-size", 2 * B, "--name", "single", "--max-steps", STEPS,
                    *EVERY_STEP))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def adam_step_bound(t: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat / sqrt(v_hat)| of Adam's step ``t`` for any gradients (bias-corrected;
    by Cauchy-Schwarz over the exponential averages): each weight moves by at most lr times
    this per step, apart from weight decay (which shrinks a difference, never grows it). It is
    exactly 1 at step 1 (the update is g / |g|)."""
    r = beta1 ** 2 / beta2
    return (math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) * (1 - beta1) / math.sqrt(1 - beta2)
            * math.sqrt(sum(r ** i for i in range(t))))


def adamw_state(ckpt: dict) -> tuple[dict, dict]:
    """(parameter index -> exp_avg, the AdamW param_groups) of a checkpoint's optimizer (the
    state is keyed by position in the groups, which trainer.build_optimizers fills in
    model.named_parameters() order, the same in both runs)."""
    opt = ckpt["optimizer"]["adamw"]
    return {i: st["exp_avg"] for i, st in opt["state"].items()}, opt["param_groups"]


def assert_same_training(a_steps: list[dict], b_steps: list[dict], a_losses: dict, b_losses: dict,
                         tokens: int = 2 * B * 32) -> None:
    """Two runs that sum the same numbers in another order trained alike, step by step, held to
    what the arithmetic guarantees: ``a_steps[k - 1]`` / ``b_steps[k - 1]`` are their step-k
    checkpoints (resume form), ``*_losses`` their logged training losses by step, ``tokens``
    the number of tokens a step's loss is the mean of.

    - Step 1's loss (the same weights and windows) to float32 rounding: a mean of ``tokens``
      positive float32 terms summed in another order is within tokens x 2**-24 of the other,
      relative (128 tokens: 7.6e-6), and its
      gradients, read back from Adam's first moment (exp_avg = (1 - beta1) g after step 1), to
      rounding relative to each tensor's largest (GRAD_RTOL): a wrong data split, a sum that
      is not averaged or a missing gradient fails here.
    - The weights after step k differ by at most 2 * sum of lr_t * adam_step_bound(t) (each
      run moves a weight by at most lr_t * bound per step; near-zero gradients that differ in
      their last bits may move it either way).
    - Later steps' losses to LATER_LOSS_RTOL.
    """
    a1, b1 = a_steps[0], b_steps[0]
    assert a1["step"] == b1["step"] == 1
    loss_rtol = tokens * 2.0 ** -24
    assert abs(a_losses[1] - b_losses[1]) <= loss_rtol * abs(b_losses[1]), (a_losses[1], b_losses[1])
    (ga, groups), (gb, _) = adamw_state(a1), adamw_state(b1)
    assert ga.keys() == gb.keys() and ga
    beta1, beta2 = groups[0]["betas"]
    for i in ga:
        scale = gb[i].abs().max().item()
        assert (ga[i] - gb[i]).abs().max().item() <= GRAD_RTOL * scale, f"gradient {i} at step 1"
    bound = 0.0
    for step, (a, b) in enumerate(zip(a_steps, b_steps), 1):
        assert a["step"] == b["step"] == step
        lrs = [g["lr"] for opt in b["optimizer"].values() for g in opt["param_groups"]]
        assert lrs == [g["lr"] for opt in a["optimizer"].values() for g in opt["param_groups"]]
        bound += 2 * max(lrs) * adam_step_bound(step, beta1, beta2)
        assert max_diff(a["model"], b["model"]) <= bound, f"weights at step {step}"
        if step > 1:
            assert abs(a_losses[step] - b_losses[step]) <= LATER_LOSS_RTOL * abs(b_losses[step]), step


def test_each_step_equals_one_process_with_the_doubled_batch(root, ddp_run, single_run):
    ck = root / "checkpoints"
    rd, rs = log_of(root, "ddp"), log_of(root, "single")
    ld, ls = losses(rd), losses(rs)
    assert sorted(ld) == sorted(ls) == list(range(1, STEPS + 1))
    d_steps = [load_checkpoint(ck / "ddp" / f"checkpoint_step_{k}.pt", "resume") for k in range(1, STEPS + 1)]
    s_steps = [load_checkpoint(ck / "single" / f"checkpoint_step_{k}.pt", "resume") for k in range(1, STEPS + 1)]
    assert_same_training(d_steps, s_steps, ld, ls)          # ld: the mean over both ranks
    previous = None
    for step, (d, s) in enumerate(zip(d_steps, s_steps), 1):
        if previous is not None:   # each step moves some weight by about its learning rate
            lr = s["optimizer"]["adamw"]["param_groups"][0]["lr"]
            assert max_diff(d["model"], previous) > lr / 2, f"step {step} changed nothing"
        previous = d["model"]
        # The same windows were consumed: rank 0's slice position is half the single one's.
        assert d["data_position"]["index"] == s["data_position"]["index"] // 2 == step * B
        assert d["tokens_seen"] == s["tokens_seen"]
    assert all(torch.equal(v, d_steps[-1]["model"][k])
               for k, v in weights(ck / "ddp" / "checkpoint_latest.pt").items())

    rd, rs = log_of(root, "ddp"), log_of(root, "single")
    lr = lambda recs: {r["step"]: r["lr"] for r in latest_per_step(recs, "train")}
    assert lr(rd) == pytest.approx(lr(rs), rel=1e-12)
    vd = {r["step"]: r["val_loss"] for r in latest_per_step(rd, "val")}
    vs = {r["step"]: r["val_loss"] for r in latest_per_step(rs, "val")}
    assert vd.keys() == vs.keys() and len(vd) >= 2                 # both ranks' val slices
    # a mean over more tokens than a training step's (VAL_RTOL), and after step 0 from weights
    # that differ as the training losses' do
    assert all(abs(vd[k] - vs[k]) <= VAL_RTOL * vs[k] for k in vd), (vd, vs)
    # bits per byte: bytes per token measured over both ranks' val slices, like one process
    bd = {r["step"]: r["bits_per_byte"] for r in latest_per_step(rd, "val")}
    bs = {r["step"]: r["bits_per_byte"] for r in latest_per_step(rs, "val")}
    assert bd.keys() == vd.keys()
    assert all(abs(bd[k] - bs[k]) <= VAL_RTOL * bs[k] for k in bd), (bd, bs)


def test_only_rank_0_writes(root, ddp_run, single_run):
    ck = root / "checkpoints"
    names = lambda d: sorted(p.name for p in d.iterdir())
    assert names(ck / "ddp") == names(ck / "single")               # no extra, no temp files
    assert sorted(p.name for p in ck.iterdir()) == ["ddp", "single"]
    recs = log_of(root, "ddp")
    train_steps = [r["step"] for r in recs if r["type"] == "train"]
    assert train_steps == list(range(1, STEPS + 1))                # once each, not per rank
    configs = [r for r in recs if r["type"] == "config"]
    assert len(configs) == 1 and configs[0]["hparams"]["world_size"] == 2
    assert configs[0]["hparams"]["effective_batch"] == 2 * B
    events = lambda run: sorted((root / "logs" / "tensorboard" / run).glob("events.out.tfevents.*"))
    assert len(events("ddp")) == len(events("single")) >= 1
    assert len({p.name.split(".")[-2] for p in events("ddp")}) == 1   # one writer process
    assert sorted(p.name for p in (root / "logs" / "raw_metrics").iterdir()) == [
        "ddp.jsonl", "single.jsonl"]
    ckpt = load_checkpoint(ck / "ddp" / "checkpoint_latest.pt", "resume")
    assert len(ckpt["rng"]["ranks"]) == 2 and ckpt["rng"]["world_size"] == 2
    out = ddp_run.stdout
    assert out.count("train: model ") == 1 and "2 processes (gloo)" in out
    assert out.count("train: done at step") == 1
    assert "python main.py status ddp" in out


def test_ctrl_c_then_resume_with_the_same_world_size_is_exact(root, cfg, ddp_run):
    """The launch a user types, `main.py train --nproc-per-node 2`, stopped by a signal to
    the whole process group (main.py, the launcher and both ranks), then resumed."""
    args = ["--batch-size", B, "--max-steps", STEPS, *EVERY_STEP]
    launch = ["train", "--test", "--config", cfg, *FLAGS, *args, "--nproc-per-node", 2]
    p = subprocess.Popen(main_command(*launch, "--name", "cut"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=paused_env(2), stdin=subprocess.DEVNULL, preexec_fn=default_signals,
                         start_new_session=True)
    wait_for_line(p, "paused after step 2")   # rank 0 waits; rank 1 waits in the stop all-reduce
    os.killpg(p.pid, signal.SIGINT)          # main.py also forwards it: the launcher gets two
    out, err = p.communicate(timeout=240)
    assert p.returncode == 130, f"{out}\n{err}"
    assert "Traceback" not in err and "the 2 ranks were stopped by SIGINT" in err
    latest = root / "checkpoints" / "cut" / "checkpoint_latest.pt"
    cut = load_checkpoint(latest, "resume")
    assert cut["step"] == 2, f"{out}\n{err}"
    assert len(cut["rng"]["ranks"]) == 2
    assert "python main.py train" in err and "--name cut --resume auto --nproc-per-node 2" in err

    # Another world size cannot continue exactly: refused, nothing written.
    before = latest.stat().st_mtime_ns
    other = train(cfg, *args, "--name", "cut", "--resume", "auto")
    assert other.returncode == 1, f"{other.stdout}\n{other.stderr}"
    assert "world size" in other.stderr and "Traceback" not in other.stderr
    assert latest.stat().st_mtime_ns == before

    ok(run_main(*launch, "--name", "cut", "--resume", "auto", timeout=300))
    a = weights(root / "checkpoints" / "ddp" / "checkpoint_latest.pt")
    b = weights(latest)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb = losses(log_of(root, "ddp")), losses(log_of(root, "cut"))
    assert sorted(lb) == list(range(1, STEPS + 1)) and la == lb


def test_auto_prepare_builds_the_missing_set_on_rank_0_only(tmp_path):
    """dataset.auto_prepare under torchrun: rank 0 runs the prep stage once while the other
    rank waits at the barrier, then both open the finished set and train. The ranks run the
    stage with an all-reduce still with gloo's worker when training ends
    (GLOO_WORKER_BUSY_AT_THE_END), and end all the same (this launch hung at exit in CI)."""
    cleaned = tmp_path / "cleaned"
    cleaned.mkdir()
    lines = [x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines()]
    (cleaned / "cleaned_news.txt").write_text("\n".join(dict.fromkeys(x for x in lines if x)) + "\n",
                                              encoding="utf-8")
    shards = tmp_path / "shards"                                    # missing: auto_prepare builds it
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)},
                                  "paths": {"cleaned_dir": str(cleaned)},
                                  "dataset": {"wikipedia_test_dir": str(shards), "auto_prepare": True,
                                              "shard_tokens": 20_000}})
    rank = tmp_path / "rank.py"
    rank.write_text(GLOO_WORKER_BUSY_AT_THE_END, encoding="utf-8")
    p = ok(torchrun(cfg, "--batch-size", B, "--name", "auto", "--max-steps", 2, script=rank))
    assert p.stderr.count("dataset.auto_prepare: the shard set is missing") == 1, p.stderr
    meta = json.loads((shards / "metadata.json").read_text())
    assert len(meta["shards"]) == len(list(shards.glob("tokens_*.npy"))) >= 2
    assert not [f for f in shards.iterdir() if ".tmp" in f.name]
    assert [r["step"] for r in log_of(tmp_path, "auto") if r["type"] == "train"] == [1, 2]
    assert p.stdout.count("train: done at step 2") == 1


def test_launcher_reports_a_failed_rank_in_one_line(tmp_path):
    """A shard set that does not exist: rank 0 says so, the other rank learns it from rank 0
    (not from a broken connection), and the launch ends with exit 1 and no traceback."""
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)},
                                  "dataset": {"wikipedia_test_dir": str(tmp_path / "none")}})
    p = run_main("train", "--test", "--config", cfg, "--nproc-per-node", 2, "--name", "f")
    assert p.returncode == 1, p.stderr
    assert f"token shard set {tmp_path / 'none'} does not exist" in p.stderr
    assert "rank 0 could not open the shard set" in p.stderr
    assert "of 2 failed (exit code 1)" in p.stderr
    assert "Traceback" not in p.stderr and "unexpected error" not in p.stderr
    bad = run_stage("train", "--test", "--config", cfg, "--nproc-per-node", 0)
    assert bad.returncode == 2 and "--nproc-per-node: expected a whole number" in bad.stderr


def test_sigterm_to_main_py_alone_stops_the_launch_with_130(root, cfg):
    """A supervisor's SIGTERM to main.py only: forwarded to the launcher, passed to the ranks,
    which save; the launch ends with 130 like a single process, not 143."""
    p = subprocess.Popen(main_command("train", "--test", "--config", cfg, *FLAGS, "--batch-size", B,
                                      "--max-steps", 50, "--nproc-per-node", 2, "--name", "term"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=paused_env(1), stdin=subprocess.DEVNULL, preexec_fn=default_signals,
                         start_new_session=True)
    wait_for_line(p, "paused after step 1")
    os.kill(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 130, f"{out}\n{err}"
    assert "the 2 ranks were stopped by SIGTERM" in err and "Traceback" not in err
    assert load_checkpoint(root / "checkpoints" / "term" / "checkpoint_latest.pt", "resume")["step"] == 1
