"""An ordered, bounded parallel map over worker processes (library; no side effects).

Both the cleaner (wikitext -> text) and the prep engine (text -> token ids) stream items
through a pool: results must come back in input order (so outputs do not depend on the
number of workers) and only a few items may be in flight (so memory does not grow with
the input). A worker that dies (killed, out of memory) raises BrokenProcessPool in the
caller instead of hanging it. Workers die with the process that started them
(utils/processes.py ``die_with_parent``): a stage killed with SIGKILL, or by the out-of-memory
killer, leaves none running.
"""
from __future__ import annotations

import multiprocessing as mp
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from utils.processes import die_with_parent, os_parent_of_workers

T = TypeVar("T")


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
