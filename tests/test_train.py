"""`python main.py train`: files written, exact resume after a real SIGINT, stop signals, the
--max-steps total, refusals (other tokenizer, reused run name), Muon and gradient accumulation,
and SIGKILL during a checkpoint save (the previous checkpoint stays loadable; resume works).

Every run is the CLI a user types (subprocess `python main.py train --test ...`) on a tiny shard
set of the real news sample encoded with the Llama-style SentencePiece sample tokenizer and
written by utils.data.shards (tests/conftest.py: write_train_shards); tiny model, windows of 32
tokens, batches of 2, so each run takes seconds. Signals are sent to the process when the
run's own JSONL log shows a given step (polling the file), never after a sleep.
"""
from __future__ import annotations

import os
import re
import signal
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

import pytest
import torch

from tests.conftest import (SPM_MODEL, child_pids, main_command, offline_env, paused_env, popen_main, run_main,
                            run_places, run_stage, wait_for_line, write_config)
from utils.run import load_checkpoint
from utils.training.logging_utils import latest_per_step, read_jsonl, read_log
from utils.training.scheduler import CosineWarmupScheduler, lr_factor

FLAGS = ["--window", "32", "--batch-size", "2", "--eval-batches", "2", "--sample-tokens", "4",
         "--log-every", "1", "--warmup-steps", "2", "--eval-steps", "4"]


@pytest.fixture(scope="module")
def shard_dir(train_shards):
    """The shared tiny shard set (tests/conftest.py: write_train_shards)."""
    return train_shards


TOTAL = 12   # steps of the module's reference run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_root")


@pytest.fixture(scope="module")
def cfg(root, shard_dir):
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                               "dataset": {"wikipedia_test_dir": str(shard_dir)}})


def allocator_env(**extra) -> dict:
    """The caller's environment without allocator settings, so the stage decides alone."""
    env = offline_env(**extra)
    for var in ("GLIBC_TUNABLES", "LLM_CPU_ALLOCATOR"):
        if var not in extra:
            env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def full_run(cfg, root):
    """The reference run: TOTAL steps uninterrupted (name "full"), as its own process through
    main.py (the stage's re-exec with the allocator settings happens there); returns its stdout."""
    return ok(train(cfg, "--name", "full", "--max-steps", TOTAL, env=allocator_env(),
                    process=True)).stdout


def train(cfg, *args, timeout=240, env=None, process=False):
    """`main.py train --test` with the module's FLAGS: in this process (conftest.run_stage), or
    with ``process`` as its own (conftest.run_main)."""
    run = run_main if process else run_stage
    return run("train", "--test", "--config", cfg, *FLAGS, *map(str, args), timeout=timeout, env=env)


def ok(proc, code=0):
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def log_of(tmp_path, run) -> list[dict]:
    return read_jsonl(tmp_path / "logs" / "raw_metrics" / f"{run}.jsonl")


def losses(records) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in latest_per_step(records, "train")}


def weights(path) -> dict:
    return load_checkpoint(path, purpose="resume")["model"]


# --------------------------------------------------------------------------- end to end
def test_train_writes_run_files_and_loss_goes_down(root, cfg, full_run):
    run = root / "checkpoints" / "full"
    for name in ("checkpoint_latest.pt", "checkpoint_best.pt", "config.json"):
        assert (run / name).is_file(), name
    assert list((root / "logs" / "tensorboard" / "full").glob("events.out.tfevents.*"))
    recs = log_of(root, "full")
    assert recs[0]["type"] == "config" and recs[0]["hparams"]["total_steps"] == TOTAL
    tr = losses(recs)
    assert sorted(tr) == list(range(1, TOTAL + 1))
    assert all(np.isfinite(v) for v in tr.values())
    val = [r["val_loss"] for r in latest_per_step(recs, "val")]
    assert len(val) >= 3 and val[-1] < val[0], val
    assert any(r["type"] == "sample" for r in recs)
    ck = load_checkpoint(run / "checkpoint_latest.pt", purpose="resume")
    assert ck["step"] == TOTAL and ck["kind"] == "pretrain"
    assert ck["model_args"]["d_model"] == 64 and ck["tokenizer"]["vocab_size"] == 32000
    assert "python main.py status full" in full_run
    # On CPU with glibc the stage restarted itself once with the malloc tunables, and said so
    # (the test machines are Linux with glibc; elsewhere it must not restart at all).
    from utils.training.allocator import CPU_MALLOC_TUNABLES, cpu_allocator_env
    glibc = bool(cpu_allocator_env())
    restart = f"restarting once with GLIBC_TUNABLES={CPU_MALLOC_TUNABLES}"
    assert full_run.count(restart) == (1 if glibc else 0), full_run
    assert ("glibc malloc tunables set" in full_run) == glibc, full_run


