"""A full disk, a read-only folder, a folder that vanished and a file in the way, met by the
pipeline's writers (utils/disk.py, utils/atomic.py): each is named (device, path, room needed
and free, the setting to point elsewhere), exit 1, no temporary file left, and what was written
before stays byte-identical and loads.

Real small file systems: a tmpfs of a few MB mounted by the test, which needs root (CI runs as
root); elsewhere those tests are skipped with that reason. The translation itself is also
checked by simulation (an ENOSPC raised where the write would fail), which runs everywhere."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import SAMPLES, SPM_MODEL, paused_env, popen_main, run_stage, wait_for_line, write_config
from utils.atomic import atomic_open
from utils.disk import WriteError, named

FLAGS = ["--window", "32", "--batch-size", "2", "--eval-batches", "2", "--sample-tokens", "0",
         "--log-every", "1", "--warmup-steps", "2", "--device", "cpu"]


@contextlib.contextmanager
def small_fs(where: Path, kib: int, read_only: bool = False):
    """A tmpfs of ``kib`` KiB mounted at ``where`` for the block (skips where mounting is not allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root); the simulated ENOSPC tests still run")
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={kib}k" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the simulated ENOSPC tests still run")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def digests(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def temps(folder: Path) -> list:
    return [p for p in folder.rglob("*") if ".tmp" in p.name]


# --------------------------------------------------------------------------- simulated, everywhere
def test_a_full_disk_in_a_write_is_named_with_the_room_it_needed(tmp_path, monkeypatch):
    """ENOSPC while syncing (as a full disk shows on write-back), and torch.save's RuntimeError
    when the device has less room than the write needs: both are WriteError naming the device,
    the path, the sizes and the setting; the temporary file is gone, the earlier file intact."""
    target = tmp_path / "out.bin"
    target.write_bytes(b"earlier")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteError) as e:
        with atomic_open(target, needed=3_000_000, setting="paths.checkpoints_dir") as f:
            f.write(b"x" * 1000)
    msg = str(e.value)
    assert msg.startswith(f"no space left on ") and f"writing {target}: needs about 3.0 MB, " in msg
    assert msg.endswith("MB free; free space or point paths.checkpoints_dir elsewhere")
    assert target.read_bytes() == b"earlier" and not temps(tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr("utils.disk.free_bytes", lambda path: 1_000)          # the device is full
    assert named(target, RuntimeError("[enforce fail at inline_container.cc:672]"), needed=50_000).what == "full"
    monkeypatch.setattr("utils.disk.free_bytes", lambda path: 10 ** 12)       # plenty: not a full disk
    assert named(target, RuntimeError("some other failure"), needed=50_000) is None
    again = pickle.loads(pickle.dumps(e.value))                                # from a worker process, whole
    assert str(again) == msg


def test_refusals_of_the_write_itself_are_named_but_not_the_callers_reads(tmp_path):
    """A read-only file system, no permission, a vanished folder, a file in the way: named when
    the write itself fails; the same errno raised by the caller's own block (a read of some
    input) is not attributed to the file being written."""
    for code, said in ((errno.EROFS, "the file system is read-only"), (errno.ENOENT, "no longer exists"),
                       (errno.ENOTDIR, "a part of the path is a file")):
        err = named(tmp_path / "x", OSError(code, os.strerror(code)), setting="paths.reports_dir")
        assert said in str(err) and "(point paths.reports_dir elsewhere)" in str(err)
        assert named(tmp_path / "x", OSError(code, os.strerror(code)), own=False) is None
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    with pytest.raises(WriteError, match="a part of the path is a file, not a folder"):
        with atomic_open(blocker / "out.json", "w") as f:
            f.write("{}")


# --------------------------------------------------------------------------- real small file systems
@pytest.fixture(scope="module")
def shards(train_shards):
    return train_shards


def test_training_warns_at_start_and_names_a_full_disk_mid_run_keeping_its_checkpoints(shards, tmp_path):
    """checkpoints on a 90 MB tmpfs: a first run of 2 steps writes latest and best (26 MB each);
    then the disk fills up (another file takes all but 10 MB). Resumed, the run says at its start
    that the checkpoints it keeps do not fit (with the numbers), and its next save fails: exit 1
    naming the device, the file, about 26 MB needed and what is free, paths.checkpoints_dir; no
    temporary file; the first run's checkpoints byte-identical and resumable."""
    from utils.disk import free_bytes
    from utils.run import load_checkpoint
    with small_fs(tmp_path / "ck", 90 * 1024) as ck:
        cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)}, "paths": {"checkpoints_dir": str(ck)},
                                      "dataset": {"wikipedia_test_dir": str(shards)}})
        first = run_stage("train", "--test", "--config", cfg, *FLAGS, "--name", "full", "--max-steps", "2",
                          "--eval-steps", "2", "--keep-checkpoints", "0")
        assert first.returncode == 0 and "warning: the checkpoints" not in first.stdout + first.stderr, first.stderr
        before = digests(ck / "full")
        (ck / "other.bin").write_bytes(b"\0" * (free_bytes(ck) - 10_000_000))
        r = run_stage("train", "--test", "--config", cfg, *FLAGS, "--name", "full", "--resume", "auto",
                      "--max-steps", "8", "--eval-steps", "2", "--checkpoint-every", "2")
        assert r.returncode == 1, r.stdout + r.stderr
        out = r.stdout + r.stderr
        assert "warning: the checkpoints this run keeps (latest, best, 3 numbered, the temporary copy of a save: " \
               "6 x about 26.1 MB = 156.3 MB) do not fit the 10.0 MB free (and the 52.2 MB of checkpoints " \
               "they replace)" in out and "keep fewer (training.keep_checkpoints)" in out, out
        assert out.index("warning: the checkpoints") < out.index("step 4/8")
        err = [line for line in r.stderr.splitlines() if line.startswith("train.py: error:")]
        assert len(err) == 1 and err[0].startswith(f"train.py: error: no space left on tmpfs (mounted at {ck}) "
                                                   f"writing {ck / 'full'}/checkpoint_"), err
        assert ": needs about 26.1 MB, 10." in err[0] and err[0].endswith("MB free; free space or point "
                                                                          "paths.checkpoints_dir elsewhere")
        checkpoints = lambda d: {k: v for k, v in d.items() if k.endswith(".pt")}   # noqa: E731
        assert not temps(ck) and len(checkpoints(before)) == 2 and checkpoints(digests(ck / "full")) == checkpoints(before)
        assert load_checkpoint(ck / "full" / "checkpoint_latest.pt", purpose="resume")["step"] == 2


