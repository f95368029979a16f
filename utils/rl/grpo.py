"""GRPO on verifiable rewards: rollouts from the engine, group-relative advantages, the
policy-gradient loss (library; nothing runs on import).

    data = Rollouts(model, prompts, rollout, reward_fn, seed)      the trainer's train_data
    batch = next(iter(data))     {"x", "y", "loss_mask", "advantages", "rewards"}
    loss, metrics = pg_loss(model, batch, kl_beta, ref_model)       a TrainSpec's loss

Rollouts. Each step takes the next ``prompts_per_step`` training prompts (a seeded order per
epoch; the position ``{"epoch", "index"}`` is checkpointed) and samples ``group_size``
replies to each with the current weights through utils/generation/engine.py: all
prompts x group_size rows in one continuous batch, row r seeded with ``base + r`` where
``base`` comes from (seed, the batch's number). The weights and the position are restored on
resume, so a resumed run samples the same replies and gets the same rewards. A reply that
ended at a stop token is trained on with that token, the one it sampled (the template's
end-of-turn, or EOS: whichever the model chose), so the policy also learns when to stop and
never trains on a token it did not sample.

Advantages (:func:`group_advantages`), per group of one prompt's replies, never over the
batch: "grpo" (DeepSeekMath's GRPO, TRL's default): (r - mean) / (std + 1e-4); "mean"
(nanochat's and Dr. GRPO's simplification): r - mean, which does not up-weight prompts whose
rewards barely differ. A group whose replies all got the same reward has advantage 0: it
teaches nothing, as it should (nothing to prefer).

Loss (:func:`pg_loss`): one optimizer step per batch of fresh samples, so the policy that
sampled is the one being updated (the importance ratio is 1 and PPO's clip never acts; it
is left out, as in nanochat; it is 1 because the rollouts compute as the step does: under its
autocast, ``Rollouts``' ``amp``, and with the policy's dropout off, rl.py): the loss is -A * log p(token), averaged over every reply token
of the batch (token-level mean, as DAPO and TRL's default: each token counts once, so a long
wrong reply is pushed down as hard per token as a short one; the per-sequence mean of the
GRPO paper would weigh a token of a long reply less). With ``kl_beta`` > 0, beta times the
k3 estimate of KL(policy || reference) per token (DeepSeekMath: exp(q - p) - (q - p) - 1 with
p, q the policy's and the frozen reference's log-probabilities) is added to it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from utils.cli import PipelineError
from utils.generation.engine import Engine, SamplingParams, Sequence

ADV_EPS = 1e-4
SEED_STRIDE = 1 << 20           # row seeds of consecutive batches never overlap (rows < 2^20)


# --------------------------------------------------------------------------- advantages
def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """(P * G,) rewards, consecutive groups of ``group_size`` replies to one prompt -> (P * G,)
    advantages: each reward minus its group's mean, divided by the group's standard deviation
    (+ 1e-4) when ``scale`` (GRPO), not with "mean" (module docstring)."""
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True) + ADV_EPS)
    return adv.reshape(-1)


# --------------------------------------------------------------------------- the loss
def token_logprobs(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability of each target ``y`` (0 where y is -100) under ``model(x)``."""
    logits, _ = model(x)
    lp = -F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none")
    return lp.view_as(y.float())


def pg_loss(model, batch: dict, kl_beta: float = 0.0, ref_model=None) -> tuple[torch.Tensor, dict]:
    """The policy-gradient loss of one batch of rollouts (module docstring) and its metrics:
    the mean reward, the mean reply length, and the KL estimate when ``kl_beta`` > 0."""
    mask = batch["loss_mask"].float()
    tokens = mask.sum().clamp(min=1.0)
    logp = token_logprobs(model, batch["x"], batch["y"])
    per_token = -batch["advantages"].float()[:, None] * logp
    metrics = {"reward": batch["rewards"].float().mean(), "reply_tokens": mask.sum(1).mean()}
    if kl_beta > 0:
        with torch.no_grad():
            ref = token_logprobs(ref_model, batch["x"], batch["y"])
        d = ref - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_beta * kl
        metrics["kl"] = ((kl * mask).sum() / tokens).detach()
    return (per_token * mask).sum() / tokens, metrics


