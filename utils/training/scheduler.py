"""Learning-rate schedule: linear warm-up, then cosine decay to a minimum (library).

``lr(step) = peak * factor(step)`` for the optimizer step numbered ``step`` (0-based):

    warm-up   step < warmup:          factor = (step + 1) / warmup
    cosine    warmup <= step < total: factor = m + (1 - m) * 0.5 * (1 + cos(pi * p)),
              p = (step - warmup) / max(1, total - warmup),  m = min_lr / peak
    after     step >= total:          factor = m

The schedule is a pure function of the step, so resuming needs only the step count (the
state_dict also records the settings, and a resume with different settings is reported).
Every parameter group of every optimizer is scaled from its own ``initial_lr``, so groups
with different peak rates (AdamW and Muon) follow the same shape.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch


def effective_warmup(warmup_steps: int, total_steps: int) -> int:
    """The warm-up a run uses: the configured steps, capped at 20% of the run's steps (a short
    run would otherwise end before its learning rate peaks); 0 for a run of unknown length."""
    return min(int(warmup_steps), max(0, int(total_steps) // 5)) if total_steps else 0


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    p = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


class CosineWarmupScheduler:
    """Sets ``group["lr"]`` on every group of ``optimizers`` before each step.

    Call ``apply(step)`` before ``optimizer.step()`` for step ``step``; ``state_dict()`` /
    ``load_state_dict()`` carry the step and the settings (plain types).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer, *,
                 warmup: int, total: int, min_ratio: float):
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers)
        self.warmup, self.total, self.min_ratio = int(warmup), int(total), float(min_ratio)
        self.step = 0
        for opt in self.optimizers:
            for g in opt.param_groups:
                g.setdefault("initial_lr", g["lr"])

    def factor(self, step: int) -> float:
        return lr_factor(step, warmup=self.warmup, total=self.total, min_ratio=self.min_ratio)

    def apply(self, step: int) -> float:
        """Set the learning rates for optimizer step ``step``; returns the factor."""
        self.step = int(step)
        f = self.factor(step)
        for g in self._groups():
            g["lr"] = g["initial_lr"] * f
        return f

    def _groups(self) -> Iterable[dict]:
        for opt in self.optimizers:
            yield from opt.param_groups

    def lrs(self) -> list[float]:
        return [g["lr"] for g in self._groups()]

    def state_dict(self) -> dict:
        return {"step": self.step, "warmup": self.warmup, "total": self.total,
                "min_ratio": self.min_ratio}

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore the step; returns a list of settings that differ from the checkpoint's
        (the caller reports them: the resumed run then follows the new schedule)."""
        self.step = int(state.get("step", 0))
        return [f"{k}: {state[k]} -> {getattr(self, k)}" for k in ("warmup", "total", "min_ratio")
                if k in state and state[k] != getattr(self, k)]
