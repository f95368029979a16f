"""Stage ``status``: how is a training run doing? (seeds/000's check_training.py)

    python main.py status              every run, newest first, one line each
    python main.py status RUN          the run's latest step, loss and trend, tokens/s, ETA,
                                       validation, checkpoints, and whether it is still running
    python main.py status RUN --json   the same as one JSON object (for scripts)

Reads only what training writes: ``logs/raw_metrics/<run>.jsonl`` (utils/training/logging_utils.py's
records) and the run folder ``checkpoints/<run>/``. It never opens a checkpoint (they can be
gigabytes) and never writes anything, so it is safe to run while training is writing.

"Still running" means: the log's last record is not a terminal event (done, interrupted,
stopped early) and it is recent, younger than max(2 minutes, 5 x the median gap between train
records). A run killed with SIGKILL therefore shows as "stalled" once that time has passed.

A damaged log is said, never taken for a missing one: a log that exists but of which not one
line is a record (binary data, not UTF-8, not JSON lines) or that cannot be opened is "log
unreadable": status names the file, the first bad line and what to do, still shows the rest
(the checkpoints), and exits 1 after printing, as for an unknown run. Damaged lines among
readable records are skipped and counted in the output (exit 0); a last line without its
newline is a record being written (or cut short by a crash) and is skipped silently. ``--json``
states the problem in ``log_problem`` (null when there is none).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from utils.cli import PipelineError, StageParser, printable, run_stage
from utils.run import checkpoint_bytes, check_run_name, lineage, list_runs, run_checkpoints, run_kind
from utils.training.logging_utils import (TERMINAL_EVENTS, LogRead, finite as _finite, json_safe, latest_per_step,
                                          read_log)

MIN_STALE_S = 120.0


def build_parser() -> StageParser:
    p = StageParser("main.py status", "Show the progress of training runs (read-only).")
    p.add_argument("run", nargs="?", default=None,
                   help="run name (a folder of paths.checkpoints_dir or a log of "
                        "paths.logs_dir/raw_metrics); default: list every run")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


# ------------------------------------------------------------------------------ library
def run_names(checkpoints_dir: Path, logs_dir: Path) -> list[tuple[str, float]]:
    """(name, last activity) of every run with a metrics log or a checkpoint, newest first."""
    seen: dict[str, float] = {}
    raw = logs_dir / "raw_metrics"
    if raw.is_dir():
        for p in raw.glob("*.jsonl"):
            if p.is_file():
                seen[p.stem] = p.stat().st_mtime
    for r in list_runs(checkpoints_dir):           # the run layer's listing (run folders)
        if not r.legacy:
            seen[r.name] = max(seen.get(r.name, 0.0), r.mtime)
    return sorted(seen.items(), key=lambda kv: kv[1], reverse=True)


def summarize(run: str, checkpoints_dir: Path, logs_dir: Path,
              now: Optional[float] = None) -> dict:
    """Everything ``status RUN`` shows, as a dict (None where the log has no value yet)."""
    now = time.time() if now is None else now
    log_path = logs_dir / "raw_metrics" / f"{run}.jsonl"
    run_dir = checkpoints_dir / run
    if not log_path.is_file() and not run_dir.is_dir():
        if log_path.exists():
            raise PipelineError(f"run '{run}': its log {log_path} is not a file (a folder?) and "
                                f"{run_dir} does not exist; move it aside.")
        raise PipelineError(f"no run '{run}': neither {log_path} nor {run_dir} exists. "
                            "`python main.py status` lists the runs.")
    log, problem = _read_log(log_path, run_dir)
    records = log.records
    train, val, configs, events, samples = _usable(records)
    hparams = configs[-1]["hparams"] if configs else {}
    total = hparams.get("total_steps")

    out: dict = {"run": run, "log": str(log_path), "run_dir": str(run_dir),
                 "total_steps": total if isinstance(total, int) else None,
                 "step": None, "loss": None, "smoothed_loss": None, "lr": None,
                 "tokens_per_s": None, "tokens_seen": None, "trend": None, "eta_s": None,
                 "val_loss": None, "best_val_loss": None, "perplexity": None,
                 "bits_per_byte": None, "last_event": None, "last_record_age_s": None,
                 "state": "log unreadable" if _is_unreadable(problem) else "no log yet",
                 "log_problem": problem, "checkpoints": [], "sample": None,
                 "kind": run_kind(run_dir), "chain": lineage(checkpoints_dir, run_dir),
                 "metrics": {}, "val_metrics": {},
                 "lora": hparams.get("lora") if isinstance(hparams.get("lora"), dict) else None}
    if train:
        last = train[-1]
        out.update(step=last.get("step"), loss=last.get("loss"),
                   smoothed_loss=last.get("smoothed_loss"), lr=last.get("lr"),
                   tokens_seen=last.get("tokens_seen"))
        rates = [r["tokens_per_s"] for r in train[-5:] if _finite(r.get("tokens_per_s"))]
        out["tokens_per_s"] = statistics.median(rates) if rates else None
        out["trend"] = loss_trend(train)
        out["eta_s"] = eta_seconds(train, out["total_steps"])
        out["metrics"].update(extra_metrics(last, TRAIN_KEYS))
    out.update(_validation(val))
    if samples:
        out["sample"] = {"step": samples[-1].get("step"), "prompt": samples[-1].get("prompt"),
                         "text": samples[-1].get("text")}
    if events:
        out["last_event"] = events[-1].get("event")
    out["restarts"] = [{k: e.get(k) for k in ("attempt", "step", "checkpoint", "reached_step", "steps_lost")}
                       for e in events if e.get("event") == "restart"]
    times = [r["time"] for r in records if _finite(r.get("time"))]
    if times:
        age = max(0.0, now - max(times))
        out["last_record_age_s"] = age
        out["state"] = run_state(out["last_event"], age, train)
    out["checkpoints"] = checkpoint_files(run_dir, now)
    return out


def checkpoint_files(run_dir: Path, now: float) -> list[dict]:
    """The run's checkpoints, newest first: file, size (MB), age (s)."""
    if not run_dir.is_dir():
        return []
    out = []
    for p in sorted(run_checkpoints(run_dir), key=lambda p: p.stat().st_mtime, reverse=True):
        st = p.stat()
        out.append({"file": p.name, "mb": round(checkpoint_bytes(p) / 1e6, 1),      # a *.dcp folder: its files
                    "age_s": round(now - st.st_mtime, 1)})
    return out


