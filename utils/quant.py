"""Weight-only int8 for generation (``--quantize int8`` of serve, infer and benchmark; library,
no side effects).

``quantize_int8(model)`` replaces every ``nn.Linear`` of the blocks and the output head by an
:class:`Int8Linear`: symmetric per-output-channel int8 weights (scale = max |w| / 127 of the
row); activations stay in floating point. The query/key/value projections of a block are
quantized as one (out, in) matrix, and so are the MLP's gate and up projections (per-row
scales: the same numbers as one by one); their Int8Linear modules hold row views of it, so
the engine's decode steps make one product per fused matrix (``int8_decode_weights``)
without a second copy. The embedding table stays in its dtype (a lookup reads one row per
token).

The product, :func:`int8_mm`: on CPU ``torch._weight_int8pack_mm`` (PyTorch's int8
weight-only kernel, the one torchao's int8 weight-only config also uses on CPU) with the
activations rounded to bf16 and the result cast back: its fp32 variant is a scalar loop,
10-20x slower than the bf16 one here (AVX-512 Zen 4: 1.9 ms against 0.11 ms for a 576 x 1536
product at batch 1), while bf16 rounding of the activations and outputs (2^-9 relative)
is below the weights' own int8 rounding. Each row of a batch is computed on its own, so a
row's result does not depend on the others (the engine's exactness). On CUDA torchao's
``Int8WeightOnlyConfig`` is used when torchao is importable, else the same modules
dequantize per product.

Cost and effect: the linear weights take a quarter of their fp32 bytes; the logits move by
the rounding of each weight (at most half a scale step) and of the activations, which
``perf/quant_quality.py`` reports as the held-out perplexity difference against fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn


class Int8Weight(NamedTuple):
    """int8 rows (out, in) with per-row scales: the product by ``x`` is
    ``x @ (qweight * scales)^T`` (:func:`int8_mm`)."""
    qweight: torch.Tensor       # (out, in) int8
    scales: torch.Tensor        # (out,) fp32
    scales_bf16: torch.Tensor   # (out,) the CPU kernel's copy

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)               # (out,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
        return cls(q, scale, scale.to(torch.bfloat16))

    def rows(self, start: int, stop: int) -> "Int8Weight":
        """Rows start..stop-1 as views (no copy)."""
        return Int8Weight(*(t[start:stop] for t in self))


def int8_mm(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """``x @ (w.qweight * w.scales)^T`` in ``x``'s dtype for x (B, in) -> (B, out), in as few
    operations as it takes (also the product of generation's decode steps, ``PackedLayer.mm``:
    four of them per block per token)."""
    if x.device.type == "cpu":
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), w.qweight, w.scales_bf16).to(x.dtype)
    return F.linear(x, w.qweight.to(x.dtype)) * w.scales.to(x.dtype)


def int8_matmul(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """:func:`int8_mm` for x (..., in) -> (..., out)."""
    return int8_mm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.qweight.shape[0])


class Int8Linear(nn.Module):
    """A bias-free Linear with :class:`Int8Weight` weights (its buffers may be row views of a
    fused matrix, see the module docstring)."""

    def __init__(self, w: Int8Weight):
        super().__init__()
        self.out_features, self.in_features = w.qweight.shape
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("scales", w.scales)
        self.register_buffer("scales_bf16", w.scales_bf16, persistent=False)

    @property
    def weight8(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scales, self.scales_bf16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.weight8)


@dataclass
class QuantReport:
    how: str
    layers: int
    bytes_before: int
    bytes_after: int
    head_copy: int = 0      # an output head tied to the embedding: its int8 copy (new memory)

    def line(self) -> str:
        mb = lambda b: f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
        head = (f"; plus a {mb(self.head_copy)} int8 copy of the output head, tied to the embedding "
                "table, which stays as it is" if self.head_copy else "")
        return (f"int8 weights ({self.how}): {self.layers} linear layers, {mb(self.bytes_before)} -> "
                f"{mb(self.bytes_after)} ({1 - self.bytes_after / max(self.bytes_before, 1):.0%} "
                f"less for those layers){head}")


def _linears(model: nn.Module):
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (name.startswith("layers.") or name == "lm_head"):
            yield name, mod


def _quantize_together(parts: list[tuple[nn.Module, str]]) -> Int8Weight:
    """Quantize the Linear layers ``getattr(owner, name)`` as one matrix (rows stacked) and
    put an Int8Linear over each one's rows in its place; returns the whole matrix."""
    linears = [getattr(owner, name) for owner, name in parts]
    if any(m.bias is not None for m in linears):
        raise ValueError("Int8Linear takes bias-free Linear layers (the Llama blocks have none)")
    w = Int8Weight.quantize(torch.cat([m.weight for m in linears]))
    start = 0
    for (owner, name), m in zip(parts, linears):
        setattr(owner, name, Int8Linear(w.rows(start, start + m.out_features)))
        start += m.out_features
    return w


def quantize_int8(model: nn.Module) -> QuantReport:
    """Quantize ``model``'s block and head linears in place, on the device they are on (see
    the module docstring)."""
    targets = list(_linears(model))
    before = sum(m.weight.numel() * m.weight.element_size() for _, m in targets)
    tied = model.lm_head.weight is model.tok_embeddings.weight
    if tied:                             # the embedding keeps the shared weights: not saved
        before -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    device = next(model.parameters()).device
    how = "per-channel, torch._weight_int8pack_mm with bf16 activations on CPU"
    if device.type == "cuda":
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError:
            how = "per-channel, dequantized per product (torchao is not installed)"
        else:
            quantize_(model, Int8WeightOnlyConfig())
            model.quantized = "int8"
            return QuantReport("torchao Int8WeightOnlyConfig", len(targets), before, before // 4)
    for block in model.layers:
        a, m = block.attn, block.mlp
        block.int8_decode = (_quantize_together([(a, "wq"), (a, "wk"), (a, "wv")]),
                             _quantize_together([(a, "wo")]),
                             _quantize_together([(m, "w_gate"), (m, "w_up")]),
                             _quantize_together([(m, "w_down")]))
    for name, mod in list(_linears(model)):          # any other Linear, one by one
        owner, attr = (model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]) \
            if "." in name else (model, name)
        _quantize_together([(owner, attr)])
    size = lambda mod: sum(b.numel() * b.element_size() for b in (mod.qweight, mod.scales, mod.scales_bf16))  # noqa: E731
    after = sum(size(mod) for mod in model.modules() if isinstance(mod, Int8Linear))
    head = size(model.lm_head) if tied else 0
    model.quantized = "int8"
    return QuantReport(how, len(targets), before, after - head, head)


def int8_decode_weights(model: nn.Module) -> Optional[tuple[list[tuple], Int8Weight]]:
    """For a model :func:`quantize_int8` made on CPU (or on CUDA without torchao): each block's
    (qkv, wo, gate_up, down) :class:`Int8Weight` (the engine's ``PackedLayer`` fields) and the
    head's; None for any other model."""
    if not isinstance(getattr(model, "lm_head", None), Int8Linear):
        return None
    return [b.int8_decode for b in model.layers], model.lm_head.weight8
