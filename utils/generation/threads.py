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
"""
from __future__ import annotations

import contextlib
from typing import Optional

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