def test_allocator_opt_out_keeps_the_defaults(root, cfg):
    from utils.training.allocator import OPT_OUT_ENV
    out = ok(train(cfg, "--name", "sysalloc", "--max-steps", 1,
                   env=allocator_env(**{OPT_OUT_ENV: "system"}))).stdout
    assert "restarting once" not in out
    assert f"{OPT_OUT_ENV}=system: glibc malloc defaults" in out


def test_cpu_training_restarts_and_trains_with_stderr_closed(root, cfg):
    """``train ... 2>&-``: the allocator's re-exec flushed a None sys.stderr (AttributeError,
    exit 1, nothing trained); now the closed stream is /dev/null (utils/stdio.py) and the run
    trains, its output to stdout intact."""
    out = root / "closed_stderr.out"
    with out.open("w") as f:
        cmd = main_command("train", "--test", "--config", cfg, *FLAGS, "--name", "nostderr", "--max-steps", 1)
        proc = subprocess.run(["/bin/sh", "-c", '"$@" 2>&-', "sh", *map(str, cmd)], stdout=f,
                              stdin=subprocess.DEVNULL, env=allocator_env(), timeout=240)
    text = out.read_text()
    assert proc.returncode == 0, text
    assert "AttributeError" not in text and (root / "checkpoints" / "nostderr" / "checkpoint_latest.pt").is_file()


def test_a_link_planted_where_the_log_goes_is_refused_not_written_through(root, cfg, tmp_path):
    """logs/raw_metrics/RUN.jsonl as a symbolic link to another file: records were appended to
    that file (the log is opened for appending); now the run stops, naming the path."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    log = root / "logs" / "raw_metrics" / "linked.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.symlink_to(victim)
    try:
        proc = train(cfg, "--name", "linked", "--max-steps", 1)
    finally:
        log.unlink()             # the module's root outlives this test's tmp_path, where it points
    assert proc.returncode == 1, proc.stderr
    assert f"cannot use {log}" in proc.stderr and "symbolic link" in proc.stderr, proc.stderr
    assert victim.read_text() == "keep me\n" and "Traceback" not in proc.stderr


def test_reused_run_name_refused(root, cfg, full_run):
    ck = root / "checkpoints" / "full" / "checkpoint_latest.pt"
    before = ck.stat().st_mtime_ns
    again = train(cfg, "--name", "full", "--max-steps", 4)
    assert again.returncode == 2, again.stderr
    assert "already holds a run" in again.stderr and "--resume auto" in again.stderr
    assert ck.stat().st_mtime_ns == before


def test_a_run_name_that_is_a_path_is_refused_before_anything_is_written(root, cfg, tmp_path):
    """--name ../../x, /abs, a/b, . or .. wrote checkpoints outside paths.checkpoints_dir (or
    into it as a run); status read such paths too. Exit 2 naming the flag, nothing written."""
    outside = tmp_path / "escape"
    before = sorted(p.name for p in (root / "checkpoints").iterdir())
    for name in (f"../../{outside.name}", str(outside), "a/b", ".", "..", ""):
        r = train(cfg, "--name", name, "--max-steps", 1)
        assert r.returncode == 2, (name, r.stderr)
        assert "--name (training.run_name)" in r.stderr and "is not a run name" in r.stderr
        assert "Traceback" not in r.stderr
    assert not outside.exists() and sorted(p.name for p in (root / "checkpoints").iterdir()) == before
    for run in ("../..", "/etc"):
        r = run_stage("status", "--config", cfg, run)
        assert r.returncode == 2 and "is not a run name" in r.stderr, r.stderr


@pytest.mark.parametrize("damage", ["rng", "rng_without_ranks", "data_position", "step"])
def test_a_damaged_training_state_stops_the_resume_with_what_to_do(root, cfg, full_run, damage):
    """A checkpoint whose training state was damaged (rng.ranks a string, an rng without ranks,
    a data position without its fields, step -5) was an unexpected error on --resume, blamed
    on the world size (no ranks: "written by 0 process(es)"), or (step -5) trained on from
    step -5. Exit 1 saying the state is damaged and what to do; nothing is trained."""
    ck = load_checkpoint(root / "checkpoints" / "full" / "checkpoint_latest.pt", "resume")
    key = damage.split("_without")[0]
    ck[key] = {"rng": {"world_size": 1, "ranks": "x"}, "rng_without_ranks": {"python": "garbage"},
               "data_position": {"index": "x"}, "step": -5}[damage]
    run = root / "checkpoints" / f"damaged_{damage}"
    from utils.training.checkpoint import save_checkpoint
    save_checkpoint(run / "checkpoint_latest.pt", ck)
    r = train(cfg, "--name", run.name, "--max-steps", TOTAL + 2, "--resume", "auto")
    assert r.returncode == 1, r.stderr
    assert ("training state is damaged" if damage != "step" else "entry 'step' is -5") in r.stderr
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr
    assert not (run / "checkpoint_best.pt").exists()


def test_model_settings_on_a_resume_are_named_as_not_used(root, cfg, full_run):
    """A resume's model is the checkpoint's: --preset default (or model.* keys) given with it
    were ignored in silence, and the start line said "preset default" of the tiny model. A
    note names each differing model.* setting; the start line names the checkpoint's."""
    shutil.copytree(root / "checkpoints" / "full", root / "checkpoints" / "preset_changed")
    r = ok(train(cfg, "--name", "preset_changed", "--resume", "auto", "--preset", "default",
                 "--max-steps", TOTAL + 1))
    out = r.stdout + r.stderr
    assert "the model is the checkpoint's; these settings differ from its run and are not used" in out, out
    assert "model.preset 'tiny' -> 'default'" in out and "(the checkpoint's model, preset tiny)" in out, out
    assert "(preset default)" not in out


