"""Infini-attention's compressive memory and gate (Munkhdalai et al. 2024, "Leave No Context
Behind"; nanotron's exp53 configuration, seeds/000): the part of an infini attention layer
that is not ordinary attention (library; no side effects).

An infini layer splits its input into segments of ``segment`` tokens. Local attention is
causal within each segment, with RoPE positions restarting at each segment (utils/attention.py
``segment_spec``; model.py computes it like any attention). Across segments, each KV head
keeps a memory ``M`` (head_dim x head_dim) and a normalizer ``z`` (head_dim), built from the
queries, keys and values taken *before* RoPE, with ``sigma(x) = ELU(x) + 1`` (always > 0):

    retrieval   A_mem = sigma(Q) M / (sigma(Q) z)               zero in the first segment
    update      V' = V - sigma(K) M / (sigma(K) z)              delta rule (else V' = V)
                M <- M + sigma(K)^T V',   z <- z + sum_t sigma(K_t)

Segment j retrieves from the memory of segments 0..j-1 only. Every division is guarded by
clamping the denominator to at least ``EPS`` = 1e-6: in the first segment ``M`` and ``z`` are
zero, so the retrieval is exactly 0 / EPS = 0 (no special case); later denominators are sums
of positive terms far above EPS. The memory is computed in float32 with autocast off, whatever
the model's dtype. It starts empty for every sequence (a training window, a prompt) and
gradients flow through it across the segments of a window (nothing is detached).

Query head h reads the memory of KV head h // (n_heads / n_kv_heads) (grouped-query attention,
as the local attention groups them). One gate parameter ``beta`` per query head, zero at
initialization, mixes the two: ``y = g * A_mem + (1 - g) * A_local``, then the output
projection. ``g`` is, by ``gate``:

    hard_sigmoid   clamp(0.2 beta + 0.5, 0, 1)   (exp53; 0.5 at init; exactly 0 for beta <= -2.5)
    sigmoid        1 / (1 + exp(-beta))          (0.5 at init)
    tanh           (1 + tanh(beta)) / 2          tanh's (-1, 1) mapped onto (0, 1); 0.5 at
                                                 init; equal to sigmoid(2 beta)

Generation (utils/generation/engine.py) keeps, per sequence and layer, the KV cache of the
current segment only, sigma(K) of that segment, and ``M``, ``z``: memory bounded by the
segment, not by the context. Its cache views hand this module an :class:`InfiniCache`; a
segment is folded into the memory as soon as its last token has been processed.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6
GATES = ("hard_sigmoid", "sigmoid", "tanh")


def sigma(x: torch.Tensor) -> torch.Tensor:
    """ELU + 1: the positive feature map of the memory's keys and queries."""
    return F.elu(x) + 1.0


def gate_value(beta: torch.Tensor, kind: str) -> torch.Tensor:
    """The gate g in [0, 1] of each head for ``beta`` (module docstring)."""
    if kind == "hard_sigmoid":
        return (0.2 * beta + 0.5).clamp(0.0, 1.0)
    if kind == "sigmoid":
        return torch.sigmoid(beta)
    if kind == "tanh":
        return (1.0 + torch.tanh(beta)) / 2.0
    raise ValueError(f"unknown infini gate {kind!r} (one of {', '.join(GATES)})")


class Memory(NamedTuple):
    M: torch.Tensor        # (B, n_kv_heads, head_dim, head_dim) float32
    z: torch.Tensor        # (B, n_kv_heads, head_dim) float32


def empty_memory(B: int, n_kv_heads: int, head_dim: int, device) -> Memory:
    return Memory(torch.zeros(B, n_kv_heads, head_dim, head_dim, device=device),
                  torch.zeros(B, n_kv_heads, head_dim, device=device))


def retrieve(sq: torch.Tensor, mem: Memory) -> torch.Tensor:
    """sigma(Q) M / max(sigma(Q) z, EPS): (B, Hkv, N, hd) features -> (B, Hkv, N, hd)."""
    return (sq @ mem.M) / (sq @ mem.z.unsqueeze(-1)).clamp_min(EPS)


def update(mem: Memory, sk: torch.Tensor, v: torch.Tensor, delta: bool) -> Memory:
    """The memory after one segment: ``sk`` = sigma(K), ``v`` = V, both (B, Hkv, S, hd) fp32."""
    if delta:
        v = v - retrieve(sk, mem)
    return Memory(mem.M + sk.transpose(-1, -2) @ v, mem.z + sk.sum(dim=-2))


class InfiniCache(NamedTuple):
    """What generation keeps for one layer, as views over the rows of one call (one prompt's
    slot, or the running rows of a decode step): the new tokens sit at segment positions
    ``pos[r] .. pos[r] + T - 1`` of row r."""
    sk: torch.Tensor       # (R, Hkv, S, hd) sigma(K) of the current segment (weights' dtype)
    v: torch.Tensor        # (R, Hkv, S, hd) its values: the layer's KV cache
    M: torch.Tensor        # (R, Hkv, hd, hd) float32
    z: torch.Tensor        # (R, Hkv, hd) float32
    pos: torch.Tensor      # (R,) segment position of each row's first new token


