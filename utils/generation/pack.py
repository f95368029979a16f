"""The weights generation steps multiply by on CPU (library; no side effects): the decode
pack, a transposed, contiguous copy of an fp32 model's weights, or an int8 model's fused int8
weights (no copy). The engine (utils/generation/engine.py) holds one per model and asks
:func:`pack_key` whether the one it holds is still current.

Why a copy: ``nn.Linear`` on one or a few rows computes each output as a dot product over the
input features, which BLAS runs far below memory bandwidth on CPU; ``x @ Wt`` with a
contiguous (in, out) copy streams over the outputs with full vector FMAs, and the
query/key/value and gate/up projections each become one product (the gain:
perf/generate_throughput.py, docs/performance.md). Where a one-token step runs on several
threads (utils/generation/threads.py ``pack_panels``), each matrix is stored as that many
column panels, so a product of a few rows uses every thread; a step on one thread multiplies
through NumPy's BLAS where that is the faster (AMD CPUs, where MKL runs below OpenBLAS:
``build_pack``'s ``product``); the head is also packed by oneDNN
for steps of 2 or more rows (``RowsProduct``: MKL's product of a few rows by a wide matrix is
slow on some CPUs). Both in utils/generation/cpu.py.

Cost: a second copy of the weights (and a third of the head) while the engine holds it, so
models above ``DECODE_PACK_MAX_BYTES`` of weights are not packed. Sums run in another order,
so logits can differ from the Linear's in the last bits. Not on CUDA (its GEMV has no such
gap) nor for bf16/fp16 weights (slower transposed on CPU), nor for a model training a LoRA
adapter (utils/lora.py: its projections are W x + B A x, which the copy of W would not hold).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from utils import lora
from utils.generation.cpu import BlasProduct, RowsProduct, fastest, panel_mm, panels, rows_product
from utils.quant import int8_decode_weights, int8_mm

DECODE_PACK_MAX_BYTES = 1 << 30   # models with more weights generate without a transposed copy
INT8 = ("int8",)                  # the key of an int8 model's pack: its weights are the pack


def decode_pack_applies(device_type: str, dtype: torch.dtype, weight_bytes: float) -> bool:
    """Whether generation keeps a transposed copy of the weights: fp32 weights on CPU, at most
    DECODE_PACK_MAX_BYTES of them."""
    return device_type == "cpu" and dtype == torch.float32 and weight_bytes <= DECODE_PACK_MAX_BYTES


class PackedLayer(NamedTuple):
    """One block's weights for CPU decoding and their product ``mm(x, w)`` (x (B, in)):
    transposed to (in, out) and contiguous with ``torch.mm``, or an int8 model's
    ``utils.quant.Int8Weight`` with ``utils.quant.int8_mm``."""
    qkv: torch.Tensor      # (d_model, (n_heads + 2 n_kv_heads) * head_dim): wq | wk | wv
    wo: torch.Tensor       # (n_heads * head_dim, d_model)
    gate_up: torch.Tensor  # (d_model, 2 hidden): w_gate | w_up
    down: torch.Tensor     # (hidden, d_model)
    mm: Callable = torch.mm


class DecodePack(NamedTuple):
    """The weights generation steps multiply by on CPU; ``key`` is :func:`pack_key`'s at build."""
    key: tuple
    layers: list
    head: torch.Tensor     # (d_model, vocab), multiplied by ``mm``
    head_rows: Optional[RowsProduct] = None   # the head for 2 or more rows (utils/generation/cpu.py)
    mm: Callable = torch.mm


def pack_key(model) -> Optional[tuple]:
    """What a pack of ``model``'s weights is valid for: ``INT8`` for an int8 model
    (utils/quant.py), each parameter's (storage, ``_version``) for fp32 weights on CPU (an
    optimizer step or ``load_state_dict`` changes it), None where no pack applies."""
    if getattr(model, "quantized", None):
        return INT8
    if lora.settings_of(model) is not None:    # an unmerged adapter: a copy of the weights would drop it
        return None
    w = model.lm_head.weight
    params = list(model.parameters())
    if not decode_pack_applies(w.device.type, w.dtype, sum(p.numel() * p.element_size() for p in params)):
        return None
    return tuple((p.data_ptr(), p._version) for p in params)


