"""Gated feed-forward activations (SwiGLU, GeGLU, ReGLU) and the Llama hidden-size rule.

A gated MLP has three bias-free matrices: ``down(act(gate(x)) * up(x))`` (Shazeer 2020,
"GLU Variants Improve Transformer"). The gate nonlinearity picks the variant:

| name   | gate act            | Hugging Face ``hidden_act`` |
| ------ | ------------------- | --------------------------- |
| swiglu | SiLU (Swish, beta=1) | "silu"  (Llama)            |
| geglu  | GELU (exact erf)    | "gelu"                      |
| reglu  | ReLU                | "relu"                      |

Because LlamaForCausalLM's MLP is exactly ``down_proj(act(gate_proj(x)) * up_proj(x))``
with ``ACT2FN[hidden_act]``, all three variants map onto it one-to-one.

The hidden size follows Llama: 2/3 of 4*d_model (so the three matrices cost what a 4x
two-matrix MLP costs), rounded up to a multiple of 64 or 256 for GPU-friendly shapes.
No side effects on import.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.config import llama_ffn_hidden

__all__ = ["GATE_ACTIVATIONS", "HF_ACT_NAMES", "gate_activation", "GatedMLP", "llama_ffn_hidden"]

GATE_ACTIVATIONS = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}
HF_ACT_NAMES = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


def gate_activation(name: str):
    """The gate nonlinearity of a gated MLP variant (``swiglu`` | ``geglu`` | ``reglu``)."""
    try:
        return GATE_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(GATE_ACTIVATIONS)}")


class GatedMLP(nn.Module):
    """``w_down(act(w_gate(x)) * w_up(x))``, no biases; dropout on the output."""

    def __init__(self, d_model: int, hidden: int, activation: str = "swiglu", dropout: float = 0.0):
        super().__init__()
        self.act = gate_activation(activation)
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_model) -> (B, T, d_model)
        return self.dropout(self.w_down(self.act(self.w_gate(x)) * self.w_up(x)))

    def packed(self, x: torch.Tensor, gate_up, down, mm=torch.mm) -> torch.Tensor:
        """The same function (no dropout: inference) for x (B, d_model) with fused weights and
        their product ``mm(x, w)``: ``gate_up`` = (w_gate | w_up) (d_model -> 2 hidden) and
        ``down`` = w_down (hidden -> d_model), e.g. transposed fp32 tensors with ``torch.mm``."""
        gate, up = mm(x, gate_up).chunk(2, dim=-1)
        return mm(self.act(gate) * up, down)
