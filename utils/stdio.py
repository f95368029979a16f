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

:func:`mark_standard_output` / :func:`stdout_refused`: an ``OSError`` from writing standard
output (``> /dev/full``: ENOSPC, an I/O error) carries a mark, so the entry point names
standard output ("cannot write to standard output") instead of reporting an unexpected error
with a log file, as it did; an errno alone cannot tell it from a full disk under a checkpoint.
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


class _StandardOutput(io.FileIO):
    """Descriptor 1, whose write errors are marked ``standard_output``."""

    def write(self, b):
        try:
            return super().write(b)
        except OSError as e:
            e.standard_output = True
            raise


def mark_standard_output() -> None:
    """Put ``sys.stdout`` (Python's own, on descriptor 1) over :class:`_StandardOutput`, with the
    same encoding and buffering; any other stream (a test's capture) is left alone."""
    out = sys.stdout
    if out is None or out is not sys.__stdout__ or not isinstance(out, io.TextIOWrapper):
        return
    try:
        if out.fileno() != 1:
            return
        out.flush()
    except (OSError, ValueError):
        return
    raw = _StandardOutput(1, "w", closefd=False)
    # python -u / PYTHONUNBUFFERED: Python's stdout has no buffer layer (each write goes out at
    # once); keep it so, or lines a reader waits for would sit in a buffer
    layer = raw if isinstance(getattr(out, "buffer", None), io.FileIO) else io.BufferedWriter(raw)
    sys.stdout = io.TextIOWrapper(layer, encoding=out.encoding, errors=out.errors,
                                  line_buffering=out.line_buffering, write_through=out.write_through)


def stdout_refused(e: BaseException) -> bool:
    """Whether ``e`` is standard output refusing its bytes; then ``sys.stdout`` becomes
    /dev/null, so that Python's flush at exit does not fail once more."""
    if not getattr(e, "standard_output", False):
        return False
    drop_standard_output()
    return True


def drop_standard_output() -> None:
    """``sys.stdout`` to /dev/null for the rest of the process (Python flushes it at exit)."""
    sys.stdout = open(os.devnull, "w")          # noqa: SIM115


def refused_line(prog: str, e: OSError) -> str:
    """What an entry point says on stderr when standard output refused its bytes."""
    return (f"{prog}: error: cannot write to standard output: {e.strerror}; send the output "
            f"somewhere that takes it.")