def _refused_start(root: Path, case: str) -> tuple[list, int, str]:
    """(arguments, exit code, stderr text) of a start that cannot go ahead, set up in ``root``."""
    from utils.training.checkpoint import save_checkpoint
    full = root / "checkpoints" / "full" / "checkpoint_latest.pt"
    if case == "no such run":
        return ["--name", "ghost", "--resume", "auto"], 1, "no checkpoints of run 'ghost'"
    if case == "truncated checkpoint":
        cut = root / "elsewhere" / "truncated.pt"
        cut.parent.mkdir(exist_ok=True)
        cut.write_bytes(full.read_bytes()[:50_000])
        return ["--name", "from_truncated", "--resume", cut], 1, "truncated"
    ck = load_checkpoint(full, "resume")
    if case == "weights of another shape":
        other = root / "elsewhere" / "wider.pt"
        save_checkpoint(other, dict(ck, model_args=dict(ck["model_args"], d_model=96)))
        return ["--name", "from_wider", "--resume", other], 1, "shape"
    if case == "another optimizer":
        return (["--name", "other_opt", "--resume", full, "--optimizer", "muon"], 1,
                "trained with optimizer(s) ['adamw']")
    if case == "damaged state of an existing run":
        save_checkpoint(root / "checkpoints" / "half_run" / "checkpoint_latest.pt",
                        dict(ck, rng={"world_size": 1, "ranks": "x"}))
        return ["--name", "half_run", "--resume", "auto"], 1, "training state is damaged"
    if case == "run file in the way":   # the start fails while writing the run's files
        (root / "checkpoints" / "blocked").mkdir(parents=True, exist_ok=True)
        (root / "checkpoints" / "blocked" / "tokenizer").write_text("not a tokenizer folder")
        return ["--name", "blocked"], 1, "already exists"
    if case == "another window":        # the data position cannot be carried over: said why
        return (["--name", "other_window", "--resume", full, "--window", "16"], 1,
                "now: dataset.window or dataset.stride, the shard set, or dataset.val_split changed")
    if case == "run name too long":     # was an unexpected OSError (File name too long)
        return ["--name", "x" * 300], 2, "is 300 bytes long: give at most 128"
    if case == "control character in the run name":
        return ["--name", "a\x01b"], 2, "is not a run name"
    if case == "logs folder is a file":  # was an unexpected NotADirectoryError
        (root / "elsewhere").mkdir(exist_ok=True)
        (root / "elsewhere" / "logs_file").write_text("a file")
        layer = write_config(root / "elsewhere", {"paths": {"logs_dir": str(root / "elsewhere" / "logs_file")}},
                             "logs_file.json")
        return (["--config", layer, "--name", "logs_blocked"], 1,
                "logs_file/tensorboard/logs_blocked: Not a directory; a part of this path is a file")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["no such run", "truncated checkpoint", "weights of another shape",
                                  "another optimizer", "damaged state of an existing run",
                                  "run file in the way", "run name too long",
                                  "control character in the run name", "logs folder is a file",
                                  "another window"])
