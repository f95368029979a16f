"""torch.distributed set-up for ``torchrun`` (library; nothing happens on import).

``torchrun --nproc_per_node=N train.py ...`` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE in their environment; :func:`init` turns that into a process group (NCCL on
CUDA, gloo on CPU) and a :class:`DistInfo`. A plain ``python train.py`` is world size 1 and
never touches torch.distributed. Only rank 0 logs and writes (``dist.is_main``).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as tdist


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def init(device_kind: str = "cpu", timeout_s: float = 1800.0) -> DistInfo:
    """Initialize the process group when launched by torchrun (WORLD_SIZE > 1)."""
    world = env_world_size()
    if world <= 1:
        return DistInfo()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    if not tdist.is_initialized():
        tdist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, local_rank, world, backend)


def shutdown() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        tdist.barrier()


def all_reduce_sum(info: DistInfo, values: list[float], device) -> list[float]:
    """Sum a few floats over ranks (float64); identity on one process."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t.tolist()


def any_rank(info: DistInfo, flag: bool, device) -> bool:
    """True on every rank when ``flag`` is true on any rank (a stop request, ...)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item() > 0)


def gather_objects(info: DistInfo, obj: Any) -> list:
    """Every rank's ``obj`` (picklable plain data), in rank order, on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(info: DistInfo, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]
