"""Atomic file writes: a file appears under its final name only when it is complete.

A crash or Ctrl-C mid-write leaves at most a hidden ``.NAME.tmp-PID`` sibling (which the
writer removes when it can), never a half-written file under the real name. No project
imports, so every other module (utils.config included) can use it.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator, Optional


def temp_path(path: Path, pid: Optional[int] = None) -> Path:
    """The hidden temp sibling a file is written under by process ``pid`` (default: this
    one); same folder, so the rename is atomic."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temp sibling of ``path`` for writing; when the block ends normally it is synced
    and renamed to ``path``; when the block raises, it is removed and nothing is replaced."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Pretty JSON (UTF-8, non-ASCII kept) written atomically."""
    with atomic_open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
