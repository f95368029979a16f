"""Dual logging: TensorBoard events and a raw JSONL file per run (library).

``logs/tensorboard/<run>/`` gets TensorBoard scalars, texts (sample generations) and the
hyperparameters; ``logs/raw_metrics/<run>.jsonl`` gets one JSON object per line::

    {"type": "config", "time": ..., "config": {...}, "hparams": {...},
     "environment": {...}}            once per start (utils/environment.py: git, packages, machine)
    {"type": "train", "step": 10, "time": ..., "loss": ..., "smoothed_loss": ..., "lr": ...,
     "grad_norm": ..., "tokens_per_s": ..., "tokens_seen": ..., "peak_memory_mb": ...,
     "epoch": ..., "mfu": ... (when the device's peak is known)}
    {"type": "val", "step": ..., "val_loss": ..., "perplexity": ..., "bits_per_byte": ...}
    {"type": "sample", "step": ..., "prompt": ..., "text": ...}
    {"type": "event", "step": ..., "event": "start" | "resume" | "interrupted" | "done" | ...}

Lines are appended and flushed as they are written (a reader such as ``main.py status`` sees
them at once; a crash loses nothing already logged). After a resume a step may appear twice
(logged, then killed before the next checkpoint): the later line is the one that counts.
On a resume, TensorBoard's ``purge_step`` drops events after the resumed step. Only the
main process logs: other DDP ranks get a logger whose methods do nothing.

Readers (``main.py status``, ``main.py report``): :func:`read_log` returns the records and the
line numbers of lines that are not a JSON object (a line torn by a crash, damaged bytes), so
a reader can say how many it skipped; :func:`latest_per_step` keeps one record per step.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from utils import environment
from utils.disk import named

# The last event of a start: Trainer.fit's reasons (utils/training/trainer.py). A start with
# none of these after it ended without saying so (killed, crashed) or is still running.
TERMINAL_EVENTS = ("done", "interrupted", "early_stopping", "already_done")


def json_safe(v: Any) -> Any:
    """JSON-safe values: NaN/inf become null (JSON has no NaN), tensors become numbers."""
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def log_paths(logs_dir: Path, run: str) -> tuple[Path, Path]:
    """``(TensorBoard folder, JSONL file)`` of run ``run`` under ``logs_dir``."""
    return Path(logs_dir) / "tensorboard" / run, Path(logs_dir) / "raw_metrics" / f"{run}.jsonl"


class DualLogger:
    """TensorBoard + JSONL logger of one run. ``enabled=False`` (non-main ranks) is a no-op.
    Its folders and files are created by the first record, not before: a stage that stops
    before it logs anything has written nothing here."""

    def __init__(self, run: str, logs_dir: Path, *, tensorboard: bool = True, jsonl: bool = True,
                 enabled: bool = True, purge_step: Optional[int] = None):
        self.run, self.enabled = run, enabled
        self.tb_dir, self.jsonl_path = log_paths(logs_dir, run)
        self._tb = None
        self._fh = None
        self._pending = (tensorboard, jsonl, purge_step) if enabled else None

    def _open(self) -> None:
        """Create the TensorBoard writer and open the JSONL file (once, at the first record)."""
        if self._pending is None:
            return
        tensorboard, jsonl, purge_step = self._pending
        self._pending = None
        if tensorboard:
            # torch (and tensorboard, 0.2 s more): only with logging.tensorboard on; status reads
            # logs through this module without torch
            from torch.utils.tensorboard import SummaryWriter
            self.tb_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(str(self.tb_dir), purge_step=purge_step)
        if jsonl:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: a link planted where the log goes would have had records appended to
            # whatever it points at (ELOOP, named by run_stage, instead)
            fd = os.open(self.jsonl_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            self._fh = os.fdopen(fd, "a", encoding="utf-8")
            if self._fh.tell() and not _ends_a_line(self.jsonl_path):
                self._fh.write("\n")       # a line torn by a crash: the next record starts its own

    # ------------------------------------------------------------------ writers
    def _line(self, record: dict) -> None:
        self._open()
        if self._fh is not None:
            try:
                self._fh.write(json.dumps(json_safe(record), ensure_ascii=False) + "\n")
                self._fh.flush()
            except OSError as e:                  # a full disk, named (utils/disk.py)
                refused = named(self.jsonl_path, e, setting="paths.logs_dir")
                if refused is None:
                    raise
                raise refused from e

    def log(self, kind: str, step: int, values: dict, prefix: Optional[str] = None) -> None:
        """One record of ``kind`` ("train" or "val"); numeric values also go to TensorBoard
        under ``prefix/name`` (prefix defaults to kind)."""
        if not self.enabled:
            return
        self._line({"type": kind, "step": int(step), "time": time.time(), **values})
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None \
                        and math.isfinite(float(v)):
                    self._tb.add_scalar(f"{prefix or kind}/{k}", v, int(step))

    def text(self, tag: str, step: int, text: str, **extra) -> None:
        if not self.enabled:
            return
        self._line({"type": tag, "step": int(step), "time": time.time(), "text": text, **extra})
        if self._tb is not None:
            self._tb.add_text(tag, text, int(step))

    def event(self, step: int, event: str, **extra) -> None:
        if not self.enabled:
            return
        self._line({"type": "event", "step": int(step), "time": time.time(), "event": event,
                    **extra})

    def config(self, config: dict, hparams: dict) -> None:
        """The resolved config and the run's hyperparameters (once per start or resume)."""
        if not self.enabled:
            return
        self._line({"type": "config", "time": time.time(), "config": config, "hparams": hparams,
                    "environment": environment.describe()})
        if self._tb is not None:
            self._tb.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
            simple = {k: v for k, v in hparams.items()
                      if isinstance(v, (int, float, str, bool)) and v is not None}
            self._tb.add_hparams(simple, {}, run_name=".")

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        self._pending = None            # nothing is opened after close
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@dataclass
class LogRead:
    """A raw-metrics file as read: its records, and the 1-based numbers of the lines that are
    not a JSON object (torn by a crash mid-write, damaged bytes), which were skipped."""
    path: Path
    records: list = field(default_factory=list)
    bad_lines: list = field(default_factory=list)
    exists: bool = True
    first_bad: Optional[str] = None   # what is wrong with the first bad line
    torn_tail: bool = False           # the last bad line is the file's last, without its newline,
                                      # and begins like a record: one being written, or cut short

    @property
    def damaged_lines(self) -> list:
        """``bad_lines`` without a torn tail: a reader running while training writes can see a
        record's line half written, and a crash mid-write leaves one; any other bad line is
        damage."""
        return self.bad_lines[:-1] if self.torn_tail else list(self.bad_lines)

    @property
    def unreadable(self) -> bool:
        """The file has damaged lines and not one record: nothing in it can be read."""
        return not self.records and bool(self.damaged_lines)


