"""The standard streams of an entry point (main.py, a stage's ``run_stage``), made safe to use
whatever the shell left them as (library: nothing happens on import; the standard library only,
so the router stays light).

:func:`open_standard_streams`: a descriptor 0, 1 or 2 the process was started without (``cmd
>&-``, ``2>&-``, ``<&-``) is opened on /dev/null, and Python gets a stream for it. Python left
``sys.stdout`` (or ``stderr`` / ``stdin``) None then: every ``.flush()`` of it failed (CPU
training could not start, its re-exec flushes both; every stage ended with a traceback), the
router's menu failed on ``input()``, and the next file the process opened took the free
descriptor, so what C code or a child process wrote to "standard output" went into that file.
Output nobody can read is dropped.
"""
from __future__ import annotations

import io
import os
import sys


def open_standard_streams() -> None:
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:                                    # closed: the lowest free descriptor is fd
            got = os.open(os.devnull, os.O_RDWR)
            if got != fd:
                os.dup2(got, fd)
                os.close(got)
    if sys.stdin is None:
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    if sys.stdout is None:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                      line_buffering=True)
    if sys.stderr is None:
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      errors="backslashreplace", line_buffering=True)
