"""`python main.py status`: read-only progress of training runs, from the logs the trainer's
own writer (utils.training.logging_utils.DualLogger) produces and the run folder."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time

import pytest

import status
from tests.conftest import ROOT, offline_env, write_config
from utils.training.logging_utils import DualLogger


def _cfg(tmp_path):
    return write_config(tmp_path, {
        "paths": {"checkpoints_dir": str(tmp_path / "checkpoints"), "logs_dir": str(tmp_path / "logs")}}, name="status.json")


def _log_run(tmp_path, run, losses, *, total=100, dt=2.0, t0=None, end_event=None, val=None):
    """A run's JSONL written by the real logger; record times set to a fake clock."""
    t0 = time.time() - dt * len(losses) if t0 is None else t0
    lg = DualLogger(run, tmp_path / "logs", tensorboard=False, jsonl=True)
    lg.config({"model": {}}, {"total_steps": total, "run": run})
    lg.event(0, "start")
    for i, loss in enumerate(losses, 1):
        lg.log("train", i * 10, {"loss": loss, "smoothed_loss": loss, "lr": 1e-3,
                                 "tokens_per_s": 1000.0 + i, "tokens_seen": i * 10 * 512})
    for step, v in (val or []):
        lg.log("val", step, {"val_loss": v, "perplexity": 2.718 ** v, "bits_per_byte": v / 3})
    lg.text("sample", 10 * len(losses), "once upon a time", prompt="The history of")
    if end_event:
        lg.event(10 * len(losses), end_event)
    lg.close()
    # Rewrite the times as if one train record came every dt seconds from t0.
    path = tmp_path / "logs" / "raw_metrics" / f"{run}.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    for k, r in enumerate(recs):
        r["time"] = t0 + dt * (r.get("step", 0) / 10)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _ckpt_dir(tmp_path, run, names=("checkpoint_latest.pt", "checkpoint_best.pt")):
    d = tmp_path / "checkpoints" / run
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"\0" * 1000)   # status never opens checkpoints
    return d


def test_summary_of_a_running_run(tmp_path):
    losses = [9.0 - 0.3 * i for i in range(20)]
    now = time.time()
    _log_run(tmp_path, "exp1", losses, total=400, dt=2.0, t0=now - 40, val=[(100, 7.5), (200, 6.5)])
    _ckpt_dir(tmp_path, "exp1")
    s = status.summarize("exp1", tmp_path / "checkpoints", tmp_path / "logs", now=now)
    assert s["step"] == 200 and s["total_steps"] == 400
    assert s["loss"] == pytest.approx(losses[-1])
    assert s["trend"]["direction"] == "falling" and s["trend"]["change"] < 0
    assert s["state"] == "running"
    # 10 steps every 2 s, 200 steps left -> 40 s
    assert s["eta_s"] == pytest.approx(40.0)
    assert s["val_loss"] == 6.5 and s["best_val_loss"] == 6.5
    assert s["tokens_per_s"] == pytest.approx(1018.0)   # median of the last five records
    assert {c["file"] for c in s["checkpoints"]} == {"checkpoint_latest.pt", "checkpoint_best.pt"}
    assert s["sample"]["text"] == "once upon a time"


def test_states_finished_interrupted_stalled(tmp_path):
    now = time.time()
    _log_run(tmp_path, "done_run", [5, 4, 3, 2], end_event="done", t0=now - 10)
    _log_run(tmp_path, "int_run", [5, 4, 3, 2], end_event="interrupted", t0=now - 10)
    _log_run(tmp_path, "dead_run", [5, 4, 3, 2], t0=now - 3600)      # SIGKILLed an hour ago
    _log_run(tmp_path, "flat_run", [3, 3, 3, 3, 3], t0=now - 10)
    get = lambda r: status.summarize(r, tmp_path / "checkpoints", tmp_path / "logs", now=now)
    assert get("done_run")["state"] == "finished"
    assert get("int_run")["state"] == "interrupted"
    assert get("dead_run")["state"].startswith("stalled")
    assert get("flat_run")["trend"]["direction"] == "flat"
    assert get("flat_run")["state"] == "running"


def test_a_rising_loss_is_called_rising(tmp_path):
    _log_run(tmp_path, "bad", [2, 2.5, 3, 3.5, 4, 4.5])
    s = status.summarize("bad", tmp_path / "checkpoints", tmp_path / "logs")
    assert s["trend"]["direction"] == "rising"