def test_a_start_that_fails_leaves_no_folder_or_file_behind(root, cfg, full_run, case):
    """A resume refused after the logger and the run folder were set up (another optimizer, a
    damaged training state) left a new run folder (config.json, tokenizer copy), a TensorBoard
    folder and a metrics log that status showed as a run; into an existing run it rewrote
    config.json and appended to its log. Now any start that fails before training leaves the
    run places exactly as they were: nothing new (the files of a start that failed while
    writing them included), nothing removed, nothing changed."""
    args, code, message = _refused_start(root, case)
    before = run_places(root)
    r = train(cfg, *args, "--max-steps", TOTAL + 2)
    assert r.returncode == code, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert run_places(root) == before


def test_a_refused_resume_in_a_new_project_creates_no_folder(root, full_run, shard_dir, tmp_path):
    """The same in a project without checkpoints/ or logs/ yet: neither is created."""
    fresh = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)},
                                    "dataset": {"wikipedia_test_dir": str(shard_dir)}})
    r = train(fresh, "--name", "x", "--resume", root / "checkpoints" / "full" / "checkpoint_latest.pt",
              "--optimizer", "muon")
    assert r.returncode == 1 and "trained with optimizer(s)" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name]


@pytest.mark.parametrize("shape", [{"n_layers": 100_000_000}, {"d_model": 10 ** 9, "n_heads": 10 ** 6,
                                                                  "n_kv_heads": 10 ** 6}])
def test_a_model_too_large_to_build_is_a_configuration_error(root, cfg, shape):
    """model.n_layers 10^8 hung building the layers one by one; d_model 10^9 was an unexpected
    allocation error. Both are refused before anything is built: exit 2 naming the keys."""
    big = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)}, "model": shape},
                       f"big_{len(shape)}.json")
    r = run_stage("train", "--test", "--config", big, "--name", f"big_{len(shape)}", "--max-steps", 1,
                 timeout=120)
    assert r.returncode == 2, r.stderr
    assert "this pipeline builds" in r.stderr and "n_layers" in r.stderr and "Traceback" not in r.stderr


def test_divergence_stops_without_saving_the_broken_weights(root, cfg):
    """A learning rate of 1e30: the validation loss becomes NaN; training stops there with
    exit 1 and what to do, no checkpoint holds the NaN weights, and no sample is drawn from
    them (that sampling was an unexpected error before)."""
    r = train(cfg, "--name", "diverge", "--max-steps", 12, "--lr", "1e30")
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"training diverged by step \d+: the validation loss is not a number", r.stderr), r.stderr
    assert "Lower training.lr (now 1e+30)" in r.stderr and "unexpected" not in r.stderr
    assert not list((root / "checkpoints" / "diverge").glob("checkpoint_*.pt"))
    vals = [rec for rec in log_of(root, "diverge") if rec.get("type") == "val"]
    assert vals[-1]["val_loss"] is None and "the weights diverged" in r.stdout


