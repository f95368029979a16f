"""An ordered, bounded parallel map over worker processes (library; no side effects).

Both the cleaner (wikitext -> text) and the prep engine (text -> token ids) stream items
through a pool: results must come back in input order (so outputs do not depend on the
number of workers) and only a few items may be in flight (so memory does not grow with
the input). A worker that dies (killed, out of memory) raises BrokenProcessPool in the
caller instead of hanging it. Workers die with the process that started them
(:func:`die_with_parent`): a stage killed with SIGKILL, or by the out-of-memory killer, leaves
none running.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


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


def _start_worker(parent: Optional[int], initializer, initargs) -> None:
    die_with_parent(parent)
    if initializer is not None:
        initializer(*initargs)


def ordered_map(fn: Callable, items: Iterable[T], workers: int, *,
                arg: Callable[[T], Any] = lambda item: item, initializer=None, initargs=(),
                ahead: int = 2) -> Iterator[tuple[T, Any]]:
    """Yield ``(item, fn(arg(item)))`` in input order, computed in ``workers`` processes.

    At most ``ahead * workers + 1`` items are submitted and not yet yielded. ``fn`` and
    ``initializer`` must be picklable (module-level). Closing the generator early (or an
    exception, Ctrl-C included) cancels what has not started and waits for the few tasks
    already running. The workers die with this process (:func:`die_with_parent`, SIGKILL:
    they hold nothing to clean up).
    """
    ctx = mp.get_context()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                               initargs=(os_parent_of_workers(ctx), initializer, initargs))
    try:
        inflight: deque = deque()
        for item in items:
            inflight.append((item, pool.submit(fn, arg(item))))
            if len(inflight) > ahead * workers:
                first, future = inflight.popleft()
                yield first, future.result()
        while inflight:
            first, future = inflight.popleft()
            yield first, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
