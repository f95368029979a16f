"""Attention backends and masks: which kernel a forward call uses, and how documents in a
packed window are kept apart (library; no side effects; flash-attn, an optional package, is
imported on first use, and flex attention compiled then, once).

- ``forward_spec(idx, weight_dtype, document_mask, bos_id) -> (positions or None, AttnSpec)``:
  the rule ``Transformer.forward`` applies, per call. flash-attn (``flash_attn_func``;
  ``varlen`` over document boundaries) when importable, on CUDA, in fp16/bf16; else a compiled
  flex-attention block mask for document masks on CUDA; else PyTorch SDPA (``is_causal`` for
  plain windows, a boolean block-diagonal causal mask for document masks). With document
  masks, positions restart at each BOS (RoPE sees each document from 0).
- Infini-attention's local attention (``segment``: model.segment_length) is the same block
  structure with blocks of fixed length: causal within each segment of the window, positions
  restarting at each segment (:func:`segment_spec`); the compressive memory across segments
  is utils/infini.py.
- ``attention_path(...)``: that rule as one line for people, with why the faster kernels are
  not used (the trainer prints it at start).
- ``AttnSpec``: what every layer of one call needs to attend.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def flash_backend() -> tuple[Optional[tuple], str]:
    """(flash_attn's (func, varlen_func) or None, why not), imported once on first use."""
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func     # optional (requirements-gpu.txt)
        return (flash_attn_func, flash_attn_varlen_func), ""
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or built for another torch/CUDA
        return None, f"{type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def flex_backend() -> tuple[Optional[tuple], str]:
    """((compiled flex_attention, create_block_mask) or None, why not), made once on first use."""
    try:
        return (torch.compile(flex_attention, dynamic=False), create_block_mask), ""
    except (ImportError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"


def flash_attn() -> Optional[tuple]:
    return flash_backend()[0]


def flex_attn() -> Optional[tuple]:
    return flex_backend()[0]


@dataclass
class AttnSpec:
    """How every layer of one forward call attends (computed once per call).

    kind: "causal" (SDPA is_causal), "full" (SDPA, no mask: one new token over the cache),
    "mask" (SDPA with boolean ``mask`` (B, 1, Tq, Tk), True = attend), "flash", "varlen"
    (flash-attn over ``cu_seqlens``), "flex" (flex-attention ``block_mask``).
    """
    kind: str = "causal"
    mask: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: int = 0
    block_mask: Any = None


def forward_spec(idx: torch.Tensor, weight_dtype: torch.dtype, document_mask: bool,
                 bos_id: Optional[int], segment: Optional[int] = None
                 ) -> tuple[Optional[torch.Tensor], AttnSpec]:
    """(positions (B, T) or None, AttnSpec) for a training/eval forward over ``idx`` (B, T);
    ``segment``: Infini-attention's segment length (attention within segments)."""
    half = idx.is_cuda and (torch.is_autocast_enabled("cuda") or weight_dtype in HALF)
    if segment is not None:
        return segment_spec(idx, segment, half)
    if document_mask:
        return document_spec(idx, bos_id, half)
    if half and flash_attn():
        return None, AttnSpec("flash")
    return None, AttnSpec("causal")


def document_spec(idx: torch.Tensor, bos_id: Optional[int], half: bool
                  ) -> tuple[Optional[torch.Tensor], AttnSpec]:
    """Positions (B, T) restarting at each BOS and the attention that keeps each token inside
    its document; (None, causal) when no row holds a second document."""
    B, T = idx.shape
    is_bos = idx == bos_id
    if T < 2 or not bool(is_bos[:, 1:].any()):
        return None, AttnSpec("causal")
    start = is_bos.clone()
    start[:, 0] = True
    return block_spec(start, half)


def segment_spec(idx: torch.Tensor, segment: int, half: bool
                 ) -> tuple[Optional[torch.Tensor], AttnSpec]:
    """Positions (B, T) restarting every ``segment`` tokens and attention causal within each
    segment (Infini-attention's local attention); (None, causal, or flash) for one segment."""
    B, T = idx.shape
    if T <= segment:
        return None, AttnSpec("flash" if half and flash_attn() else "causal")
    start = (torch.arange(T, device=idx.device) % segment == 0).expand(B, T)
    return block_spec(start, half)


def block_spec(start: torch.Tensor, half: bool) -> tuple[torch.Tensor, AttnSpec]:
    """Positions (B, T) restarting where ``start`` (B, T) is True (column 0 always is) and the
    attention that keeps each token causal inside its block (documents, or segments)."""
    B, T = start.shape
    ar = torch.arange(T, device=start.device)
    last_start = torch.where(start, ar, 0).cummax(dim=1).values
    positions = ar - last_start                                          # (B, T)
    doc = start.cumsum(dim=1)                                            # (B, T) document ids
    if half and flash_attn():
        starts = (start.reshape(-1)).nonzero().squeeze(1).to(torch.int32)
        cu = torch.cat([starts, torch.tensor([B * T], dtype=torch.int32, device=start.device)])
        return positions, AttnSpec("varlen", cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))
    if start.is_cuda and flex_attn():
        create_block_mask = flex_attn()[1]

        def mask_mod(b, h, q, k):
            return (k <= q) & (doc[b, q] == doc[b, k])
        return positions, AttnSpec("flex", block_mask=create_block_mask(mask_mod, B, None, T, T,
                                                                         device=start.device))
    causal = torch.ones(T, T, dtype=torch.bool, device=start.device).tril()
    mask = causal & (doc[:, :, None] == doc[:, None, :])                 # (B, T, T)
    return positions, AttnSpec("mask", mask=mask[:, None])


def attention_path(document_mask: bool, weight_dtype: torch.dtype, device_type: str,
                   dtype: torch.dtype, segmented: bool = False) -> str:
    """Which attention kernel training runs with on ``device_type`` under autocast ``dtype``
    (the rule ``forward_spec`` applies), and why the faster ones are not used, in one line.
    ``segmented``: Infini-attention's local attention (blocks are segments)."""
    half = dtype in HALF or weight_dtype in HALF
    doc = document_mask or segmented
    blocks = "segments" if segmented else "document masks"
    cuda = device_type == "cuda"
    if cuda and half and flash_attn():
        return "flash-attn" + (f" varlen ({blocks})" if doc else "")
    why = []
    if not cuda:
        why.append(f"flash-attn and flex attention run on CUDA only, this is {device_type}")
    elif not half:
        why.append("flash-attn needs fp16/bf16, this run is fp32")
    elif not flash_attn():
        why.append(f"flash-attn is not importable ({flash_backend()[1]})")
    if doc and cuda:
        if flex_attn():
            return (f"flex attention with a {'segment' if segmented else 'document'} block mask ("
                    + "; ".join(why) + ")")
        why.append(f"flex attention is unavailable ({flex_backend()[1]})")
    kind = f"a block-diagonal causal mask ({blocks})" if doc else "is_causal"
    return f"PyTorch SDPA with {kind} (" + "; ".join(why) + ")"
