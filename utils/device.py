"""Which torch device a stage runs on: one rule for train, sft, infer and benchmark.

``resolve_device(name, setting, local_rank)``: ``auto`` is CUDA when available, else the CPU;
``cuda`` under torchrun is this process's GPU (``cuda:LOCAL_RANK``); asking for CUDA where
there is none is a usage error (exit 2) naming the setting, never a silent CPU fallback; so is
any other name (``tpu``, ``cuda:x``: the accepted ones are auto, cpu, cuda and cuda:N).

``available_bytes(device)``: the memory a new allocation can take on ``device`` (a GPU's free
memory; on the CPU the kernel's MemAvailable, else free physical pages), as ``(bytes, "")``,
or ``(None, reason)`` where it cannot be read: the caller says the reason once and skips its
check.
"""
from __future__ import annotations

import os
from typing import Optional

from utils.cli import UsageError


def resolve_device(name: str, setting: str = "device", local_rank: int = 0):
    import torch     # 1.5 s: post_training imports this module, and `sft prepare` does not load torch
    want = name
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    kind = want.split(":")[0]
    if kind not in ("cpu", "cuda") or (":" in want and (kind == "cpu" or not want.split(":", 1)[1].isdigit())):
        raise UsageError(f"{setting} is '{name}': give auto, cpu, cuda or cuda:N (N a GPU index).")
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"{setting} is '{name}' but CUDA is not available here; use "
                             "--device cpu (or auto).")
        if want == "cuda":
            want = f"cuda:{local_rank}"
    return torch.device(want)



def available_bytes(device) -> tuple[Optional[int], str]:
    import torch     # as in resolve_device
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0]), ""
        except RuntimeError as e:               # a CUDA error from the driver
            return None, f"the free memory of {device} could not be read ({e})"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, ""
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        pass                                    # not Linux, or an unusual /proc: the next source
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), ""
    except (ValueError, OSError, AttributeError):   # no such sysconf name on this system
        return None, "the free memory of this machine could not be read (no /proc/meminfo or sysconf)"