TRAIN_KEYS = {"step", "loss", "smoothed_loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen",
              "epoch", "peak_memory_mb", "mfu", "time", "type", "run"}
VAL_KEYS = {"step", "val_loss", "perplexity", "bits_per_byte", "best_val_loss", "epoch", "time",
            "type", "run"}


def extra_metrics(record: dict, known: set) -> dict:
    """The numbers a training mode logs beyond every run's (DPO's rewards, RL's reward and
    pass@1): ``{name: value}`` of a log record, finite numbers only."""
    return {k: v for k, v in record.items() if k not in known and _finite(v)}


def _validation(val: list) -> dict:
    """The last validation's numbers: its loss (where the mode has one) and the mode's own
    held-out measures (DPO's rewards, RL's pass@1)."""
    if not val:
        return {}
    out = {"val_metrics": extra_metrics(val[-1], VAL_KEYS)}
    good = [r for r in val if _finite(r.get("val_loss"))]
    if good:
        last = good[-1]
        out.update(val_loss=last["val_loss"], perplexity=last.get("perplexity"),
                   bits_per_byte=last.get("bits_per_byte"), best_val_loss=min(r["val_loss"] for r in good))
    return out


def _usable(records: list) -> tuple:
    """(train, val, config, event, sample records) of a log, passing over values of the wrong
    shape (a damaged or hand-edited log), as NaNs are: a step outside 0..2^63, a config record
    whose hparams is not an object, an event or a sample text that is not text."""
    train = [r for r in latest_per_step(records, "train") if 0 <= r["step"] < 1 << 63]
    val = [r for r in latest_per_step(records, "val") if 0 <= r["step"] < 1 << 63]
    configs = [r for r in records if r.get("type") == "config" and isinstance(r.get("hparams"), dict)]
    events = [r for r in records if r.get("type") == "event" and isinstance(r.get("event"), str)]
    samples = [r for r in records if r.get("type") == "sample" and isinstance(r.get("text"), str)]
    return train, val, configs, events, samples


def _read_log(path: Path, run_dir: Path) -> tuple:
    """``(LogRead, problem)``: the log's records, and None or a dict saying what is wrong with
    the file: ``problem`` "unreadable" (nothing in it can be read) or "damaged lines" (some
    lines were skipped), the first bad ``line``, the ``damaged_lines`` count, the ``reason``
    and a ``message`` that names the file and what to do."""
    try:
        log = read_log(path)
    except OSError as e:                       # a folder of that name, no permission, I/O error
        why = f"{type(e).__name__}: {e.strerror or e}"
        return LogRead(path), {
            "problem": "unreadable", "line": None, "damaged_lines": None, "reason": why,
            "message": f"the metrics log {path} exists but cannot be opened ({why}). "
                       + _what_to_do(path, run_dir)}
    bad = log.damaged_lines
    if not bad:
        return log, None
    if log.unreadable:
        return log, {
            "problem": "unreadable", "line": bad[0], "damaged_lines": len(bad), "reason": log.first_bad,
            "message": f"the metrics log {path} exists but is unreadable: line {bad[0]} is "
                       f"{log.first_bad}, and none of its {len(bad)} non-blank line(s) is a JSON "
                       "record. " + _what_to_do(path, run_dir)}
    return log, {
        "problem": "damaged lines", "line": bad[0], "damaged_lines": len(bad), "reason": log.first_bad,
        "message": f"the metrics log {path} is damaged at line {bad[0]}, which is {log.first_bad}: "
                   f"{len(bad)} line(s) skipped; the values shown come from its other "
                   f"{len(log.records)} records."}