def _what_is_wrong(line: bytes) -> str:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (binary data? byte {e.start + 1} is 0x{line[e.start]:02x})"
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return "not JSON"
    return "JSON but not an object (a record is one JSON object per line)"


def _ends_a_line(path: Path) -> bool:
    """Whether the (non-empty) file's last byte is a newline."""
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_log(path: Path) -> LogRead:
    """Every JSON-object line of a raw-metrics file; any other non-blank line is skipped and
    its number kept in ``bad_lines`` (``first_bad`` says what is wrong with the first). A
    missing file reads as empty (``exists`` False); other OSErrors are raised."""
    out = LogRead(Path(path))
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                line = raw.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)       # bytes: invalid UTF-8 is a ValueError too
                except (ValueError, RecursionError):
                    rec = None
                if isinstance(rec, dict):
                    out.records.append(rec)
                    out.torn_tail = False
                else:
                    out.bad_lines.append(number)
                    if out.first_bad is None:
                        out.first_bad = _what_is_wrong(line)
                    out.torn_tail = not raw.endswith(b"\n") and line.startswith(b"{")
    except FileNotFoundError:
        out.exists = False
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Records of a raw-metrics file; damaged lines (a torn last line after a crash) skipped."""
    return read_log(path).records


def finite(x) -> bool:
    """A real number (not bool, NaN or infinity): what a logged metric value must be to count."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:          # an integer beyond float's range (JSON allows 4,300 digits)
        return False


def latest_per_step(records: list[dict], kind: str = "train") -> list[dict]:
    """Records of ``kind`` with one per step (the last written wins), sorted by step."""
    by_step: dict[int, dict] = {}
    for r in records:
        if r.get("type") == kind and isinstance(r.get("step"), int):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]
