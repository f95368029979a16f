"""torch.distributed set-up for ``torchrun`` (library; nothing happens on import).

``torchrun --nproc_per_node=N train.py ...`` starts N processes with RANK, LOCAL_RANK and
WORLD_SIZE in their environment; :func:`init` turns that into a process group (NCCL on
CUDA, gloo on CPU) and a :class:`DistInfo`. A plain ``python train.py`` is world size 1 and
never touches torch.distributed. Only rank 0 logs and writes (``dist.is_main``).

:func:`launch_local` is the launch behind ``python main.py train --nproc-per-node N`` (one
machine: ``--standalone``) and ``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` (this
machine as one node of several: c10d rendezvous, :class:`Launch`): torchrun's own entry point
run inside the calling process, so that a Ctrl-C or SIGTERM ends with the ranks' own messages
and exit code 130 instead of the launcher's traceback, and a failed rank with one line naming
it. ``max_restarts`` > 0 is torchrun's elastic restart: when a rank dies, the agent stops the
others and starts them all again (``TORCHELASTIC_RESTART_COUNT`` = the attempt,
:func:`restart_count`); the stage script resumes from its newest checkpoint by itself.

Restarts and torch's shared rendezvous store (torch 2.13): the c10d rendezvous hands the
workers of every attempt one TCPStore, whose keys from the attempt before (each rank's
address) are read by the next attempt's process group set-up, which then connects to a dead
rank (pytorch/pytorch#135712, #167288). A launch with restarts sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's own switch: a fresh store per attempt);
:func:`store_warning` says so to a user who launched torchrun by hand without it.
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
from torch.distributed.elastic.rendezvous.api import RendezvousError

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


def restart_count() -> int:
    """The attempt of this worker under torchrun's elastic restarts: 0 for the first (and
    outside torchrun), k after the k-th restart of the worker group."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(value) if value.isdigit() else 0


def max_restarts() -> int:
    """torchrun's ``--max-restarts`` as the workers see it (0 outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    return int(value) if value.isdigit() else 0


SHARED_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def store_warning() -> Optional[str]:
    """What to tell a worker's user whose torchrun restarts workers over torch's shared
    rendezvous store (module docstring), or None."""
    if max_restarts() > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"torchrun restarts the workers (--max-restarts {max_restarts()}) but shares its "
                "rendezvous store with them, and in this torch a restarted worker then reads the "
                "dead workers' addresses and fails (pytorch/pytorch#135712): export "
                f"{SHARED_STORE_SWITCH}=1 before torchrun (python main.py train sets it itself)")
    return None


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank's process is gone (killed,
    out of memory, its node lost): gloo says "Connection closed by peer" or "Connection reset by
    peer", NCCL raises DistBackendError."""
    if isinstance(e, getattr(tdist, "DistBackendError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("Connection closed by peer" in text
                                            or "Connection reset by peer" in text)


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


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this machine's ranks are started: ``nproc`` per node; one node (``--standalone``) or
    node ``node_rank`` of ``nnodes`` meeting at ``endpoint`` (HOST:PORT, c10d rendezvous hosted
    by node 0, keyed by ``run_id``); ``max_restarts`` elastic restarts of the workers."""
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    endpoint: Optional[str] = None
    run_id: str = "none"
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def torchrun_args(self) -> list[str]:
        """torchrun's flags for this launch (what the docs' hand-written launch spells out)."""
        out = [f"--nproc_per_node={self.nproc}"]
        if self.nnodes == 1:
            out.append("--standalone")
        else:
            # torchrun's own --node_rank applies to the static rendezvous only (it warns and
            # ignores it with c10d, whose rendezvous numbers the nodes): here the node rank says
            # which node hosts the rendezvous store, at the endpoint
            out += [f"--nnodes={self.nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={self.endpoint}",
                    f"--rdzv_id={self.run_id}", f"--rdzv_conf=is_host={int(self.node_rank == 0)}"]
        if self.max_restarts:
            out.append(f"--max_restarts={self.max_restarts}")
        return out


def launch_local(script: Path, launch: "Launch | int", argv: Sequence[str], prog: str) -> int:
    """Run ``script argv`` as this machine's ranks of ``launch`` (an int: that many ranks of
    one machine) and wait for them: what ``torchrun FLAGS script ARGS`` does (torch's elastic
    agent, called in this process). Returns the exit code: 0; 130 when a stop signal (SIGINT,
    SIGTERM) ended the run, as for one process (the agent passes it to the ranks, which save
    their state and print how to resume); a failed rank's own exit code otherwise (its error
    is printed above, then torch's summary), after the restarts ``launch.max_restarts`` allows."""
    if isinstance(launch, int):
        launch = Launch(launch)
    nproc = launch.world_size
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
    if launch.max_restarts:                     # see the module docstring
        os.environ.setdefault(SHARED_STORE_SWITCH, "1")
    try:
        torchrun.main([*launch.torchrun_args(), str(script), *map(str, argv)])
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"{prog}: the {launch.nproc if launch.nnodes > 1 else nproc} ranks"
              f"{' of this node' if launch.nnodes > 1 else ''} were stopped by {name}; see their "
              "messages above.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        after = (f" after {launch.max_restarts} restart(s) of the workers" if launch.max_restarts else "")
        print(f"{prog}: rank {rank} of {nproc} failed (exit code {code}){after}; its message is above.",
              file=sys.stderr)
        return code if code and code > 0 else 1
    except RendezvousError as e:
        print(f"{prog}: node {launch.node_rank} of {launch.nnodes}: the rendezvous at {launch.endpoint} "
              f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): node 0 must "
              "be started with the same --rdzv-endpoint and --name, its port free there and reachable "
              "from every node.", file=sys.stderr)
        return 1
    finally:
        if handler is not None:
            pcontext._terminate_process_handler = handler
    return 0