# --------------------------------------------------------------------------- exact resume
def test_sigint_then_resume_is_bit_exact(root, cfg, full_run):
    p = popen_main("train", "--test", "--config", cfg, *FLAGS, "--name", "cut", "--max-steps", TOTAL,
                   env=paused_env(3))
    wait_for_line(p, "paused after step 3")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 130, f"{out}\n{err}"
    assert "--name cut --resume auto" in err
    cut = load_checkpoint(root / "checkpoints" / "cut" / "checkpoint_latest.pt", "resume")
    assert cut["step"] == 3

    ok(train(cfg, "--name", "cut", "--max-steps", TOTAL, "--resume", "auto"))
    a = weights(root / "checkpoints" / "full" / "checkpoint_latest.pt")
    b = weights(root / "checkpoints" / "cut" / "checkpoint_latest.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    la, lb = losses(log_of(root, "full")), losses(log_of(root, "cut"))
    assert sorted(lb) == list(range(1, TOTAL + 1))
    assert la == lb                                   # every step's loss, bit for bit
    lra = {r["step"]: r["lr"] for r in latest_per_step(log_of(root, "full"))}
    lrb = {r["step"]: r["lr"] for r in latest_per_step(log_of(root, "cut"))}
    assert lra == lrb


def test_dropout_training_resumes_bit_exact(root, shard_dir, full_run):
    """With dropout the steps draw from torch's RNG: a run resumed from a step-1 checkpoint (its
    RNG restored, then the data loader started) draws the uninterrupted run's masks: the same
    losses and weights, bit for bit. The checkpoint is a one-process `--parallel fsdp` run's
    (a .dcp folder: the RNG states from its meta.pt) and the resumed run is a plain one (the
    format switch on a resume loses nothing)."""
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)}, "model": {"dropout": 0.1},
                              "dataset": {"wikipedia_test_dir": str(shard_dir)}}, "dropout.json")
    run = ["--max-steps", 2, "--checkpoint-every", 1, "--keep-checkpoints", 2,
           "--sample-tokens", 0, "--eval-batches", 1]
    ok(train(cfg, *run, "--parallel", "fsdp", "--name", "dropout"))
    (root / "checkpoints" / "dropout_resumed").mkdir()
    shutil.copytree(root / "checkpoints" / "dropout" / "checkpoint_step_1.dcp",
                    root / "checkpoints" / "dropout_resumed" / "checkpoint_latest.dcp")
    ok(train(cfg, *run, "--parallel", "ddp", "--name", "dropout_resumed", "--resume", "auto"))
    la, lb = losses(log_of(root, "dropout")), losses(log_of(root, "dropout_resumed"))
    assert la[1] != losses(log_of(root, "full"))[1]        # the dropout is on (else: full_run's)
    assert sorted(lb) == [2] and lb[2] == la[2], (la, lb)
    a = weights(root / "checkpoints" / "dropout" / "checkpoint_latest.dcp")
    b = weights(root / "checkpoints" / "dropout_resumed" / "checkpoint_latest.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_exits_130_and_max_steps_is_the_run_total(root, cfg):
    p = popen_main("train", "--test", "--config", cfg, *FLAGS, "--name", "term", "--max-steps", 200,
                   env=paused_env(2))
    wait_for_line(p, "paused after step 2")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 130, f"{out}\n{err}"
    ck = root / "checkpoints" / "term" / "checkpoint_latest.pt"
    step = load_checkpoint(ck, "resume")["step"]
    assert step == 2
    assert any(r.get("event") == "interrupted" for r in log_of(root, "term"))
    log = root / "logs" / "raw_metrics" / "term.jsonl"
    torn = len(log.read_bytes().splitlines()) + 1
    with open(log, "ab") as f:                       # a record torn by a crash (SIGKILL mid-write)
        f.write(b'{"type": "train", "step": 3, "lo')
    # --max-steps is the run's total, not "N more": the resumed run stops at step step + 3.
    ok(train(cfg, "--name", "term", "--max-steps", step + 3, "--resume", "auto"))
    assert load_checkpoint(ck, "resume")["step"] == step + 3
    assert sorted(losses(log_of(root, "term"))) == list(range(1, step + 4))
    read = read_log(log)                             # the resume's records start their own line
    assert read.bad_lines == [torn], read.bad_lines
    assert sum(r.get("type") == "config" for r in read.records) == 2


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's exit is reaped by init, not by us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_main_py_killed_with_sigkill_stops_the_stage_as_sigterm_would(root, cfg):
    """main.py killed with SIGKILL (a supervisor's timeout, `kill -9` on the router) cannot
    forward anything: the training stage it started gets SIGTERM from the kernel and stops as on
    SIGTERM, its state saved, instead of training on orphaned (it did before)."""
    p = popen_main("train", "--test", "--config", cfg, *FLAGS, "--name", "orphan", "--max-steps", 200,
                   env=paused_env(2))
    try:
        wait_for_line(p, "paused after step 2")
        (stage,) = child_pids(p.pid)
        p.kill()
        assert p.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 120
        while running(stage) and time.monotonic() < deadline:
            time.sleep(0.05)
        err = p.stderr.read()                        # complete once the stage has exited
    finally:
        for pid in [p.pid, *child_pids(p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not running(stage), f"stage pid {stage} still running after main.py died"
    assert "interrupted at step 2/200 (SIGTERM); saved" in err, err
    assert load_checkpoint(root / "checkpoints" / "orphan" / "checkpoint_latest.pt", "resume")["step"] == 2
    assert any(r.get("event") == "interrupted" for r in log_of(root, "orphan"))


def test_resume_with_another_tokenizer_refused(root, cfg, shard_dir, full_run):
    from utils.data.tok import load_tokenizer_from
    other = root / "other_tok"
    tok2 = load_tokenizer_from(str(SPM_MODEL))     # the same vocabulary plus one added token
    tok2.add_tokens(["<extra_token_for_the_test>"])
    tok2.save_pretrained(str(other))
    cfg2 = write_config(root, {"tokenizer": {"name": str(other)},
                               "dataset": {"wikipedia_test_dir": str(shard_dir)}}, "other.json")
    proc = train(cfg2, "--name", "full", "--max-steps", TOTAL + 4, "--resume", "auto")
    assert proc.returncode == 1, proc.stderr
    assert "tokenizer mismatch" in proc.stderr and "checkpoint_latest.pt" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- optimizer options
def test_muon_with_grad_accum_trains_and_resumes_exactly(root, cfg):
    opt = ["--optimizer", "muon", "--grad-accum", "2"]
    total = 8
    ok(train(cfg, *opt, "--name", "mu_full", "--max-steps", total))
    p = popen_main("train", "--test", "--config", cfg, *FLAGS, *opt, "--name", "mu_cut",
                   "--max-steps", total, env=paused_env(2))
    wait_for_line(p, "paused after step 2")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 130, f"{out}\n{err}"
    ok(train(cfg, *opt, "--name", "mu_cut", "--max-steps", total, "--resume", "auto"))
    ck = load_checkpoint(root / "checkpoints" / "mu_full" / "checkpoint_latest.pt", "resume")
    assert set(ck["optimizer"]) == {"muon", "adamw"}
    la, lb = losses(log_of(root, "mu_full")), losses(log_of(root, "mu_cut"))
    assert sorted(la) == list(range(1, total + 1))
    assert all(np.isfinite(v) for v in la.values()) and la == lb
    b = weights(root / "checkpoints" / "mu_cut" / "checkpoint_latest.pt")
    assert all(torch.equal(ck["model"][k], b[k]) for k in b)


# --------------------------------------------------------------------------- scheduler
def test_scheduler_warmup_cosine_min_and_resume():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    s = CosineWarmupScheduler(opt, warmup=4, total=20, min_ratio=0.1)
    seen = [s.apply(i) for i in range(25)]
    assert seen[:4] == [0.25, 0.5, 0.75, 1.0]
    assert seen[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(seen[4:20], seen[5:20]))    # cosine decays monotonically
    assert seen[12] == pytest.approx(0.1 + 0.9 * 0.5)              # half-way: mean of peak and min
    assert seen[20:] == [0.1] * 5                                   # min lr after the end
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    s.apply(9)
    state = s.state_dict()
    opt2 = torch.optim.AdamW([p], lr=1.0)
    s2 = CosineWarmupScheduler(opt2, warmup=4, total=20, min_ratio=0.1)
    assert s2.load_state_dict(state) == [] and s2.step == 9
    assert s2.apply(10) == s.apply(10)
    s3 = CosineWarmupScheduler(torch.optim.AdamW([p], lr=1.0), warmup=4, total=30, min_ratio=0.1)
    assert s3.load_state_dict(state) == ["total: 20 -> 30"]
    assert lr_factor(0, warmup=0, total=10, min_ratio=0.0) == 1.0


# --------------------------------------------------------------------------- throughput
class _Windows:
    """In-memory training windows with the resumable position the Trainer asks of its data."""

    def __init__(self, rows: int = 40, batch: int = 2, window: int = 8):
        self.data = torch.randint(0, 64, (rows, window + 1), generator=torch.Generator().manual_seed(0))
        self.batch, self.epoch, self.index = batch, 0, 0

    def __iter__(self):
        while self.index + self.batch <= len(self.data):
            rows = self.data[self.index:self.index + self.batch]
            self.index += self.batch
            yield {"x": rows[:, :-1], "y": rows[:, 1:]}
        self.epoch, self.index = self.epoch + 1, 0

    def __len__(self):
        return len(self.data) // self.batch

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "batch_size": self.batch}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]


def test_logged_tokens_per_s_is_the_training_steps_alone(tmp_path):
    """On a clock where a training step takes 1 s and a validation batch, a sample and a
    checkpoint save take far longer, every logged tokens/s is one step's tokens per second:
    validation, samples and saves are timed apart (they were timed with the step after them,
    logged at a small fraction of the others: the report's throughput curve zig-zagged)."""
    from model import ModelArgs, create_model
    from utils.training.logging_utils import DualLogger
    from utils.training.trainer import (OptimizerSpec, Settings, Trainer, TrainSpec,
                                        next_token_loss, seed_everything)
    now = [0.0]

    def loss(model, batch):                # a training step: 1 s; a validation batch: 100 s
        now[0] += 1.0 if torch.is_grad_enabled() else 100.0
        return next_token_loss(model, batch)

    def sample(model):
        now[0] += 500.0
        return [("p", "text")]

    class SlowSaves(Trainer):
        def save(self, name):
            now[0] += 300.0
            return super().save(name)

    seed_everything(0)
    args = ModelArgs(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8)
    windows = _Windows()
    spec = TrainSpec(create_model(args), args, windows, [next(iter(_Windows()))] * 2,
                     optimizer=OptimizerSpec(), loss=loss, sample_fn=sample,
                     settings=Settings(total_steps=8, min_lr=1e-4, warmup_steps=0, eval_interval=2,
                                       eval_batches=2, checkpoint_every=3, keep_checkpoints=1,
                                       log_every=1, dtype="fp32"))
    logger = DualLogger("thr", tmp_path / "logs", tensorboard=False)
    trainer = SlowSaves(spec, run_dir=tmp_path / "run", logger=logger, device="cpu",
                        progress=False, clock=lambda: now[0])
    assert trainer.fit().reason == "done"
    logger.close()
    rates = {r["step"]: r["tokens_per_s"] for r in latest_per_step(read_jsonl(logger.jsonl_path), "train")}
    assert rates == {step: 2 * 8 / 1.0 for step in range(1, 9)}


def test_metrics_returned_by_a_loss_and_a_val_fn_are_logged(tmp_path):
    """A spec's loss may return ``(loss, {name: tensor})`` and its ``val_fn`` {name: float}:
    the train records carry each metric's mean over the steps since the last record, the val
    records the count-weighted validation mean as ``val_<name>`` and val_fn's numbers; with
    val_fn and no validation data the run still validates (DPO and RL log through this)."""
    from model import ModelArgs, create_model
    from utils.training.logging_utils import DualLogger
    from utils.training.trainer import (OptimizerSpec, Settings, Trainer, TrainSpec,
                                        next_token_loss, seed_everything)
    calls = []

    def loss(model, batch):
        calls.append(len(calls) + 1)
        return next_token_loss(model, batch), {"n": torch.tensor(float(len(calls)))}

    def run(name, val_data, val_fn):
        calls.clear()
        seed_everything(0)
        args = ModelArgs(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8)
        spec = TrainSpec(create_model(args), args, _Windows(), val_data, optimizer=OptimizerSpec(),
                         loss=loss, val_fn=val_fn,
                         settings=Settings(total_steps=4, min_lr=1e-4, warmup_steps=0, eval_interval=2,
                                           eval_batches=1, checkpoint_every=4, keep_checkpoints=0,
                                           log_every=2, dtype="fp32"))
        logger = DualLogger(name, tmp_path / "logs", tensorboard=False)
        assert Trainer(spec, run_dir=tmp_path / name, logger=logger, device="cpu",
                       progress=False).fit().reason == "done"
        logger.close()
        recs = read_jsonl(logger.jsonl_path)
        return latest_per_step(recs, "train"), latest_per_step(recs, "val")

    train, val = run("both", [next(iter(_Windows()))], lambda model: {"pass": 0.25})
    # calls: val@0 (1), steps 1-2 (2, 3), val@2 (4), steps 3-4 (5, 6), val@4 (7)
    assert [(r["step"], r["n"]) for r in train] == [(2, 2.5), (4, 5.5)]
    assert [(r["step"], r["val_n"], r["val_pass"]) for r in val] == [(0, 1.0, 0.25), (2, 4.0, 0.25), (4, 7.0, 0.25)]
    train, val = run("fn_only", None, lambda model: {"pass": 0.5})
    assert [(r["step"], r["val_pass"]) for r in val] == [(0, 0.5), (2, 0.5), (4, 0.5)]
    assert all("val_loss" not in r for r in val) and (tmp_path / "fn_only" / "checkpoint_latest.pt").is_file()


# --------------------------------------------------------------------------- SIGKILL mid-save
def _catch_save(run_dir: Path, proc: subprocess.Popen, skip: set, limit: float = 180):
    """Spin until a training process starts writing checkpoint_latest.pt over an existing one:
    its temp file ``.checkpoint_latest.pt.tmp-PID`` appears (PID: the writer, i.e. the stage
    process that main.py started). Returns (pid, temp path)."""
    latest = run_dir / "checkpoint_latest.pt"
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if latest.exists():
            for t in run_dir.glob(".checkpoint_latest.pt.tmp-*"):
                pid = int(t.name.rsplit("-", 1)[1])
                if pid not in skip:
                    return pid, t
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"run ended (exit {proc.returncode}) before a second save\n{out}\n{err}")
        time.sleep(0.001)                 # a save takes tens of ms; leave the CPU to the run
    proc.kill()
    pytest.fail(f"no save of {latest} within {limit} s")


