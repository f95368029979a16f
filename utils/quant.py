"""Weight-only int8 for generation (``--quantize int8`` of serve, infer and benchmark; library,
no side effects).

``quantize_int8(model)`` replaces every ``nn.Linear`` of the blocks and the output head by an
:class:`Int8Linear`: symmetric per-output-channel int8 weights (scale = max |w| / 127 of the
row) and the scales in the activations' dtype; activations stay in floating point. On CPU the
product is ``torch._weight_int8pack_mm`` (PyTorch's int8 weight-only kernel, the one torchao's
int8 weight-only config also uses on CPU); on CUDA torchao's ``Int8WeightOnlyConfig`` is used
when torchao is importable, else the same module dequantizes row blocks on the fly. The
embedding table stays in its dtype (a lookup reads one row per token).

Cost and effect (docs/serve.md measures them): the linear weights take a quarter of their fp32
bytes; the logits move by the rounding of each weight (at most half a scale step), which
``perf/quant_quality.py`` reports as the held-out perplexity difference against fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """``y = x @ (q * scale)^T`` with int8 ``q`` (out, in) and fp ``scale`` (out,); no bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear takes bias-free Linear layers (the Llama blocks have none)")
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)               # (out,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales.to(x.dtype))
        else:
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y.view(*shape, self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


@dataclass
class QuantReport:
    how: str
    layers: int
    bytes_before: int
    bytes_after: int

    def line(self) -> str:
        mb = lambda b: f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
        return (f"int8 weights ({self.how}): {self.layers} linear layers, {mb(self.bytes_before)} -> "
                f"{mb(self.bytes_after)} ({1 - self.bytes_after / max(self.bytes_before, 1):.0%} "
                "less for those layers)")


def _linears(model: nn.Module):
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (name.startswith("layers.") or name == "lm_head"):
            yield name, mod


def quantize_int8(model: nn.Module) -> QuantReport:
    """Quantize ``model``'s block and head linears in place (see the module docstring)."""
    targets = list(_linears(model))
    before = sum(m.weight.numel() * m.weight.element_size() for _, m in targets)
    if model.lm_head.weight is model.tok_embeddings.weight:
        before -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()  # shared
    device = next(model.parameters()).device
    how = "per-channel, torch._weight_int8pack_mm on CPU"
    if device.type == "cuda":
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError:
            how = "per-channel, dequantized per product (torchao is not installed)"
        else:
            quantize_(model, Int8WeightOnlyConfig())
            model.quantized = "int8"
            return QuantReport("torchao Int8WeightOnlyConfig", len(targets), before, before // 4)
    after = 0
    for name, mod in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        q = Int8Linear(mod)
        setattr(parent, name.rsplit(".", 1)[-1], q)
        after += q.qweight.numel() + q.scales.numel() * q.scales.element_size()
    model.quantized = "int8"
    return QuantReport(how, len(targets), before, after)
