"""An ordered, bounded parallel map over worker processes (library; no side effects).

Both the cleaner (wikitext -> text) and the prep engine (text -> token ids) stream items
through a pool: results must come back in input order (so outputs do not depend on the
number of workers) and only a few items may be in flight (so memory does not grow with
the input). A worker that dies (killed, out of memory) raises BrokenProcessPool in the
caller instead of hanging it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterable, Iterator, TypeVar

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


def ordered_map(fn: Callable, items: Iterable[T], workers: int, *,
                arg: Callable[[T], Any] = lambda item: item, initializer=None, initargs=(),
                ahead: int = 2) -> Iterator[tuple[T, Any]]:
    """Yield ``(item, fn(arg(item)))`` in input order, computed in ``workers`` processes.

    At most ``ahead * workers + 1`` items are submitted and not yet yielded. ``fn`` and
    ``initializer`` must be picklable (module-level). Closing the generator early (or an
    exception, Ctrl-C included) cancels what has not started and waits for the few tasks
    already running.
    """
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context(), initializer=initializer,
                               initargs=initargs)
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