def test_a_device_that_cannot_hold_one_checkpoint_is_refused_before_training(shards, tmp_path):
    with small_fs(tmp_path / "ck", 10 * 1024) as ck:
        cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)}, "paths": {"checkpoints_dir": str(ck)},
                                      "dataset": {"wikipedia_test_dir": str(shards)}})
        r = run_stage("train", "--test", "--config", cfg, *FLAGS, "--name", "none", "--max-steps", "2")
        assert r.returncode == 1
        assert (f"error: not even one checkpoint of this run (about 26." in r.stderr
                and f"free on tmpfs (mounted at {ck}), where {ck / 'none'} is; free space or point "
                    "paths.checkpoints_dir elsewhere. Nothing was trained." in r.stderr), r.stderr
        assert "step 1" not in r.stdout and list(ck.iterdir()) == [] and not (tmp_path / "logs").exists()


def test_a_run_folder_removed_mid_run_is_said_and_the_stop_still_saves(shards, tmp_path):
    """The run folder deleted while training (paused at step 2): Ctrl-C's save says the folder
    vanished and makes it again; exit 130; the checkpoint loads."""
    from utils.run import load_checkpoint
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)},
                                  "dataset": {"wikipedia_test_dir": str(shards)}})
    p = popen_main("train", "--test", "--config", cfg, *FLAGS, "--name", "gone", "--max-steps", "6",
                   env=paused_env(2))
    wait_for_line(p, "paused after step 2")
    shutil.rmtree(tmp_path / "checkpoints" / "gone")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    assert f"{tmp_path / 'checkpoints' / 'gone'} vanished while the run wrote to it" in out + err
    assert load_checkpoint(tmp_path / "checkpoints" / "gone" / "checkpoint_latest.pt", purpose="resume")["step"] == 2


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """A 2-step run and cleaned text under one root, and a config writer over it."""
    root = tmp_path_factory.mktemp("writers")
    common = {"tokenizer": {"name": str(SPM_MODEL)}, "wikipedia": {"raw_dir": str(SAMPLES / "enwiki")},
              "dataset": {"wikipedia_test_dir": str(shards)}}

    def config(name: str, setting: str = "", folder: Path = root) -> Path:
        sections = {k: dict(v) for k, v in common.items()}
        if setting:
            key, field = setting.split(".")
            sections.setdefault(key, {})[field] = str(folder)
        return write_config(root, sections, f"{name}.json")
    base = config("base")
    assert run_stage("clean", "--config", base, "--test", "--output-dir", root / "cleaned").returncode == 0
    first = run_stage("train", "--test", "--config", base, *FLAGS, "--name", "run", "--max-steps", "2",
                      "--eval-steps", "2")
    assert first.returncode == 0, first.stderr
    return {"root": root, "config": config, "base": base}


