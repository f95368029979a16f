"""Where a run ran: the code's git commit, package versions and the machine (library; nothing
runs on import).

:func:`describe` is what the training logger records once per start or resume, in the
``config`` record of ``logs/raw_metrics/<run>.jsonl`` (utils/training/logging_utils.py), so a
report can say which code, packages and machine produced a run (``main.py report``)::

    {"git": {"commit": "3f2c...", "dirty": false},          # or {"commit": null, "reason": "..."}
     "packages": {"python": "3.11.7", "torch": "2.13.0", ...},   # null: not installed
     "machine": {"hostname": ..., "os": ..., "cpu": ..., "cpus": 2, "memory_gb": 23.4,
                 "gpus": ["NVIDIA H100 80GB HBM3", ...], "cuda": "12.8"}}

``dirty`` is True when ``git status --porcelain`` lists anything: changed tracked files or
new files git does not ignore (the pipeline's data, checkpoints and logs are git-ignored). Under
torchrun only rank 0 logs, so a multi-node run records rank 0's machine. Cost: two ``git``
calls and reading /proc; no network.
"""
from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional, Sequence

from utils.config import PROJECT_ROOT

PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "datasets", "safetensors",
            "sentencepiece", "flash-attn")
GIT_TIMEOUT_S = 10.0


def package_versions(names: Sequence[str] = PACKAGES) -> dict:
    """{package: installed version or None} for ``names``, and the Python version."""
    out: dict = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


# variables that point git at another repository than the one at -C (git hooks set GIT_DIR):
# a run started from one recorded that repository's commit
_GIT_LOCATORS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                 "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR", "GIT_NAMESPACE")


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATORS}
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL, env=env)


def git_state(root: Optional[Path] = None) -> dict:
    """``{"commit", "dirty"}`` of the checkout at ``root`` (default: the project root), or
    ``{"commit": None, "reason": ...}`` when git or the checkout is not there."""
    if root is None:
        root = PROJECT_ROOT
    try:
        head = _git(root, "rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "reason": f"{root} is not a git checkout"}
        status = _git(root, "status", "--porcelain")
    except FileNotFoundError:
        return {"commit": None, "reason": "git is not installed"}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"commit": None, "reason": f"git failed ({type(e).__name__})"}
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return {"commit": head.stdout.strip(), "dirty": dirty}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> Optional[float]:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict:
    """Host name, OS, CPU model and count, memory, and the CUDA GPUs torch sees."""
    import torch     # 1.5 s: status imports this module (through logging_utils) and needs no torch
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"hostname": platform.node(), "os": platform.platform(), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "memory_gb": _memory_gb(), "gpus": gpus,
            "cuda": torch.version.cuda}


def describe(root: Optional[Path] = None) -> dict:
    """The whole record (module docstring)."""
    return {"git": git_state(root), "packages": package_versions(), "machine": machine()}
