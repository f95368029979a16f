"""Sharded checkpoints: the folder an FSDP2 run writes through ``torch.distributed.checkpoint``
(DCP), each rank its own shards (library; nothing happens on import).

Layout. A sharded checkpoint is a folder beside the plain files, named like the file it stands
for with ``.dcp`` for ``.pt`` (``checkpoint_latest.dcp/``, ``checkpoint_step_N.dcp/``)::

    .metadata                 DCP's index: every tensor's global shape, dtype and where its
                              chunks are (rank 0 writes it)
    __R_0.distcp              rank R's shards of every tensor (each rank writes its own)
    meta.pt                   torch.save of the plain entries of utils/training/checkpoint.py's
                              format (format_version, kind, model_args, step, epoch, tokens_seen,
                              data_position, rng of every rank, scheduler, metrics, config,
                              tokenizer, ...) plus ``optimizer_groups`` ({name: param_groups, the
                              parameters named by their state-dict names}) and ``sharded``
                              ({"world_size": N})
    manifest.json             written last: {file: {"bytes", "crc32"}} of every file above

DCP holds only tensors: ``model.<name>`` (the model's state dict) and
``optimizer.<opt>.state.<name>.<stat>`` (each optimizer's per-parameter state, keyed by the
parameter's name, not its position), so DCP's planner reshards them for any world size: a run
saved on N ranks loads on M. Non-tensor data never goes through DCP (its reader unpickles those
with ``weights_only=False``), and ``.metadata`` is read with an unpickler that takes DCP's
metadata classes only (:class:`SafeReader`): a checkpoint folder is data, never code.

Atomic. The ranks write into a hidden temp folder ``.NAME.tmp-HOST-PID`` (rank 0's host and
pid, :func:`writer_tag`); when every rank is done, rank 0 writes meta.pt and the manifest,
moves the previous folder aside (``.NAME.old-HOST-PID``), renames the new one into place and
removes the old one. A save killed at any point leaves the previous checkpoint loadable: until
the rename it is untouched; between the two renames it waits under ``.NAME.old-HOST-PID``.

Several hosts, one file system. Whether the process that wrote a temp name is alive can only be
known on its own host, so nothing that merely reads a checkpoint changes a run folder:

- :func:`recover` (undo what a killed save left: put ``.NAME.old-*`` back, remove
  ``.NAME.tmp-*``) is run only by the job that writes the run, on its rank 0, at its start
  (train.py, before any rank reads its resume checkpoint; the Trainer's first step). It acts on
  the leftovers of this host's dead processes, and of every other host's: a job that starts
  writing a run takes the run over (two jobs must never write one run folder at once). A save
  of a process of this host that is alive is left alone, and said.
- :func:`read` (infer, benchmark, export, serve, sft, a resume) never renames or removes
  anything. A checkpoint whose save is in flight (``NAME`` moved aside, the new one not yet in
  place), on this host or another, is read from the folder moved aside: the previous
  checkpoint, complete, and the reader says so. A folder swapped away while it was read (the
  save finished meanwhile) is read again under its name, the new checkpoint, also said.
  Several nodes: the run folder must be on a file system every node sees (as for torchtitan).

Reading. :func:`read` gives the same dict as utils/training/checkpoint.py's ``read_checkpoint``
for a plain file, with the same checks: the manifest first (a missing, truncated or damaged
file is named, nothing is loaded), then the entries' types, then the weights' names and shapes
(from DCP's index, before any tensor is read) and finiteness. ``tensors=False`` (an FSDP
resume: each rank loads its own shards straight into the sharded model, utils/training/fsdp.py)
reads no tensor; otherwise the tensors are consolidated in this process, without writing
anything: the model's weights (purpose "weights") or also the optimizers' state in the plain
format's positional form (purpose "resume"), so every reader of weights (infer, benchmark,
export, sft, serve) and a one-process resume take a sharded checkpoint as they take a file.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import socket
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata

from utils.disk import named
from utils.errors import error_line
from utils.training import distributed as D
from utils.training.checkpoint import FORMAT_VERSION, CheckpointError, pid_alive, validate

SUFFIX = ".dcp"
META_FILE = "meta.pt"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = ".metadata"
MODEL, OPTIMIZER = "model", "optimizer"
# What DCP's load raises when shards and index disagree: CheckpointException gathers every rank's
# failure; one process raises the reader's own (a size mismatch is an AssertionError there).
READ_ERRORS = (CheckpointException, RuntimeError, OSError, ValueError, KeyError, AssertionError)


def is_sharded(path) -> bool:
    """A sharded checkpoint's path (a ``*.dcp`` name; the folder may be missing or damaged)."""
    return Path(path).suffix == SUFFIX