def test_torn_last_line_and_nan_values_are_tolerated(tmp_path):
    """NaN as the real logger writes it (null), and as a raw NaN/Infinity literal (what Python's
    json writes by default, e.g. another tool's log), then a line torn by a crash."""
    path = _log_run(tmp_path, "torn", [5, 4, float("nan"), 2, 1])
    assert '"step": 30, "time": ' in path.read_text() and '"loss": null' in path.read_text()
    with open(path, "a") as f:
        f.write(json.dumps({"type": "train", "step": 60, "loss": float("nan"),
                            "smoothed_loss": float("inf"), "lr": 1e-3,
                            "tokens_per_s": float("nan"), "tokens_seen": 30720,
                            "time": time.time()}) + "\n")
        f.write('{"type": "train", "step": 70, "loss": nu')   # crash mid-write
    assert "NaN" in path.read_text() and "Infinity" in path.read_text()
    s = status.summarize("torn", tmp_path / "checkpoints", tmp_path / "logs")
    assert s["step"] == 60                                     # the torn line is skipped
    assert s["trend"]["direction"] == "falling"                # from the finite losses only
    assert s["tokens_per_s"] == pytest.approx(1003.5)          # NaN rates left out
    proc = _run(tmp_path, "torn")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"loss\s+n/a \(smoothed n/a\)", proc.stdout), proc.stdout
    body = proc.stdout.replace(str(tmp_path), "TMP")                # the path says "nan" too
    assert "tokens/s     1,004" in body and "nan" not in body.lower() and "inf" not in body
    for args in (["torn", "--json"], ["--json"]):              # standard JSON: null, never NaN
        out = _run(tmp_path, *args)
        assert out.returncode == 0, out.stderr
        assert "NaN" not in out.stdout and "Infinity" not in out.stdout
        js = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
        one = js if isinstance(js, dict) else js[0]
        assert one["step"] == 60 and one["loss"] is None
        assert one["log_problem"] is None                      # a torn last line is no damage


def _run(tmp_path, *args):
    cfg = tmp_path / "status.json"
    if not cfg.exists():
        _cfg(tmp_path)
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "status", "--config",
                           str(cfg), *args], capture_output=True, text=True,
                          env=offline_env(), timeout=120)


def test_cli_lists_runs_newest_first_and_shows_one(tmp_path):
    now = time.time()
    _log_run(tmp_path, "older", [5, 4, 3, 2], end_event="done", t0=now - 500)
    _log_run(tmp_path, "newer", [5, 4, 3, 2], t0=now - 10)
    os.utime(tmp_path / "logs/raw_metrics/older.jsonl", (now - 400, now - 400))
    _ckpt_dir(tmp_path, "newer")
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 run(s)")
    assert "newer" in lines[1] and "running" in lines[1] and "2 checkpoint(s)" in lines[1]
    assert "older" in lines[2] and "finished" in lines[2]
    one = _run(tmp_path, "newer")
    assert one.returncode == 0, one.stderr
    assert "run newer: running" in one.stdout and "step         40 of 100" in one.stdout
    assert "checkpoint_latest.pt" in one.stdout and "trend        falling" in one.stdout
    js = json.loads(_run(tmp_path, "newer", "--json").stdout)
    assert js["step"] == 40 and js["state"] == "running"


def test_a_run_name_with_control_characters_stays_on_its_own_row(tmp_path):
    """A run folder named with a newline and an escape sequence: the listing printed it raw,
    which made a fake row (and drove the terminal); each such character shows as U+FFFD."""
    _ckpt_dir(tmp_path, "real\n  fake    finished\x1b[2J")
    _ckpt_dir(tmp_path, "plain")
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 run(s)") and len(lines) == 3, proc.stdout
    assert "\x1b" not in proc.stdout and any("real\ufffd  fake    finished\ufffd[2J" in x for x in lines)


