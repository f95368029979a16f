"""How many intra-op threads a generation step runs on, and the scope that sets them (library:
the only library module that changes torch's thread count, and only for the length of one
step).

- :func:`step_threads`: on CPU, 1 for a small model's small step, else all of torch's threads.
  Small steps are a few ms of work, of which a second thread saves little, while every op's
  parallel region waits for its worker, a scheduler time slice whenever that worker was
  descheduled: on cores shared with the server's event loop and a client, a tiny model's
  server made fewer tokens/s with 2 threads than with 1. Large models: a batch-1 step reads
  >= 64 MB of weights, which one core cannot stream (MKL's fp32 products run one thread; the
  decode pack's column panels and the int8 kernel spread over all), so a second core speeds
  their decoding up (docs/performance.md, Generation).
- :func:`pack_panels`: the column panels of the fp32 decode pack (utils/generation/pack.py),
  one per thread of a one-token step.
- :func:`step_mode`: inference mode and the step's threads, both restored before the caller's
  code runs again (``Engine.stream`` yields between steps), so torch's global thread count is
  never left changed.
- :class:`DecodeThreads`: where the rule gives a decode step all threads, the count of each
  step is chosen by measurement among 1 and all, per batch size: on cores other processes
  also use, every parallel region of a step waits for its descheduled workers, and a step on
  all threads became many times slower than on one (SmolLM2-135M at batch 1 under a load of
  10 on 2 cores: 0.1-0.7 tokens/s on 2 threads, 3-11 on 1), while on idle cores all threads
  are faster (37 against 27 tokens/s). So the faster count of recent steps is used, and the
  other one is tried again every ``EXPLORE`` steps, so a change of load is followed within a
  few dozen steps. A row's arithmetic does not depend on the thread count (the decode products
  split the output columns across threads, never a sum), so neither do its tokens.
"""
from __future__ import annotations

import contextlib
import time
from typing import Hashable, Optional

import torch

SMALL_MODEL = 1 << 26   # weights per token below which a model's small steps run on one thread
SMALL_STEP = 1 << 28    # multiply-adds of a small step (8 decode rows or a 32-token prompt of a 7M model)


def n_weights(model) -> int:
    """Weights a token multiplies by: the parameters and an int8 model's int8 buffers."""
    n = model.num_params()
    if getattr(model, "quantized", None):
        n += sum(b.numel() for b in model.buffers() if b.dtype == torch.int8)
    return n


def step_threads(model, n_tokens: int, n_weights: int, threads: Optional[int] = None) -> Optional[int]:
    """Intra-op threads for one step over ``n_tokens`` tokens of ``model``, which multiplies by
    ``n_weights`` weights per token: ``threads`` when given (the engine's override); on CPU, 1
    for a small model's small step (see the module docstring), else None (unchanged: all of
    torch's threads)."""
    if threads is not None:
        return threads
    if model.device.type != "cpu":
        return None
    return 1 if n_weights < SMALL_MODEL and n_tokens * n_weights <= SMALL_STEP else None


def pack_panels(model, threads: Optional[int] = None) -> int:
    """Column panels of the fp32 decode pack (utils/generation/cpu.py ``panels``): the threads
    of a one-token step (the product of a few rows then uses them all), 1 when such a step runs
    on one thread."""
    return step_threads(model, 1, n_weights(model), threads) or torch.get_num_threads()


@contextlib.contextmanager
def step_mode(threads: Optional[int]):
    """Inference mode, and ``threads`` intra-op threads (None: unchanged), for one generation
    step; both are restored before the caller's code runs again."""
    prev = torch.get_num_threads()
    change = threads is not None and threads != prev
    if change:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            yield
    finally:
        if change:
            torch.set_num_threads(prev)


class DecodeThreads:
    """The threads of decode steps for which the rule gives all threads (``step_threads``
    None), chosen by measurement (see the module docstring): :meth:`pick` before a step of
    ``n`` rows (any key of steps measured together), :meth:`done` after it. Each count runs ``TRY`` steps in a row when tried, and
    the first step after a change of count is not measured (the thread team's start-up); the
    other count is tried again after ``EXPLORE`` steps times how much slower it was, so trying
    a count that is many times slower costs a few percent of the time at most."""

    EXPLORE = 32          # steps between two tries of the other count, times its slowness
    TRY = 3               # steps per try (the first not measured)
    WEIGHT = 0.3          # of the newest step in each count's moving average of step time

    def __init__(self, all_threads: int):
        self.counts = (1, all_threads) if all_threads > 1 else (all_threads,)
        self.seconds: dict[tuple[int, int], float] = {}     # (rows, threads) -> moving average
        self.steps: dict[int, int] = {}                     # rows -> steps so far
        self.trying: dict[int, tuple[int, int]] = {}        # rows -> (try ends, next try) steps
        self._last: Optional[int] = None                    # threads of the last step
        self._started: Optional[tuple[int, int, float]] = None

    def pick(self, n: Hashable) -> int:
        step = self.steps.get(n, 0)
        self.steps[n] = step + 1
        known = [(self.seconds[(n, t)], t) for t in self.counts if (n, t) in self.seconds]
        if len(known) < len(self.counts):                   # the counts in turn, TRY steps each
            t = self.counts[(step // self.TRY) % len(self.counts)]
        else:
            (best_s, best), (other_s, other) = min(known), max(known)
            end, nxt = self.trying.setdefault(n, (0, step + self.EXPLORE))
            if step >= nxt:
                end, nxt = step + self.TRY, step + int(self.EXPLORE * max(1.0, other_s / best_s))
                self.trying[n] = (end, nxt)
            t = other if step < end and other != best else best
        self._started = (n, t, time.perf_counter())
        return t

    def done(self) -> None:
        if self._started is None:
            return
        n, t, t0 = self._started
        dt, self._started = time.perf_counter() - t0, None
        switched, self._last = self._last != t, t
        if switched:                            # the step started the count's threads: not counted
            return
        old = self.seconds.get((n, t))
        self.seconds[(n, t)] = dt if old is None else old + self.WEIGHT * (dt - old)