def sharded_name(name: str) -> str:
    """``checkpoint_latest.pt`` -> ``checkpoint_latest.dcp``."""
    return str(Path(name).with_suffix(SUFFIX))


# --------------------------------------------------------------------------- writing
def save(path, tensors: dict, meta: dict, dist: D.DistInfo) -> Path:
    """Write a sharded checkpoint (every rank calls, with its own shards in ``tensors``:
    ``{"model": ..., "optimizer": {...}}`` of tensors or DTensors; ``meta``: rank 0's plain
    entries). Atomic as the module docstring says; returns ``path``."""
    path = Path(path)
    tmp = None
    if dist.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = aside(path, "tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = Path(D.broadcast_object(dist, str(tmp)))
    try:
        with warnings.catch_warnings():     # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(tensors, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True,
                                                              sync_files=True, thread_count=1),
                     no_dist=not dist.enabled)
        own = {f.name: _file_record(f) for f in sorted(tmp.glob(f"__{dist.rank}_*.distcp"))}
        records = D.gather_objects(dist, own)
        if dist.is_main:
            with open(tmp / META_FILE, "wb") as f:
                torch.save({"format_version": FORMAT_VERSION, **meta}, f)
                f.flush()
                os.fsync(f.fileno())
            manifest = {name: rec for part in records for name, rec in part.items()}
            for name in (INDEX_FILE, META_FILE):
                manifest[name] = _file_record(tmp / name)
            _write_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
            _swap_in(tmp, path)
    except BaseException as e:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        refused = _refused_write(path, e)
        if refused is None:
            raise
        raise refused from None
    D.barrier(dist)
    return path


