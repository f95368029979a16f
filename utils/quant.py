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
activations rounded to bf16: its fp32 variant is a scalar loop, an order of magnitude slower
than the bf16 one, while bf16 rounding of the activations and outputs (2^-9 relative, random
from value to value) is below the weights' own int8 rounding. The kernel takes its scales in
the activations' dtype, and a scale rounded to bf16 is a systematic error of its whole output
channel (a bias, which shows in the perplexity, unlike random rounding), so the kernel gets
unit scales (``Int8Weight.unit``) and the fp32 scales multiply its bf16 output, the same
one operation as casting it back. Each row of a batch is computed on its own, so a row's
result does not depend on the others (the engine's exactness). That kernel's time grows with
the rows: a prompt's prefill and benchmark's batches (the modules' ``forward``,
:func:`int8_matmul`) of ``MANY_ROWS`` rows or more instead widen each weight matrix to bf16
for its product (int8 values are exact in bf16) and make one bf16 GEMM, the per-row scales
applied to its output, which from that many rows on is faster than the row-by-row kernel
(docs/performance.md, int8 weights; the widened copy is transient: one matrix's at a time,
3.5 MB for SmolLM2's largest block matrix, 57 MB for its head). Decode steps always
use the row-by-row kernel, so a row's tokens never depend on how many rows share its step.
On CUDA torchao's ``Int8WeightOnlyConfig`` is used when torchao is importable, else the
same modules dequantize per product.

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

MANY_ROWS = 16      # int8_matmul: from this many rows on, a bf16 GEMM over the widened weights


class Int8Weight(NamedTuple):
    """int8 rows (out, in) with per-row scales: the product by ``x`` is
    ``x @ (qweight * scales)^T`` (:func:`int8_mm`)."""
    qweight: torch.Tensor       # (out, in) int8
    scales: torch.Tensor        # (out,) fp32
    unit: torch.Tensor          # (out,) bf16 ones: the CPU kernel's scales (see int8_mm)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)               # (out,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
        return cls(q, scale, torch.ones_like(scale, dtype=torch.bfloat16))

    def rows(self, start: int, stop: int) -> "Int8Weight":
        """Rows start..stop-1 as views (no copy)."""
        return Int8Weight(*(t[start:stop] for t in self))


def int8_mm(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """``x @ (w.qweight * w.scales)^T`` in ``x``'s dtype for x (B, in) -> (B, out), in as few
    operations as it takes (also the product of generation's decode steps, ``PackedLayer.mm``:
    four of them per block per token)."""
    if x.device.type == "cpu":
        xb = x.to(torch.bfloat16, memory_format=torch.contiguous_format)    # the kernel's rows
        y = torch._weight_int8pack_mm(xb, w.qweight, w.unit).mul(w.scales)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    return F.linear(x, w.qweight.to(x.dtype)) * w.scales.to(x.dtype)


def int8_matmul(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x (..., in) -> (..., out) for the modules' ``forward`` (a prompt's prefill, benchmark's
    batches): :func:`int8_mm`, except on CPU for ``MANY_ROWS`` rows or more, where the weights
    are widened to bf16 for this product and multiplied by one bf16 GEMM, scales after (see the
    module docstring)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and x2.shape[0] >= MANY_ROWS:
        y = torch.mm(x2.to(torch.bfloat16), w.qweight.t().to(torch.bfloat16)).to(x.dtype).mul_(w.scales)
    else:
        y = int8_mm(x2, w)
    return y.view(*x.shape[:-1], w.qweight.shape[0])


class Int8Linear(nn.Module):
    """A bias-free Linear with :class:`Int8Weight` weights (its buffers may be row views of a
    fused matrix, see the module docstring)."""

    def __init__(self, w: Int8Weight):
        super().__init__()
        self.out_features, self.in_features = w.qweight.shape
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("scales", w.scales)
        self.register_buffer("unit", w.unit, persistent=False)

    @property
    def weight8(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scales, self.unit)

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
    how = ("per-channel, fp32 scales; on CPU torch._weight_int8pack_mm on bf16 activations, "
           f"a bf16 GEMM over the widened weights from {MANY_ROWS} rows on (prefill)")
    if device.type == "cuda":
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_   # optional (CUDA only)
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
    size = lambda mod: sum(b.numel() * b.element_size() for b in (mod.qweight, mod.scales, mod.unit))  # noqa: E731
    after = sum(size(mod) for mod in model.modules() if isinstance(mod, Int8Linear))
    head = size(model.lm_head) if tied else 0
    model.quantized = "int8"
    return QuantReport(how, len(targets), before, after - head, head)


def int8_decode_weights(model: nn.Module) -> Optional[tuple[list[tuple], Int8Weight]]:
    """For a model :func:`quantize_int8` made on CPU (or on CUDA without torchao): each block's
    (qkv, wo, gate_up, down) :class:`Int8Weight` (the decode pack's ``PackedLayer`` fields,
    utils/generation/pack.py) and the head's; None for any other model."""
    if not isinstance(getattr(model, "lm_head", None), Int8Linear):
        return None
    return [b.int8_decode for b in model.layers], model.lm_head.weight8
