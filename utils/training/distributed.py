"""torch.distributed set-up for ``torchrun`` (library; nothing happens on import).

``torchrun --nproc_per_node=N train.py ...`` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE in their environment; :func:`init` turns that into a process group (NCCL on
CUDA, gloo on CPU) and a :class:`DistInfo`. A plain ``python train.py`` is world size 1 and
never touches torch.distributed. Only rank 0 logs and writes (``dist.is_main``).

:func:`launch_local` is the one-machine launch behind ``python main.py train --nproc-per-node
N``: torchrun's own entry point (``--standalone``) run inside the calling process, so that a
Ctrl-C or SIGTERM ends with the ranks' own messages and exit code 130 instead
of the launcher's traceback, and a failed rank with one line naming it.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as tdist
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import api as pcontext
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from utils.cli import EXIT_INTERRUPTED


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
        # Every way out of an interpreter that exits destroys the group, errors included: a group
        # still alive then lets C++ threads be destroyed unjoined ("terminate called without
        # an active exception", SIGABRT instead of the stage's exit code).
        atexit.register(shutdown)
    return DistInfo(rank, local_rank, world, backend)


def init_single(device_kind: str = "cpu") -> DistInfo:
    """A process group of this one process (an in-process HashStore: no rendezvous, no port):
    FSDP2 needs a group to shard over even where one rank holds everything, and its CPU
    offload on one GPU (a model whose weights, gradients and optimizer state outgrow the GPU,
    ``training.cpu_offload``) is such a case. The DistInfo is a one-process one (``enabled``
    False: no collective is needed)."""
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend=backend, store=tdist.HashStore(), rank=0, world_size=1)
        atexit.register(shutdown)
    return DistInfo(0, 0, 1, backend)


def shutdown() -> None:
    """Destroy the process group: at the process's end only (``init`` registers it with
    atexit; a torchrun rank of a stage script ends with ``os._exit`` before it, utils/cli.py),
    once no model holds the group. A DDP model alive after the group is destroyed is left its
    last owner, and the model's Reducer frees it with the GIL held: gloo's destructor then
    joins its worker threads, while a worker may be waiting for the GIL to free a Python
    tensor of the group's last collective (torch hands a tensor's last reference to the
    worker when Python drops it first): both wait forever (a rank hung at exit)."""
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


def launch_local(script: Path, nproc: int, argv: Sequence[str], prog: str) -> int:
    """Run ``script argv`` as ``nproc`` DDP ranks on this machine and wait for them: what
    ``torchrun --standalone --nproc_per_node=N script ARGS`` does (torch's elastic agent,
    called in this process). Returns the exit code: 0; 130 when a stop signal (SIGINT,
    SIGTERM) ended the run, as for one process (the agent passes it to the ranks, which save
    their state and print how to resume); a failed rank's own exit code otherwise (its error is printed above, then
    torch's summary)."""
    # The agent turns a stop signal into SignalException and then waits for the ranks to
    # stop. A second signal (a supervisor's killpg also reaches main.py, which forwards it)
    # would raise again inside that wait and cut it short; take only the first one. The
    # agent installs the handler by this module-level name (torch 2.13, pinned).
    handler = getattr(pcontext, "_terminate_process_handler", None)
    fired: list[int] = []

    def first_signal_only(signum, frame):
        if not fired:
            fired.append(signum)
            handler(signum, frame)
    if handler is not None:
        pcontext._terminate_process_handler = first_signal_only
    try:
        torchrun.main([f"--nproc_per_node={nproc}", "--standalone", str(script), *map(str, argv)])
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"{prog}: the {nproc} ranks were stopped by {name}; see their messages above.",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        print(f"{prog}: rank {rank} of {nproc} failed (exit code {code}); its message is above.",
              file=sys.stderr)
        return code if code and code > 0 else 1
    finally:
        if handler is not None:
            pcontext._terminate_process_handler = handler
    return 0