def _refused_write(path: Path, e: BaseException):
    """A full disk or a refused write (DCP's CheckpointException carries each rank's own) as
    utils.disk's WriteError naming the folder and ``paths.checkpoints_dir``; None otherwise."""
    causes = [pair[0] for pair in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    for cause in causes:
        refused = named(path, cause, setting="paths.checkpoints_dir") if isinstance(
            cause, (OSError, RuntimeError)) else None
        if refused is not None:
            return refused
    return None


def _file_record(f: Path) -> dict:
    crc = 0
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": f.stat().st_size, "crc32": crc}


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _swap_in(tmp: Path, path: Path) -> None:
    """``tmp`` becomes ``path``; a previous ``path`` waits under ``.NAME.old-HOST-PID`` between
    the two renames (readers read it there; :func:`recover` puts it back after a crash there),
    then is removed."""
    _fsync_dir(tmp)
    old = aside(path, "old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_tag() -> str:
    """This host, as a temp name carries it: the host name (characters other than letters,
    digits, ``.`` and ``_`` as ``_``) and the first 8 characters of the kernel's boot id where
    there is one (two machines named alike, or this one after a reboot, whose pids were
    reused, are told apart)."""
    name = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()[:8]
    except OSError:
        boot = ""
    return f"{name}.{boot}" if re.fullmatch(r"[0-9a-f]{8}", boot) else name


def aside(path: Path, kind: str, tag: Optional[str] = None, pid: Optional[int] = None) -> Path:
    """The hidden name of ``path``'s save in flight: ``kind`` "tmp" (the new folder being
    written) or "old" (the previous one moved aside), of writer ``tag`` (default this host)
    and ``pid`` (default this process)."""
    return path.with_name(f".{path.name}.{kind}-{tag or writer_tag()}-{pid or os.getpid()}")


_ASIDE = re.compile(r"^\.(?P<name>.+" + re.escape(SUFFIX) + r")\.(?P<kind>tmp|old)-(?:(?P<tag>.+)-)?(?P<pid>\d+)$")


def in_flight(directory) -> list[dict]:
    """The saves in flight (or killed) in ``directory``: ``{"path", "name", "kind", "tag",
    "pid"}`` per hidden folder, newest first; ``tag`` None for a name without a host (a save
    of an earlier version of this program)."""
    out = []
    for p in Path(directory).glob(f".*{SUFFIX}.*-*"):
        m = _ASIDE.match(p.name)
        if m and p.is_dir():
            out.append({"path": p, **m.groupdict(), "pid": int(m["pid"])})
    return sorted(out, key=lambda e: _mtime(e["path"]), reverse=True)


def _mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except OSError:
        return 0


def _writer(e: dict) -> str:
    return f"pid {e['pid']} on {'this host' if e['tag'] == writer_tag() else 'host ' + (e['tag'] or '(not recorded)')}"


def recover(directory) -> list[str]:
    """Undo what killed saves left in run folder ``directory`` (the writing job's rank 0, at its
    start, only: module docstring): a folder moved aside is renamed back when its checkpoint is
    missing, else removed; a temp folder is removed. A save of a live process of this host is
    left alone. Returns one line per folder, saying what was done and whose it was."""
    said = []
    me = writer_tag()
    for e in in_flight(directory):
        p = e["path"]
        here = e["tag"] in (me, None)      # no tag: this program's earlier naming, judged here as before
        if here and e["pid"] != os.getpid() and pid_alive(e["pid"]):
            said.append(f"left {p.name} alone: its writer ({_writer(e)}) is running; if that is not "
                        "a training job (a reused pid), remove or rename it yourself")
            continue
        target = p.with_name(e["name"])
        if e["kind"] == "old" and not target.exists():
            try:
                os.replace(p, target)
            except OSError as err:
                raise CheckpointError(target, f"a save killed mid-way left the previous checkpoint at {p}, "
                                              f"which cannot be renamed back ({err.strerror or err}); rename "
                                              f"it to {target.name} yourself.") from None
            said.append(f"put {target.name} back: a save by {_writer(e)} was killed between its renames")
        else:
            shutil.rmtree(p, ignore_errors=True)
            said.append(f"removed {p.name}, left by a save of {_writer(e)} that did not finish")
    return said


def remove(path) -> None:
    """Delete a sharded checkpoint folder (rotation; a run that switched formats)."""
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- reading
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: this takes the classes DCP writes there and nothing
    else, so a forged index cannot run code."""
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
               ("pathlib", "PureWindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}

    def find_class(self, module, name):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        # classes only: the module's other names (os, torch, dataclass) would give a pickle a
        # module object whose attributes BUILD could overwrite in this process
        if module in self.ALLOWED_MODULES and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with a safe ``.metadata`` read: only DCP's metadata classes, and only
    tensor entries (non-tensor entries would be unpickled by DCP's planner)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / INDEX_FILE
        md = read_index(path.parent)
        md.storage_meta = md.storage_meta or dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def read_index(folder: Path):
    """DCP's index of ``folder`` (safely unpickled), refused unless every entry is a tensor."""
    path = Path(folder) / INDEX_FILE
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"DCP's index is damaged or not DCP's ({type(e).__name__}: "
                                    f"{str(e)[:160]}); nothing was loaded. Use another checkpoint "
                                    "of the run.") from None
    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(entries, dict):
        raise CheckpointError(path, "is not DCP's index of a checkpoint; nothing was loaded.")
    odd = [k for k, v in entries.items() if not isinstance(v, dcp_metadata.TensorStorageMetadata)]
    if odd:
        raise CheckpointError(path, f"entries that are not tensors ({', '.join(odd[:3])}): this "
                                    "pipeline writes tensors only through DCP (pickled objects are "
                                    "refused, never run).")
    return md


def verify(path: Path, names: Optional[list[str]] = None) -> dict:
    """The manifest of sharded checkpoint ``path``, every file it lists (or only ``names``)
    checked for its size and CRC-32: a missing, truncated or damaged file is named (CheckpointError)."""
    if not path.is_dir():
        raise CheckpointError(path, "sharded checkpoint folder not found. List runs with `python "
                                    "main.py status`." if not path.exists() else
                                    "is a file, not a sharded checkpoint folder (*.dcp).")
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(path, f"has no {MANIFEST_FILE}: the save never completed. Use another "
                                    "checkpoint of the run.") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"{MANIFEST_FILE} is unreadable ({e}). Use another checkpoint "
                                    "of the run.") from None
    if not isinstance(manifest, dict) or INDEX_FILE not in manifest or META_FILE not in manifest:
        raise CheckpointError(path, f"{MANIFEST_FILE} is damaged (it must list {INDEX_FILE} and "
                                    f"{META_FILE}). Use another checkpoint of the run.")
    for name in (names if names is not None else sorted(manifest)):
        _check_file(path, name, manifest.get(name))
    return manifest


