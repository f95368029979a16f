"""Atomic file writes: a file appears under its final name only when it is complete.

A crash or Ctrl-C mid-write leaves at most a hidden ``.NAME.tmp-PID`` sibling (which the
writer removes when it can), never a half-written file under the real name. A refused write is
named (utils/disk.py). Imports nothing of the project above utils.disk, so every other module
(utils.config included) can use it.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator, Optional

from utils.disk import named


def temp_path(path: Path, pid: Optional[int] = None) -> Path:
    """The hidden temp sibling a file is written under by process ``pid`` (default: this
    one); same folder, so the rename is atomic."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if pid is None else pid}")


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb", *, needed: Optional[int] = None,
                setting: Optional[str] = None) -> Iterator[IO]:
    """Open a temp sibling of ``path`` for writing; when the block ends normally it is synced
    and renamed to ``path``; when the block raises, it is removed and nothing is replaced.

    A write the file system refuses (full, read-only, no permission, the folder gone, a file in
    the way) is raised as utils.disk.WriteError naming the device and ``path`` (a full disk also
    with ``needed``, the bytes the write needs when the caller knows them, and the room left);
    ``setting`` is the config key or flag that chose the folder (what to point elsewhere)."""
    path = Path(path)
    tmp = temp_path(path)
    own = True                       # a failure of the write itself, not of the caller's block
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            own = False
            yield f
            own = True
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        written = tmp.stat().st_size if tmp.is_file() else None
        _remove(tmp)
        refused = named(path, e, written=written, needed=needed, setting=setting, own=own)
        if refused is None:
            raise
        raise refused from e
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path) -> None:
    """Remove a temp file if it is there (its folder may be gone, or a file)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        tmp.unlink()


def write_json_atomic(path: Path, obj: Any, setting: Optional[str] = None) -> None:
    """Pretty JSON (UTF-8, non-ASCII kept) written atomically."""
    with atomic_open(path, "w", setting=setting) as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
