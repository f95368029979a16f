"""The network pass of a decode step, written once (library; no side effects): the engine's
eager step (utils/generation/engine.py ``Batcher._decode``), the compiled step
(compiled.py, the same function traced as one graph) and prompt lookup's verify pass
(speculative.py) all call :func:`decode_pass`; they differ only in which cache cells their
new tokens go to and which keys each token attends, which :class:`KVView` holds.

    view = KVView(rows=slice(0, n), length=L, cells=cells(slots, pos, Hkv, cache_len), pos=pos)
    logits = decode_pass(model, layers, head, kv_flat, shape, view, tokens, cos_all, sin_all,
                         key_bias=causal_bias(pos, L, dtype))      # (n, V) fp32

The cache rule, in one place (:meth:`_LayerView.update`): a batcher's KV cache holds its
engine's compute dtype (the weights' dtype, or the autocast dtype the engine runs under:
Engine ``amp``), and every key and value written into it is cast to that dtype. Under autocast
the projections give the autocast dtype while anything that meets an fp32 tensor on the way
(a RoPE table, a norm) is promoted, so without the cast a step's keys and values could reach
the cache in two dtypes (``index_copy_`` refuses a source of another dtype). RoPE rows are
made in the cache's dtype too, in :func:`decode_pass` itself, so q and k keep it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from utils.infini import InfiniCache


def cells(slots: torch.Tensor, pos: torch.Tensor, n_kv_heads: int, cache_len: int) -> torch.Tensor:
    """The rows of the flat caches (slots * n_kv_heads * cache_len, head_dim) that the new keys of
    tokens at positions ``pos`` (n,) of slots ``slots`` (n,) go to, in the order of ``k.reshape(
    -1, head_dim)`` for k (n, n_kv_heads, head_dim): (n * n_kv_heads,)."""
    heads = torch.arange(n_kv_heads, device=pos.device)
    return ((slots[:, None] * n_kv_heads + heads) * cache_len + pos[:, None]).view(-1)


def causal_bias(pos: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, length) additive key mask of tokens at positions ``pos`` (n,): 0 for the keys at or
    before a token's position, -inf after (the cache past a row's position holds another
    sequence's or stale keys)."""
    keys = torch.arange(length, device=pos.device)
    return torch.zeros(pos.shape[0], length, dtype=dtype, device=pos.device).masked_fill(
        keys[None] > pos[:, None], float("-inf"))


@dataclass
class KVView:
    """What one decode pass writes and reads in a batcher's caches: the new keys and values go
    to ``cells`` (:func:`cells`); each token attends the keys of slots ``rows`` at positions
    ``0..length-1`` (rows 0..n-1 for a batch step, one slot for a verify pass, whose tokens are
    consecutive tokens of one sequence); ``pos``: each token's position (its RoPE angle; for an
    Infini-attention model, its position in the segment); ``mems``: per layer, the (sigma(K),
    M, z) buffers of an Infini-attention model, else None."""
    rows: slice
    length: int
    cells: torch.Tensor
    pos: torch.Tensor
    mems: Optional[list] = None


class _LayerView:
    """One layer's cache as ``Attention.decode`` sees it (``update(k, v) -> (keys, values)``,
    and ``infini`` for an Infini-attention layer)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, shape: tuple, view: KVView, mem: Optional[tuple]):
        self.k, self.v, self.shape, self.view, self.mem = k, v, shape, view, mem

    def update(self, k, v):                                   # (n, Hkv, hd)
        hd, at = k.shape[-1], self.view.cells
        self.k.index_copy_(0, at, k.reshape(-1, hd).to(self.k.dtype))     # the one write rule
        self.v.index_copy_(0, at, v.reshape(-1, hd).to(self.v.dtype))
        rows, L = self.view.rows, self.view.length
        return self.k.view(self.shape)[rows, :, :L], self.v.view(self.shape)[rows, :, :L]

    @property
    def infini(self):
        """The rows' segment keys, values and memory (utils/infini.py ``InfiniCache``), each at
        its own position in the segment."""
        n = self.view.pos.shape[0]
        sk, M, z = self.mem
        return InfiniCache(sk[:n], self.v.view(self.shape)[:n], M[:n], z[:n], self.view.pos)


def decode_pass(model, layers: list, head: Callable, kv_flat: list, shape: tuple, view: KVView,
                tokens: torch.Tensor, cos_all: torch.Tensor, sin_all: torch.Tensor,
                key_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(n, V) fp32 logits of ``tokens`` (n,), their keys and values written into the caches.
    ``layers``: each block's decode weights (utils/generation/pack.py ``PackedLayer``) or None
    (the block's own Linear layers); ``head``: x (n, d_model) -> logits; ``kv_flat``: each
    layer's (k, v) as (slots * n_kv_heads * cache_len, head_dim), ``shape`` their
    (slots, n_kv_heads, cache_len, head_dim) view; ``cos_all``/``sin_all``: the model's RoPE
    tables (``model.rope``), whose rows at ``view.pos`` are taken in the cache's dtype;
    ``key_bias``: (n, length) additive key mask, None where every token attends all
    ``view.length`` keys."""
    cos, sin = model.decode_rope(cos_all, sin_all, view.pos, kv_flat[0][0].dtype)
    h = model.tok_embeddings(tokens)                                        # (n, d_model)
    mems = view.mems or [None] * len(model.layers)
    for layer, (k, v), mem, packed in zip(model.layers, kv_flat, mems, layers):
        h = layer.decode(h, cos, sin, _LayerView(k, v, shape, view, mem), key_bias, packed)
    return head(model.norm(h)).float()
