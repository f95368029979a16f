"""The language-model loss: the weighted mean cross-entropy of the next token, and its fused,
chunked form that never holds the (N, vocab) logits.

Contract (model.py's ``Transformer.forward``): targets equal to ``IGNORE_INDEX`` are not
counted; ``loss_mask`` (0/1 or fractional weights) weights each position; the loss is the
weighted mean over counted positions, 0 when none count. :func:`linear_cross_entropy` computes
the same sum as the output head followed by ``F.cross_entropy`` in row chunks, with each
chunk's gradient computed in the same pass (softmax - onehot): training pays no extra matmul
and neither the logits nor their fp32 copy are kept, which is where most of a small model's
step memory goes on a 32k vocabulary. Imports torch only; no side effects.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def loss_weights(targets: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-position weights (N,) fp32 of flat ``targets`` (N,), summing to 1 over counted
    positions (all 0 if none count)."""
    w = (targets != IGNORE_INDEX).float()
    if loss_mask is not None:
        w = w * loss_mask.reshape(-1).float()
    return w / w.sum().clamp_min(torch.finfo(torch.float32).tiny)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * CE(logits_i, y_i): logits (B, T, vocab) in fp32, targets (B, T), w (B*T,)
    from :func:`loss_weights`."""
    ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none")        # (B*T,)
    return (ce * w).sum()


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         w: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """sum_i w_i * CE(h_i @ weight^T, y_i) without the logits: h (N, d), weight (vocab, d),
    targets and w (N,); ``chunk_rows`` rows of logits exist at a time. Differentiable in h and
    weight (their gradients are computed in the forward pass when grad mode is on)."""
    return _ChunkedLinearCE.apply(h, weight, targets, w, chunk_rows, torch.is_grad_enabled())


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) over row chunks, with the gradients computed in the
    same pass (softmax - onehot, scaled by w_i): the full (N, vocab) logits never exist.

    ``grad`` is the caller's grad mode (``torch.is_grad_enabled()`` at the call): inside
    ``forward`` grad mode is always off and ``ctx.needs_input_grad`` only says which inputs
    require grad, which the head weight does under ``torch.no_grad()`` too. Without grad
    (evaluation, inference_mode) the loss alone is computed: no (vocab, d) gradient buffer,
    one matmul per chunk instead of three."""

    @staticmethod
    def forward(ctx, h, weight, targets, w, chunk: int, grad: bool):
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        need_h, need_w = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        with torch.autocast(h.device.type, enabled=False):
            hc_all = h.to(dtype)
            wc = weight.to(dtype)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(hc_all) if need_h else None
            new = torch.empty if h.shape[0] else torch.zeros                 # every row chunk writes
            grad_w = new(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
            safe_t = targets.clamp(min=0)
            for s in range(0, h.shape[0], chunk):
                hc = hc_all[s:s + chunk]
                logits = (hc @ wc.t()).float()                             # (n, V)
                t = safe_t[s:s + chunk, None]
                wt = w[s:s + chunk, None]
                tgt = logits.gather(1, t)
                mx = logits.amax(dim=-1, keepdim=True)
                p = logits.sub_(mx).exp_()                                 # in place: one (n, V) buffer
                z = p.sum(dim=-1, keepdim=True)
                loss += ((mx + z.log() - tgt) * wt).sum()                  # logsumexp - target logit
                if need_h or need_w:
                    g = p.mul_(wt / z)                                     # w * softmax
                    g.scatter_add_(1, t, -wt)                              # w * (softmax - onehot)
                    g = g.to(dtype)
                    if need_h:
                        torch.mm(g, wc, out=grad_h[s:s + chunk])
                    if need_w:                                             # the first chunk writes, the rest add
                        if dtype == torch.float32:
                            torch.mm(g.t(), hc, out=grad_w) if s == 0 else grad_w.addmm_(g.t(), hc)
                        elif s == 0:
                            grad_w.copy_(g.t() @ hc)
                        else:
                            grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved = list(ctx.saved_tensors)
        one = grad_loss.device.type == "cpu" and bool(grad_loss == 1)     # the usual case: no copy

        def scaled(g, dtype):
            return g.to(dtype) if one else g.mul(grad_loss).to(dtype)
        grad_h = scaled(saved.pop(0), ctx.h_dtype) if ctx.needs_input_grad[0] else None
        grad_w = scaled(saved.pop(0), ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None
