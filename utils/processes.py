"""The processes a stage runs on (library; no side effects): the CPUs it may use, and worker
processes that die with the process that started them.

"0 = all cores" in every stage means :func:`available_cpus`. A worker calls
:func:`die_with_parent` first thing, so a stage killed with SIGKILL (which it cannot catch to
stop its workers), or by the out-of-memory killer, leaves none running; a stage started by
main.py calls it too, so it stops when main.py is killed (utils/cli.py).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional


def available_cpus() -> int:
    """CPUs this process may run on (affinity masks, taskset, cpusets), not the host's count:
    ``os.process_cpu_count()`` on Python 3.13+, else ``len(os.sched_getaffinity(0))``,
    else ``os.cpu_count()``. What "0 = all cores" means in every stage."""
    count = getattr(os, "process_cpu_count", None)
    if count is not None:
        return count() or 1
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


PR_SET_PDEATHSIG = 1             # linux/prctl.h


def os_parent_of_workers(ctx) -> Optional[int]:
    """The pid a worker started through ``ctx`` has as its parent: this process, except under
    the forkserver start method (the fork server is the parent; None: unknown)."""
    return None if ctx.get_start_method() == "forkserver" else os.getpid()


def die_with_parent(parent: Optional[int], sig: int = signal.SIGKILL) -> None:
    """Call first thing in a worker process: ``sig`` reaches it when its parent exits, so a
    stage killed with SIGKILL (which it cannot catch to stop its workers) leaves no worker
    running on. Linux: the kernel sends it (``PR_SET_PDEATHSIG``); elsewhere a daemon thread
    checks the parent once a second. ``parent``: the pid the worker's parent had
    (:func:`os_parent_of_workers`); if the worker already has another parent (its parent died
    while it started), ``sig`` is sent at once. None: not checked."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        start = os.getppid()

        def watch() -> None:
            while os.getppid() == start:
                time.sleep(1.0)
            os.kill(os.getpid(), sig)
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
