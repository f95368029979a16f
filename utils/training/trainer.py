"""The one training loop, for pre-training and SFT (library; nothing runs on import).

A training mode is a :class:`TrainSpec`, not a subclass: the parts (model, optimizer with its
parameter groups, loss, data, the numbers it follows, how its checkpoints are named and what
they record); the Trainer adds the run around them (device, DDP, logging, signals, resume)::

    spec = TrainSpec(model, model_args, train_data, val_data,
                     optimizer=OptimizerSpec.from_config(cfg.training),
                     settings=Settings.from_config(cfg.training, cfg.logging, total_steps, steps_per_epoch),
                     record=RunRecord("pretrain", cfg.to_dict(), tok_info), sample_fn=fn)
    trainer = Trainer(spec, run_dir=run_dir, logger=logger, device=device, dist=dist_info,
                      resume_command=cmd)
    if ckpt is not None: trainer.load_state(ckpt)    # a utils.run.load_checkpoint(..., "resume") dict
    result = trainer.fit()                           # TrainResult(reason, step, best_val_loss)

Every stateful part has ``state_dict`` / ``load_state_dict`` (model, optimizers, scheduler,
GradScaler, data position, metrics, RNG), and the checkpoint is their union.

Data
    ``train_data`` is any iterable of batches with a resumable position: ``state_dict()``,
    ``load_state_dict()`` and an ``epoch`` attribute (dataloader.TrainLoader, OnTheFlyLoader,
    or SFT's own). Each ``for`` pass over it yields the rest of the current epoch. A batch is
    a dict ``{"x", "y"}`` plus an optional ``"loss_mask"`` (all ``(B, T)``; y == -100 is
    ignored), or an ``(x, y)`` tuple. ``val_data`` is re-iterable in a fixed order, or None.

Step
    ``settings.grad_accum`` micro-batches (``spec.loss`` / grad_accum; DDP syncs gradients only
    on the last one) -> unscale (fp16) -> clip to ``settings.grad_clip`` (the norm is logged) ->
    learning rates from utils.training.scheduler for this step -> optimizer step(s) -> zero
    grads. Autocast bf16/fp16 or fp32 (``settings.dtype``); fp16 uses a GradScaler. AdamW decays
    2-D weights only (fused on CUDA and CPU); ``optimizer.optimizer == "muon"``:
    torch.optim.Muon for the 2-D hidden matrices and AdamW for embeddings, norms and the head.

Exact resume
    A checkpoint is taken only at an optimizer-step boundary. It holds the weights, every
    optimizer's and the scheduler's state, the GradScaler, the loader position (batches
    consumed), the python/numpy/torch/CUDA RNG states of every rank, the metrics window and
    the step / tokens counters. Evaluation and sample generation run inside
    ``torch.random.fork_rng`` so they never perturb training randomness. On CPU a resumed run
    therefore repeats the uninterrupted run bit for bit (same batches, LRs, losses, weights).

Stopping
    SIGINT / SIGTERM set a flag; the current optimizer step finishes, checkpoint_latest.pt is
    written atomically, the resume command is printed and ``fit`` returns reason
    "interrupted" (the stage exits 130). Further signals while finishing are ignored (with a
    message), so a second Ctrl-C cannot interrupt the save. Under DDP the ranks agree on the
    stop step (one all-reduce of a flag per step). A signal ignored when the process started
    (nohup, ``cmd &``) stays ignored. ``pause_at_step`` (``$LLM_PIPELINE_PAUSE_AT_STEP``, read by
    the stages through :func:`pause_step_from_env`) makes rank 0 wait after that step until a
    stop signal arrives: a known point for tests to interrupt a run at.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from utils.training import distributed as D
from utils.training import fsdp, sharded
from utils.training.checkpoint import CHECKPOINT_GLOB, remove_stale_temps, save_checkpoint
from utils.disk import bytes_of, device_of, free_bytes, mb
from utils.cli import PipelineError, UsageError
from utils.training.metrics import (MetricsTracker, Throughput, bits_per_byte, device_peak_flops, mfu,
                           mfu_unavailable_reason,
                           peak_memory_mb, perplexity)
from utils.training.scheduler import CosineWarmupScheduler, effective_warmup
from utils.infini import gate_parameters
from utils import lora


# --------------------------------------------------------------------------- precision
def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Autocast dtype for ``training.dtype``: auto = bf16 on CUDA (fp16 where bf16 is not
    supported), fp32 on CPU (CPU bf16 autocast is usually slower than fp32)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def autocast_ctx(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout of ``model`` to 0: each ``nn.Dropout`` (LoRA's among them) and the
    attention's own dropout probability (``model.Attention.dropout``); returns how many were
    on. DPO and GRPO compare the policy's training forward with numbers computed in eval mode
    (DPO's stored reference log-probabilities, GRPO's rollouts): with dropout on, the policy
    at step 0 is not the reference and the sampled distribution is not the trained one (TRL's
    ``disable_dropout``). The model's arguments are unchanged (checkpoints keep its dropout)."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            m.p, n = 0.0, n + 1
        elif isinstance(getattr(m, "dropout", None), float) and m.dropout > 0:
            m.dropout, n = 0.0, n + 1
    return n


# --------------------------------------------------------------------------- optimizers
def _embedding_and_head_params(model: nn.Module) -> set[int]:
    """ids of the embedding weights and of the output head, found by role, never by shape (a
    hidden matrix may well have vocab_size outputs): every ``nn.Embedding``, and the head that
    ``get_output_embeddings()`` (transformers models) or ``lm_head`` (model.py) names."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else getattr(model, "lm_head", None)
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
        ids.add(id(head.weight))
    return ids


