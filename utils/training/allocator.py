"""CPU training's memory allocator settings: glibc malloc tunables, applied by re-executing.

Contract:

- ``CPU_MALLOC_TUNABLES`` is what CPU training runs with: glibc's malloc serves large blocks
  from its heap instead of fresh mmaps (``mmap_threshold``), never trims the top of the heap
  back to the kernel (``trim_threshold``) and grows it 256 MiB at a time (``top_pad``). A
  training step frees and re-allocates the same large activation and gradient buffers every
  step; with glibc's defaults each of them is unmapped and page-faulted in again (tens of
  thousands of minor faults per step; trim_threshold and top_pad without mmap_threshold
  changed nothing measurable). With the tunables they stay in the heap: more tokens/s and a
  few page faults per step where there were tens of thousands, for a few percent more peak
  memory (perf/train_throughput.py; docs/performance.md, Training step). (jemalloc via
  LD_PRELOAD was slower: its decay-based purging faults even more.)
- glibc reads ``GLIBC_TUNABLES`` only when a process starts, so a CPU training process
  has to be re-executed once (``os.execve``: same pid, the same interpreter flags and
  arguments (``sys.orig_argv``), signal mask and ignored signals kept) with the tunables
  added to the environment. ``cpu_allocator_plan()`` says how (a :class:`Restart`, whose
  message the stage prints before it re-executes: only the stage's own code calls
  ``os.execve``), or returns a short note for the "training on CPU" line. No restart (and the
  reason as the note) when: the tunables are already set (the re-executed
  process, or a user's own ``GLIBC_TUNABLES``), ``LLM_CPU_ALLOCATOR=system`` is set (the
  opt-out), the C library is not glibc, the process is not the script named by ``script``
  (e.g. ``train.main`` called from Python or tests), or it is one rank of a torchrun job
  (every rank would re-exec under the elastic agent: set the variable before torchrun).
- ``cpu_allocator_env()`` is the environment to add (perf scripts use it to run HF alike).

No import side effects.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CPU_MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296:"
                       "glibc.malloc.top_pad=268435456")
OPT_OUT_ENV = "LLM_CPU_ALLOCATOR"


def cpu_allocator_env() -> dict[str, str]:
    """Environment variables CPU training runs with (empty when not on glibc)."""
    if platform.libc_ver()[0] != "glibc":
        return {}
    return {"GLIBC_TUNABLES": CPU_MALLOC_TUNABLES}


@dataclass(frozen=True)
class Restart:
    """How the stage re-executes itself with the allocator settings (``os.execve`` arguments)."""
    executable: str
    argv: list
    env: dict
    message: str


def cpu_allocator_plan(script: str = "train.py") -> tuple[Optional[Restart], Optional[str]]:
    """``(restart, note)``: a :class:`Restart` the stage's entry point performs (this module
    never re-executes anything), or None with a short note for the "training on CPU" line
    saying why not (see the module docstring)."""
    env = cpu_allocator_env()
    current = os.environ.get("GLIBC_TUNABLES", "")
    if not env:
        return None, None
    if current == env["GLIBC_TUNABLES"]:
        return None, "glibc malloc tunables set (large blocks kept in the heap, no trimming)"
    if current:
        return None, "GLIBC_TUNABLES given by the user: kept as is"
    if os.environ.get(OPT_OUT_ENV, "") == "system":
        return None, f"{OPT_OUT_ENV}=system: glibc malloc defaults"
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if Path(main_file).name != script or not sys.argv or Path(sys.argv[0]).name != script:
        return None, None
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return None, (f"malloc defaults (set GLIBC_TUNABLES={CPU_MALLOC_TUNABLES} before torchrun "
                      "for fewer page faults)")
    msg = (f"{script}: CPU run: restarting once with GLIBC_TUNABLES={CPU_MALLOC_TUNABLES} "
           f"(glibc malloc returns freed step buffers to the kernel otherwise; "
           f"{OPT_OUT_ENV}=system keeps the defaults).")
    return Restart(sys.executable, [sys.executable] + sys.orig_argv[1:], {**os.environ, **env}, msg), None
