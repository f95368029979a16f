"""Past one machine: two torchrun agents as two "nodes" of this machine, a rank killed and
restarted by torchrun's elastic agent, and sharded checkpoints on a file system that several
hosts share (docs/training.md, "Several machines").

- **Two nodes.** `main.py train --nnodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:PORT` (c10d
  rendezvous on a free port of 127.0.0.1, one gloo rank per node) prints the command of node 1,
  which the test runs as printed. For DDP and for `--parallel fsdp` the two ranks train as one
  process with the same global batch (test_ddp.py's tolerances: :func:`assert_same_training`),
  and only global rank 0 (on whichever node the rendezvous put it) writes checkpoints and logs.
- **Elastic restart.** `main.py train --nproc-per-node 2 --max-restarts 1`, rank 1 SIGKILLed
  after step 4 (the run paused there: LLM_PIPELINE_PAUSE_AT_STEP), after checkpoint_step_3 and
  a checkpoint_latest of step 2: torchrun restarts both ranks, which resume from the newest
  checkpoint (step 3) by themselves; the job exits 0 with the weights, optimizer state and
  losses of the uninterrupted two-node DDP run, bit for bit; the restart is in the log and in
  `status`.
- **Shared file system.** A reader (infer) facing another host's save in flight (the previous
  checkpoint moved aside, the new one half written) reads the previous checkpoint, says so and
  changes nothing (before: it judged the other host's pid by its own process table, and removed
  or renamed that save's folders); the job that writes the run takes such leftovers over at its
  start, and leaves a live save of its own host alone.

Ranks and launchers run in sessions of their own; a launch that does not end in its time is
killed with its ranks and fails with the end of its output (test_ddp.py's discipline). Each
rank runs one thread (OMP_NUM_THREADS=1): two ranks on two cores, and the same arithmetic in
the two-node and the one-node launch (the restart is compared with the two-node run bit for bit).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (ROOT, SPM_MODEL, default_signals, main_command, offline_env, run_stage,
                            wait_for_line, write_config)
from tests.test_cleaner import descendants
from tests.test_ddp import assert_same_training
from tests.test_fsdp import _dead_pid
from tests.test_train import FLAGS, log_of, losses, ok
from utils.run import load_checkpoint
from utils.training import sharded
from utils.training.logging_utils import latest_per_step

STEPS = 6
B = 2                                          # windows per rank per step (one process: 2 * B)
RUN = ["--batch-size", B, "--max-steps", STEPS, "--sample-tokens", 0]
EVERY_STEP = ["--checkpoint-every", 1, "--keep-checkpoints", STEPS + 1]
OTHER_HOST = "node-b.0123abcd"                 # a writer_tag() that is not this host's


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode_root")


@pytest.fixture(scope="module")
def cfg(root, train_shards):
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(train_shards)}})


def rank_env() -> dict:
    return offline_env(OMP_NUM_THREADS=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list, env=None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env or rank_env(), stdin=subprocess.DEVNULL,
                            preexec_fn=default_signals, start_new_session=True)


def finish(procs: list, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Wait for every process; one that does not end in ``timeout`` seconds is killed with its
    ranks (sessions of their own), all the others too, and the test fails with the ends of
    their output."""
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        ends = []
        for p in procs:
            for pid in [*descendants(p.pid), p.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = p.communicate()
            ends.append(f"----- {shlex.join(map(str, p.args[1:4]))} ...\n{out[-2000:]}\n--- stderr\n{err[-2000:]}")
        pytest.fail(f"the launch did not end in {timeout:g} s; the end of its output:\n" + "\n".join(ends))
    return done


def two_nodes(cfg, name: str, *args) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, str]:
    """Node 0 as a user starts it, then node 1 with the command node 0 printed for it. Returns
    both nodes' outcomes and that command."""
    port = free_port()
    node0 = start(main_command("train", "--test", "--config", cfg, *FLAGS, *RUN, *args, "--name", name,
                               "--nnodes", 2, "--node-rank", 0, "--rdzv-endpoint", f"127.0.0.1:{port}"))
    try:
        said = wait_for_line(node0, "--node-rank 1")
    except BaseException:
        finish([node0], timeout=1)
        raise
    printed = said[-1].strip()
    cmd = shlex.split(printed)
    assert cmd[:3] == ["python", "main.py", "train"], said
    node1 = start([sys.executable, str(ROOT / "main.py"), *cmd[2:]])
    r0, r1 = finish([node0, node1])
    r0.stdout = "".join(said) + r0.stdout
    return r0, r1, printed


@pytest.fixture(scope="module")
def single(cfg):
    """One process, batch 2B: the global batch of the two nodes."""
    return ok(run_stage("train", "--test", "--config", cfg, *FLAGS, *RUN, *EVERY_STEP,
                        "--batch-size", 2 * B, "--name", "single"))


@pytest.fixture(scope="module")
def nodes(cfg):
    """The two-node runs, by parallelism: DDP ("ddp2") and FSDP2 ("fsdp2"), a checkpoint every step."""
    out = {}

    def run(parallel: str):
        if parallel not in out:
            out[parallel] = two_nodes(cfg, f"{parallel}2", *EVERY_STEP, "--parallel", parallel)
        return out[parallel]
    return run