def build_optimizers(model: nn.Module, hp, device: torch.device, lr: Optional[float] = None
                     ) -> dict[str, torch.optim.Optimizer]:
    """``{"adamw": AdamW}`` or, with ``hp.optimizer == "muon"``, ``{"muon": Muon, "adamw": AdamW}``.

    AdamW: weight decay on 2-D weights (matrices, embeddings), none on norms/biases; fused on
    CUDA and CPU. Muon (torch.optim.Muon, ``adjust_lr_fn="match_rms_adamw"`` so it shares AdamW's
    learning rate and weight decay): the 2-D hidden matrices; AdamW keeps embeddings, norms
    and an untied head. Infini-attention's gates (utils/infini.py, found by role) are AdamW's
    last group with their own peak rate ``hp.gate_lr`` (default: the others') and weight
    decay ``hp.gate_weight_decay`` (default 0), under either optimizer; the schedule scales
    every group alike. Parameter order follows ``model.named_parameters()`` (deterministic).
    """
    lr = hp.lr if lr is None else lr
    gates = gate_parameters(model)
    gate_ids = {id(p) for p in gates}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in gate_ids]
    special = _embedding_and_head_params(model)
    # torch's fused AdamW (one kernel over all tensors) on CUDA and on CPU, where it is also
    # faster than the foreach form (docs/performance.md, Training step); the arithmetic is
    # AdamW's either way.
    kw = dict(lr=lr, betas=(hp.beta1, hp.beta2), eps=1e-8)
    if device.type in ("cuda", "cpu"):
        kw["fused"] = True
    opts: dict[str, torch.optim.Optimizer] = {}
    if getattr(hp, "optimizer", "adamw") == "muon":
        hidden = [p for n, p in params if p.ndim == 2 and id(p) not in special]
        rest = [p for n, p in params if not (p.ndim == 2 and id(p) not in special)]
        if not hidden:
            raise PipelineError("training.optimizer is 'muon' but the model has no 2-D hidden "
                                "matrices for it.")
        opts["muon"] = torch.optim.Muon(hidden, lr=lr, weight_decay=hp.weight_decay,
                                        momentum=getattr(hp, "muon_momentum", 0.95),
                                        nesterov=True, adjust_lr_fn="match_rms_adamw")
        decay = [p for p in rest if p.ndim >= 2]
        no_decay = [p for p in rest if p.ndim < 2]
    else:
        decay = [p for n, p in params if p.ndim >= 2]
        no_decay = [p for n, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": hp.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if gates:
        gate_lr = getattr(hp, "gate_lr", None)
        groups.append({"params": [p for p in gates if p.requires_grad], "name": "gates",
                       "lr": lr if gate_lr is None else gate_lr,
                       "weight_decay": getattr(hp, "gate_weight_decay", None) or 0.0})
    opts["adamw"] = torch.optim.AdamW([g for g in groups if g["params"]], **kw)
    return opts


# --------------------------------------------------------------------------- the spec
@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer(s) and their hyperparameters (``build_optimizers`` makes the parameter
    groups: decay on 2-D weights; Muon for the hidden matrices, found by role)."""
    optimizer: str = "adamw"            # "adamw" | "muon"
    lr: float = 2e-3                    # peak learning rate (the schedule scales it)
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    muon_momentum: float = 0.95
    gate_lr: Optional[float] = None     # infini gates: their own peak rate (None: lr)
    gate_weight_decay: Optional[float] = None   # and weight decay (None: 0)

    @classmethod
    def from_config(cls, section, **override) -> "OptimizerSpec":
        """From a config section with these keys (``training``, or ``sft`` for its own)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{**{n: getattr(section, n) for n in names if hasattr(section, n)}, **override})

    def build(self, model: nn.Module, device: torch.device) -> dict[str, torch.optim.Optimizer]:
        return build_optimizers(model, self, device)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The numbers a run follows, explicit (each stage builds them from its own config section)."""
    total_steps: int
    min_lr: float                       # end of the cosine decay (peak: OptimizerSpec.lr)
    warmup_steps: int                   # capped at 20% of total_steps by the trainer (said once)
    eval_interval: int                  # optimizer steps between validations
    eval_batches: int                   # validation batches per evaluation
    checkpoint_every: int               # steps between numbered checkpoints
    keep_checkpoints: Optional[int]     # numbered checkpoints kept (0: none written, None: all)
    steps_per_epoch: Optional[int] = None
    grad_accum: int = 1
    grad_clip: float = 1.0              # 0: no clipping (the norm is still logged)
    dtype: str = "auto"                 # auto | bf16 | fp16 | fp32 (autocast)
    patience: int = 0                   # evaluations without improvement before stopping (0: off)
    log_every: int = 10
    smoothing_window: int = 50
    compile: bool = False
    activation_checkpointing: bool = False
    warmup_source: str = "training.warmup_steps"   # named when the cap applies
    parallel: str = "ddp"               # ddp | fsdp (utils/training/fsdp.py; sharded checkpoints)
    cpu_offload: bool = False           # fsdp: sharded state in CPU memory

    @classmethod
    def from_config(cls, hp, log_cfg, total_steps: int,
                    steps_per_epoch: Optional[int] = None) -> "Settings":
        """Pre-training's numbers: the ``training`` and ``logging`` sections."""
        return cls(total_steps=int(total_steps), min_lr=hp.min_lr, warmup_steps=hp.warmup_steps,
                   eval_interval=eval_interval(hp.eval_steps, hp.eval_every, steps_per_epoch, total_steps),
                   eval_batches=hp.eval_batches, checkpoint_every=hp.checkpoint_every,
                   keep_checkpoints=hp.keep_checkpoints, steps_per_epoch=steps_per_epoch,
                   grad_accum=hp.grad_accum, grad_clip=hp.grad_clip, dtype=hp.dtype,
                   patience=hp.early_stopping_patience, log_every=log_cfg.log_every,
                   smoothing_window=log_cfg.smoothing_window, compile=hp.compile,
                   activation_checkpointing=hp.activation_checkpointing,
                   parallel=hp.parallel, cpu_offload=hp.cpu_offload)


def eval_interval(eval_steps: Optional[int], eval_every: float, steps_per_epoch: Optional[int],
                  total_steps: int) -> int:
    """Steps between validations: ``eval_steps`` when set, else ``eval_every`` of an epoch
    (of the run when the data has no epoch length), at least 1."""
    if eval_steps:
        return int(eval_steps)
    span = steps_per_epoch or total_steps
    span = min(span, total_steps) if total_steps else span
    return max(1, int(round(eval_every * span)))


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What every checkpoint says about the run beyond its training state."""
    kind: str = "pretrain"              # "pretrain" | "sft" | "dpo" | "rl"
    config: dict = dataclasses.field(default_factory=dict)     # the resolved config
    tokenizer: Optional[dict] = None    # utils.data.tok.describe
    chat_template: Any = None           # SFT: the template its data was rendered with
    extra: dict = dataclasses.field(default_factory=dict)      # e.g. {"sft": {...}}


def next_token_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss of both modes today: next-token cross-entropy over ``y`` (-100 ignored), weighted
    by the batch's ``loss_mask`` when it has one (SFT: the assistant's tokens), fused with the
    head (no logits kept)."""
    _, loss = model(batch["x"], batch["y"], loss_mask=batch.get("loss_mask"), return_logits=False)
    return loss


