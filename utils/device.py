"""Which torch device a stage runs on: one rule for train, sft, infer and benchmark.

``resolve_device(name, setting, local_rank)``: ``auto`` is CUDA when available, else the CPU;
``cuda`` under torchrun is this process's GPU (``cuda:LOCAL_RANK``); asking for CUDA where
there is none is a usage error (exit 2) naming the setting, never a silent CPU fallback; so is
any other name (``tpu``, ``cuda:x``: the accepted ones are auto, cpu, cuda and cuda:N).
"""
from __future__ import annotations

from utils.cli import UsageError


def resolve_device(name: str, setting: str = "device", local_rank: int = 0):
    import torch
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

