"""A compiled decode step (library; no side effects at import): the network pass of one decode
step (embedding, every block's ``decode``, final norm, head) as one ``torch.compile`` graph,
as gpt-fast runs it. The engine (utils/generation/engine.py ``Batcher._decode``) calls
:meth:`CompiledStep.__call__` in place of its eager loop when ``inference.compile`` turns it on.

    step = CompiledStep(model, packs, head, mode)     one per engine (its weights)
    step.warm(kv, shape, cos, sin, slots)             compile now, on a batcher's caches
    logits = step(kv, shape, tokens, pos, cos_all, sin_all)

The pass itself is utils/generation/step.py's ``decode_pass``, the eager step's too.

Shapes are static, as gpt-fast's: every step attends over its slot's whole capacity with a
key mask, so a graph serves one batch size of one batcher shape (slots x capacity), which CUDA
graphs (``mode`` "reduce-overhead") record once and replay; the caches are mutated in place,
which CUDA graph trees record only for inputs marked as static addresses (a batcher's caches
never move: the engine marks them, ``Engine.static_caches``; unmarked, inductor skips the
graphs for "mutated inputs").
Static on CPU too: a graph dynamic in the rows and the keys attended (one for every step)
spent its compile in symbolic-shape reasoning and had not finished SmolLM2 after 30 minutes,
where a static one compiles in about a minute (docs/performance.md, Decode at batch 1). A
row's arithmetic depends only on its own inputs (the products are row by row, the attention
per row), so a row's tokens never depend on its neighbours, as in the eager step.

Compile time is paid once per engine (model) and shape, in :meth:`warm`, for the shapes the
callers use: serve at start-up, before it listens, on its lane's slots and capacity (every
batch size); infer when it loads a model, on one prompt of the smallest capacity
:func:`static_capacity` gives ``Engine.generate``'s one-off batchers (it rounds capacities up
to powers of two, so prompts of every length share a few). So a request waits for a compile
only when it needs a shape no earlier one had (a longer capacity, a larger batch in
``generate``), once per shape; torch logs the recompile. Infini-attention models decode
eagerly (their memory update is a different step). Whether it pays: :func:`compile_applies`
(the measured choice of ``auto``, docs/performance.md, Compiled decode step).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from utils.generation.step import KVView, causal_bias, cells, decode_pass

BACKEND = "inductor"     # torch.compile's backend (tests trace with "eager": dynamo's graphs, seconds not minutes)


def compile_applies(setting: str, device_type: str, segment: Optional[int]) -> bool:
    """Whether ``inference.compile`` (auto | on | off) compiles the decode step on
    ``device_type``: ``on`` everywhere but Infini-attention models, ``off`` nowhere, ``auto``
    on CUDA only (on CPU the compiled step measured no faster than the eager one, whose
    products already are the fused kernels: docs/performance.md)."""
    if segment or setting == "off":
        return False
    return setting == "on" or device_type == "cuda"


STATIC_MIN_CAPACITY = 256   # the smallest capacity of generate's batchers (the shape infer warms)
RECOMPILE_LIMIT = 64        # graphs per engine (batch sizes x batcher shapes) before dynamo runs eagerly


def static_capacity(needed: int, context: Optional[int]) -> int:
    """The cache capacity of a one-off batcher (``Engine.generate``) whose steps run the
    compiled step: ``needed`` positions rounded up to a power of two, at least
    STATIC_MIN_CAPACITY, at most the model's ``context``. Each capacity is a shape of its own,
    so one compile each: prompts of every length then share a few, where the exact capacity
    (prompt + new tokens) would compile anew for nearly every call."""
    cap = max(STATIC_MIN_CAPACITY, 1 << max(needed - 1, 0).bit_length())
    return max(needed, min(cap, context)) if context else cap


def compile_mode(device_type: str) -> Optional[str]:
    """torch.compile's mode for the decode step: CUDA graphs on CUDA ("reduce-overhead":
    a step replays one recorded graph instead of launching each kernel), inductor's default
    elsewhere (its max-autotune benchmarks kernels at compile time, minutes on a CPU)."""
    return "reduce-overhead" if device_type == "cuda" else None


class CompiledStep:
    """The decode step's network pass over ``model`` with its decode weights (``packs``: one
    per block or None each; ``head``: x -> logits), compiled with ``mode`` (None: inductor's
    default) and static shapes (see the module docstring); ``pack``: the decode pack they come
    from (the engine's check that they are current)."""

    def __init__(self, model, packs: list, head: Callable, pack=None, mode: Optional[str] = None):
        self.model, self.packs, self.head, self.pack = model, packs, head, pack
        self.compiled = torch.compile(self._logits, backend=BACKEND, mode=mode, dynamic=False)
        self.seconds = 0.0               # spent compiling (warm)

    def _logits(self, flat: list, shape: tuple, tokens: torch.Tensor, pos: torch.Tensor,
                cos_all: torch.Tensor, sin_all: torch.Tensor) -> torch.Tensor:
        model, n, dtype = self.model, tokens.shape[0], flat[0][0].dtype
        cache_len = shape[2]
        view = KVView(slice(0, n), cache_len, cells(torch.arange(n, device=pos.device), pos, shape[1], cache_len), pos)
        return decode_pass(model, self.packs, self.head, flat, (-1, *shape[1:]), view, tokens, cos_all, sin_all,
                           causal_bias(pos, cache_len, dtype))

    def __call__(self, flat: list, shape: tuple, tokens: torch.Tensor, pos: torch.Tensor,
                 cos_all: torch.Tensor, sin_all: torch.Tensor) -> torch.Tensor:
        """(n, V) fp32 logits of rows 0..n-1 (``tokens`` at positions ``pos``), their keys and
        values written into a batcher's caches, ``flat``: each layer's (k, v) seen as (slots *
        n_kv_heads * cache_len, head_dim), ``shape`` (slots, n_kv_heads, cache_len, head_dim);
        every row attends over all ``cache_len`` positions, those past its own masked. A graph
        per batch size and batcher shape: more than dynamo's default limit of 8 recompiles."""
        # torch._dynamo is reached through torch's lazy attribute, not imported with this module:
        # its import sets TORCHINDUCTOR_CACHE_DIR in the process's environment (torch 2.13)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return self.compiled(flat, tuple(shape), tokens, pos, cos_all, sin_all)

    def warm(self, flat: list, shape: tuple, cos_all: torch.Tensor, sin_all: torch.Tensor, slots: int) -> float:
        """Compile the step now for every batch size 1..``slots`` of a batcher of caches of
        ``shape`` (see :meth:`__call__`), on its caches (``flat``; their
        positions 0..1 are overwritten: call it before the batcher holds sequences); returns the
        seconds it took."""
        t0 = time.perf_counter()
        device = flat[0][0].device
        for n in range(1, slots + 1):
            tokens = torch.zeros(n, dtype=torch.long, device=device)
            self(flat, shape, tokens, torch.ones(n, dtype=torch.long, device=device), cos_all, sin_all)
        self.seconds += time.perf_counter() - t0
        return time.perf_counter() - t0