def split_loss(out) -> tuple[torch.Tensor, dict]:
    """A spec's loss output as ``(loss, metrics)``: a bare tensor has no metrics."""
    if isinstance(out, tuple):
        loss, metrics = out
        return loss, dict(metrics)
    return out, {}


def counted_tokens(batch: dict) -> float:
    """Positions the loss counts (for the token-weighted validation mean)."""
    valid = batch["y"] != -100
    if batch.get("loss_mask") is not None:
        valid = valid & (batch["loss_mask"] > 0)
    return float(valid.sum())


def step_checkpoint_name(step: int) -> str:
    return f"checkpoint_step_{step}.pt"


@dataclasses.dataclass
class TrainSpec:
    """A training mode: the parts a :class:`Trainer` is built from.

    ``train_data``: an iterable of batches with a resumable position (``state_dict``,
    ``load_state_dict``, ``epoch``); each ``for`` pass yields the rest of the current epoch; a
    batch is ``{"x", "y"[, "loss_mask"]}`` (all (B, T)) or an ``(x, y)`` tuple. ``val_data``:
    re-iterable in a fixed order, or None. ``loss(model, batch)`` -> scalar; ``count(batch)``
    -> the positions it averages over. ``checkpoint_name(step)``: the numbered checkpoint's
    file name. ``sample_fn(model)`` -> [(prompt, text)] at each validation.

    Metrics beyond the loss: ``loss`` may return ``(loss, {name: tensor})`` (e.g. DPO's
    rewards and accuracy); the trainer averages each over a step's micro-batches, over the
    steps since the last log record and over ranks, and logs it with the loss (train record)
    or, count-weighted over the validation batches, as ``val_<name>`` (val record).
    ``val_fn(model)`` -> {name: float} adds what is measured by generating rather than by a
    loss (e.g. RL's pass@1 on held-out prompts): run at each validation on rank 0, inside
    ``torch.random.fork_rng`` (training randomness is untouched), logged as ``val_<name>``;
    with it, a run without ``val_data`` still validates (without a best checkpoint)."""
    model: nn.Module                    # the plain model, on the device
    model_args: Any                     # stored as checkpoint["model_args"] (to_dict())
    train_data: Any
    val_data: Any
    optimizer: OptimizerSpec
    settings: Settings
    record: RunRecord = dataclasses.field(default_factory=RunRecord)
    loss: Callable[[nn.Module, dict], torch.Tensor] = next_token_loss
    count: Callable[[dict], float] = counted_tokens
    checkpoint_name: Callable[[int], str] = step_checkpoint_name
    sample_fn: Optional[Callable[[nn.Module], list[tuple[str, str]]]] = None
    val_fn: Optional[Callable[[nn.Module], dict]] = None
    bytes_per_token: Optional[float] = None     # for bits per byte
    # the loss is a mean next-token cross-entropy, so exp(loss) is a perplexity and loss / ln 2
    # per byte is bits per byte; a mode whose loss is something else (DPO's) sets False and
    # its validation logs neither (a "perplexity" of a preference loss would mean nothing)
    next_token_loss: bool = True
    flops_per_token: Optional[float] = None     # for MFU (default: the model's own count)


# --------------------------------------------------------------------------- model wrappers
def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each transformer block's activations in the backward pass (less memory,
    about one extra forward). Blocks are the children of the model's first ModuleList."""
    if hasattr(model, "gradient_checkpointing"):   # model.py's own switch
        model.gradient_checkpointing = True
        return len(getattr(model, "layers", []))
    blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)
    if blocks is None:
        return 0
    def wrapped(fwd, *a, **k):
        return checkpoint(fwd, *a, use_reentrant=False, **k)

    for blk in blocks:
        blk.forward = functools.partial(wrapped, blk.forward)
    return len(blocks)