def test_clean_prepare_sft_export_and_report_name_a_full_disk(trained, tmp_path):
    """Each writer meets a tiny tmpfs: exit 1, the message naming the device, the file being
    written and the setting that chose its folder; no temporary file; a file already there
    (an earlier output) byte-identical."""
    root, config, base = trained["root"], trained["config"], trained["base"]
    cleaned = root / "cleaned"
    cases = {   # the stage's arguments after --config, the setting whose folder is the small device
        "clean": (["clean", "--test", "--force"], "cleaning.output_dir"),
        "prepare": (["prepare", "--test", "--input-dir", cleaned], "dataset.wikipedia_test_dir"),
        "sft": (["sft", "prepare", "--dataset", "samples", "--limit", "400"], "paths.post_training_dir"),
        "report": (["report", "run"], "paths.reports_dir"),
    }
    for name, (args, setting) in cases.items():
        with small_fs(tmp_path / f"small-{name}", 48) as small:
            (small / "earlier.txt").write_text("an earlier output\n")
            before = digests(small)
            stage, rest = (args[:2], args[2:]) if args[0] == "sft" else (args[:1], args[1:])
            r = run_stage(*stage, "--config", config(name, setting, small), *rest)
            assert r.returncode == 1, (name, r.stdout[-2000:], r.stderr[-2000:])
            assert f"error: no space left on tmpfs (mounted at {small}) writing {small}" in r.stderr, (name, r.stderr)
            assert f"free space or point {setting} elsewhere" in r.stderr, (name, r.stderr)
            assert "Traceback" not in r.stderr and not temps(small), name
            assert {k: v for k, v in digests(small).items() if k in before} == before, name
    out = tmp_path / "exports" / "run-hf"
    with small_fs(tmp_path / "exports", 2 * 1024) as exports:
        r = run_stage("export", "--config", base, "--checkpoint", root / "checkpoints" / "run", "--format", "hf",
                      "--out", out)
        assert r.returncode == 1 and f"no space left on tmpfs (mounted at {exports}) writing {out}: needs about 8." \
            in r.stderr and "free space or point --out elsewhere. Nothing was written." in r.stderr, r.stderr
        assert list(exports.iterdir()) == []


def test_a_read_only_folder_and_a_file_in_the_way_are_named(trained, shards, tmp_path):
    """reports_dir on a read-only file system, checkpoints_dir that is a file: each named with
    what to do, exit 1, nothing written."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the checkpoints folder should be\n")
    cfg = write_config(tmp_path, {"tokenizer": {"name": str(SPM_MODEL)}, "paths": {"checkpoints_dir": str(blocker)},
                                  "dataset": {"wikipedia_test_dir": str(shards)}})
    r = run_stage("train", "--test", "--config", cfg, *FLAGS, "--name", "x", "--max-steps", "1")
    assert r.returncode == 1 and f"{blocker}" in r.stderr and "is a file, not a folder" in r.stderr, r.stderr
    assert blocker.read_text() == "a file where the checkpoints folder should be\n"
    with small_fs(tmp_path / "ro", 256, read_only=True) as ro:
        r = run_stage("report", "--config", trained["config"]("ro", "paths.reports_dir", ro), "run")
        assert r.returncode == 1 and f"error: cannot write {ro}" in r.stderr, r.stderr
        assert f"on tmpfs (mounted at {ro}): the file system is read-only; give a writable folder (point " \
               "--out or paths.reports_dir elsewhere)" in r.stderr and "Traceback" not in r.stderr, r.stderr
