"""Token shard sets on disk: the contract between prep stages and their readers.

A shard set is a directory of ``tokens_NNNNN.npy`` files plus ``metadata.json``.
Each shard is a 1-D array (uint16 if the vocabulary fits, else uint32; little-endian) of
whole documents, each stored as BOS + tokens + EOS; a document never spans two shards.
Training windows are cut at read time, so no token is stored twice.

``metadata.json`` is written last and atomically; a set without it, or with
``complete: false``, is incomplete. Each ``shards[i]`` entry names its ``file`` and its
``tokens`` and ``documents`` counts, and (sets built since it was recorded) ``max_token_id``.

Writing is one set of functions, used by the prep engine (:mod:`utils.data.packing`, which streams)
and by anyone with documents already tokenized (the tests): :func:`write_shard` writes one
shard atomically and returns its ``shards[i]`` record; :func:`shard_set_metadata` builds the
``metadata.json`` of a complete set and refuses (``ValueError``) anything the reader below
would refuse; :func:`write_metadata` writes it, last; :func:`write_shard_set` does all three
for a list of framed documents ("these documents -> a shard set").

Reading is validation (docs/data_stages.md, malformed input). :func:`read_metadata` reads the JSON
(never deleting anything it cannot read) and names every field of the wrong type at once;
:func:`validate_metadata` compares it with the current tokenizer and model;
:func:`load_shards` opens each shard with :func:`open_shard`, which parses the ``.npy``
header itself (no pickle, ever: untrusted bytes are data) and memory-maps the token data
without reading it, refusing truncated, non-``.npy``, object, 2-D or wrong-dtype files and
token ids at or beyond the vocabulary. Every refusal is a :class:`ShardSetError` (exit
code 1) naming the file and the command that rebuilds the set. Cost: the metadata, one
header of about 128 bytes per shard, and no token data when ``max_token_id`` is recorded
(otherwise one sequential max over each shard, reported).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Optional

import numpy as np

from utils.atomic import atomic_open, write_json_atomic
from utils.cli import PipelineError

FORMAT_NAME = "llm-pipeline-token-shards"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
SHARD_PATTERN = "tokens_{:05d}.npy"
SHARD_FILE_RE = re.compile(r"^tokens_\d{5,}\.npy$")
# The dtypes the contract allows, as .npy descriptors (little-endian unsigned).
SHARD_DTYPES = {"uint16": "<u2", "uint32": "<u4"}
MAX_NPY_HEADER = 10_000   # bytes; numpy's own safety limit for .npy headers


class ShardSetError(PipelineError):
    """A missing, incomplete, damaged or stale shard set (exit code 1).

    ``field`` names what is wrong (``"directory"``, ``"complete"``, ``"tokenizer.fingerprint"``,
    ``"shards"``...). ``auto_rebuild`` is False when a rebuild must not be attempted
    automatically (``dataset.auto_prepare``): the set's metadata could not be read or parsed,
    which is a reason to stop and say so, never a reason to delete anything.
    """

    def __init__(self, message: str, field: Optional[str] = None, auto_rebuild: bool = True):
        self.field = field
        self.auto_rebuild = auto_rebuild
        super().__init__(message)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(index: int) -> str:
    return SHARD_PATTERN.format(index)


def save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    """Write a .npy so that it appears only when complete (temp file, fsync, rename)."""
    with atomic_open(path) as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)


def rebuild_command(source: Optional[str], test: bool, *, config_file: Optional[str | list] = None,
                    output_dir: Optional[str] = None) -> str:
    """The command that (re)builds a shard set, ready to paste (quoted). Add ``--force`` to
    start over; without it the prep stage resumes an unfinished set. ``config_file``: one
    file, or the list of ``--config`` files in their order."""
    stage = "fineweb" if source == "fineweb" else "prepare"
    parts = ["python", "main.py", stage]
    if test:
        parts.append("--test")
    for f in (config_file if isinstance(config_file, list) else [config_file] if config_file else []):
        parts += ["--config", str(f)]
    if output_dir:
        parts += ["--output-dir", str(output_dir)]
    return " ".join(shlex.quote(p) for p in parts)


# --------------------------------------------------------------------------- metadata
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicated key(s) {', '.join(map(repr, dup))}")
    return dict(pairs)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class _Problems(list):
    """The problems found so far, each a line naming the field."""

    def need(self, where: str, value: Any, ok: bool, what: str) -> bool:
        """``ok``, after adding a problem when it is False."""
        if not ok:
            self.append(f"{where} is {json.dumps(value)[:60]}, expected {what}")
        return ok

    def count(self, where: str, value: Any) -> None:
        self.need(where, value, _is_int(value) and value >= 0, "an integer >= 0")


def _type_problems(meta: dict) -> list[str]:
    """Every field of the wrong type or out of range, each named (``tokenizer.vocab_size``,
    ``shards[3].tokens``...). Optional fields are checked only when present."""
    p = _Problems()
    p.need("dtype", meta.get("dtype"), meta.get("dtype") in SHARD_DTYPES,
           f"one of {', '.join(map(repr, SHARD_DTYPES))}")
    tok = meta.get("tokenizer")
    if p.need("tokenizer", tok, isinstance(tok, dict), "an object"):
        _check_tokenizer(p, tok)
    shards = meta.get("shards")
    if p.need("shards", shards, isinstance(shards, list) and len(shards) > 0, "a non-empty list"):
        _check_shards(p, shards)
    for key in ("totals", "source", "stats", "settings"):
        if key in meta:
            p.need(key, meta[key], isinstance(meta[key], dict), "an object")
    totals = meta.get("totals")
    if isinstance(totals, dict):
        _check_totals(p, totals, shards)
    for key in ("window", "stride"):
        if key in meta and meta[key] is not None:
            p.need(key, meta[key], _is_int(meta[key]) and meta[key] > 0, "an integer > 0")
    return list(p)


def _check_tokenizer(p: _Problems, tok: dict) -> None:
    p.need("tokenizer.vocab_size", tok.get("vocab_size"),
           _is_int(tok.get("vocab_size")) and tok["vocab_size"] > 0, "an integer > 0")
    for key in ("bos_id", "eos_id"):
        p.count(f"tokenizer.{key}", tok.get(key))
    for key in ("unk_id", "pad_id"):
        if tok.get(key) is not None:
            p.count(f"tokenizer.{key}", tok.get(key))
    p.need("tokenizer.fingerprint", tok.get("fingerprint"), isinstance(tok.get("fingerprint"), str),
           "a string")
    if "name" in tok:
        p.need("tokenizer.name", tok["name"], tok["name"] is None or isinstance(tok["name"], str),
               "a string")


def _check_shards(p: _Problems, shards: list) -> None:
    """Each shard an object with a file name of its own (no folders, none listed twice) and
    its counts."""
    seen: set = set()
    for i, s in enumerate(shards):
        w = f"shards[{i}]"
        if not p.need(w, s, isinstance(s, dict), "an object"):
            continue
        f = s.get("file")
        if p.need(f"{w}.file", f, isinstance(f, str) and SHARD_FILE_RE.match(f) is not None,
                  "a shard file name like 'tokens_00000.npy' (no folders)"):
            if f in seen:
                p.append(f"{w}.file {f!r} is listed twice")
            seen.add(f)
        p.count(f"{w}.tokens", s.get("tokens"))
        if "documents" in s:
            p.count(f"{w}.documents", s.get("documents"))
        if "max_token_id" in s:
            p.count(f"{w}.max_token_id", s.get("max_token_id"))


def _check_totals(p: _Problems, totals: dict, shards: Any) -> None:
    """The totals' counts, and their tokens the sum of the shards' (when both can be read)."""
    for key in ("tokens", "documents", "shards"):
        if key in totals:
            p.count(f"totals.{key}", totals[key])
    if (_is_int(totals.get("tokens")) and isinstance(shards, list)
            and all(isinstance(s, dict) and _is_int(s.get("tokens")) for s in shards)
            and totals["tokens"] != sum(s["tokens"] for s in shards)):
        p.append(f"totals.tokens is {totals['tokens']} but the shards list "
                 f"{sum(s['tokens'] for s in shards)} tokens")


def read_metadata(directory: Path, rebuild: str = "python main.py prepare") -> dict:
    """Read and check a shard set's metadata.json: readable JSON object, format and version,
    ``complete: true``, every field of the right type (all problems named at once), every
    listed shard present. Raises :class:`ShardSetError`; never modifies the set."""
    d = Path(directory)
    mpath = d / METADATA_FILE
    if not d.is_dir():
        raise ShardSetError(f"token shard set {d} does not exist. Build it with: {rebuild}", "directory")
    if not mpath.exists():
        raise ShardSetError(f"{d} has no {METADATA_FILE}: the shard set is incomplete (an interrupted "
                            f"prep?). Finish it with: {rebuild}", "metadata.json")
    keep = ("Nothing was changed or deleted; check the file (or move the folder aside) and "
            f"rebuild with: {rebuild} --force")
    try:
        raw = mpath.read_bytes()
    except OSError as e:
        raise ShardSetError(f"{mpath} cannot be read ({e.strerror or e}). {keep}", "metadata.json",
                            auto_rebuild=False) from None
    try:
        meta = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ShardSetError(f"{mpath} is not UTF-8 text (byte {e.start}): damaged. {keep}",
                            "metadata.json", auto_rebuild=False) from None
    except (ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError
        what = "is empty" if not raw.strip() else f"is not valid JSON ({str(e)[:200]})"
        raise ShardSetError(f"{mpath} {what}: damaged. {keep}", "metadata.json",
                            auto_rebuild=False) from None
    if not isinstance(meta, dict):
        raise ShardSetError(f"{mpath} holds a JSON {type(meta).__name__}, not an object: damaged. "
                            f"{keep}", "metadata.json", auto_rebuild=False)
    # The header fields, then every other field: all problems are named at once. A lone header
    # problem keeps its own message (a set from another tool or version, an interrupted prep).
    header: list[ShardSetError] = []
    if meta.get("format") != FORMAT_NAME:
        header.append(ShardSetError(f"format is {json.dumps(meta.get('format'))[:80]}, expected "
                                    f"{FORMAT_NAME!r}. Rebuild with: {rebuild} --force", "format"))
    version = meta.get("format_version")
    if not _is_int(version) or version != FORMAT_VERSION:
        header.append(ShardSetError(f"format_version is {json.dumps(version)[:80]}, this code reads "
                                    f"version {FORMAT_VERSION}. Rebuild with: {rebuild} --force",
                                    "format_version"))
    if meta.get("complete") is not True:
        header.append(ShardSetError(f"complete is {json.dumps(meta.get('complete'))[:40]}, not true "
                                    f"(an interrupted prep). Finish it with: {rebuild}", "complete"))
    problems = _type_problems(meta)
    if len(header) == 1 and not problems:
        raise ShardSetError(f"{mpath}: {header[0]}", header[0].field)
    problems = [str(h).split(". ")[0] for h in header] + problems
    if problems:
        raise ShardSetError(f"{mpath}: {len(problems)} field(s) of the wrong type or value: "
                            + "; ".join(problems[:20]) + (" ..." if len(problems) > 20 else "")
                            + f". The file is damaged; {keep}", "metadata", auto_rebuild=False)
    missing = [s["file"] for s in meta["shards"] if not (d / s["file"]).is_file()]
    if missing:
        raise ShardSetError(f"{d}: {len(missing)} shard file(s) listed in {METADATA_FILE} are missing "
                            f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}). "
                            f"Rebuild with: {rebuild} --force", "shards")
    return meta


def validate_metadata(meta: dict, directory: Path, *, tokenizer_info: Optional[dict] = None,
                      model_vocab_size: Optional[int] = None, rebuild: str = "python main.py prepare") -> None:
    """Refuse a shard set that does not match the current tokenizer or model.

    ``tokenizer_info`` is :func:`utils.data.tok.describe` of the configured tokenizer.
    """
    where = Path(directory) / METADATA_FILE
    tmeta = meta.get("tokenizer", {})
    if tokenizer_info is not None:
        for key in ("fingerprint", "vocab_size", "bos_id", "eos_id"):
            if tmeta.get(key) != tokenizer_info.get(key):
                raise ShardSetError(
                    f"{where}: stale shard set: tokenizer.{key} is {tmeta.get(key)!r} in the shards but "
                    f"{tokenizer_info.get(key)!r} for the configured tokenizer "
                    f"('{tokenizer_info.get('name')}'; shards were built with '{tmeta.get('name')}'). "
                    f"Rebuild with: {rebuild} --force", f"tokenizer.{key}")
    vocab = tmeta.get("vocab_size")
    if _is_int(vocab) and meta.get("dtype") == "uint16" and vocab > 65536:
        raise ShardSetError(f"{where}: dtype uint16 cannot hold the ids of a {vocab:,}-token vocabulary "
                            f"(the contract is uint32 above 65,536). Rebuild with: {rebuild} --force",
                            "dtype")
    if model_vocab_size is not None and _is_int(vocab) and vocab > model_vocab_size:
        raise ShardSetError(f"{where}: tokenizer.vocab_size {vocab} does not fit "
                            f"model.vocab_size {model_vocab_size}; raise model.vocab_size or rebuild the "
                            f"shards with a smaller tokenizer ({rebuild} --force)", "tokenizer.vocab_size")


# --------------------------------------------------------------------------- writing
def write_shard(directory: Path, index: int, tokens: np.ndarray, documents: int,
                dtype: np.dtype) -> dict:
    """Write shard ``index`` of a set (``tokens``: whole documents, each BOS + ids + EOS, as
    one 1-D array) atomically as ``dtype``; returns its ``shards[i]`` record for metadata.json.
    Raises ``ValueError`` for ids that ``dtype`` cannot hold (they would wrap silently)."""
    arr = np.asarray(tokens)
    dt = np.dtype(dtype)
    if dt.str not in SHARD_DTYPES.values():
        raise ValueError(f"shard dtype {dt} is not one of {', '.join(SHARD_DTYPES)}")
    if arr.ndim != 1:
        raise ValueError(f"a shard is a 1-D array of token ids, got shape {arr.shape}")
    if arr.dtype != dt and len(arr) and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dt).max):
        raise ValueError(f"token ids {int(arr.min())}..{int(arr.max())} do not fit {dt.name}")
    arr = arr.astype(dt, copy=False)
    name = shard_name(index)
    save_npy_atomic(Path(directory) / name, arr)
    return {"file": name, "tokens": int(len(arr)), "documents": int(documents),
            "max_token_id": int(arr.max()) if len(arr) else 0}


def shard_set_metadata(shards: list, *, dtype: np.dtype, tokenizer_info: dict, source: dict,
                       window: Optional[int], stride: Optional[int], shard_tokens: Optional[int],
                       totals: Optional[dict] = None, **extra: Any) -> dict:
    """The ``metadata.json`` of a complete set of ``shards`` (records from :func:`write_shard`).

    ``totals`` tokens/documents/shards are counted from the records (``totals`` adds keys such
    as ``characters``); ``extra`` keys (``stats``, ``settings``...) are added as given. Raises
    ``ValueError`` naming every field the reader (:func:`read_metadata`) would refuse."""
    shards = list(shards)
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "complete": True,
            "dtype": np.dtype(dtype).name, "tokenizer": dict(tokenizer_info), "source": dict(source),
            "window": window, "stride": stride, "shard_tokens": shard_tokens, "shards": shards,
            "totals": {"tokens": sum(s["tokens"] for s in shards),
                       "documents": sum(s["documents"] for s in shards),
                       **(totals or {}), "shards": len(shards)},
            **extra,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    problems = _type_problems(meta)
    if meta["dtype"] == "uint16" and _is_int(tokenizer_info.get("vocab_size")) \
            and tokenizer_info["vocab_size"] > 65536:
        problems.append(f"dtype uint16 cannot hold a {tokenizer_info['vocab_size']:,}-token vocabulary")
    if problems:
        raise ValueError("shard set metadata the reader would refuse: " + "; ".join(problems))
    return meta


def write_metadata(directory: Path, meta: dict) -> None:
    """Write ``metadata.json`` atomically: the last file of a set (it makes the set complete)."""
    write_json_atomic(Path(directory) / METADATA_FILE, meta)


def write_shard_set(directory: Path, docs: Iterable[np.ndarray], tokenizer_info: dict, *,
                    shard_tokens: int, source: dict, window: Optional[int] = None,
                    stride: Optional[int] = None) -> dict:
    """Documents -> a complete shard set in ``directory`` (new or empty); returns its metadata.

    Each document is a 1-D array of token ids already framed as BOS + ids + EOS
    (``tokenizer_info``'s ``bos_id``/``eos_id``, every id below its ``vocab_size``). Shards
    are packed as the prep engine packs them: whole documents in order, a shard closed once it
    holds ``shard_tokens`` tokens or more, dtype from the vocabulary size, metadata.json last.
    Raises ``ValueError`` for a document that is not framed or holds an id out of range, and
    for a directory that already holds a set (nothing is overwritten)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in d.iterdir()
                     if SHARD_FILE_RE.match(p.name) or p.name == METADATA_FILE)
    if present:
        raise ValueError(f"{d} already holds {', '.join(present[:3])}; write a new set into an "
                         "empty folder")
    vocab, bos, eos = (tokenizer_info["vocab_size"], tokenizer_info["bos_id"],
                       tokenizer_info["eos_id"])
    dtype = dtype_for_vocab(vocab)
    shards: list = []
    buf: list = []
    fill = 0
    for i, doc in enumerate(docs):
        doc = np.asarray(doc)
        if doc.ndim != 1 or len(doc) < 2 or doc[0] != bos or doc[-1] != eos:
            raise ValueError(f"document {i} is not framed as BOS ({bos}) + ids + EOS ({eos})")
        if int(doc.min()) < 0 or int(doc.max()) >= vocab:
            raise ValueError(f"document {i} holds token ids {int(doc.min())}..{int(doc.max())}, "
                             f"outside the vocabulary (0..{vocab - 1})")
        buf.append(doc)
        fill += len(doc)
        if fill >= shard_tokens:
            shards.append(write_shard(d, len(shards), np.concatenate(buf), len(buf), dtype))
            buf, fill = [], 0
    if buf:
        shards.append(write_shard(d, len(shards), np.concatenate(buf), len(buf), dtype))
    if not shards:
        raise ValueError("no documents: a shard set holds at least one")
    meta = shard_set_metadata(shards, dtype=dtype, tokenizer_info=tokenizer_info, source=source,
                              window=window, stride=stride, shard_tokens=shard_tokens)
    write_metadata(d, meta)
    return meta