def build_pack(model, key: tuple, n_panels: int, product: str = "auto") -> Optional[DecodePack]:
    """The pack of ``model`` for ``key`` (from :func:`pack_key`): an int8 model's fused int8
    weights (None when it has none), else the fp32 weights transposed, in ``n_panels`` column
    panels (utils/generation/cpu.py ``panels``), multiplied by ``product``: "torch"
    (``panel_mm``), "blas" (``BlasProduct``: NumPy's BLAS on steps of one thread), or "auto":
    whichever multiplies a row by the head faster on one thread (``fastest``); with a oneDNN
    copy of the head for steps of 2 or more rows where available."""
    if key == INT8:
        got = int8_decode_weights(model)
        return got and DecodePack(INT8, [PackedLayer(*w, mm=int8_mm) for w in got[0]], got[1], mm=int8_mm)
    t = lambda *ws: panels(torch.cat([x.detach() for x in ws]).t().contiguous(), n_panels)  # noqa: E731
    w = model.lm_head.weight
    head = t(w)
    mm = _product(head, product)
    layers = [PackedLayer(t(b.attn.wq.weight, b.attn.wk.weight, b.attn.wv.weight), t(b.attn.wo.weight),
                          t(b.mlp.w_gate.weight, b.mlp.w_up.weight), t(b.mlp.w_down.weight), mm)
              for b in model.layers]
    return DecodePack(key, layers, head, rows_product(w), mm)


def _product(head: torch.Tensor, product: str) -> Callable:
    """The product of an fp32 pack (see :func:`build_pack`); ``head``: its paneled head."""
    if product == "torch":
        return panel_mm
    blas = BlasProduct()
    if not blas.available:
        if product == "blas":
            raise ValueError("product 'blas': NumPy has no BLAS library threadpoolctl can steer")
        return panel_mm
    if product == "auto":
        row = torch.ones(1, head.shape[-2])
        product = fastest({"torch": lambda: panel_mm(row, head), "blas": lambda: blas(row, head)}, 1)
    return blas if product == "blas" else panel_mm


def traceable(pack: DecodePack) -> DecodePack:
    """``pack`` with torch's products wherever it multiplies through NumPy's BLAS, for the
    compiled step: dynamo would break its graph at each NumPy call and thread check (121 a
    token), where torch's product is one traced op that inductor picks a kernel for."""
    if not isinstance(pack.mm, BlasProduct):
        return pack
    return pack._replace(layers=[p._replace(mm=panel_mm) for p in pack.layers], mm=panel_mm)


def pack_head(pack: DecodePack, onednn: bool = True):
    """The output projection over ``pack``, x (n, d_model) -> (n, vocab): its oneDNN copy for 2
    or more rows, where it has one and ``onednn`` (the compiled step leaves it out: dynamo
    cannot trace an op over a oneDNN-packed tensor, and inductor picks the product itself)."""
    mm, w, rows = pack.mm, pack.head, pack.head_rows if onednn else None
    if rows is None:
        return lambda x: mm(x, w)
    return lambda x: mm(x, w) if x.shape[0] == 1 else rows(x)


def estimated_weight_bytes(checkpoint_bytes: float, device_type: str) -> float:
    """Memory a checkpoint's model takes to generate: its fp32 weights (about a third of a
    training checkpoint, which also holds AdamW's two moments), 2.5 times that where the
    engine keeps a transposed copy and a second copy of the head (``decode_pack_applies``;
    the head is up to half the weights of a small model with a 32k vocabulary)."""
    weights = checkpoint_bytes / 3
    if decode_pack_applies(device_type, torch.float32, weights):
        weights *= 2.5
    return weights
