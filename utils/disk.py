"""A write the file system refuses, named (library; no side effects; imports nothing of the
project but its error class, so utils/atomic.py, which every writer uses, can use it).

Contract (docs/DESIGN.md, "Files on disk"): a full disk, a read-only file system, a folder the
process may not write, a folder removed while a stage ran and a file where a folder belongs are
each one :class:`WriteError` (a PipelineError: exit 1, no traceback) naming the device, the path
and what to do; for a full disk also the room the write needed and the room left::

    no space left on /dev/vda (mounted at /) writing checkpoints/run/checkpoint_latest.pt: needs
    about 18.4 MB, 3.1 MB free; free space or point paths.checkpoints_dir elsewhere

The writer's temporary file is removed and nothing it replaces is touched (utils/atomic.py).
torch.save reports a full disk as a RuntimeError from its zip writer, not as ENOSPC: such an
error (or any other failed write) counts as a full disk when the device has less room left than
the write needed, or almost none (:data:`SLACK`), when it failed; its message is never parsed.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional

from utils.errors import PipelineError

FULL = (errno.ENOSPC, errno.EDQUOT)
SLACK = 1 << 20          # a write that failed with less than this left is taken for a full disk
REFUSALS = {             # errno -> (what the file system said, what to do)
    errno.EROFS: ("the file system is read-only", "give a writable folder"),
    errno.EACCES: ("permission denied", "give a folder you can write to, or fix its permissions"),
    errno.EPERM: ("the operation is not permitted there", "give another folder"),
    errno.ENOENT: ("its folder no longer exists (removed while the stage ran?)",
                   "run the command again (it creates the folder), or give another folder"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "move the file or give another folder"),
    errno.EISDIR: ("a folder is in the way of the file", "move the folder or give another path"),
}


class WriteError(PipelineError):
    """A refused write, named: ``what`` is "full" or one of :data:`REFUSALS`' errnos."""

    def __init__(self, path, what, *, written: Optional[int] = None, needed: Optional[int] = None,
                 free: Optional[int] = None, setting: Optional[str] = None, note: str = ""):
        self.path, self.what, self.written, self.needed, self.free = Path(path), what, written, needed, free
        self.setting = setting                    # the config key or flag that names the folder
        self.note = note                          # what the writer kept (e.g. "an earlier export is unchanged")
        self.device = device_of(self.path)
        super().__init__(str(self.path))

    def __reduce__(self):                         # crosses from a worker process whole
        return (_rebuild, (self.path, self.what, dict(written=self.written, needed=self.needed, free=self.free,
                                                     setting=self.setting, note=self.note)))

    def __str__(self) -> str:
        elsewhere = f"point {self.setting} elsewhere" if self.setting else "write it elsewhere"
        if self.what == "full":
            if self.needed:
                need = f"needs about {mb(self.needed)} MB, "
            elif self.written:
                need = f"needs more than the {mb(self.written)} MB it had written, "
            else:
                need = ""
            free = f"{mb(self.free)} MB free" if self.free is not None else "free space unknown"
            return (f"no space left on {self.device} writing {self.path}: {need}{free}; free space or "
                    f"{elsewhere}" + (f". {self.note}" if self.note else ""))
        said, todo = REFUSALS[self.what]
        return (f"cannot write {self.path} on {self.device}: {said}; {todo} ({elsewhere})"
                + (f". {self.note}" if self.note else ""))


def _rebuild(path, what, kw: dict) -> WriteError:
    return WriteError(path, what, **kw)


def mb(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 1e6:,.1f}"


def existing_folder(path) -> Path:
    """The nearest folder of ``path`` (itself or an ancestor) that exists."""
    p = Path(os.path.abspath(path))
    while not p.is_dir() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path) -> Optional[int]:
    """Bytes free for this process on the device that holds ``path`` (or would), or None."""
    try:
        return shutil.disk_usage(existing_folder(path)).free
    except OSError:
        return None


def device_of(path) -> str:
    """The device that holds ``path``, as ``SOURCE (mounted at MOUNT)`` from /proc/self/mountinfo
    (the longest mount point above it); the mount point alone where that file is not there."""
    folder = str(existing_folder(path).resolve())
    best, source = "", None
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = fields[4].encode().decode("unicode_escape") if "\\" in fields[4] else fields[4]
        inside = folder == mount or folder.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, source = mount, line.split(" - ", 1)[1].split()[1]
    if source is None:
        return f"the disk holding {folder}"
    return f"{source} (mounted at {best})"


def named(path, exc: BaseException, *, written: Optional[int] = None, needed: Optional[int] = None,
          setting: Optional[str] = None, own: bool = True, note: str = "") -> Optional[WriteError]:
    """``exc``, raised while writing ``path``, as a :class:`WriteError`, or None when it is not a
    refused write. ``own``: raised by the write itself (opening, syncing, renaming the file);
    otherwise by the caller's block between open and close, where only a full disk is taken to be
    about this file (a read of some input can fail with EACCES too)."""
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    free = free_bytes(path)
    if code in FULL or (isinstance(exc, (OSError, RuntimeError)) and code not in REFUSALS
                        and free is not None and (free < SLACK or (needed is not None and free < needed))):
        return WriteError(path, "full", written=written, needed=needed, free=free, setting=setting, note=note)
    if own and code in REFUSALS:
        return WriteError(path, code, setting=setting, note=note)
    return None


def bytes_of(obj, _seen: Optional[set] = None) -> int:
    """The bytes of the tensors and arrays in a nested dict/list/tuple, each storage once (what
    torch.save writes, less its small framing): the room a checkpoint needs."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, dict):
        return sum(bytes_of(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(bytes_of(v, seen) for v in obj)
    if hasattr(obj, "untyped_storage"):                 # a torch tensor: saved with its whole storage
        try:
            storage = obj.untyped_storage()
        except (NotImplementedError, RuntimeError):     # sparse and other layouts have none: its values
            return int(obj.numel() * obj.element_size())
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes())
    return int(getattr(obj, "nbytes", 0) or 0)