def test_sigkill_during_checkpoint_save_keeps_the_previous_checkpoint(root, cfg):
    """kill -9 the writer at moments inside the atomic save of checkpoint_latest.pt (as its
    temp file appears, and a few ms later): each time the file under the real name is the
    previous complete checkpoint (the one loader accepts it for a resume), and `--resume auto`
    continues from it to the end and removes the dead writers' temp files."""
    run_dir = root / "checkpoints" / "killed"
    total = 8
    args = ["--name", "killed", "--max-steps", str(total), "--eval-steps", "1"]  # save every step
    killed, mid_save, resume, before = set(), 0, [], 0
    for delay in (0.0, 0.002, 0.01):
        p = popen_main("train", "--test", "--config", cfg, *FLAGS, *args, *resume)
        pid, tmp = _catch_save(run_dir, p, killed)
        if delay:
            time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
        out, err = p.communicate(timeout=60)
        assert p.returncode not in (0, 130), f"{out}\n{err}"
        mid_save += tmp.exists()              # the writer died before its rename
        ck = load_checkpoint(run_dir / "checkpoint_latest.pt", "resume")
        assert before <= ck["step"] < total
        assert ck["optimizer"]["adamw"]["state"], "optimizer state missing"
        before, resume = ck["step"], ["--resume", "auto"]
    assert mid_save >= 2, "the kills should land inside the save (temp file left behind)"
    ok(train(cfg, *args, "--resume", "auto"))
    assert load_checkpoint(run_dir / "checkpoint_latest.pt", "resume")["step"] == total
    assert not list(run_dir.glob(".*.tmp-*")), "temp files of the killed writers remain"
    steps = losses(log_of(root, "killed"))
    assert sorted(steps) == list(range(1, total + 1))
    assert all(np.isfinite(v) for v in steps.values())