def _check_file(folder: Path, name: str, want) -> None:
    f = folder / name
    if not isinstance(want, dict) or "/" in name or name.startswith(".."):
        raise CheckpointError(f, f"is not listed properly in {MANIFEST_FILE}: a damaged checkpoint.")
    if not f.is_file():
        raise CheckpointError(f, "missing: the shard file of a sharded checkpoint is gone. Use "
                                 "another checkpoint of the run.")
    if f.stat().st_size != want.get("bytes"):
        raise CheckpointError(f, f"{f.stat().st_size} bytes where the save wrote {want.get('bytes')}: "
                                 "truncated or replaced. Use another checkpoint of the run.")
    if _file_record(f)["crc32"] != want.get("crc32"):
        raise CheckpointError(f, "corrupt: its bytes do not match the checksum stored when it was "
                                 "written (damaged since: a bad copy or disk). Nothing was loaded; use "
                                 "another checkpoint of the run.")


def read_meta(path: Path) -> dict:
    """meta.pt (plain data, ``weights_only``)."""
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(path / META_FILE, f"cannot be read ({type(e).__name__}: "
                                                f"{str(e).splitlines()[0][:160] if str(e) else ''}); "
                                                "nothing from it was executed.") from None
    if not isinstance(meta, dict):
        raise CheckpointError(path / META_FILE, "is not the checkpoint's dict of entries.")
    return meta


READ_TRIES = 3


def read(path, purpose: str = "weights", shapes_of: Optional[Callable[[dict, dict], dict]] = None,
         tensors: bool = True) -> dict:
    """A sharded checkpoint as the plain format's dict (module docstring), validated like a
    plain file; ``tensors=False``: without "model" and "optimizer" (an FSDP resume loads them
    rank by rank: :func:`load_into`), the weights' names and shapes checked from DCP's index.
    Changes nothing on disk: a save in flight is read around (module docstring), said on stderr;
    ``ckpt["sharded"]["path"]`` is the folder read."""
    path = Path(path)
    attempt = 0
    while True:
        attempt += 1
        folder = _readable(path)
        before = _inode(folder)
        try:
            ckpt = _read_folder(folder, purpose, shapes_of, tensors)
        except (CheckpointError, OSError):
            if attempt < READ_TRIES and before is not None and _inode(folder) != before:
                # swapped away while read (the save finished meanwhile): read it again
                print(f"note: {folder.name} was replaced by a save while it was read; reading "
                      f"{path.name} again.", file=sys.stderr, flush=True)
                continue
            raise
        if folder != path:
            print(f"note: {path.name}: a save is replacing it ({_writer(_entry(folder))}, in flight "
                  f"or killed between its renames); read the checkpoint it replaces (step "
                  f"{ckpt.get('step')}) from {folder.name}, and changed nothing.", file=sys.stderr, flush=True)
        return ckpt


def _inode(p: Path) -> Optional[int]:
    try:
        return p.stat().st_ino
    except OSError:
        return None


def _entry(folder: Path) -> dict:
    return {**_ASIDE.match(folder.name).groupdict(), "pid": int(_ASIDE.match(folder.name)["pid"])}


def _readable(path: Path) -> Path:
    """``path``, or while a save swaps it (``path`` missing, moved aside under ``.NAME.old-*``)
    the folder moved aside, the newest one if several."""
    if path.exists():
        return path
    olds = [e["path"] for e in in_flight(path.parent) if e["kind"] == "old" and e["name"] == path.name]
    return olds[0] if olds else path