# --------------------------------------------------------------------------- RNG state
def rng_state() -> dict:
    """This process's RNG states as tensors and plain types (weights_only-loadable)."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": _plain(random.getstate()),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def _plain(x):
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x


def _tuple(x):
    if isinstance(x, list):
        return tuple(_tuple(v) for v in x)
    return x


def set_rng_state(state: dict) -> None:
    random.setstate(_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        cuda = list(state["cuda"])[:torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------- signals
class StopRequest:
    """SIGINT/SIGTERM -> a flag checked at step boundaries (see module docstring)."""

    def __init__(self, is_main: bool = True):
        self.requested: Optional[str] = None
        self.is_main = is_main
        self._previous: dict = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            if self.is_main:
                print(f"\n{name} received: finishing the current step, then saving "
                      "checkpoint_latest.pt ...", file=sys.stderr, flush=True)
        elif self.is_main:
            print(f"\n{name} again: still finishing and saving; the checkpoint will not be "
                  "corrupted. Please wait.", file=sys.stderr, flush=True)

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(s) is not signal.SIG_IGN:    # nohup / `cmd &`: stays ignored
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        return False

    def wait(self, limit: float = 600.0) -> None:
        """Block until a stop signal has arrived (at most ``limit`` seconds)."""
        deadline = time.monotonic() + limit
        while self.requested is None and time.monotonic() < deadline:
            time.sleep(0.01)


PAUSE_ENV = "LLM_PIPELINE_PAUSE_AT_STEP"


def pause_step_from_env() -> Optional[int]:
    """The step after which a run waits for a stop signal (``$LLM_PIPELINE_PAUSE_AT_STEP``): a
    deterministic point for tests and demos to interrupt a run at; None when unset, and in a
    worker torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` > 0: the pause was the first
    attempt's, whose ranks are gone)."""
    value = os.environ.get(PAUSE_ENV, "").strip()
    if not value or D.restart_count() > 0:
        return None
    if not value.isdigit() or int(value) < 1:
        raise PipelineError(f"{PAUSE_ENV}={value!r}: expected a step number >= 1 (or unset).")
    return int(value)


# --------------------------------------------------------------------------- trainer
@dataclasses.dataclass
class TrainResult:
    reason: str                 # "done", "interrupted", "early_stopping", "already_done", "diverged"
    step: int
    best_val_loss: Optional[float]
    last_val_loss: Optional[float]
    checkpoint: Optional[Path]


def diverged_message(result: "TrainResult", run_dir: Path, lr_key: str, lr: float) -> str:
    """What a run that ended with ``reason == "diverged"`` tells its user."""
    last = Path(run_dir) / "checkpoint_latest.pt"
    kept = (f"{last} holds the last weights saved before it" if last.is_file() else
            "no checkpoint was saved before it")
    return (f"training diverged by step {result.step}: the validation loss is not a number (NaN or "
            f"inf), so the weights are broken and were not saved; {kept}. Lower {lr_key} (now {lr:g}), "
            "or set training.dtype bf16 or fp32 if it ran in fp16, then start again or --resume "
            "from a checkpoint before the divergence.")


def _as_dict(batch) -> dict:
    if isinstance(batch, dict):
        return batch
    x, y = batch[0], batch[1]
    return {"x": x, "y": y}


def _to(batch: dict, device: torch.device) -> dict:
    nb = device.type == "cuda"
    return {k: (v.to(device, non_blocking=nb) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


class Trainer:
    """See the module docstring. ``model`` is the plain model (already on ``device``); the
    trainer adds activation checkpointing, torch.compile and DDP as configured."""

    def __init__(self, spec: TrainSpec, *, run_dir: Path, logger, device,
                 dist: D.DistInfo = D.DistInfo(), resume_command: Optional[str] = None,
                 progress: bool = True, out=None, pause_at_step: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.spec = spec
        st = self.settings = spec.settings
        model = spec.model
        self.device = torch.device(device)
        self.dist = dist
        self.raw_model = model
        self.model_args = spec.model_args
        self.train_data, self.val_data = spec.train_data, spec.val_data
        self.run_dir = Path(run_dir)
        self._started = False
        self.logger = logger
        self.total_steps = int(st.total_steps)
        self.steps_per_epoch = st.steps_per_epoch
        self.sample_fn = spec.sample_fn
        self.bytes_per_token = spec.bytes_per_token
        self.resume_command = resume_command
        self.progress = progress and dist.is_main
        self.out = out or sys.stdout
        self.pause_at_step = pause_at_step   # see pause_step_from_env
        self.clock = clock                   # what tokens/s is timed with

        self.dtype = resolve_dtype(st.dtype, self.device)
        self.sharded = st.parallel == "fsdp"          # checkpoints: sharded (DCP) folders
        # the model sharded across the ranks; on one GPU with CPU offload, "sharded" over its one
        # rank (train.py made it a group of one): the offload is the point there
        self.fsdp = self.sharded and (dist.enabled or (st.cpu_offload and tdist.is_initialized()))
        self._refuse_parallel()
        self.amp_dtype = torch.float32 if self.fsdp else self.dtype   # FSDP's policy casts instead
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.flops_per_token = spec.flops_per_token
        if self.flops_per_token is None and hasattr(model, "flops_per_token"):
            self.flops_per_token = float(model.flops_per_token())
        self.model = self._wrap(model)              # before the optimizers: FSDP replaces the weights
        self.optimizers = spec.optimizer.build(model, self.device)
        warmup = effective_warmup(st.warmup_steps, self.total_steps)
        self.warmup_capped = warmup != st.warmup_steps
        self.scheduler = CosineWarmupScheduler(list(self.optimizers.values()), warmup=warmup,
                                               total=self.total_steps,
                                               min_ratio=st.min_lr / spec.optimizer.lr)
        self.metrics = MetricsTracker(st.smoothing_window, st.patience)
        self.step = 0
        self.tokens_seen = 0
        self.peak_flops = device_peak_flops(self.device)
        self.mfu_note = mfu_unavailable_reason(self.device, self.flops_per_token)

        self.eval_interval = st.eval_interval
        self._pending: list[torch.Tensor] = []   # per-step losses not yet pulled to the host
        self._step_metrics: list[dict] = []      # spec.loss's metrics of the steps since the last log record
        self._val_metrics: dict = {}             # the last evaluation's (val_<name>)
        self._grad_norm: Optional[torch.Tensor] = None
        self._last_val: Optional[float] = None
        self._last_eval_step = -1
        self._resumed_from: Optional[int] = None

    def _refuse_parallel(self) -> None:
        """Settings FSDP cannot train with (utils/training/fsdp.py), as a UsageError."""
        problem = fsdp.refusal(self.spec.optimizer.optimizer, self.dtype) if self.sharded else None
        if problem:
            raise UsageError(problem)
        if self.settings.cpu_offload and self.device.type != "cuda":
            raise UsageError("training.cpu_offload moves FSDP's sharded state from the GPUs to CPU "
                             f"memory; training on {self.device.type} it is there already: leave it out.")

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Activation checkpointing, torch.compile, then DDP or FSDP2 (in that order, as
        torchtitan: utils/training/fsdp.py); the raw model stays reachable for saving and
        generation (under FSDP it is the sharded model itself)."""
        st = self.settings
        self.checkpointed_blocks = enable_activation_checkpointing(model) if st.activation_checkpointing else 0
        if self.fsdp:
            fsdp.shard(model, self.dtype, st.cpu_offload, compile_blocks=st.compile)
            return model
        m = torch.compile(model) if st.compile else model
        if self.dist.enabled:
            m = DDP(m, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return m

    # ------------------------------------------------------------------ progress
    @property
    def epoch_float(self) -> float:
        pos = self.train_data.state_dict()
        per = len(self.train_data) if hasattr(self.train_data, "__len__") else None
        if per:
            return pos["epoch"] + pos["index"] / max(1, pos.get("batch_size", 1)) / per
        return float(pos["epoch"])

    # ------------------------------------------------------------------ state
    def state_payload(self, tensors: bool = True) -> dict:
        """Everything DESIGN.md section 3 lists, as plain data and tensors (``tensors`` False:
        without the weights and optimizer states, which a sharded save writes through DCP)."""
        self._flush_losses()
        ranks = D.gather_objects(self.dist, rng_state()) if self.dist.enabled else [rng_state()]
        rec = self.spec.record
        weights = {
            "model": lora.split_state(self.raw_model)[0],     # base weights under plain names
            **lora.checkpoint_entries(self.raw_model),         # {"lora": the adapter} of a LoRA run
            "optimizer": {k: o.state_dict() for k, o in self.optimizers.items()},
        } if tensors else {}
        return {
            "kind": rec.kind,
            **weights,
            "model_args": self.model_args.to_dict(),
            "scheduler": self.scheduler.state_dict(),
            "grad_scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "step": self.step,
            "epoch": int(self.train_data.state_dict()["epoch"]),
            "tokens_seen": self.tokens_seen,
            "data_position": dict(self.train_data.state_dict()),
            "rng": {"world_size": self.dist.world_size, "ranks": ranks},
            "best_val_loss": self.metrics.best_val_loss,
            "config": rec.config,
            "tokenizer": rec.tokenizer,
            "chat_template": rec.chat_template,
            "metrics": {**self.metrics.state_dict(), "last_val_loss": self._last_val,
                        "last_eval_step": self._last_eval_step,
                        "bytes_per_token": self.bytes_per_token},
            **rec.extra,
        }

    def load_state(self, ckpt: dict) -> None:
        """Continue from a ``load_checkpoint(path, purpose="resume")`` dict (weights included).
        A training state whose parts have the right types but not the right contents (a
        forged or damaged rng, data_position, optimizer or metrics entry) is a PipelineError
        saying so, not an unexpected error from the part that reads it."""
        try:
            self._load_state(ckpt)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise PipelineError(f"the checkpoint's training state is damaged ({type(e).__name__}: {e}); "
                                "resume from another checkpoint of the run, or start a new run "
                                "without --resume.") from None

    def _load_weights(self, ckpt: dict) -> None:
        """The weights and optimizer states: a sharded checkpoint's shards straight into this
        rank's (``ckpt["sharded"]`` without "model": utils/training/fsdp.py), a whole state
        into the sharded model, or a plain state into the plain model."""
        opt_states = ckpt["optimizer"]
        if set(opt_states) != set(self.optimizers):
            raise PipelineError(f"the checkpoint was trained with optimizer(s) {sorted(opt_states)}"
                                f" but training.optimizer now gives {sorted(self.optimizers)}; "
                                "resume with the same training.optimizer.")
        if "model" not in ckpt and ckpt.get("sharded"):
            fsdp.load_into(ckpt["sharded"]["path"], self.raw_model, self.optimizers,
                           ckpt["optimizer_groups"], self.dist.enabled)
        elif self.fsdp:
            fsdp.load_full(self.raw_model, self.optimizers, ckpt["model"], opt_states)
        else:
            lora.load_weights(self.raw_model, ckpt)    # with the adapter, unmerged, of a LoRA run
            for k, o in self.optimizers.items():
                o.load_state_dict(opt_states[k])

    def _load_state(self, ckpt: dict) -> None:
        self._load_weights(ckpt)
        changed = self.scheduler.load_state_dict(ckpt["scheduler"])
        if changed and self.dist.is_main:
            print("resume: the learning-rate schedule differs from the checkpoint's ("
                  + "; ".join(changed) + "); the run follows the new one.", file=self.out)
        if ckpt.get("grad_scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(ckpt["grad_scaler"])
        self.step = int(ckpt["step"])
        self.tokens_seen = int(ckpt["tokens_seen"])
        pos = dict(ckpt["data_position"])
        ranks = ckpt["rng"].get("ranks")
        if not isinstance(ranks, list) or not ranks:   # damage, not another world size
            raise ValueError("entry 'rng' holds no list of per-process RNG states")
        if len(ranks) != self.dist.world_size:
            pos = self._resharded(ckpt, pos, len(ranks))
        if "rank" in pos:
            pos["rank"] = self.dist.rank
        self.train_data.load_state_dict(pos)
        m = ckpt.get("metrics") or {}
        self.metrics.load_state_dict(m)
        self._last_val = m.get("last_val_loss")
        self._last_eval_step = int(m.get("last_eval_step", -1))
        if self.bytes_per_token is None:
            self.bytes_per_token = m.get("bytes_per_token")
        set_rng_state(ranks[self.dist.rank % len(ranks)])
        self._resumed_from = self.step

    def _resharded(self, ckpt: dict, pos: dict, old: int) -> dict:
        """The data position of a run continued on another number of processes (sharded runs
        only: DCP reshards the weights and optimizer state): the same global window, each rank
        its slice of what follows (dataloader.ResumableSampler: rank r takes positions
        r + j x world size); RNG states of rank r mod ``old``."""
        new = self.dist.world_size
        if not (self.sharded or ckpt.get("sharded")):
            raise PipelineError(f"the checkpoint was written by {old} process(es) but this "
                                f"run has {new}; resume with the same world size "
                                "(torchrun --nproc_per_node) for an exact continuation, or use "
                                "--parallel fsdp, whose sharded checkpoints continue on any number.")
        if "world_size" not in pos:
            raise PipelineError(f"the checkpoint was written by {old} process(es) and this run has {new}: "
                                "on-the-fly data cannot continue at the same place on another number of "
                                "processes; resume with the same world size.")
        consumed = int(pos["index"]) * old
        pos.update(index=consumed // new, world_size=new)
        if self.dist.is_main:
            print(f"resume: the checkpoint was written by {old} process(es), this run has {new}: the "
                  "weights and optimizer state are resharded; the data continues at window "
                  f"{consumed // new * new} of the epoch (the checkpoint's {consumed})"
                  + ("" if consumed % new == 0 else f", {consumed % new} window(s) seen twice") +
                  f"; each process continues with the random state saved by rank (its rank mod {old}).",
                  file=self.out)
        return pos

    # ------------------------------------------------------------------ checkpoints
    def save(self, name: str) -> Optional[Path]:
        """Write ``run_dir/name`` on rank 0 (every rank must call: RNG states are gathered); a
        sharded run writes ``name`` as a DCP folder (``.dcp`` for ``.pt``), every rank its
        shards. The other format's checkpoint of that name (a run that changed
        training.parallel) is removed after the save. A run folder removed while the run wrote
        to it is said once and made again."""
        if self.sharded:
            name = sharded.sharded_name(name)
            payload = self.state_payload(tensors=False)
            tensors, payload["optimizer_groups"] = fsdp.state_for_save(self.raw_model, self.optimizers)
            payload["sharded"] = {"world_size": self.dist.world_size}
        else:
            payload = self.state_payload()
        path = self.run_dir / name
        if self.dist.is_main and self._started and not self.run_dir.is_dir():
            self._print(f"warning: {self.run_dir} vanished while the run wrote to it (removed?); made "
                        "it again for this checkpoint (what it held is gone).")
        if self.sharded:
            sharded.save(path, tensors, payload if self.dist.is_main else {}, self.dist)
        elif self.dist.is_main:
            save_checkpoint(path, payload)
        if self.dist.is_main:
            other = path.with_suffix(".pt" if self.sharded else sharded.SUFFIX)
            if other.is_dir():
                sharded.remove(other)
            elif other.is_file():
                other.unlink()
        D.barrier(self.dist)
        return path

    def checkpoint_bytes(self) -> int:
        """About the bytes of one checkpoint of this run: the weights (fp32 as saved) and the
        optimizer state they will have (AdamW: two moments per weight; Muon: one)."""
        if self.fsdp:        # DTensor shards: their global sizes (all ranks write one folder)
            weights = sum(p.numel() * p.element_size() for p in self.raw_model.parameters())
        else:
            weights = bytes_of(self.raw_model.state_dict())                # tied weights once
        state = 0
        for name, opt in self.optimizers.items():
            per = 1 if name == "muon" else 2
            state += per * sum(p.numel() * 4 for g in opt.param_groups for p in g["params"])
        return weights + state

    def kept_checkpoints(self) -> list[str]:
        """What the run keeps on disk at most: latest, best (with validation data), the numbered
        checkpoints kept (all of them when every one is kept), and the temporary copy a save
        writes before it replaces its file."""
        st = self.settings
        numbered = 0 if st.keep_checkpoints == 0 or not st.checkpoint_every else (
            st.keep_checkpoints if st.keep_checkpoints is not None
            else max(1, self.total_steps // st.checkpoint_every))
        names = ["latest"] + (["best"] if self.val_data is not None else [])
        return names + ([f"{numbered} numbered"] if numbered else []) + ["the temporary copy of a save"]

    def check_checkpoint_room(self, keep_setting: Optional[str]) -> Optional[str]:
        """Before the first step: a PipelineError when not even one checkpoint fits the run
        folder's device, a warning (returned) when the checkpoints the run keeps do not; files
        of a resumed run that its saves replace count as room. ``keep_setting``: the key that
        keeps fewer numbered checkpoints, when there is one."""
        one, kept = self.checkpoint_bytes(), self.kept_checkpoints()
        free = free_bytes(self.run_dir)
        if free is None:
            return None
        count = sum(int(k.split()[0]) if k[0].isdigit() else 1 for k in kept)
        replaced = sum(p.stat().st_size for p in self.run_dir.glob(CHECKPOINT_GLOB)) if self.run_dir.is_dir() else 0
        where = f"{device_of(self.run_dir)}, where {self.run_dir} is"
        if free + replaced < one:
            raise PipelineError(f"not even one checkpoint of this run (about {mb(one)} MB) fits the {mb(free)} MB "
                                f"free on {where}; free space or point paths.checkpoints_dir elsewhere. "
                                "Nothing was trained.")
        if free + replaced >= count * one:
            return None
        fewer = f", keep fewer ({keep_setting})" if keep_setting else ""
        return (f"warning: the checkpoints this run keeps ({', '.join(kept)}: {count} x about {mb(one)} MB = "
                f"{mb(count * one)} MB) do not fit the {mb(free)} MB free"
                + (f" (and the {mb(replaced)} MB of checkpoints they replace)" if replaced else "")
                + f" on {where}; a save will fail when the "
                f"disk is full (earlier checkpoints stay whole). Free space{fewer} or point "
                "paths.checkpoints_dir elsewhere.")

    def _rotate_step_checkpoints(self) -> None:
        keep = self.settings.keep_checkpoints
        if keep is None:                                   # keep every numbered checkpoint
            return
        files = sorted([*self.run_dir.glob("checkpoint_step_*.pt"), *self.run_dir.glob("checkpoint_step_*.dcp")],
                       key=lambda p: int(p.stem.rsplit("_", 1)[1]) if p.stem.rsplit("_", 1)[1].isdigit() else -1)
        for p in files[:max(0, len(files) - keep)]:
            if p.is_dir():
                sharded.remove(p)
            else:
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, max_batches: Optional[int] = None) -> Optional[float]:
        """Token-weighted mean validation loss over the first ``max_batches`` batches (all
        ranks' slices combined); None without validation data."""
        if self.val_data is None:
            return None
        max_batches = max_batches or self.settings.eval_batches
        model = self.raw_model if not self.dist.enabled else self.model
        was = model.training
        model.eval()
        total = count = 0.0
        sums: dict[str, float] = {}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for i, batch in enumerate(self.val_data):
                if i >= max_batches:
                    break
                b = _to(_as_dict(batch), self.device)
                with autocast_ctx(self.device, self.amp_dtype):
                    loss, metrics = split_loss(self.spec.loss(self.raw_model, b))
                n = self.spec.count(b)
                total += float(loss) * n
                count += n
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * n
        model.train(was)
        names = sorted(sums)
        total, count, *vals = D.all_reduce_sum(self.dist, [total, count] + [sums[k] for k in names],
                                               self.device)
        self._val_metrics = {f"val_{k}": v / count for k, v in zip(names, vals)} if count else {}
        return total / count if count else None

    def _val_fn_metrics(self) -> dict:
        """``spec.val_fn``'s numbers (rank 0, eval mode, training randomness untouched)."""
        if self.spec.val_fn is None or not self.dist.is_main or self.fsdp:   # rank 0 alone cannot run it
            return {}
        was = self.raw_model.training
        self.raw_model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                with torch.no_grad(), autocast_ctx(self.device, self.amp_dtype):
                    got = self.spec.val_fn(self.raw_model)
        finally:
            self.raw_model.train(was)
        return {f"val_{k}": float(v) for k, v in got.items()}

    def _say_metrics(self, metrics: dict) -> str:
        return "".join(f" | {k.removeprefix('val_')} {v:.4g}" for k, v in metrics.items())

    def _samples(self) -> None:
        if self.sample_fn is None or not self.dist.is_main or self.fsdp:   # see _announce
            return
        was = self.raw_model.training
        self.raw_model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                with torch.no_grad(), autocast_ctx(self.device, self.amp_dtype):
                    pairs = self.sample_fn(self.raw_model)
        finally:
            self.raw_model.train(was)
        for prompt, text in pairs:
            self._print(f"  sample @ step {self.step}: {prompt!r} -> {text!r}")
            self.logger.text("sample", self.step, text, prompt=prompt)

    def _validate(self, bar=None) -> Optional[str]:
        """Evaluate, log, save best/latest, print a sample; "early_stopping" when early stopping
        fires, "diverged" when the validation loss is not finite (the weights are NaN or inf:
        nothing is saved from them and no sample is drawn), else None."""
        val = self.evaluate()
        extra = {**self._val_metrics, **self._val_fn_metrics()} if val is not None or self.spec.val_fn else {}
        self._last_eval_step = self.step
        if val is None:
            if self.spec.val_fn is not None:        # the same on every rank: each must call save
                if extra:                            # val_fn's numbers: rank 0's
                    self.logger.log("val", self.step, {**extra, "epoch": self.epoch_float})
                    self._print(f"step {self.step}/{self.total_steps} | validation" + self._say_metrics(extra))
                self._samples()
                if self.step > 0:
                    self.save("checkpoint_latest.pt")
            return None
        if not math.isfinite(val):
            self.logger.log("val", self.step, {"val_loss": val, "epoch": self.epoch_float})
            self._print(f"step {self.step}/{self.total_steps} | val loss {val}: the weights diverged; "
                        "training stops without saving them.")
            return "diverged"
        self._last_val = val
        is_best = self.metrics.update_val(self.step, val)
        lm = self.spec.next_token_loss
        rec = {"val_loss": val, "perplexity": perplexity(val) if lm else None,
               "bits_per_byte": bits_per_byte(val, self.bytes_per_token) if lm else None,
               "best_val_loss": self.metrics.best_val_loss, "epoch": self.epoch_float, **extra}
        self.logger.log("val", self.step, rec)
        bpb = rec["bits_per_byte"]
        self._print(f"step {self.step}/{self.total_steps} | val loss {val:.4f}"
                    + (f" | ppl {rec['perplexity']:.1f}" if lm else "") + (f" | bpb {bpb:.3f}" if bpb else "")
                    + (" | best" if is_best else f" | best {self.metrics.best_val_loss:.4f}")
                    + self._say_metrics(extra))
        self._samples()
        if self.step > 0:
            if is_best:
                self.save("checkpoint_best.pt")
            self.save("checkpoint_latest.pt")
        return "early_stopping" if self.metrics.should_stop else None

    def _print(self, msg: str) -> None:
        if not self.dist.is_main:
            return
        try:
            tqdm.write(msg, file=self.out)
        except Exception:
            print(msg, file=self.out, flush=True)

    # ------------------------------------------------------------------ data
    def _batches(self) -> Iterator[dict]:
        """Micro-batches across epoch boundaries, forever (the step count bounds training)."""
        empty = 0
        while True:
            got = False
            for batch in self.train_data:
                got = True
                yield _as_dict(batch)
            if not got:
                empty += 1
                if empty >= 2:
                    raise PipelineError("the training data yielded no batch in a whole epoch "
                                        "(too little data for one batch?).")
            else:
                empty = 0

    def _flush_losses(self) -> None:
        if not self._pending:
            return
        vals = torch.stack(self._pending).float()
        if self.dist.enabled:
            tdist.all_reduce(vals, op=tdist.ReduceOp.SUM)
            vals = vals / self.dist.world_size
        self._pending = []
        self._last_losses = vals.tolist()
        for v in self._last_losses:
            self.metrics.update_loss(v)

    # ------------------------------------------------------------------ loop
    def fit(self) -> TrainResult:
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.run_dir)
            for line in sharded.recover(self.run_dir):   # a sharded save killed mid-way
                self._print(line)
        self._started = True                         # the run folder exists from here on
        if self.step >= self.total_steps:
            self._print(f"the run is already complete: step {self.step} of {self.total_steps}. "
                        "Raise --max-steps (or training.epochs) to train further.")
            return TrainResult("already_done", self.step, self.metrics.best_val_loss,
                               self._last_val, None)
        self._announce()
        self.model.train()
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)
        reason = "done"
        if self._resumed_from is None and (self.val_data is not None or self.spec.val_fn is not None):
            reason = self._validate() or reason   # step 0: the untrained model's loss, the curve's first point
        bar = None
        if self.progress:
            bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr, smoothing=0.1)
        ckpt_path = None
        with StopRequest(self.dist.is_main) as stop:
            try:
                reason = self._train_steps(reason, bar, stop)
                if reason == "done" and self._last_eval_step != self.step:
                    reason = "diverged" if self._validate(bar) == "diverged" else reason
                if bar is not None:
                    bar.close()
                if reason != "diverged":                  # NaN weights would replace the last good ones
                    ckpt_path = self.save("checkpoint_latest.pt")
            finally:
                if bar is not None:
                    bar.close()
                self.logger.flush()
        self.logger.event(self.step, reason, best_val_loss=self.metrics.best_val_loss)
        if reason == "interrupted" and self.dist.is_main:
            print(f"\ninterrupted at step {self.step}/{self.total_steps} ({stop.requested}); "
                  f"saved {ckpt_path}.", file=sys.stderr)
            if self.resume_command:
                print(f"resume with:\n  {self.resume_command}", file=sys.stderr, flush=True)
        return TrainResult(reason, self.step, self.metrics.best_val_loss, self._last_val, ckpt_path)

    def _announce(self) -> None:
        """The log's start (or resume) event and what the run says before its first step."""
        st = self.settings
        self.logger.event(self.step, "resume" if self._resumed_from is not None else "start",
                          total_steps=self.total_steps, mfu_unavailable=self.mfu_note)
        if not self.dist.is_main:
            return
        if self.checkpointed_blocks:
            self._print(f"activation checkpointing: {self.checkpointed_blocks} blocks recompute "
                        "their activations in the backward pass.")
        if self.fsdp:
            self._print(f"FSDP2: {len(fsdp.blocks_of(self.raw_model))} blocks and the root sharded over "
                        f"{self.dist.world_size} processes"
                        + (", weights and optimizer state in CPU memory" if st.cpu_offload else "")
                        + "; checkpoints are sharded folders (*.dcp). Validation samples are not drawn "
                        "(generation would need the whole model on one rank): `python main.py infer` "
                        "reads the checkpoints.")
        elif self.sharded:
            self._print("training.parallel fsdp on one process: nothing to shard; checkpoints are "
                        "sharded folders (*.dcp), which continue on any number of processes.")
        path = getattr(self.raw_model, "attention_path", None)
        if path is not None:
            self._print(f"attention: {path(self.device.type, self.dtype)}.")
        if self.mfu_note:
            self._print(f"note: MFU is not logged: {self.mfu_note}.")
        if self.warmup_capped and self._resumed_from is None:
            self._print(f"note: warm-up shortened to {self.scheduler.warmup} steps (20% of the "
                        f"run's {self.total_steps}) from {st.warmup_source} = {st.warmup_steps}.")

    def _train_steps(self, reason: str, bar, stop: StopRequest) -> str:
        """Optimizer steps until the run's last, a stop request ("interrupted"), early stopping
        or divergence. tokens/s is the training steps' alone: validation, samples, checkpoint
        saves and a pause are timed apart (Throughput.paused)."""
        st = self.settings
        thr = Throughput(self.clock, sync=self._sync_device)
        batches = self._batches()
        while reason == "done" and self.step < self.total_steps:
            thr.add(self._train_step(batches))
            self.step += 1
            if bar is not None:
                bar.update(1)
            if self.step % st.log_every == 0 or self.step == self.total_steps:
                self._log_train(thr, bar)
            if self.step == self.pause_at_step and self.dist.is_main:
                self._print(f"paused after step {self.step} until a stop signal ({PAUSE_ENV}).")
                self.logger.flush()
                with thr.paused():
                    stop.wait()
            if D.any_rank(self.dist, stop.requested is not None, self.device):
                return "interrupted"
            reason = self._between_steps(thr, bar)
        return reason

    def _between_steps(self, thr: Throughput, bar) -> str:
        """The validation and the numbered checkpoint this step is due for, if any (their time
        does not count as training); "done" unless the run stops here."""
        st = self.settings
        if self.step % self.eval_interval == 0 and self.step < self.total_steps:
            with thr.paused():
                reason = self._validate(bar)
            if reason == "early_stopping":
                self._print(f"early stopping: validation loss did not improve for "
                            f"{st.patience} evaluations.")
            if reason is not None:
                return reason
        if self.step % st.checkpoint_every == 0 and st.keep_checkpoints != 0:
            with thr.paused():
                self.save(self.spec.checkpoint_name(self.step))
                if self.dist.is_main:
                    self._rotate_step_checkpoints()
        return "done"

    def _sync_device(self) -> None:
        """Wait for the queued kernels (CUDA runs them asynchronously): work queued by training
        steps is timed as theirs, not as the validation's that follows."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _train_step(self, batches: Iterator[dict]) -> int:
        """One optimizer step over ``grad_accum`` micro-batches; returns tokens processed
        (all ranks)."""
        st = self.settings
        accum = st.grad_accum
        loss_sum = None
        metric_sum: dict[str, torch.Tensor] = {}
        tokens = 0
        for micro in range(accum):
            b = _to(next(batches), self.device)
            last = micro == accum - 1
            if self.fsdp:
                fsdp.set_grad_sync(self.model, last)
            sync = contextlib.nullcontext() if (last or not self.dist.enabled or self.fsdp) else self.model.no_sync()
            with sync:
                with autocast_ctx(self.device, self.amp_dtype):
                    loss, metrics = split_loss(self.spec.loss(self.model, b))
                self.scaler.scale(loss / accum).backward()
            for k, v in metrics.items():
                v = v.detach().float() / accum
                metric_sum[k] = v if k not in metric_sum else metric_sum[k] + v
            d = loss.detach()
            loss_sum = d if loss_sum is None else loss_sum + d
            tokens += b["x"].numel()
        for o in self.optimizers.values():
            self.scaler.unscale_(o)
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        max_norm = st.grad_clip if st.grad_clip > 0 else float("inf")
        self._grad_norm = fsdp.local_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.scheduler.apply(self.step)
        for o in self.optimizers.values():
            self.scaler.step(o)
        self.scaler.update()
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=True)
        self._pending.append(loss_sum / accum)
        if metric_sum:
            self._step_metrics.append(metric_sum)
        tokens *= self.dist.world_size
        self.tokens_seen += tokens
        return tokens

    def _window_metrics(self) -> dict:
        """The mean of each loss metric over the steps since the last log record (and ranks)."""
        if not self._step_metrics:
            return {}
        names = sorted(self._step_metrics[0])
        vals = torch.stack([torch.stack([m[k] for k in names]) for m in self._step_metrics]).mean(0)
        if self.dist.enabled:
            tdist.all_reduce(vals, op=tdist.ReduceOp.SUM)
            vals = vals / self.dist.world_size
        self._step_metrics = []
        return dict(zip(names, vals.tolist()))

    def _log_train(self, thr: Throughput, bar) -> None:
        self._flush_losses()
        loss = self._last_losses[-1]
        gn = float(self._grad_norm) if self._grad_norm is not None else None
        rate = thr.rate()
        rec = {"loss": loss, "smoothed_loss": self.metrics.smoothed(),
               "lr": self.scheduler.lrs()[0], "grad_norm": gn, "tokens_per_s": rate,
               "tokens_seen": self.tokens_seen, "epoch": self.epoch_float,
               "peak_memory_mb": peak_memory_mb(self.device)}
        u = mfu(rate, self.flops_per_token, self.peak_flops, self.dist.world_size)
        if u is not None:
            rec["mfu"] = u
        rec.update(self._window_metrics())
        if not math.isfinite(loss) and self.dist.is_main:
            self._print(f"warning: loss is {loss} at step {self.step} (diverged); lower "
                        "training.lr or use training.dtype bf16/fp32.")
        self.logger.log("train", self.step, rec)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