def steps_of(root, run: str, suffix: str) -> list[dict]:
    return [load_checkpoint(root / "checkpoints" / run / f"checkpoint_step_{k}{suffix}", "resume")
            for k in range(1, STEPS + 1)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_nodes_train_as_one_process_and_only_global_rank_0_writes(root, cfg, single, nodes, parallel):
    r0, r1, printed = nodes(parallel)
    run = f"{parallel}2"
    assert (r0.returncode, r1.returncode) == (0, 0), f"{r0.stdout}\n{r0.stderr}\n----\n{r1.stdout}\n{r1.stderr}"
    assert f"--nnodes 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:" in printed and f"--name {run}" in printed
    assert "Traceback" not in r0.stderr + r1.stderr
    suffix = ".pt" if parallel == "ddp" else ".dcp"
    recs = log_of(root, run)
    assert_same_training(steps_of(root, run, suffix), steps_of(root, "single", ".pt"),
                         losses(recs), losses(log_of(root, "single")))
    hp = next(r for r in recs if r["type"] == "config")["hparams"]
    assert hp["world_size"] == 2 and hp["parallel"] == parallel and hp["effective_batch"] == 2 * B
    # one writer: global rank 0, on whichever node the rendezvous put it
    said = [r.stdout.count(f"train: done at step {STEPS}") for r in (r0, r1)]
    assert sorted(said) == [0, 1], (r0.stdout, r1.stdout)
    assert [r["step"] for r in recs if r["type"] == "train"] == list(range(1, STEPS + 1))
    assert len([r for r in recs if r["type"] == "config"]) == 1
    folder = root / "checkpoints" / run
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(p.name.replace(".pt", suffix) for p in (root / "checkpoints" / "single").iterdir())
    assert not [n for n in names if n.startswith(".")]                    # no temp left
    events = sorted((root / "logs" / "tensorboard" / run).glob("events.out.tfevents.*"))
    assert len({p.name.split(".")[-2] for p in events}) == 1              # one writer process
    latest = load_checkpoint(folder / f"checkpoint_latest{suffix}", "resume")
    assert latest["step"] == STEPS and len(latest["rng"]["ranks"]) == 2


def test_a_rank_killed_after_a_checkpoint_is_restarted_and_the_run_ends_as_if_never_killed(root, cfg, nodes):
    """SIGKILL to rank 1 after step 4, whose newest checkpoint is checkpoint_step_3 (latest is
    step 2's): torchrun restarts the workers, they continue from step 3, and the job ends with
    exit 0 and the uninterrupted two-node DDP run's weights, bit for bit."""
    reference = nodes("ddp")
    assert reference[0].returncode == 0
    env = offline_env(OMP_NUM_THREADS=1, LLM_PIPELINE_PAUSE_AT_STEP=4)
    p = start(main_command("train", "--test", "--config", cfg, *FLAGS, *RUN, "--eval-steps", 2,
                           "--checkpoint-every", 3, "--name", "elastic", "--nproc-per-node", 2,
                           "--max-restarts", 1), env=env)
    try:
        said = wait_for_line(p, "paused after step 4")        # rank 1 waits in the step's stop all-reduce
        folder = root / "checkpoints" / "elastic"
        assert sorted(x.name for x in folder.glob("*.pt")) == [
            "checkpoint_best.pt", "checkpoint_latest.pt", "checkpoint_step_3.pt"]
        rank1 = [pid for pid in descendants(p.pid)
                 if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGKILL)
    except BaseException:
        finish([p], timeout=1)
        raise
    r = finish([p])[0]
    out = "".join(said) + r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr}"
    assert "restarted by torchrun (restart 1 of 1): resuming from checkpoint_step_3.pt (step 3); the 1 " \
           "step(s) after it are trained again." in out
    assert "another rank's process ended during a step" in r.stderr        # the survivor, in one line
    assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr
    a = load_checkpoint(root / "checkpoints" / "ddp2" / "checkpoint_latest.pt", "resume")
    b = load_checkpoint(folder / "checkpoint_latest.pt", "resume")
    assert b["step"] == STEPS and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optimizer"]["adamw"]["state"], b["optimizer"]["adamw"]["state"]
    assert all(torch.equal(sa[i][s], sb[i][s]) for i in sa for s in sa[i])
    recs = log_of(root, "elastic")
    assert losses(recs) == losses(log_of(root, "ddp2"))     # the later line of a step counts
    restarts = [r for r in recs if r.get("event") == "restart"]
    assert len(restarts) == 1 and {k: restarts[0][k] for k in ("step", "attempt", "checkpoint", "reached_step",
                                                               "steps_lost")} == {
        "step": 3, "attempt": 1, "checkpoint": "checkpoint_step_3.pt", "reached_step": 4, "steps_lost": 1}
    assert [r["step"] for r in latest_per_step(recs, "train")] == list(range(1, STEPS + 1))
    st = ok(run_stage("status", "elastic", "--config", cfg)).stdout
    assert ("restarts     1 by torchrun (elastic): #1 after step 4, resumed from checkpoint_step_3.pt "
            "(step 3), 1 step(s) trained again") in st, st