def _what_to_do(path: Path, run_dir: Path) -> str:
    return (f"Restore it from a backup, or move it aside (mv {path} {path}.damaged): the run's "
            "next start or `--resume auto` then begins a new log. The checkpoints"
            + (f" in {run_dir}" if run_dir.is_dir() else "") + " do not depend on it.")


def _is_unreadable(problem: Optional[dict]) -> bool:
    return problem is not None and problem["problem"] == "unreadable"


def loss_trend(train: list[dict]) -> Optional[dict]:
    """Mean loss of the last fifth of the train records against the fifth before it."""
    losses = [r.get("smoothed_loss") if _finite(r.get("smoothed_loss")) else r.get("loss")
              for r in train]
    losses = [x for x in losses if _finite(x)]
    if len(losses) < 4:
        return None
    k = max(1, len(losses) // 5)
    recent, before = statistics.fmean(losses[-k:]), statistics.fmean(losses[-2 * k:-k])
    change = recent - before
    word = "falling" if change < -0.01 * abs(before) else (
        "rising" if change > 0.01 * abs(before) else "flat")
    return {"recent": recent, "before": before, "change": change, "direction": word}


def eta_seconds(train: list[dict], total: Optional[int]) -> Optional[float]:
    """Seconds left at the step rate of the recent train records (None when unknown)."""
    pts = [(r["step"], r["time"]) for r in train if _finite(r.get("time"))][-20:]
    if not total or len(pts) < 2:
        return None
    (s0, t0), (s1, t1) = pts[0], pts[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    return max(0, total - s1) * (t1 - t0) / (s1 - s0)


def run_state(last_event: Optional[str], age: float, train: list[dict]) -> str:
    if last_event in TERMINAL_EVENTS:
        return "interrupted" if last_event == "interrupted" else "finished"
    gaps = [b["time"] - a["time"] for a, b in zip(train, train[1:])
            if _finite(a.get("time")) and _finite(b.get("time")) and b["time"] > a["time"]]
    limit = max(MIN_STALE_S, 5 * statistics.median(gaps)) if gaps else MIN_STALE_S
    return "running" if age <= limit else "stalled (no log record for " + _dur(age) + ")"


def _dur(s: Optional[float]) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _num(x, fmt: str = ".4f") -> str:
    return format(x, fmt) if _finite(x) else "n/a"


def _lora_line(a: dict) -> str:
    """A LoRA run's adapter (the log's hyperparameters, post_training.adapter_record)."""
    share = (f": {a['trainable_params']:,} trainable of {a['total_params']:,} parameters "
             f"({100 * a['trainable_params'] / a['total_params']:.2f}%)"
             if isinstance(a.get("trainable_params"), int) and a.get("total_params") else "")
    return (f"r={a.get('rank')}, alpha={a.get('alpha')}, on "
            f"{', '.join(map(str, a.get('target_modules') or []))}{share}")


def _restart_text(r: dict) -> str:
    """One restart of the workers (the log's ``restart`` event, train.py ``note_restart``)."""
    reached = f"after step {r['reached_step']}, " if isinstance(r.get("reached_step"), int) else ""
    where = (f"resumed from {r['checkpoint']} (step {r['step']})" if r.get("checkpoint") else "started over")
    lost = f", {r['steps_lost']} step(s) trained again" if isinstance(r.get("steps_lost"), int) else ""
    return f"#{r.get('attempt')} {reached}{where}{lost}"


def format_summary(s: dict) -> str:
    step = s["step"] if s["step"] is not None else "n/a"
    of = f" of {s['total_steps']}" if s["total_steps"] else ""
    lines = [f"run {s['run']}: {s['state']}" + (f" (last event: {s['last_event']})"
                                                if s["last_event"] else "")]
    if len(s.get("chain") or []) > 1:
        lines.append(f"  {s['kind']:<12} started from " + " -> ".join(s["chain"][:-1]))
    lines += [
             f"  step         {step}{of}" + (f" ({100 * s['step'] / s['total_steps']:.1f}%)"
                                             if s["step"] is not None and s["total_steps"] else ""),
             f"  loss         {_num(s['loss'])} (smoothed {_num(s['smoothed_loss'])}), "
             f"lr {_num(s['lr'], '.3g')}"]
    t = s["trend"]
    if t:
        lines.append(f"  trend        {t['direction']}: {t['before']:.4f} -> {t['recent']:.4f} "
                     f"({t['change']:+.4f})")
    lines.append(f"  tokens/s     {_num(s['tokens_per_s'], ',.0f')}"
                 + (f"; {s['tokens_seen']:,} tokens seen" if isinstance(s["tokens_seen"], int) else ""))
    if s["state"] == "running":
        lines.append(f"  ETA          {_dur(s['eta_s'])}")
    lines.append(f"  validation   loss {_num(s['val_loss'])} (best {_num(s['best_val_loss'])})"
                 + ("" if s["val_loss"] is not None and s["perplexity"] is None   # not a next-token loss (DPO)
                    else f", perplexity {_num(s['perplexity'], '.2f')}, bits/byte {_num(s['bits_per_byte'])}"))
    if s.get("metrics") or s.get("val_metrics"):
        said = [", ".join(f"{k} {v:.4g}" for k, v in sorted(s["metrics"].items()))]
        if s.get("val_metrics"):
            said.append("held-out: " + ", ".join(f"{k.removeprefix('val_')} {v:.4g}"
                                                 for k, v in sorted(s["val_metrics"].items())))
        lines.append("  metrics      " + "; ".join(x for x in said if x))
    if s.get("lora"):
        lines.append(f"  LoRA         {_lora_line(s['lora'])}")
    if s.get("restarts"):
        lines.append(f"  restarts     {len(s['restarts'])} by torchrun (elastic): "
                     + "; ".join(_restart_text(r) for r in s["restarts"]))
    if s["sample"]:
        lines.append(f"  sample       step {s['sample']['step']}: {s['sample']['prompt']!r} -> "
                     f"{(s['sample']['text'] or '')[:120]!r}")
    if s["checkpoints"]:
        lines.append(f"  checkpoints  in {s['run_dir']}:")
        lines += [f"    {c['file']:<28} {c['mb']:>8.1f} MB  {_dur(c['age_s'])} ago"
                  for c in s["checkpoints"]]
    else:
        lines.append(f"  checkpoints  none yet in {s['run_dir']}")
    problem = s.get("log_problem")
    if problem is None:
        lines.append(f"  log          {s['log']}")
    elif _is_unreadable(problem):
        at = f"line {problem['line']} is " if problem["line"] else ""
        lines.append(f"  log          {s['log']}: unreadable: {at}{problem['reason']}")
    else:
        lines.append(f"  log          {s['log']}: {problem['damaged_lines']} damaged line(s) "
                     f"skipped, the first at line {problem['line']}: {problem['reason']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ stage
def as_json(value) -> str:
    """``--json`` output: standard JSON, so a value that is not a finite number (a diverged
    run's NaN loss, which the metrics log keeps) is null; json.dumps wrote NaN, which JSON
    parsers other than Python's refuse."""
    return json.dumps(json_safe(value), indent=2, allow_nan=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(list(sys.argv[1:] if argv is None else argv))
    ckdir, logs = cfg.path("paths.checkpoints_dir"), cfg.path("paths.logs_dir")
    if args.run is None:
        runs = run_names(ckdir, logs)
        summaries = [summarize(name, ckdir, logs) for name, _ in runs]
        if args.json:
            print(as_json(summaries))
            return _fail_on_unreadable(summaries)
        if not runs:
            print(f"No training runs yet (nothing in {ckdir} or {logs / 'raw_metrics'}). "
                  "Start one with: python main.py train --test")
            return 0
        print(f"{len(runs)} run(s), newest first (details: python main.py status RUN):")
        for (name, _), s in zip(runs, summaries):
            step = f"step {s['step']}" + (f"/{s['total_steps']}" if s["total_steps"] else "") \
                if s["step"] is not None else "no steps logged"
            problem = s["log_problem"]
            damaged = (f"  [log: {problem['damaged_lines']} damaged line(s) skipped]"
                       if problem is not None and not _is_unreadable(problem) else "")
            print(f"  {printable(name):<32} {s['state']:<12} {step:<18} loss {_num(s['loss'])}  "
                  f"val {_num(s['val_loss'])}  {len(s['checkpoints'])} checkpoint(s){damaged}")
        return _fail_on_unreadable(summaries)
    s = summarize(check_run_name(args.run, "RUN"), ckdir, logs)
    print(as_json(s) if args.json else format_summary(s))
    return _fail_on_unreadable([s])


def _fail_on_unreadable(summaries: list[dict]) -> int:
    """After everything is printed: a log that exists but cannot be read is an error (exit 1,
    like an unknown run), its message on stderr; 0 otherwise."""
    bad = [s["log_problem"]["message"] for s in summaries if _is_unreadable(s["log_problem"])]
    if bad:
        sys.stdout.flush()
        raise PipelineError("\n".join(bad))
    return 0


if __name__ == "__main__":
    run_stage(main)
