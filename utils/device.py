"""Which torch device a stage runs on: one rule for train, sft, infer and benchmark.

``resolve_device(name, setting, local_rank)``: ``auto`` is CUDA when available, else the CPU;
``cuda`` under torchrun is this process's GPU (``cuda:LOCAL_RANK``); asking for CUDA where
there is none is a usage error (exit 2) naming the setting, never a silent CPU fallback; so is
any other name (``tpu``, ``cuda:x``: the accepted ones are auto, cpu, cuda and cuda:N).

``available_bytes(device)``: the memory a new allocation can take on ``device`` (a GPU's free
memory; on the CPU the kernel's MemAvailable, else free physical pages), as ``(bytes, "")``,
or ``(None, reason)`` where it cannot be read: the caller says the reason once and skips its
check.

``generation_dtype(name, device, quantize, setting)``: the dtype infer and serve cast a
model's weights to (``auto``: bf16 on a CUDA GPU, fp16 where it lacks bf16; as stored on the
CPU), or None to keep them.
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


def generation_dtype(name: str, device, quantize: str = "none", setting: str = "dtype"):
    """The weights' dtype of a model that only generates (infer, serve), or None to keep the
    stored one: ``auto`` casts to bf16 on CUDA (fp16 where the GPU has no bf16), as vLLM serves
    an fp32 checkpoint in half precision (decoding reads every weight per token: half the
    bytes, twice the tokens), and keeps the stored dtype on the CPU (fp32 products are the
    fast ones there, utils/generation/pack.py); ``fp32`` / ``bf16`` / ``fp16`` cast to that.
    Casting the weights, not autocast, since autocast would convert every weight again at
    every step. int8 weights (``quantize``) keep their fp32 scales and round activations to bf16
    themselves: ``auto`` keeps them, another dtype is a usage error naming ``setting``."""
    import torch     # see resolve_device
    if quantize != "none":
        if name != "auto":
            raise UsageError(f"{setting} is '{name}' with {quantize} weights: int8 weights keep fp32 "
                             f"scales and round the activations to bf16 themselves; leave {setting} auto.")
        return None
    if name == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
