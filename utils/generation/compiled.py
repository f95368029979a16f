"""A compiled decode step (library; no side effects at import): the network pass of one decode
step (embedding, every block's ``decode``, final norm, head) as one ``torch.compile`` graph,
as gpt-fast runs it. The engine (utils/generation/engine.py ``Batcher._decode``) calls
:meth:`CompiledStep.__call__` in place of its eager loop when ``inference.compile`` turns it on.

    step = CompiledStep(model, packs, head, mode)     one per engine (its weights)
    step.warm(kv)                                     compile now, on a batcher's caches
    logits = step(kv, tokens, pos, length, cos_all, sin_all)

Shapes: on CPU the graph is dynamic in the rows n and in the keys attended, ``length`` (the
longest row's position + 1): one graph serves every step of every batch size (sizes 0 and 1
are specialized by dynamo, so batch 1 and batches of 2 or more are two graphs, both made by
:meth:`warm`), and a step reads only the keys it attends over. On CUDA the KV cache is
static, as gpt-fast's: every step attends over the slot's whole capacity with a key mask, so
each batch size is one shape, which CUDA graphs (``mode`` "reduce-overhead") record once and
replay; the caches are mutated in place, which CUDA graph trees support for inputs that stay
at one address (a batcher's caches do). A row's arithmetic depends only on its own inputs
(the products are row by row, the attention per row), so a row's tokens never depend on its
neighbours, as in the eager step.

Compile time is paid once per engine (model) and shape family, in :meth:`warm`: serve warms
at start-up, before it listens, and infer when it loads a model, so no request waits for a
compile; a step of a shape not yet compiled (dynamo's recompile) is possible only past what
``warm`` covered and is logged by torch. Infini-attention models decode eagerly (their
memory update is a different step). Whether it pays: :func:`compile_applies` (the measured
choice of ``auto``, docs/performance.md, Compiled decode step).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch.fx.experimental import _config as fx_config

BACKEND = "inductor"     # torch.compile's backend (tests trace with "eager": dynamo's graphs, seconds not minutes)


def compile_applies(setting: str, device_type: str, segment: Optional[int]) -> bool:
    """Whether ``inference.compile`` (auto | on | off) compiles the decode step on
    ``device_type``: ``on`` everywhere but Infini-attention models, ``off`` nowhere, ``auto``
    on CUDA only (on CPU the compiled step measured no faster than the eager one, whose
    products already are the fused kernels: docs/performance.md)."""
    if segment or setting == "off":
        return False
    return setting == "on" or device_type == "cuda"


def compile_mode(device_type: str) -> Optional[str]:
    """torch.compile's mode for the decode step: CUDA graphs on CUDA ("reduce-overhead":
    a step replays one recorded graph instead of launching each kernel), inductor's default
    elsewhere (its max-autotune benchmarks kernels at compile time, minutes on a CPU)."""
    return "reduce-overhead" if device_type == "cuda" else None


class _StepCache:
    """One layer's cache view inside the compiled graph: the new keys and values of rows 0..n-1
    go to ``cells`` of the flat (slots * Hkv * positions, hd) cache; the keys returned are
    rows 0..n-1's first ``length`` positions (the model's ``update``)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cells: torch.Tensor, shape: tuple, length):
        self.k, self.v, self.cells, self.shape, self.length = k, v, cells, shape, length

    def update(self, k, v):                                   # (n, Hkv, hd)
        n, hd = k.shape[0], k.shape[-1]
        self.k.index_copy_(0, self.cells, k.reshape(-1, hd))
        self.v.index_copy_(0, self.cells, v.reshape(-1, hd))
        return self.k.view(self.shape)[:n, :, :self.length], self.v.view(self.shape)[:n, :, :self.length]


class CompiledStep:
    """The decode step's network pass over ``model`` with its decode weights (``packs``: one
    per block or None each; ``head``: x -> logits), compiled with ``mode`` (None: inductor's
    default); ``pack``: the decode pack they come from (the engine's check that they are
    current). ``static``: attend over the slot's whole capacity (CUDA, see the module
    docstring); default: on CUDA."""

    def __init__(self, model, packs: list, head: Callable, pack=None, mode: Optional[str] = None,
                 static: Optional[bool] = None):
        self.model, self.packs, self.head, self.pack = model, packs, head, pack
        self.static = model.device.type == "cuda" if static is None else static
        self.compiled = torch.compile(self._logits, backend=BACKEND, mode=mode, dynamic=not self.static)
        self.seconds = 0.0               # spent compiling (warm)

    def _logits(self, flat: list, cache_len: int, tokens: torch.Tensor, pos: torch.Tensor, length: int,
                cos_all: torch.Tensor, sin_all: torch.Tensor) -> torch.Tensor:
        model = self.model
        n, Hkv, hd = tokens.shape[0], model.args.n_kv_heads, model.args.head_dim
        shape = (-1, Hkv, cache_len, hd)
        cos, sin = model.decode_rope(cos_all, sin_all, pos)                # (n, 1, hd)
        keys = torch.arange(length, device=pos.device)
        key_bias = torch.zeros(n, length, dtype=cos.dtype, device=pos.device).masked_fill(
            keys[None] > pos[:, None], float("-inf"))                       # (n, length)
        cells = ((torch.arange(n, device=pos.device)[:, None] * Hkv + torch.arange(Hkv, device=pos.device))
                 * cache_len + pos[:, None]).view(-1)                       # (n * Hkv,)
        h = model.tok_embeddings(tokens)
        for layer, (k, v), packed in zip(model.layers, flat, self.packs):
            h = layer.decode(h, cos, sin, _StepCache(k, v, cells, shape, length), key_bias, packed)
        return self.head(model.norm(h)).float()

    def __call__(self, flat: list, cache_len: int, tokens: torch.Tensor, pos: torch.Tensor, length: int,
                 cos_all: torch.Tensor, sin_all: torch.Tensor) -> torch.Tensor:
        """(n, V) fp32 logits of rows 0..n-1 (``tokens`` at positions ``pos``), their keys and
        values written into a batcher's caches, ``flat``: each layer's (k, v) seen as (slots *
        n_kv_heads * cache_len, head_dim); ``length``: the longest row's position + 1 (the
        slot's capacity when static). Sizes are not duck-typed (two sizes that happen to be
        equal at the first call are not assumed equal after), and the flat caches keep a
        1-slot batcher's from being a size-1 dimension, which dynamo would specialize."""
        if self.static:
            length = cache_len
        with fx_config.patch(use_duck_shape=False):
            return self.compiled(flat, cache_len, tokens, pos, length, cos_all, sin_all)

    def warm(self, flat: list, cache_len: int, cos_all: torch.Tensor, sin_all: torch.Tensor) -> float:
        """Compile the step for batch 1 and batches of 2 or more on a batcher's caches of two
        slots or more (``flat``, see :meth:`__call__`; their slots 0..1, positions 0..2, are
        overwritten: call it before the batcher holds sequences); returns the seconds it took."""
        t0 = time.perf_counter()
        device = flat[0][0].device
        for n in (1, 2):
            for length in (2, 3):                        # two lengths: the graph is made dynamic in it
                tokens = torch.zeros(n, dtype=torch.long, device=device)
                self(flat, cache_len, tokens, torch.full((n,), length - 1, device=device), length, cos_all, sin_all)
        self.seconds += time.perf_counter() - t0
        return time.perf_counter() - t0