class InfiniMemory(nn.Module):
    """The compressive memory and gate of one attention layer (module docstring)."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, segment: int,
                 gate: str = "hard_sigmoid", delta_rule: bool = True):
        super().__init__()
        if gate not in GATES:
            raise ValueError(f"unknown infini gate {gate!r} (one of {', '.join(GATES)})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.segment, self.gate_kind, self.delta_rule = segment, gate, delta_rule
        self.beta = nn.Parameter(torch.zeros(n_heads))       # zero init (model.reset_parameters)

    def gate(self) -> torch.Tensor:
        """(n_heads,) the current mixing weights g of the memory."""
        return gate_value(self.beta, self.gate_kind)

    def forward(self, y: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: Optional[InfiniCache] = None) -> torch.Tensor:
        """Mix the memory into the local attention output ``y`` (B, T, H, hd); ``q`` (B, T, H,
        hd), ``k``, ``v`` (B, T, Hkv, hd) are the layer's projections before RoPE. Without a
        cache the T tokens are a whole sequence (segments from an empty memory); with one,
        they continue the cached rows (generation, T <= segment)."""
        B, T, H, hd = q.shape
        with torch.autocast(q.device.type, enabled=False):
            sq, sk, vf = sigma(q.float()), sigma(k.float()), v.float()
            if cache is None:
                a = self._sequence(sq, sk, vf)                              # (B, T, H, hd)
            else:
                a = self._continue(sq, sk, cache)
        g = self.gate().to(y.dtype).view(H, 1)                              # (H, 1)
        return g * a.to(y.dtype) + (1 - g) * y

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, hd) -> (B, Hkv, G*T, hd): the query heads of each KV head together."""
        B, T, H, hd = x.shape
        G = H // self.n_kv_heads
        return x.permute(0, 2, 1, 3).reshape(B, self.n_kv_heads, G * T, hd)

    def _ungrouped(self, a: torch.Tensor, T: int) -> torch.Tensor:
        """(B, Hkv, G*T, hd) -> (B, T, H, hd)."""
        B = a.shape[0]
        return a.reshape(B, self.n_heads, T, self.head_dim).permute(0, 2, 1, 3)

    def _sequence(self, sq, sk, v) -> torch.Tensor:
        """Retrieval for every segment of whole sequences: the memory before each segment (a
        scan over segments), then one batched retrieval. A last partial segment is fine."""
        B, T, H, hd = sq.shape
        S = self.segment
        n = -(-T // S)
        mem = empty_memory(B, self.n_kv_heads, hd, sq.device)
        states = [mem]
        for j in range(n - 1):                                              # memory before segment j+1
            kj = sk[:, j * S:(j + 1) * S].transpose(1, 2)                   # (B, Hkv, S, hd)
            vj = v[:, j * S:(j + 1) * S].transpose(1, 2)
            mem = update(mem, kj, vj, self.delta_rule)
            states.append(mem)
        out = []
        for j, m in enumerate(states):
            qj = sq[:, j * S:(j + 1) * S]                                   # (B, Sj, H, hd)
            out.append(self._ungrouped(retrieve(self._grouped(qj), m), qj.shape[1]))
        return torch.cat(out, dim=1)                                        # (B, T, H, hd)

    def _continue(self, sq, sk, c: InfiniCache) -> torch.Tensor:
        """Retrieval for T new tokens of each cached row; their sigma(K) join the segment's;
        rows whose segment is now complete fold it into their memory."""
        R, T = sq.shape[:2]
        a = self._ungrouped(retrieve(self._grouped(sq), Memory(c.M, c.z)), T)   # (R, T, H, hd)
        at = c.pos[:, None] + torch.arange(T, device=c.pos.device)          # (R, T) positions
        rows = torch.arange(R, device=c.pos.device)[:, None]
        c.sk[rows, :, at] = sk.to(c.sk.dtype)                               # (R, T, Hkv, hd) in
        full = (c.pos + T == self.segment).nonzero().squeeze(1)
        if full.numel():
            mem = update(Memory(c.M[full], c.z[full]), c.sk[full].float(), c.v[full].float(),
                         self.delta_rule)
            c.M[full], c.z[full] = mem.M, mem.z
        return a


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The gate parameters of every infini layer of ``model`` (found by role), in order."""
    return [m.beta for m in model.modules() if isinstance(m, InfiniMemory)]


def gate_values(model: nn.Module) -> list[list[float]]:
    """g per head of each infini layer, as plain floats (for reports)."""
    with torch.no_grad():
        return [m.gate().float().cpu().tolist() for m in model.modules() if isinstance(m, InfiniMemory)]