def weights_sha256(state: dict) -> str:
    """sha256 of a state dict: each tensor's name, dtype, shape and bytes, in name order (the
    KL reference's identity, checked on resume)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- rollouts
@dataclass(frozen=True)
class RolloutSettings:
    group_size: int
    prompts_per_step: int
    max_new_tokens: int
    temperature: float
    top_k: int
    stop_ids: tuple                 # generation ends at any of these (the one sampled is trained on)
    pad_id: int
    scale: bool = True              # advantages: "grpo" (True) or "mean"


def generate_replies(engine: Engine, prompts: list[list[int]], n: int, max_new_tokens: int,
                     temperature: float, top_k: int, stop_ids, seed: int) -> list[tuple[list[int], Optional[int]]]:
    """``n`` replies to each prompt (row r = prompt r // n, seed ``seed + r``) in one continuous
    batch: [(new ids, the stop id that ended it or None)] in row order."""
    rows = [p for p in prompts for _ in range(n)]
    capacity = max(len(p) for p in rows) + max(max_new_tokens, 1)
    b = engine.batcher(len(rows), capacity)
    seqs = []
    for r, p in enumerate(rows):
        params = SamplingParams(max_new_tokens, temperature, top_k, 1.0, seed + r, frozenset(stop_ids))
        seqs.append(b.add(Sequence(p, params, tag=r)))
    for _ in engine.run(b):
        pass
    return [(list(s.tokens), s.stop_id) for s in seqs]


def collate(prompts: list[list[int]], replies: list[list[int]], pad_id: int) -> dict:
    """Rows prompt + reply as next-token pairs (x, y), right-padded; ``loss_mask`` 1 on the
    reply's targets only."""
    full = [p + r for p, r in zip(prompts, replies)]
    T = max(len(f) for f in full) - 1
    x = torch.full((len(full), T), pad_id, dtype=torch.long)
    y = torch.full((len(full), T), -100, dtype=torch.long)
    mask = torch.zeros((len(full), T), dtype=torch.float32)
    for i, (p, f) in enumerate(zip(prompts, full)):
        n = len(f) - 1
        x[i, :n] = torch.tensor(f[:-1])
        y[i, :n] = torch.tensor(f[1:])
        mask[i, len(p) - 1:n] = 1.0
    return {"x": x, "y": y, "loss_mask": mask}


class Rollouts:
    """The trainer's ``train_data``: each batch is a fresh group of replies per prompt, scored
    and with group-relative advantages (module docstring). ``prompts``: the training prompts'
    ids; ``reward_fn(i, new_ids) -> float`` scores a reply to prompt i; ``amp``: the autocast
    dtype of the training steps, which the rollouts (and pass@1, through ``engine``) run under
    too, so that the distribution sampled from is the one trained (None: no autocast)."""

    def __init__(self, model, prompts: list[list[int]], settings: RolloutSettings,
                 reward_fn: Callable[[int, list[int]], float], seed: int, amp: Optional[torch.dtype] = None):
        if len(prompts) < settings.prompts_per_step:
            raise PipelineError(f"the task has {len(prompts)} training prompt(s), fewer than "
                                f"rl.prompts_per_step ({settings.prompts_per_step}); lower it.")
        self.engine = Engine(model, amp=amp)       # the training steps' autocast (None: none)
        rope = getattr(model, "rope", None)
        if callable(rope):      # its cached RoPE tables made here, not first in the engine's inference
            rope(model.args.max_seq_len, model.device)      # mode, where training could not use them
        self.prompts, self.settings, self.reward_fn, self.seed = prompts, settings, reward_fn, int(seed)
        self.epoch, self.index = 0, 0

    def __len__(self) -> int:
        return len(self.prompts) // self.settings.prompts_per_step

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def __iter__(self) -> Iterator[dict]:
        order, per = self.order(self.epoch), self.settings.prompts_per_step
        while self.index + per <= len(order):
            chosen = [int(i) for i in order[self.index:self.index + per]]
            number = self.epoch * len(self) + self.index // per
            batch = self.batch(chosen, self.seed * 7919 + number * SEED_STRIDE)
            self.index += per
            yield batch
        self.epoch += 1
        self.index = 0

    def batch(self, chosen: list[int], seed: int) -> dict:
        s = self.settings
        prompts = [self.prompts[i] for i in chosen]
        out = generate_replies(self.engine, prompts, s.group_size, s.max_new_tokens, s.temperature,
                               s.top_k, s.stop_ids, seed)
        rewards = torch.tensor([self.reward_fn(chosen[r // s.group_size], ids)
                                for r, (ids, _) in enumerate(out)], dtype=torch.float32)
        replies = [ids + [stop] if stop is not None else ids for ids, stop in out]
        rows = [p for p in prompts for _ in range(s.group_size)]
        batch = collate(rows, replies, s.pad_id)
        batch["rewards"] = rewards
        batch["advantages"] = group_advantages(rewards, s.group_size, s.scale)
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "batch_size": self.settings.prompts_per_step,
                "seed": self.seed, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("num_prompts", len(self.prompts))) != len(self.prompts):
            raise PipelineError(f"the checkpoint's RL position is over {state.get('num_prompts')} "
                                f"training prompts but the task now has {len(self.prompts)}; resume "
                                "with the same rl.task, rl.max_operand, rl.val_prompts and seed.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def pass_at_1(engine: Engine, prompts: list[list[int]], score: Callable[[int, list[int]], float],
              max_new_tokens: int, stop_ids) -> float:
    """The fraction of ``prompts`` whose greedy reply the verifier accepts."""
    if not prompts:
        return float("nan")
    out = generate_replies(engine, prompts, 1, max_new_tokens, 0.0, 0, stop_ids, 0)
    return sum(score(i, ids) for i, (ids, _) in enumerate(out)) / len(prompts)
