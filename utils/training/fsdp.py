"""FSDP2 for the trainer: the model sharded with torch's own ``fully_shard``, and its state
for sharded checkpoints (library; nothing happens on import).

``training.parallel: fsdp`` under torchrun (the same launch as DDP, one node or several):

- :func:`shard` applies ``torch.distributed.fsdp.fully_shard`` to every transformer block,
  then to the root (embeddings, final norm, head: one group), as torchtitan does. Each rank
  keeps 1/N of every weight, gradient and optimizer moment; a block's weights are gathered for
  its forward and again for its backward, its gradients reduce-scattered after. The order of
  the wrappers is torchtitan's: activation checkpointing (model.py's per-block switch), then
  torch.compile per block (the compiled wrapper replaces the block in ``model.layers``; the
  distributed state-dict API drops its ``_orig_mod.`` from the names), then ``fully_shard``.
- Mixed precision comes from ``training.dtype`` as a ``MixedPrecisionPolicy``: bf16 gathers
  and computes the blocks in bf16 and reduces gradients in fp32, the sharded master weights
  and AdamW's moments stay fp32 (so the trainer does not autocast on top); fp32 is plain fp32;
  fp16 is refused (its GradScaler does not take sharded gradients: use bf16).
- ``training.cpu_offload``: the sharded weights, gradients and optimizer state live in CPU
  memory (``CPUOffloadPolicy``); the optimizer steps on the CPU. Slower; for a model whose
  shards do not fit the GPUs.
- Gradient accumulation: :func:`set_grad_sync` (``set_requires_gradient_sync``) keeps the
  gradients of all but the last micro-batch unreduced, as DDP's ``no_sync``. Clipping:
  ``torch.nn.utils.clip_grad_norm_`` on the sharded gradients (DTensors) computes the norm of
  the whole gradient across ranks, so the clip is the same as one process's.
- Muon is refused (:func:`refusal`): its Newton-Schulz orthogonalization needs each whole
  matrix, and each rank holds a slice of it. torch.optim.Muon on the shards does run (DTensor
  gathers inside every iteration, on every rank), but redundantly and with extra collectives
  in each of its iterations; a distributed Muon that gathers each matrix on one rank, as
  newer recipes do, is not built here. Use AdamW with FSDP, or Muon with DDP.

Checkpoints (utils/training/sharded.py has the folder format): :func:`state_for_save` gives
each rank's shards by parameter name (``get_model_state_dict`` / ``get_optimizer_state_dict``)
and the optimizers' param groups for meta.pt; :func:`load_into` loads a sharded checkpoint
into the model and optimizers of any world size (DCP reshards), and :func:`load_full` a plain
one (a DDP or one-process run continued under FSDP). On one process (world size 1) nothing is
sharded, and the same functions read and write the same format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from utils.errors import error_line
from utils.training import sharded
from utils.training.checkpoint import CheckpointError

PARALLEL_MODES = ("ddp", "fsdp")


def refusal(optimizer: str, dtype: torch.dtype) -> Optional[str]:
    """Why ``training.parallel fsdp`` cannot train with these settings (None: it can)."""
    if optimizer == "muon":
        return ("training.optimizer muon needs whole matrices (Newton-Schulz), and under "
                "training.parallel fsdp each rank holds a slice of every matrix. Use --optimizer "
                "adamw with --parallel fsdp, or Muon with --parallel ddp (the model, its gradients "
                "and Muon's state must then fit one GPU).")
    if dtype == torch.float16:
        return ("training.dtype fp16 needs a GradScaler, which does not take FSDP's sharded "
                "gradients; use --dtype bf16 (or fp32) with --parallel fsdp.")
    return None


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: ``model.layers`` (model.py), else the first ModuleList (empty
    when there is none)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    found = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)
    return found if found is not None else nn.ModuleList()


def mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """bf16: blocks gathered and computed in bf16, gradients reduced in fp32; fp32: none."""
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(model: nn.Module, dtype: torch.dtype, cpu_offload: bool = False,
          compile_blocks: bool = False) -> int:
    """``fully_shard`` every block (compiled first with ``compile_blocks``), then the root, in
    place; the model must be on its device already. Returns the number of blocks."""
    kw = {"mp_policy": mixed_precision(dtype)}
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    blocks = blocks_of(model)
    for i in range(len(blocks)):
        if compile_blocks:        # the compiled wrapper takes the block's place (torchtitan's way);
            blocks[i] = torch.compile(blocks[i])    # state-dict names keep no _orig_mod. (DCP's API)
        # The last block's weights are needed again at once by the backward pass: keep them.
        fully_shard(blocks[i], reshard_after_forward=i < len(blocks) - 1, **kw)
    fully_shard(model, **kw)
    return len(blocks)


def set_grad_sync(model: nn.Module, sync: bool) -> None:
    """Reduce-scatter the gradients after this backward (``sync``) or keep accumulating them."""
    model.set_requires_gradient_sync(sync)


def local_norm(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm as a plain tensor (a DTensor under FSDP: replicated)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# --------------------------------------------------------------------------- checkpoints
def state_for_save(model: nn.Module, optimizers: dict) -> tuple[dict, dict]:
    """(tensors for DCP: {"model": shards by name, "optimizer": {name: {"state": ...}}},
    {name: param_groups with parameters named}) of this rank."""
    tensors = {sharded.MODEL: get_model_state_dict(model), sharded.OPTIMIZER: {}}
    groups = {}
    for name, opt in optimizers.items():
        osd = get_optimizer_state_dict(model, opt)
        tensors[sharded.OPTIMIZER][name] = {"state": osd["state"]}
        groups[name] = osd["param_groups"]
    return tensors, groups


def load_into(path, model: nn.Module, optimizers: dict, groups: dict, distributed: bool) -> None:
    """Load sharded checkpoint ``path`` into this rank's shards (DCP reshards from the world
    size that wrote it); ``groups``: its meta.pt ``optimizer_groups``. The files were checked
    against the manifest when it was opened (utils.run.load_checkpoint, on every rank: with
    resharding any rank may read any file)."""
    path = Path(path)
    target = {sharded.MODEL: get_model_state_dict(model), sharded.OPTIMIZER: {}}
    for name, opt in optimizers.items():            # (an empty state is initialized first)
        target[sharded.OPTIMIZER][name] = {"state": get_optimizer_state_dict(model, opt)["state"]}
    try:
        dcp.load(target, storage_reader=sharded.SafeReader(path), no_dist=not distributed)
    except sharded.READ_ERRORS as e:
        raise CheckpointError(path, f"its shards cannot be loaded ({error_line(e)}).") from None
    set_model_state_dict(model, target[sharded.MODEL])
    for name, opt in optimizers.items():
        set_optimizer_state_dict(model, opt, {"state": target[sharded.OPTIMIZER][name]["state"],
                                              "param_groups": groups[name]})


def load_full(model: nn.Module, optimizers: dict, weights: dict, opt_states: dict) -> None:
    """A plain checkpoint's whole weights and positional optimizer states into the (sharded)
    model and optimizers: each rank keeps its own slice."""
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=full)
    for name, opt in optimizers.items():
        set_optimizer_state_dict(model, opt, named_optimizer_state(model, opt, opt_states[name]),
                                 options=full)


def named_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> dict:
    """A positional optimizer state_dict (torch's own) with its parameters named (the form the
    distributed state-dict API takes): position i is the i-th parameter of ``opt``'s groups,
    named as that API names it."""
    ordered = [fqn for g in get_optimizer_state_dict(model, opt)["param_groups"] for fqn in g["params"]]
    groups, i = [], 0
    for g in state["param_groups"]:
        groups.append({**g, "params": ordered[i:i + len(g["params"])]})
        i += len(g["params"])
    return {"state": {ordered[int(k)]: v for k, v in state["state"].items()}, "param_groups": groups}
