"""Training metrics: smoothing, throughput, memory, MFU, perplexity, bits per byte (library).

:class:`MetricsTracker` keeps a window of recent losses (the "smoothed loss" of the logs),
the best validation loss and the early-stopping patience counter; its ``state_dict()`` goes
into checkpoints (plain floats), so a resumed run logs exactly what the uninterrupted one
would have. Throughput and MFU are measured per logging interval from the wall time of the
training steps (validation, samples and checkpoint saves left out).
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import resource
import sys
import time
from typing import Callable, Iterator, Optional

import torch

# Dense bf16/fp16 tensor-core peak FLOP/s per device (vendor datasheets, no sparsity).
# Matched by substring of torch.cuda.get_device_name(); MFU is omitted for unknown devices.
PEAK_FLOPS = [
    ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12), ("A6000", 155e12),
    ("A5000", 111e12), ("A40", 150e12), ("RTX 4090", 165e12), ("RTX 4080", 97e12),
    ("RTX 3090", 71e12), ("RTX 3080", 59e12), ("V100", 125e12), ("T4", 65e12),
]
LN2 = math.log(2.0)


def device_peak_flops(device: torch.device) -> Optional[float]:
    """Peak bf16 FLOP/s of a CUDA device when known; None on CPU or unknown GPUs."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS:
        if key in name:
            return flops
    return None


def mfu_unavailable_reason(device: torch.device, flops_per_token: Optional[float]) -> Optional[str]:
    """Why MFU cannot be computed for a run on ``device``, or None when it can."""
    if not flops_per_token:
        return "the model does not report its FLOPs per token"
    if device.type != "cuda":
        return f"no peak FLOP/s is known for {device.type.upper()} devices (MFU is reported on CUDA GPUs)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if device_peak_flops(device) is None:
        return (f"the peak FLOP/s of '{torch.cuda.get_device_name(device)}' is not in "
                "utils/training/metrics.py PEAK_FLOPS (add it there)")
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory of the device, or this process's peak RSS on CPU (MB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def bits_per_byte(loss: float, bytes_per_token: Optional[float]) -> Optional[float]:
    """Cross-entropy in nats/token -> bits per UTF-8 byte of the text."""
    if not bytes_per_token:
        return None
    return loss / LN2 / bytes_per_token


def measure_bytes_per_token(batches, decode, max_tokens: int = 200_000) -> Optional[float]:
    """UTF-8 bytes per token over validation windows (decoded with ``decode(list[int])``)."""
    n_tok = n_bytes = 0
    for batch in batches:
        x = batch["x"] if isinstance(batch, dict) else batch[0]
        for row in x.tolist():
            n_tok += len(row)
            n_bytes += len(decode(row).encode("utf-8"))
        if n_tok >= max_tokens:
            break
    return n_bytes / n_tok if n_tok else None


class MetricsTracker:
    """Smoothed loss over a window, best validation loss and patience (checkpointed)."""

    def __init__(self, window: int = 50, patience: int = 0):
        self.window, self.patience = int(window), int(patience)
        self.losses: collections.deque = collections.deque(maxlen=self.window)
        self.best_val_loss: Optional[float] = None
        self.bad_evals = 0
        self.val_history: list = []   # [(step, val_loss)]

    def update_loss(self, loss: float) -> float:
        self.losses.append(float(loss))
        return self.smoothed()

    def smoothed(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def update_val(self, step: int, val_loss: float) -> bool:
        """Record a validation loss; True when it is the best so far."""
        self.val_history.append((int(step), float(val_loss)))
        if self.best_val_loss is None or val_loss < self.best_val_loss:
            self.best_val_loss = float(val_loss)
            self.bad_evals = 0
            return True
        self.bad_evals += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "best_val_loss": self.best_val_loss,
                "bad_evals": self.bad_evals, "val_history": [list(v) for v in self.val_history]}

    def load_state_dict(self, state: dict) -> None:
        self.losses = collections.deque((float(x) for x in state.get("losses", [])),
                                        maxlen=self.window)
        self.best_val_loss = state.get("best_val_loss")
        self.bad_evals = int(state.get("bad_evals", 0))
        self.val_history = [tuple(v) for v in state.get("val_history", [])]


class Throughput:
    """Tokens/s of the training steps between two calls of :meth:`rate`. Time spent inside
    :meth:`paused` (validation, samples, checkpoint saves, a pause) is left out, so the rate
    logged after a validation is the training steps', not theirs diluted by it. ``sync``
    (called as a pause begins) waits for work the device still has queued, so that it is
    timed as training."""

    def __init__(self, clock: Optional[Callable[[], float]] = None,
                 sync: Optional[Callable[[], None]] = None):
        self.clock = clock or time.perf_counter
        self.sync = sync or (lambda: None)
        self.t0 = self.clock()
        self.tokens = 0
        self.left_out = 0.0

    def add(self, tokens: int) -> None:
        self.tokens += int(tokens)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The time spent in this block does not count."""
        self.sync()
        t = self.clock()
        try:
            yield
        finally:
            self.left_out += self.clock() - t

    def rate(self) -> float:
        now = self.clock()
        dt = max(now - self.t0 - self.left_out, 1e-9)
        r = self.tokens / dt
        self.t0, self.tokens, self.left_out = now, 0, 0.0
        return r


def mfu(tokens_per_s: float, flops_per_token: Optional[float], peak: Optional[float],
        world_size: int = 1) -> Optional[float]:
    """Model FLOPs utilization: achieved training FLOP/s over the devices' peak."""
    if not peak or not flops_per_token:
        return None
    return tokens_per_s * flops_per_token / (peak * world_size)


def cpu_threads() -> int:
    return torch.get_num_threads() or os.cpu_count() or 1