# ----------------------------------------------------------------------------- shared file system
def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def save_in_flight(root, run: str, tag, pid: int) -> Path:
    """Run folder ``run`` as a save of writer (``tag``, ``pid``) leaves it between its two renames:
    the previous checkpoint_latest.dcp (the FSDP run's step 3) moved aside, the new one half
    written. ``tag`` None: the names of the version before host names."""
    folder = root / "checkpoints" / run
    folder.mkdir(parents=True)
    latest = folder / "checkpoint_latest.dcp"
    old, tmp = (sharded.aside(latest, kind, tag, pid) for kind in ("old", "tmp")) if tag else (
        folder / f".checkpoint_latest.dcp.{kind}-{pid}" for kind in ("old", "tmp"))
    shutil.copytree(root / "checkpoints" / "fsdp2" / "checkpoint_step_3.dcp", old)
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"half")
    return folder


@pytest.mark.parametrize("named", ["with_host", "before_host_names"])
def test_a_reader_reads_around_another_hosts_save_in_flight_and_changes_nothing(root, cfg, nodes, named):
    assert nodes("fsdp")[0].returncode == 0
    pid = _dead_pid()                             # another host's pid: not one of this host's processes
    folder = save_in_flight(root, f"reader_{named}", OTHER_HOST if named == "with_host" else None, pid)
    before = tree(folder)
    r = ok(run_stage("infer", "--config", cfg, "--checkpoint", folder / "checkpoint_latest.dcp",
                     "--prompt", "The history of", "--max-new-tokens", 2))
    host = f"host {OTHER_HOST}" if named == "with_host" else "host (not recorded)"
    assert (f"checkpoint_latest.dcp: a save is replacing it (pid {pid} on {host}, in flight or killed "
            "between its renames); read the checkpoint it replaces (step 3)") in r.stderr, r.stderr
    assert tree(folder) == before                 # nothing renamed back, nothing removed


def test_the_writing_job_takes_over_saves_left_unfinished_and_leaves_a_live_one_alone(root, cfg, nodes):
    """`train --resume auto` of a run whose save on another host was killed between its renames:
    rank 0 puts the previous checkpoint back before it is read and removes the half-written one,
    saying whose they were; a save of a live process of this host is left alone."""
    assert nodes("fsdp")[0].returncode == 0
    folder = save_in_flight(root, "takeover", OTHER_HOST, 4242)
    live = subprocess.Popen(["sleep", "120"])
    try:
        mine = sharded.aside(folder / "checkpoint_step_3.dcp", "tmp", pid=live.pid)
        mine.mkdir()
        r = ok(run_stage("train", "--test", "--config", cfg, *FLAGS, *RUN, "--parallel", "fsdp",
                         "--name", "takeover", "--resume", "auto"))
        assert mine.is_dir()
    finally:
        live.kill()
        live.wait()
    assert (f"put checkpoint_latest.dcp back: a save by pid 4242 on host {OTHER_HOST} was killed "
            "between its renames") in r.stdout, r.stdout
    assert f"removed .checkpoint_latest.dcp.tmp-{OTHER_HOST}-4242" in r.stdout
    assert f"left {mine.name} alone: its writer (pid {live.pid} on this host) is running" in r.stdout
    assert "resuming run 'takeover' from" in r.stdout and "(step 3)" in r.stdout
    assert load_checkpoint(folder / "checkpoint_latest.dcp", "weights")["step"] == STEPS
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [mine.name]


# ----------------------------------------------------------------------------- launch flags
@pytest.mark.parametrize("flags, message", [
    (["--nnodes", 2, "--node-rank", 2], "--node-rank 2 is not a node of --nnodes 2: give 0 .. 1."),
    (["--node-rank", 1], "--node-rank and --rdzv-endpoint place this machine in a job of several"),
    (["--nnodes", 2, "--node-rank", 1, "--name", "x"], "node 1: give node 0's --rdzv-endpoint HOST:PORT"),
    (["--nnodes", 2, "--rdzv-endpoint", "127.0.0.1"], "--rdzv-endpoint: expected HOST:PORT"),
    (["--max-restarts", -1], "training.max_restarts"),
], ids=["rank_out_of_range", "rank_without_nnodes", "other_node_without_endpoint", "endpoint_without_port",
        "negative_restarts"])
def test_launch_flags_are_checked_before_anything_starts(cfg, flags, message):
    r = run_stage("train", "--test", "--config", cfg, *flags)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_stopped_run_of_several_machines_says_how_to_resume_on_each():
    from utils.run import resume_command_train
    line = resume_command_train(["--test", "--name", "big", "--lr", "1e-3"], "big", 16, 8,
                                ["--nproc-per-node", "8", "--nnodes", "2", "--rdzv-endpoint", "n0:29500"])
    assert line == ("python main.py train --test --lr 1e-3 --name big --resume auto --nproc-per-node 8 "
                    "--nnodes 2 --rdzv-endpoint n0:29500 --node-rank R   (on each node, R its own node rank)")