# --------------------------------------------------------------------------- shard files
class NpyHeader(NamedTuple):
    shape: tuple
    fortran_order: bool
    dtype: np.dtype
    offset: int        # bytes before the array data
    file_size: int


class ShardFileError(ValueError):
    """What is wrong with one .npy file (our own words; never numpy's pickle advice)."""


def read_npy_header(path: Path) -> NpyHeader:
    """Parse a .npy header without ever unpickling: reads at most ``MAX_NPY_HEADER`` bytes.
    Raises :class:`ShardFileError` for a file that is not a (complete) .npy header."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8 or head[:6] != b"\x93NUMPY":
                raise ShardFileError("is empty (0 bytes)" if size == 0 else
                                     "is not a NumPy .npy file (no .npy header: a raw token dump "
                                     "or another file renamed .npy)")
            major, minor = head[6], head[7]
            if (major, minor) not in ((1, 0), (2, 0)):
                raise ShardFileError(f"has .npy format version {major}.{minor}, which shards never use")
            f.seek(0)
            np.lib.format.read_magic(f)
            reader = (np.lib.format.read_array_header_1_0 if major == 1
                      else np.lib.format.read_array_header_2_0)
            try:
                shape, fortran, dtype = reader(f, max_header_size=MAX_NPY_HEADER)
            except (ValueError, SyntaxError, TypeError, EOFError, MemoryError):
                raise ShardFileError("has a truncated or damaged .npy header") from None
            return NpyHeader(tuple(shape), bool(fortran), dtype, f.tell(), size)
    except OSError as e:
        raise ShardFileError(f"cannot be read ({e.strerror or e})") from None


def _describe_dtype(dtype: np.dtype) -> str:
    if dtype.hasobject:
        return "Python objects (object dtype; shards are plain integers and are never unpickled)"
    if dtype.names:
        return f"a structured dtype {dtype.descr}"
    return f"{dtype.name} ({dtype.str})"


def open_shard(path: Path, dtype: Optional[str] = None, tokens: Optional[int] = None) -> np.ndarray:
    """Validate one shard file's header and memory-map its tokens (read-only; no token data
    is read). ``dtype`` / ``tokens``: what metadata.json says. Raises :class:`ShardFileError`."""
    h = read_npy_header(path)
    if h.dtype.str not in SHARD_DTYPES.values():
        raise ShardFileError(f"holds {_describe_dtype(h.dtype)}; shards hold uint16 or uint32 "
                             "(little-endian) token ids")
    if len(h.shape) != 1:
        raise ShardFileError(f"is a {len(h.shape)}-D array of shape {h.shape}"
                             f"{' (Fortran order)' if h.fortran_order else ''}; shards are 1-D")
    n = h.shape[0]
    if not isinstance(n, int) or n < 0:
        raise ShardFileError(f"has a damaged .npy header (shape {h.shape})")
    need = h.offset + n * h.dtype.itemsize
    if h.file_size < need:
        raise ShardFileError(f"is truncated: its header promises {n:,} tokens ({need:,} bytes) but the "
                             f"file has {h.file_size:,} bytes")
    if h.file_size > need:
        raise ShardFileError(f"has {h.file_size - need:,} bytes after its {n:,} tokens (damaged or "
                             "not written by the prep stage)")
    if dtype is not None and h.dtype.name != dtype:
        raise ShardFileError(f"holds {h.dtype.name} but {METADATA_FILE} says {dtype}")
    if tokens is not None and n != tokens:
        raise ShardFileError(f"holds {n:,} tokens but {METADATA_FILE} lists {tokens:,}")
    if n == 0:
        return np.zeros(0, dtype=h.dtype)
    return np.memmap(path, dtype=h.dtype, mode="r", offset=h.offset, shape=(n,))


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shard_max(arr: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest token id of a shard: one sequential pass over the memory map in chunks."""
    m = 0
    for a in range(0, len(arr), chunk):
        m = max(m, int(arr[a:a + chunk].max()))
    return m


