"""A plain PyTorch loop over transformers' LlamaForCausalLM, lined up with the train stage.

Used by perf/optimizer_study.py (loop-level parity, its output in docs/performance.md) and
by tests/test_learning_parity.py. Given a finished run's resolved config and model args, it
trains LlamaForCausalLM the way the stage trains ours, without re-implementing the stage:

- initial weights: seeded with ``training.seed`` right before ``create_model`` as train.py
  does, then copied into LlamaForCausalLM through ``utils.hf.mapping.to_hf_state_dict``;
- batches: ``dataloader.build_loaders`` with the run's config, iterated from the start;
  validation: the first ``training.eval_batches`` batches, token-weighted;
- optimizer: ``utils.training.trainer.build_optimizers`` (AdamW, decay on matrices only), the same
  gradient clipping, the stage's warm-up + cosine schedule (warm-up capped at 20% of the run).

No side effects on import (torch and transformers load inside the function).
"""
from __future__ import annotations

import math


def reference_run(cfg, args, total: int, eval_steps: int) -> tuple[dict, dict]:
    """LlamaForCausalLM trained like the stage: ({step: val_loss}, {step: lr})."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    import dataloader
    import model as model_lib
    from utils.hf.mapping import hf_config, to_hf_state_dict
    from utils.training.scheduler import CosineWarmupScheduler
    from utils.data.tok import load_tokenizer
    from utils.training.trainer import _as_dict, build_optimizers, seed_everything

    hp = cfg.training
    if hp.grad_accum != 1 or args.dropout != 0.0 or hp.optimizer != "adamw":
        raise ValueError("the reference loop lines up with AdamW runs without gradient "
                         "accumulation or dropout")
    tok = load_tokenizer(cfg)
    train_loader, val_loader, _ = dataloader.build_loaders(cfg, tok, device="cpu")

    seed_everything(hp.seed)                       # as train.py does right before create_model
    ours = model_lib.create_model(args)
    hf = LlamaForCausalLM(hf_config(args, eos_id=tok.eos_token_id))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours), strict=False)
    if unexpected or not all("rotary" in k for k in missing):
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: {missing} {unexpected}")
    del ours
    hf.train()

    opts = build_optimizers(hf, hp, torch.device("cpu"))
    warmup = min(hp.warmup_steps, total // 5)     # the stage caps warm-up at 20% of the run
    sched = CosineWarmupScheduler(list(opts.values()), warmup=warmup, total=total,
                                  min_ratio=hp.min_lr / hp.lr)

    def loss_of(batch):
        batch = _as_dict(batch)                    # {"x", "y"} from a dict or an (x, y) pair
        logits = hf(input_ids=batch["x"]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten(),
                               ignore_index=-100)

    @torch.no_grad()
    def evaluate() -> float:
        hf.eval()
        total_loss = count = 0.0
        for i, b in enumerate(val_loader):
            if i >= hp.eval_batches:
                break
            n = float((_as_dict(b)["y"] != -100).sum())
            total_loss += float(loss_of(b)) * n
            count += n
        hf.train()
        return total_loss / count

    val, lrs = {0: evaluate()}, {}
    batches = iter(train_loader)
    for step in range(total):
        try:
            batch = next(batches)
        except StopIteration:                      # next epoch, as the stage's loader does
            batches = iter(train_loader)
            batch = next(batches)
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in hf.parameters() if p.grad is not None],
                                       hp.grad_clip if hp.grad_clip > 0 else math.inf)
        lrs[step + 1] = sched.apply(step) * hp.lr
        for o in opts.values():
            o.step()
            o.zero_grad(set_to_none=True)
        if (step + 1) % eval_steps == 0 or step + 1 == total:
            val[step + 1] = evaluate()
    return val, lrs
