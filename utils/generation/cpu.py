"""The CPU products and picks of generation steps, each chosen by measurement (library; no side
effects; the measurements: docs/performance.md, Generation): which kernel multiplies a few
rows by a large matrix, and how the greedy token is found. Everything here computes the same
numbers as the plain PyTorch call it replaces, up to the order of float sums (so to rounding)
or exactly where said.

- :func:`panels` / :func:`panel_mm`: ``x @ w`` for a few rows with ``w`` (in, out) stored as P
  column panels (P, in, out / P). MKL runs a product of one or a few rows on one thread
  whatever its thread count, and such a product is memory-bound: one core streams the weights
  more slowly than several do. A batched product over P panels spreads them across threads.
  With P = 1 it is the plain product (panels cost time on one thread).
- :class:`BlasProduct`: :func:`panel_mm` through NumPy's BLAS (OpenBLAS in NumPy's wheels)
  when the step runs on one thread. There, on AMD CPUs, MKL (inside PyTorch's CPU wheels)
  multiplies a row by an fp32 matrix well below what OpenBLAS reaches on the same bytes; on
  others MKL may be the faster. :func:`fastest` picks between the two by timing them on the
  weights themselves (utils/generation/pack.py).
- :func:`greedy`: the argmax of each row of the logits. ``torch.argmax`` over a 32k-49k
  vocabulary is a scalar loop on CPU; NumPy's is vectorized, several times faster, and gives
  the same index (the first maximum; NaN counts as the maximum in both).
- :class:`RowsProduct`: ``x @ w`` for 2 or more rows by a oneDNN-packed copy of ``w``
  (``torch.ops.mkldnn._linear_pointwise``, the op PyTorch's own compiler emits for CPU
  linears). MKL's fp32 GEMM with a few rows and a wide output runs at a fraction of the
  machine's speed on AMD CPUs, where MKL does not take its AVX-512 paths; oneDNN's packed
  product does not have that gap. One row stays with MKL's transposed product, which is the
  faster of the two for a single row. The packed copy holds the matrix's bytes once more.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from utils.generation.threads import step_mode


def panels(wt: torch.Tensor, p: int) -> torch.Tensor:
    """(in, out) -> (p, in, out / p) contiguous column panels; ``wt`` itself when p < 2 or p
    does not divide out."""
    n_in, n_out = wt.shape
    if p < 2 or n_out % p:
        return wt
    return wt.reshape(n_in, p, n_out // p).permute(1, 0, 2).contiguous()


def panel_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for x (n, in) and ``w`` from :func:`panels` (2-D: the plain product) -> (n, out)."""
    if w.dim() == 2:
        return torch.mm(x, w)
    return torch.matmul(x, w).transpose(0, 1).reshape(x.shape[0], -1)      # (p, n, out/p) -> (n, out)


def greedy(logits: torch.Tensor) -> list[int]:
    """(B, V) logits -> each row's argmax (the first maximum) as Python ints."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def onednn_linear_available() -> bool:
    """Whether this PyTorch build can run :class:`RowsProduct` (oneDNN on CPU)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class RowsProduct:
    """``x @ w.T`` for x (n, in) with n >= 2 and w (out, in) fp32 on CPU (a Linear's weight),
    by a oneDNN-packed copy of ``w`` (see the module docstring); ``bytes`` is what the copy
    holds."""

    def __init__(self, w: torch.Tensor, rows_hint: int = 8):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)
        self.bytes = w.numel() * w.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def rows_product(w: torch.Tensor) -> Optional[RowsProduct]:
    """A :class:`RowsProduct` of ``w`` (out, in) where oneDNN is available, else None (MKL's
    product then serves every row count)."""
    return RowsProduct(w) if onednn_linear_available() else None


class BlasProduct:
    """:func:`panel_mm`, but through NumPy's BLAS (OpenBLAS in NumPy's wheels) when the step
    runs on one thread: x (n, in) by ``w`` from :func:`panels`. On one thread OpenBLAS
    multiplies a row by an fp32 matrix faster than MKL on some CPUs (AMD's: MKL does not take
    its best paths there), and a decode step runs on one thread under load or for a small
    model (utils/generation/threads.py). On several threads the product stays torch's:
    OpenBLAS's own thread pool, spinning beside torch's, slows a step down many times over. So
    NumPy's BLAS is set to one thread for the process when this is made (threadpoolctl; it
    serves nothing else of ours)."""

    def __init__(self):
        # imported here, not with the module: threadpoolctl's import sets KMP_DUPLICATE_LIB_OK in
        # the process's environment, which importing a library module must not do
        from threadpoolctl import ThreadpoolController
        blas = ThreadpoolController().select(user_api="blas")
        self.available = bool(blas.lib_controllers)
        if self.available:
            blas.limit(limits=1)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if torch.get_num_threads() != 1:
            return panel_mm(x, w)
        y = torch.from_numpy(np.matmul(x.numpy(), w.numpy()))           # (n, out) or (p, n, out/p)
        return y if w.dim() == 2 else y.transpose(0, 1).reshape(x.shape[0], -1)


def fastest(products: dict, threads: int, repeats: int = 3):
    """The key of ``products`` (key -> a call of no argument, one product each) that runs
    fastest on ``threads`` threads: the best of ``repeats`` interleaved calls each, after one
    warm-up round (a large matrix, such as a head, is read from memory every time, as in a
    decode step)."""
    best = dict.fromkeys(products, float("inf"))
    with step_mode(threads):
        for _ in range(repeats + 1):
            for k, call in products.items():
                t0 = time.perf_counter()
                call()
                best[k] = min(best[k], time.perf_counter() - t0)
    return min(best, key=best.get)
