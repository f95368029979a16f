"""Direct Preference Optimization (Rafailov et al., 2023, arXiv:2305.18290): the loss, the
sequence log-probabilities it compares, and the reference model's log-probabilities computed
once (library; nothing runs on import).

The loss of one pair (prompt x, chosen y_w, rejected y_l), with pi the policy being trained and
pi_ref the frozen model it started from::

    r_w = beta * (log pi(y_w|x) - log pi_ref(y_w|x))        the implicit reward of the chosen
    r_l = beta * (log pi(y_l|x) - log pi_ref(y_l|x))        ... and of the rejected answer
    loss = -log sigmoid(r_w - r_l)                          averaged over the batch's pairs

``log pi(y|x)`` is the SUM of the per-token log-probabilities of the completion only (the
batch's ``loss_mask``: the last assistant turn's tokens and its end-of-turn token), as TRL's
DPOTrainer (loss_type "sigmoid") and the paper do. The metrics logged beside the loss follow
TRL's ``rewards/*``: the mean chosen and rejected rewards, the reward accuracy (the fraction of
pairs with r_w > r_l) and the mean margin r_w - r_l.

Batches (utils/data/preference.py): ``{"x", "y", "loss_mask", "pair"}`` with 2n rows, the n
chosen sequences first, then their n rejected ones in the same order; ``pair`` holds the n pair
indices, which select the stored reference log-probabilities.

The reference: its log-probabilities are computed ONCE, by the starting model before the first
step (:func:`reference_logps`), and stored in the run folder (``reference_logps.npy``, with
its sha256 recorded in every checkpoint and checked on resume). A frozen second model would
double the weights held (4 GB more for a 1B model in fp32) and cost a forward pass of it at
every step; the stored numbers cost one pass over the data at the start and 8 bytes per
sequence. With LoRA the starting model is the base (the adapter's B matrices start at zero),
so the same numbers are the adapter-disabled base's. Exactness: a resumed run reads the file
rather than recomputing it, so it repeats the uninterrupted run bit for bit.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.training.trainer import autocast_ctx

REFERENCE_FILE = "reference_logps.npy"


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """The DPO loss (module docstring) of n pairs' sequence log-probabilities (each (n,)), and
    its metrics: rewards_chosen, rewards_rejected, reward_accuracy, reward_margin (batch means,
    detached)."""
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    margin = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(margin).mean()
    d = margin.detach()
    return loss, {"rewards_chosen": chosen_rewards.detach().mean(),
                  "rewards_rejected": rejected_rewards.detach().mean(),
                  "reward_accuracy": (d > 0).float().mean(),
                  "reward_margin": d.mean()}


def sequence_logps(model: nn.Module, batch: dict) -> torch.Tensor:
    """(rows,) the sum over each row's masked positions of log p(y_t | x_<=t): the completion's
    log-probability (padding has y == -100 and mask 0). Computed in fp32 from the logits."""
    logits, _ = model(batch["x"])
    y = batch["y"]
    logp = -F.cross_entropy(logits.float().transpose(1, 2), y.clamp(min=0), reduction="none")
    mask = batch["loss_mask"].to(logp.dtype) * (y != -100)
    return (logp * mask).sum(dim=1)


def make_loss(reference: torch.Tensor, beta: float) -> Callable[[nn.Module, dict], tuple]:
    """A TrainSpec loss: DPO of the batch's pairs against ``reference`` ((2N,) float64: the
    reference log-probability of example 2i (pair i's chosen) and 2i+1 (its rejected))."""
    def loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        logps = sequence_logps(model, batch)
        n = logps.shape[0] // 2
        pair = batch["pair"].to(reference.device)
        ref = reference.to(logps.device)
        return dpo_loss(logps[:n], logps[n:], ref[2 * pair].to(logps.dtype).to(logps.device),
                        ref[2 * pair + 1].to(logps.dtype).to(logps.device), beta)
    return loss


def pair_count(batch: dict) -> float:
    """What the validation mean weights a batch by: its pairs."""
    return float(batch["pair"].numel())


@torch.no_grad()
def reference_logps(model: nn.Module, batches: Iterable[dict], n_pairs: int, device,
                    progress: Optional[Callable] = None, amp: torch.dtype = torch.float32) -> np.ndarray:
    """(2 * n_pairs,) float64: the model's completion log-probabilities of every pair's chosen
    (index 2i) and rejected (2i + 1) sequence, in eval mode, under the autocast of ``amp`` (the
    run's: the policy's validation computes under it in eval mode too, so on the same batches
    its step-0 numbers are these, bit for bit, on every device). ``batches`` must cover every
    pair once; ``progress(k)`` is told the pairs done."""
    out = np.full(2 * n_pairs, np.nan, dtype=np.float64)
    was = model.training
    model.eval()
    try:
        for batch in batches:
            b = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with autocast_ctx(torch.device(device), amp):
                logps = sequence_logps(model, b).double().cpu().numpy()
            n = len(logps) // 2
            pair = b["pair"].cpu().numpy()
            out[2 * pair], out[2 * pair + 1] = logps[:n], logps[n:]
            if progress is not None:
                progress(n)
    finally:
        model.train(was)
    if np.isnan(out).any():
        raise ValueError(f"reference log-probabilities missing for {int(np.isnan(out).sum())} sequences")
    return out


def array_sha256(a: np.ndarray) -> str:
    """The fingerprint a run records of its reference log-probabilities."""
    h = hashlib.sha256(str(a.dtype).encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