def test_cli_unknown_run_and_empty(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0 and "No training runs yet" in proc.stdout
    proc = _run(tmp_path, "nope")
    assert proc.returncode == 1
    assert "no run 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "logs" / "raw_metrics" / "dir.jsonl").mkdir(parents=True)   # a folder where the log goes
    proc = _run(tmp_path, "dir")
    assert proc.returncode == 1 and "dir.jsonl is not a file" in proc.stderr, proc.stderr


GARBAGE = {   # contents of a damaged log; the first bad line is line 2 in each (line 1 is blank)
    "binary": (b"\n" + bytes(range(255, -1, -1)) * 4, "not UTF-8 text"),
    "latin-1": ("\ncaf\xe9 step 10 loss 3.2\n".encode("latin-1"), "not UTF-8 text"),
    "text": (b"\nstep 10 loss 3.2\nstep 20 loss 3.1\n", "not JSON"),
    "json, not objects": (b"\n[1, 2]\n3.5\n", "JSON but not an object"),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_an_unreadable_log_is_said_not_taken_for_no_log(tmp_path, kind):
    """A metrics log of binary data, of text that is not UTF-8, or of lines that are not JSON
    objects was "no log yet" (exit 0), which hid the damage. status RUN names the file, the
    first bad line and what to do, still shows the checkpoints, and exits 1 (as for an
    unknown run); --json stays standard JSON with the problem in log_problem; the list of runs
    shows the run and exits 1 too."""
    data, reason = GARBAGE[kind]
    log = tmp_path / "logs" / "raw_metrics" / "broken.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(data)
    _ckpt_dir(tmp_path, "broken")
    r = _run(tmp_path, "broken")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "no log yet" not in r.stdout
    assert r.stdout.startswith("run broken: log unreadable"), r.stdout
    assert "checkpoint_latest.pt" in r.stdout and "checkpoint_best.pt" in r.stdout
    assert f"{log}: unreadable: line 2 is {reason}" in r.stdout, r.stdout
    assert f"the metrics log {log} exists but is unreadable: line 2 is {reason}" in r.stderr, r.stderr
    assert f"mv {log} {log}.damaged" in r.stderr
    for args in (["broken", "--json"], ["--json"]):
        out = _run(tmp_path, *args)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        js = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
        one = js if isinstance(js, dict) else js[0]
        assert one["state"] == "log unreadable" and len(one["checkpoints"]) == 2
        problem = one["log_problem"]
        assert problem["problem"] == "unreadable" and problem["line"] == 2, problem
        assert problem["reason"].startswith(reason) and str(log) in problem["message"]
    listing = _run(tmp_path)
    assert listing.returncode == 1 and "unreadable" in listing.stderr, listing.stderr
    assert re.search(r"broken\s+log unreadable", listing.stdout), listing.stdout


def test_damaged_lines_among_records_are_counted_and_skipped(tmp_path):
    """Lines damaged among good records (a torn line that a resume appended to, damaged
    bytes): the values come from the good records, the log line says how many were skipped
    and where the first is, --json has it in log_problem; exit 0, as for a torn last line."""
    path = _log_run(tmp_path, "scarred", [5, 4, 3, 2], end_event="done")
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3] + [b"\xff\xfe garbage\n", b'{"type": "train", "st{"x": 1}\n']
                              + lines[3:]))
    r = _run(tmp_path, "scarred")
    assert r.returncode == 0, r.stderr
    assert "run scarred: finished" in r.stdout and "step         40 of 100" in r.stdout
    assert f"{path}: 2 damaged line(s) skipped, the first at line 4: not UTF-8 text" in r.stdout, r.stdout
    js = json.loads(_run(tmp_path, "scarred", "--json").stdout)
    assert js["step"] == 40 and js["log_problem"]["problem"] == "damaged lines"
    assert (js["log_problem"]["line"], js["log_problem"]["damaged_lines"]) == (4, 2)
    listing = _run(tmp_path)
    assert listing.returncode == 0 and "[log: 2 damaged line(s) skipped]" in listing.stdout


def test_records_of_the_wrong_shape_are_passed_over_not_a_failure(tmp_path):
    """Values of the wrong shape in a log (a config record's "hparams" a list, a negative or
    31-digit step, an event that is a number) are passed over, as NaNs are: the first ended
    `status` with an unexpected error, for the listing of every run too; a negative step
    showed "step -1 of 12". The other runs and records are shown."""
    good = _log_run(tmp_path, "fine", [5, 4, 3])
    path = _log_run(tmp_path, "odd", [5, 4, 3, 2], end_event="done")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    for r in recs:
        if r.get("type") == "config":
            r["hparams"] = [1]
    recs += [{"type": "train", "step": -1, "loss": 1.0, "time": recs[-1]["time"]},
             {"type": "train", "step": 10 ** 30, "loss": 1.0, "time": recs[-1]["time"]},
             {"type": "event", "step": 40, "event": 7, "time": recs[-1]["time"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = _run(tmp_path, "odd")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step         40" in r.stdout and "step -1" not in r.stdout, r.stdout
    listing = _run(tmp_path)
    assert listing.returncode == 0 and "fine" in listing.stdout and "odd" in listing.stdout, listing.stdout
    assert "unexpected error" not in listing.stderr + r.stderr
    assert good.exists()


def test_status_writes_nothing(tmp_path):
    _log_run(tmp_path, "r", [3, 2, 1, 0.5])
    _ckpt_dir(tmp_path, "r")
    _cfg(tmp_path)
    snapshot = lambda: sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file())
    before = snapshot()
    assert _run(tmp_path, "r").returncode == 0
    after = snapshot()
    assert before == after