def load_shards(directory: Path, meta: dict, *, rebuild: str = "python main.py prepare",
                vocab_size: Optional[int] = None,
                log: Callable[[str], None] = _stderr) -> list[np.ndarray]:
    """Open (memory-map) every shard listed in ``meta`` through :func:`open_shard`.

    Refuses, naming every bad file at once: files that are not well-formed 1-D .npy arrays of
    the metadata's dtype and length, and token ids ``>= vocab_size`` (default: the
    metadata's ``tokenizer.vocab_size``), checked from each entry's ``max_token_id`` or, when
    metadata does not record it, by one max over the shard (said in a note through ``log``).
    ``.npy`` files in the folder that the metadata does not list get a warning.
    """
    d = Path(directory)
    vocab = vocab_size if vocab_size is not None else meta["tokenizer"]["vocab_size"]
    out, bad, scanned, t0 = [], [], [], time.perf_counter()
    for s in meta["shards"]:
        path = d / s["file"]
        try:
            arr = open_shard(path, meta["dtype"], s["tokens"])
        except ShardFileError as e:
            bad.append(f"{path} {e}")
            continue
        if "max_token_id" in s:
            top = s["max_token_id"]
        else:
            top = shard_max(arr) if len(arr) else 0
            scanned.append(len(arr))
        if top >= vocab:
            src = "max_token_id in metadata.json" if "max_token_id" in s else "found by a scan"
            bad.append(f"{path} holds token id {top} ({src}), but the vocabulary has {vocab:,} ids "
                       f"(0..{vocab - 1}); training would fail in the embedding lookup")
        out.append(arr)
    if bad:
        raise ShardSetError(f"{d}: {len(bad)} bad shard file(s): " + "; ".join(bad[:10])
                            + (" ..." if len(bad) > 10 else "")
                            + f". The set is damaged or was not written by the prep stage; rebuild it "
                            f"with: {rebuild} --force", "shards")
    if scanned:
        log(f"note: {d / METADATA_FILE} records no max_token_id for {len(scanned)} shard(s) (an older "
            f"prep); checked their token ids by a scan of {sum(scanned):,} tokens in "
            f"{time.perf_counter() - t0:.2f} s. Rebuilding the set records it and skips this scan.")
    listed = {s["file"] for s in meta["shards"]}
    extra = sorted(p.name for p in d.glob("*.npy") if p.name not in listed)
    if extra:
        log(f"warning: {d} holds {len(extra)} .npy file(s) that {METADATA_FILE} does not list "
            f"({', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}); they are not read. Left "
            "over from another run, or copied in by hand?")
    return out