def _read_folder(path: Path, purpose: str, shapes_of, tensors: bool) -> dict:
    manifest = verify(path)
    meta = read_meta(path)
    index = read_index(path)
    unlisted = sorted({str(getattr(info, "relative_path", "?")) for info in index.storage_data.values()}
                      - set(manifest))
    if unlisted:
        raise CheckpointError(path, f"DCP's index names files the manifest does not list ({', '.join(unlisted[:3])}): "
                                    "a damaged or mixed-up checkpoint. Use another checkpoint of the run.")
    shapes = {k[len(MODEL) + 1:]: tuple(v.size) for k, v in index.state_dict_metadata.items()
              if k.startswith(MODEL + ".")}
    ckpt = dict(meta)
    if not tensors:
        ckpt["model"] = {k: torch.empty(0) for k in shapes}      # names only, for the checks
        ckpt["optimizer"] = {k: None for k in meta.get("optimizer_groups") or {}}
        _check_shapes(path, ckpt, shapes, shapes_of)
        ckpt = validate(path, ckpt, purpose, None, weights=False)
        ckpt.pop("model")
        ckpt["sharded"] = {**dict(meta.get("sharded") or {}), "path": str(path)}
        return ckpt
    wanted = [k for k in index.state_dict_metadata
              if k.startswith(MODEL + ".") or (purpose == "resume" and k.startswith(OPTIMIZER + "."))]
    flat = _load_flat(path, index, wanted)
    ckpt["model"] = {k[len(MODEL) + 1:]: flat[k] for k in wanted if k.startswith(MODEL + ".")}
    if purpose == "resume":
        ckpt["optimizer"] = positional_optimizers(path, meta.get("optimizer_groups"), index, flat)
    return validate(path, ckpt, purpose, shapes_of)


def _check_shapes(path: Path, ckpt: dict, shapes: dict, shapes_of) -> None:
    if shapes_of is None:
        return
    try:
        expected = shapes_of(dict(ckpt["model_args"]), ckpt["model"])
    except Exception as e:   # whatever the stored args get wrong: the checkpoint is unusable
        raise CheckpointError(path, f"model_args cannot rebuild the model: {e}") from None
    bad = sorted(set(expected) ^ set(shapes)) + [k for k in expected if k in shapes and shapes[k] != tuple(expected[k])]
    if bad:
        raise CheckpointError(path, f"weights that disagree with the stored model config: {', '.join(bad[:4])}. "
                                    "The weights do not belong to the model its model_args describe.")


def _load_flat(path: Path, index, keys: list[str]) -> dict:
    """The tensors ``keys`` of DCP's index, whole, in this process (no process group)."""
    md = index.state_dict_metadata
    nested: dict = {}
    flat = {}
    for k in keys:
        t = torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype)
        flat[k] = t
        where = index.planner_data.get(k, (k,)) if isinstance(index.planner_data, dict) else (k,)
        node = nested
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = t
    try:
        with warnings.catch_warnings():     # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(nested, storage_reader=SafeReader(path), no_dist=True)
    except READ_ERRORS as e:  # the manifest passed, so the index and the shards disagree
        raise CheckpointError(path, f"its shards cannot be read ({error_line(e)}). Use another "
                                    "checkpoint of the run.") from None
    return flat


def positional_optimizers(path: Path, groups, index, flat: dict) -> dict:
    """{name: optimizer state_dict} in torch's positional form (what ``Optimizer.load_state_dict``
    takes) from the name-keyed DCP entries and meta.pt's ``optimizer_groups``."""
    if not isinstance(groups, dict):
        raise CheckpointError(path, "meta.pt has no optimizer_groups: the optimizers' state cannot be "
                                    "rebuilt. Use it for weights only (infer, export, sft).")
    planner = index.planner_data if isinstance(index.planner_data, dict) else {}
    out = {}
    for name, param_groups in groups.items():
        position = {}
        plain_groups = []
        for g in param_groups:
            ids = []
            for fqn in g["params"]:
                position[fqn] = len(position)
                ids.append(position[fqn])
            plain_groups.append({**g, "params": ids})
        state: dict = {}
        for k, t in flat.items():
            where = planner.get(k, ())
            if len(where) == 5 and where[:3] == (OPTIMIZER, name, "state") and where[3] in position:
                state.setdefault(position[where[3]], {})[where[4]] = t
        out[name] = {"state": state, "param_groups": plain_groups}
    return out
