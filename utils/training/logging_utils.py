"""Dual logging: TensorBoard events and a raw JSONL file per run (library).

``logs/tensorboard/<run>/`` gets TensorBoard scalars, texts (sample generations) and the
hyperparameters; ``logs/raw_metrics/<run>.jsonl`` gets one JSON object per line::

    {"type": "config", "time": ..., "config": {...}, "hparams": {...}}        once per start
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
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional


def _clean(v: Any) -> Any:
    """JSON-safe values: NaN/inf become null (JSON has no NaN), tensors become numbers."""
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class DualLogger:
    """TensorBoard + JSONL logger of one run. ``enabled=False`` (non-main ranks) is a no-op."""

    def __init__(self, run: str, logs_dir: Path, *, tensorboard: bool = True, jsonl: bool = True,
                 enabled: bool = True, purge_step: Optional[int] = None):
        self.run, self.enabled = run, enabled
        self.tb_dir = Path(logs_dir) / "tensorboard" / run
        self.jsonl_path = Path(logs_dir) / "raw_metrics" / f"{run}.jsonl"
        self._tb = None
        self._fh = None
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(str(self.tb_dir), purge_step=purge_step)
        if jsonl:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.jsonl_path, "a", encoding="utf-8")

    # ------------------------------------------------------------------ writers
    def _line(self, record: dict) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(_clean(record), ensure_ascii=False) + "\n")
            self._fh.flush()

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
        self._line({"type": "config", "time": time.time(), "config": config, "hparams": hparams})
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
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: Path) -> list[dict]:
    """Records of a raw-metrics file; a torn last line (crash mid-write) is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def latest_per_step(records: list[dict], kind: str = "train") -> list[dict]:
    """Records of ``kind`` with one per step (the last written wins), sorted by step."""
    by_step: dict[int, dict] = {}
    for r in records:
        if r.get("type") == kind and isinstance(r.get("step"), int):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]
