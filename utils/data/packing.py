"""Tokenize-and-pack: the one engine behind `prepare` (Wikipedia) and `fineweb` (library).

A *document stream* is a function ``open_stream(start, resume=None)`` returning an iterator
of ``(text, drop_reason)`` pairs from stream position ``start`` on; ``drop_reason`` is None
for a document to tokenize, or a short string (``"language_score"``) when the source already
filtered it. A stream that cannot seek cheaply (Hugging Face streaming) gives its iterator a
``checkpoint()`` method returning a JSON-able state for "the next document"; the engine
records it with each shard (``stream_resume`` in the progress file) and passes it back as
``resume={"position": p, "state": s}`` (``p <= start``) so a re-run restores the stream there
instead of reading it again from the beginning. :func:`pack` turns the stream into a shard set (DESIGN.md section 3,
:mod:`utils.data.shards`):

    parent: read docs -> chunks ──► worker processes: fast tokenizer ``encode_batch`` on a chunk,
            ▲                        min-token filter, BOS + ids + EOS framing, all as NumPy
            └── pack in stream order ◄── (framed uint16/uint32 array, kept mask, lengths)
                into the shard buffer; write each full shard atomically + .progress.json

- Workers hand back NumPy arrays, never Python lists of ints, and each worker runs the
  tokenizer single-threaded (``TOKENIZERS_PARALLELISM=false``, ``RAYON_NUM_THREADS=1``): with
  one process per core the processes are the parallelism, and processes fighting the
  tokenizer's own thread pool is what makes ``datasets.map(num_proc=...)`` slow.
- Results are consumed in submission order (a bounded window of in-flight chunks, so memory
  does not grow with the corpus), so the shards are byte-identical for any worker count.
- A shard holds whole documents and is closed once it reaches ``shard_tokens`` tokens (or at
  the end of the stream, or when ``max_files`` shards exist).
- Resumable: after each shard, ``.progress.json`` records the settings, the shards written,
  how many stream documents they consumed and the statistics up to that point. A re-run
  with the same settings verifies those shards, skips the consumed documents and continues;
  the result is byte-identical to an uninterrupted run. ``metadata.json`` (``complete: true``)
  is written last, atomically, and ``.progress.json`` is then removed. Different settings are
  refused unless ``force``, which builds the new set beside the old one (``out_dir/.rebuild``)
  and replaces the old files only once the new set is complete: a failed --force run leaves
  the old set byte-identical and removes the side folder (an interrupted one keeps it only
  when it holds recorded shards, for the same --force command to resume).
- A bookkeeping file (``metadata.json``, ``.progress.json``) that exists but cannot be read
  stops the run naming it; shard files that no record accounts for are never deleted (only
  temp files and the single shard a run killed before its first record can leave).

Interrupt tests need no hook here: they signal a real run from outside at measured moments
(tests/test_prep.py).
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from utils.atomic import write_json_atomic
from utils.cli import PipelineError, cli_path
from utils.data.parallel import ordered_map
from utils.data.shards import (FORMAT_VERSION, METADATA_FILE, dtype_for_vocab, shard_name,
                          shard_set_metadata, write_metadata, write_shard)
from utils.data.textio import iter_articles
from utils.data.tok import describe, encode_plain, load_tokenizer, require_bos_eos

PROGRESS_FILE = ".progress.json"
REBUILD_DIR = ".rebuild"         # where --force builds a new set beside the old one
SHARD_RE = re.compile(r"^tokens_(\d{5,})\.npy$")
CHUNK_CHARS = 1_000_000   # at most about this many characters per worker task

Stream = Callable[..., Iterator[tuple[str, Optional[str]]]]   # open_stream(start, resume=None)


# --------------------------------------------------------------------------- encoding
def encode_frame(backend, texts: list[str], dtype: np.dtype, bos: int, eos: int,
                 min_tokens: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize ``texts`` and frame each kept one as BOS + ids + EOS.

    Returns ``(framed, kept, lengths)``: the concatenated framed documents (1-D ``dtype``),
    a bool mask over ``texts`` of documents with at least ``min_tokens`` tokens, and every
    document's token count (without BOS/EOS). Text goes through :func:`utils.data.tok.encode_plain`,
    the one plain-text encoder: a literal ``<s>`` or ``</s>`` in a document stays text, also on
    a backend rebuilt in a worker process (``Tokenizer.from_str`` does not keep that setting).
    """
    ids = encode_plain(backend, texts)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    kept = lengths >= max(min_tokens, 1)
    if not kept.all():
        ids = list(itertools.compress(ids, kept.tolist()))
    klen = lengths[kept]
    n_ids = int(klen.sum())
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=n_ids)
    framed = np.empty(n_ids + 2 * len(klen), dtype=dtype)
    ends = np.cumsum(klen + 2)
    starts = ends - (klen + 2)
    body = np.ones(len(framed), dtype=bool)
    body[starts] = False
    body[ends - 1] = False
    framed[starts] = bos
    framed[ends - 1] = eos
    framed[body] = flat
    return framed, kept, lengths


_WORKER: dict = {}


def _init_worker(tokenizer_json: str, dtype: str, bos: int, eos: int, min_tokens: int) -> None:
    """Pool initializer: one single-threaded tokenizer per process; Ctrl-C is the parent's job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER.update(backend=Tokenizer.from_str(tokenizer_json), dtype=np.dtype(dtype), bos=bos,
                   eos=eos, min_tokens=min_tokens)


def _encode_task(texts: list[str]):
    w = _WORKER
    return encode_frame(w["backend"], texts, w["dtype"], w["bos"], w["eos"], w["min_tokens"])


# --------------------------------------------------------------------------- bookkeeping
@dataclass
class Counts:
    """Statistics over a stretch of the document stream (all JSON-serializable)."""

    read: int = 0                 # stream documents consumed
    kept: int = 0                 # documents stored
    dropped: dict = field(default_factory=dict)   # reason -> documents
    characters: int = 0           # characters of stored documents
    content_tokens: int = 0       # their tokens without BOS/EOS
    tokens: int = 0               # tokens stored (with BOS/EOS)

    def add(self, other: "Counts") -> None:
        self.read += other.read
        self.kept += other.kept
        self.characters += other.characters
        self.content_tokens += other.content_tokens
        self.tokens += other.tokens
        for k, v in other.dropped.items():
            self.dropped[k] = self.dropped.get(k, 0) + v

    def to_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                "characters": self.characters, "content_tokens": self.content_tokens,
                "tokens": self.tokens}

    @classmethod
    def from_dict(cls, d: dict) -> "Counts":
        return cls(**{k: (dict(v) if k == "dropped" else v) for k, v in d.items()})


@dataclass
class Chunk:
    """A contiguous stretch of the stream: what one worker task tokenizes."""

    start: int                    # stream position of the first document
    reasons: list                 # per document: None (tokenize) or a drop reason
    texts: list                   # the documents to tokenize, in order
    chars: list                   # their character counts
    state: Any = None             # the stream's checkpoint() at ``start`` (if it has one)


def _chunks(stream: Iterator[tuple[str, Optional[str]]], start: int, limit: Optional[int],
            chunk_docs: int, chunk_chars: int = CHUNK_CHARS) -> Iterator[Chunk]:
    """Cut the stream into chunks of at most ``chunk_docs`` documents and about ``chunk_chars``
    characters (so memory in flight does not depend on how long the documents are)."""
    checkpoint = getattr(stream, "checkpoint", None)
    if limit is not None:
        stream = itertools.islice(stream, max(0, limit - start))
    pos = start
    reasons, texts, chars, n_chars = [], [], [], 0
    state = checkpoint() if checkpoint else None
    for text, reason in stream:
        if reason is None and (not text or text.isspace()):
            reason = "empty"
        reasons.append(reason)
        if reason is None:
            texts.append(text)
            chars.append(len(text))
            n_chars += len(text)
        if len(reasons) >= chunk_docs or n_chars >= chunk_chars:
            yield Chunk(pos, reasons, texts, chars, state)
            pos += len(reasons)
            reasons, texts, chars, n_chars = [], [], [], 0
            state = checkpoint() if checkpoint else None
    if reasons:
        yield Chunk(pos, reasons, texts, chars, state)


# --------------------------------------------------------------------------- the job
@dataclass
class PackJob:
    """Everything :func:`pack` needs; the stage scripts fill it from config and flags."""

    out_dir: Path
    tokenizer: Any                      # a transformers fast tokenizer
    tokenizer_info: dict                # utils.data.tok.describe(tokenizer, name)
    kind: str                           # "wikipedia" | "fineweb"
    inputs: list                        # what metadata lists as the source's inputs
    input_identity: list                # what must not change for a resume (paths + sizes, ...)
    open_stream: Stream
    window: int
    stride: int
    shard_tokens: int
    batch: int = 10_000
    workers: int = 1
    max_documents: Optional[int] = None  # --test limit on stream documents
    max_files: Optional[int] = None
    min_tokens: int = 0
    filters: dict = field(default_factory=dict)
    test: bool = False
    force: bool = False
    progress_bar: bool = True
    extra_source: dict = field(default_factory=dict)
    on_complete: Optional[Callable[[Path], None]] = None   # e.g. cfg.save_resolved

    def settings(self) -> dict:
        """What a resume or an up-to-date check compares: everything the shard bytes depend on.

        Not batch size or worker count (output is identical for any), and not window/stride:
        windows are cut at read time, so the same shards serve any window (the values given at
        prep time are only recorded in metadata.json)."""
        return {"format_version": FORMAT_VERSION, "kind": self.kind,
                "tokenizer_fingerprint": self.tokenizer_info["fingerprint"],
                "vocab_size": self.tokenizer_info["vocab_size"],
                "inputs": self.input_identity, "max_documents": self.max_documents,
                "shard_tokens": self.shard_tokens, "max_files": self.max_files,
                "filters": self.filters}


def _diff(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def _set_files(d: Path) -> list[Path]:
    """The files of a shard set that this engine writes (never anything else)."""
    if not d.is_dir():
        return []
    return [p for p in d.iterdir() if SHARD_RE.match(p.name) or p.name in (METADATA_FILE, PROGRESS_FILE)
            or (p.name.startswith((".tokens_", f".{METADATA_FILE}", f".{PROGRESS_FILE}")) and ".tmp-" in p.name)]


def _remove_stale(d: Path, n_shards: int) -> int:
    """Delete temp files and shard files beyond the recorded ones; returns how many."""
    n = 0
    for p in _set_files(d):
        m = SHARD_RE.match(p.name)
        if (".tmp-" in p.name) or (m and int(m.group(1)) >= n_shards):
            p.unlink(missing_ok=True)
            n += 1
    return n


def _read_json(path: Path) -> Optional[dict]:
    """A bookkeeping file of the set: None if absent. A file that exists but cannot be read or
    is not a JSON object is a reason to stop (PipelineError naming it), never to delete."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        return data
    except (OSError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PipelineError(
            f"{path} cannot be read ({why}); nothing in {path.parent} was changed. Restore the file "
            f"(or move the folder away), or re-run with --force to build a new set beside it, which "
            f"replaces the old files only once the new set is complete.") from None


def _refuse(d: Path, what: str, fields: list[str]) -> PipelineError:
    return PipelineError(
        f"{d} holds {what} built with different settings ({', '.join(fields)} differ from this "
        f"run). Re-run the same command with --force to delete it and start over, or choose "
        f"another output directory.")


def _load_resume(job: PackJob, log: Callable[[str], None]) -> Optional[dict]:
    """Decide what to do with what is already in ``out_dir``: None = start fresh,
    ``{"up_to_date": meta}``, or a progress dict to resume from. Raises on a settings clash."""
    d = job.out_dir
    settings = job.settings()
    meta = _read_json(d / METADATA_FILE)
    if meta is not None and meta.get("complete") is True:
        if meta.get("settings") != settings:
            raise _refuse(d, "a complete shard set", _diff(meta.get("settings") or {}, settings))
        return {"up_to_date": meta}
    progress = _read_json(d / PROGRESS_FILE)
    if progress is None:
        shards = sorted(p.name for p in _set_files(d) if SHARD_RE.match(p.name))
        # Without a progress record at most the first shard of a run killed before recording
        # it can exist; anything more is a set whose records were lost: never delete it.
        if meta is not None or shards not in ([], [shard_name(0)]):
            what = f"{METADATA_FILE} (not complete)" if meta is not None else f"no {METADATA_FILE}"
            raise PipelineError(
                f"{d} holds {len(shards)} shard file(s) with {what} and no {PROGRESS_FILE}, so they "
                f"cannot be verified or resumed; nothing was deleted. Move them away, or re-run with "
                f"--force to build a new set beside them (they are replaced only once it is complete).")
        n = _remove_stale(d, 0)
        if n:
            log(f"removed {n} leftover file(s) of an unfinished run with no progress record in {d}")
        return None
    if not isinstance(progress.get("shards"), list) or not all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and SHARD_RE.match(s["file"])
            and isinstance(s.get("tokens"), int) for s in progress["shards"]):
        raise PipelineError(f"{d / PROGRESS_FILE}: 'shards' is not a list of shard records; nothing "
                            f"was deleted. Re-run with --force to build a new set beside this one.")
    if progress.get("settings") != settings:
        raise _refuse(d, "an unfinished shard set", _diff(progress.get("settings") or {}, settings))
    for s in progress["shards"]:
        p = d / s["file"]
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
            ok = arr.ndim == 1 and len(arr) == s["tokens"]
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise PipelineError(f"{p} is missing or damaged although {d / PROGRESS_FILE} lists it; "
                                "re-run with --force to rebuild the shard set.")
    _remove_stale(d, len(progress["shards"]))
    return progress


# --------------------------------------------------------------------------- packing
class _Packer:
    """Parent-side state: the shard buffer, shard list and stream-exact statistics."""

    def __init__(self, job: PackJob, dtype: np.dtype, progress: Optional[dict]):
        self.job, self.dtype = job, dtype
        self.shards: list = list(progress["shards"]) if progress else []
        self.committed = Counts.from_dict(progress["counts"]) if progress else Counts()
        self.seconds_before = float(progress.get("seconds", 0.0)) if progress else 0.0
        self.runs = int(progress.get("runs", 0)) + 1 if progress else 1
        self.pending = Counts()       # documents in the buffer (or dropped) not yet in a shard
        self.buffer: list[np.ndarray] = []
        self.fill = 0
        self.fill_docs = 0
        self.t0 = time.time()
        self.capped = False
        self.new_tokens = 0           # content tokens tokenized in this run (for tokens/s)
        self.stream_resume = progress.get("stream_resume") if progress else None

    @property
    def seconds(self) -> float:
        return self.seconds_before + (time.time() - self.t0)

    def _segment(self, chunk: Chunk, status: list, klen: np.ndarray, kchars: np.ndarray,
                 lo: int, hi: int, klo: int, khi: int) -> Counts:
        """Counts of chunk documents [lo, hi) whose kept ones are kept-indices [klo, khi)."""
        c = Counts(read=hi - lo, kept=khi - klo, characters=int(kchars[klo:khi].sum()),
                   content_tokens=int(klen[klo:khi].sum()), tokens=int(klen[klo:khi].sum()) + 2 * (khi - klo))
        for r in status[lo:hi]:
            if r is not None:
                c.dropped[r] = c.dropped.get(r, 0) + 1
        return c

    def add(self, chunk: Chunk, framed: np.ndarray, kept: np.ndarray, lengths: np.ndarray) -> None:
        """Pack one tokenized chunk (in stream order); writes every shard it completes."""
        self.new_tokens += int(lengths.sum())
        status = list(chunk.reasons)
        enc_pos = [i for i, r in enumerate(status) if r is None]
        for j, p in enumerate(enc_pos):
            if not kept[j]:
                status[p] = "min_tokens"
        kpos = [p for j, p in enumerate(enc_pos) if kept[j]]   # chunk positions of kept docs
        klen = lengths[kept]
        kchars = np.asarray(chunk.chars, dtype=np.int64)[kept] if len(chunk.chars) else np.zeros(0, np.int64)
        cs = np.cumsum(klen + 2)
        lo, klo, base = 0, 0, 0
        while klo < len(kpos):
            need = self.job.shard_tokens - self.fill
            j = int(np.searchsorted(cs, base + need, side="left"))
            if j >= len(kpos):
                break
            hi = kpos[j] + 1
            self.buffer.append(framed[base:cs[j]])
            self.fill += int(cs[j] - base)
            self.fill_docs += j + 1 - klo
            self.pending.add(self._segment(chunk, status, klen, kchars, lo, hi, klo, j + 1))
            self._write_shard(consumed=chunk.start + hi, chunk=chunk)
            lo, klo, base = hi, j + 1, int(cs[j])
            if self.capped:
                return
        self.buffer.append(framed[base:])
        self.fill += int(len(framed) - base)
        self.fill_docs += len(kpos) - klo
        self.pending.add(self._segment(chunk, status, klen, kchars, lo, len(status), klo, len(kpos)))

    def _write_shard(self, consumed: int, chunk: Optional[Chunk] = None) -> None:
        d = self.job.out_dir
        # Where a re-run can restore the stream: the start of the chunk this shard ends in.
        self.stream_resume = ({"position": chunk.start, "state": chunk.state}
                              if chunk is not None and chunk.state is not None else None)
        arr = np.concatenate(self.buffer) if len(self.buffer) != 1 else self.buffer[0]
        self.shards.append(write_shard(d, len(self.shards), arr, self.fill_docs, self.dtype))
        self.committed.add(self.pending)
        self.pending = Counts()
        self.buffer, self.fill, self.fill_docs = [], 0, 0
        if self.committed.read != consumed:   # internal invariant: stats are stream-exact
            raise RuntimeError(f"packing bookkeeping error: {self.committed.read} != {consumed}")
        self.save_progress()
        if self.job.max_files is not None and len(self.shards) >= self.job.max_files:
            self.capped = True

    def finish(self) -> None:
        """End of stream: write the last partial shard and account trailing dropped docs."""
        if self.capped:
            return
        if self.fill:
            self._write_shard(consumed=self.committed.read + self.pending.read)
        else:
            self.committed.add(self.pending)
            self.pending = Counts()
            self.save_progress()

    def save_progress(self) -> None:
        write_json_atomic(self.job.out_dir / PROGRESS_FILE, {
            "settings": self.job.settings(), "shards": self.shards, "consumed": self.committed.read,
            "stream_resume": self.stream_resume,
            "counts": self.committed.to_dict(), "seconds": round(self.seconds, 3), "runs": self.runs})


def _results(job: PackJob, chunks: Iterator[Chunk], dtype: np.dtype, bos: int, eos: int,
             workers: int) -> Iterator[tuple[Chunk, tuple]]:
    """Tokenize chunks, in order: in-process for one worker, else a pool with a bounded window."""
    backend = job.tokenizer.backend_tokenizer
    if workers <= 1:
        for c in chunks:
            yield c, encode_frame(backend, c.texts, dtype, bos, eos, job.min_tokens)
        return
    yield from ordered_map(_encode_task, chunks, workers, arg=lambda c: c.texts,
                           initializer=_init_worker,
                           initargs=(backend.to_str(), dtype.str, bos, eos, job.min_tokens))


def pack(job: PackJob, log: Callable[[str], None] = print) -> dict:
    """Build (or resume, or confirm) the shard set described by ``job``; returns its metadata.

    With ``force`` and an existing set in ``out_dir``, the new set is built beside it in
    ``out_dir/.rebuild`` and swapped in only once complete (:func:`_swap_in`): a failed or
    interrupted --force run leaves the old set byte-identical. A failed one also removes the
    side folder; an interrupted one keeps it only when it holds recorded shards, and a --force
    re-run with the same settings resumes them (:func:`_drop_staging`)."""
    d = job.out_dir
    d.mkdir(parents=True, exist_ok=True)
    if not job.force:
        return _pack(job, log)
    if not _set_files(d):
        return _pack(replace(job, force=False), log)
    staging = d / REBUILD_DIR
    if staging.is_dir():
        try:
            old = _read_json(staging / PROGRESS_FILE)
        except PipelineError:
            old = None
        if old is None or old.get("settings") != job.settings():
            shutil.rmtree(staging)
    try:                          # from the folder's making on: a Ctrl-C right after it removes it
        staging.mkdir(exist_ok=True)
        meta = _pack(replace(job, out_dir=staging, force=False, on_complete=None), log)
    except KeyboardInterrupt:
        _drop_staging(staging, keep_resumable=True, log=log)
        raise
    except BaseException:
        _drop_staging(staging, keep_resumable=False, log=log)
        raise
    _swap_in(staging, d, meta)
    if job.on_complete is not None:
        job.on_complete(d)
    log(f"--force: the new shard set replaced the previous one in {d}")
    return meta


def _drop_staging(staging: Path, keep_resumable: bool, log: Callable[[str], None]) -> None:
    """After a --force rebuild that did not complete: remove the side folder, so the old set
    is left exactly as it was with nothing beside it. Only an interrupted run (Ctrl-C,
    SIGTERM: ``keep_resumable``) keeps it, and only when it holds shards recorded in its
    progress file, which the same --force command resumes. A failed run never keeps it: what
    made it fail (a damaged input, another tokenizer) is fixed by changing what the rebuild's
    settings record, so its shards could not be resumed anyway."""
    if keep_resumable:
        try:
            progress = _read_json(staging / PROGRESS_FILE)
        except PipelineError:
            progress = None
        if progress and progress.get("shards"):
            log(f"--force: the unfinished new set is kept in {staging} ({len(progress['shards'])} "
                f"shard(s)); the same command resumes it. The previous set in {staging.parent} is "
                "unchanged.")
            return
    shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, d: Path, meta: dict) -> None:
    """Move the complete set in ``staging`` over the set in ``d``. The old metadata goes first
    (so no reader ever takes a mix of old and new shards for a complete set), then the new
    shards, then the old shards beyond the new count, then the new metadata, last."""
    for name in (METADATA_FILE, PROGRESS_FILE):
        (d / name).unlink(missing_ok=True)
    names = [s["file"] for s in meta["shards"]]
    for name in names:
        os.replace(staging / name, d / name)
    for p in _set_files(d):
        if p.name not in names and p.name != METADATA_FILE:
            p.unlink(missing_ok=True)
    os.replace(staging / METADATA_FILE, d / METADATA_FILE)
    shutil.rmtree(staging, ignore_errors=True)


def _pack(job: PackJob, log: Callable[[str], None]) -> dict:
    """Pack ``job`` into ``job.out_dir``, from where an earlier run stopped (or say the set is
    up to date); the metadata is written last, and the progress file then removed."""
    state = _load_resume(job, log)
    if state and "up_to_date" in state:
        return _up_to_date(job.out_dir, state["up_to_date"], log)
    bos, eos = require_bos_eos(job.tokenizer, job.tokenizer_info["name"])
    dtype = dtype_for_vocab(len(job.tokenizer))
    packer = _Packer(job, dtype, state)
    _fill(job, packer, _chunks_to_pack(job, packer, state, log), dtype, bos, eos)
    meta = _finished_metadata(job, packer, dtype)
    if job.on_complete is not None:
        job.on_complete(job.out_dir)
    write_metadata(job.out_dir, meta)
    (job.out_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return meta


def _up_to_date(d: Path, meta: dict, log: Callable[[str], None]) -> dict:
    log(f"{d}: shard set is up to date ({meta['totals']['tokens']:,} tokens in "
        f"{meta['totals']['shards']} shard(s)); nothing to do. Use --force to rebuild it.")
    meta["up_to_date"] = True
    return meta


def _chunks_to_pack(job: PackJob, packer: _Packer, state: Optional[dict],
                    log: Callable[[str], None]) -> Iterator[Chunk]:
    """The documents still to pack, in chunks: from the saved stream position or after the
    documents already consumed; none when the set is capped (max files or max documents)."""
    start = packer.committed.read
    resume = packer.stream_resume
    if state:
        how = ("restoring the saved stream position" if resume else
               f"skipping {start:,} documents already consumed")
        log(f"resuming {job.out_dir}: {len(packer.shards)} shard(s) done ({start:,} documents), {how}")
    if job.max_files is not None and len(packer.shards) >= job.max_files:
        packer.capped = True
    if packer.capped or (job.max_documents is not None and start >= job.max_documents):
        return iter(())
    # A batch of `batch` documents is split into 2 tasks per worker (load balance).
    chunk_docs = job.batch if job.workers <= 1 else max(1, -(-job.batch // (2 * job.workers)))
    return _chunks(job.open_stream(start, resume), start, job.max_documents, chunk_docs)


def _fill(job: PackJob, packer: _Packer, chunks: Iterator[Chunk], dtype: np.dtype, bos: int,
          eos: int) -> None:
    """Tokenize the chunks and pack them into shards, with a progress bar, until the stream
    ends or the set is capped; the worker pool stops on the way out, also on Ctrl-C."""
    bar = tqdm(total=job.max_documents, initial=packer.committed.read, unit="doc", unit_scale=True,
               mininterval=0.5, disable=not job.progress_bar, dynamic_ncols=True,
               desc=f"{job.kind} -> shards")
    results = _results(job, chunks, dtype, bos, eos, job.workers)
    try:
        for chunk, result in results:
            packer.add(chunk, *result)
            bar.update(len(chunk.reasons))
            el = max(time.time() - packer.t0, 1e-9)
            bar.set_postfix_str(f"{packer.new_tokens / el:,.0f} tok/s, {len(packer.shards)} shards",
                                refresh=False)
            if packer.capped:
                break
        packer.finish()
    finally:
        results.close()   # stops the worker pool now, also on Ctrl-C
        bar.close()


def _finished_metadata(job: PackJob, packer: _Packer, dtype: np.dtype) -> dict:
    """metadata.json of the finished set (its shards, counts, speed and settings), checked
    against what was counted; no shard at all is a PipelineError."""
    c = packer.committed
    if not packer.shards:
        (job.out_dir / PROGRESS_FILE).unlink(missing_ok=True)
        raise PipelineError(f"no document was stored: {c.read:,} read, dropped by reason "
                            f"{c.dropped or {}}. Check the input and the filters ({job.filters}).")
    seconds = packer.seconds
    run_seconds = time.time() - packer.t0
    meta = shard_set_metadata(
        packer.shards, dtype=dtype, tokenizer_info=job.tokenizer_info,
        source={"kind": job.kind, "inputs": job.inputs, "filters": job.filters, "test": job.test,
                "max_documents": job.max_documents, **job.extra_source},
        window=job.window, stride=job.stride, shard_tokens=job.shard_tokens,
        totals={"characters": c.characters},
        stats={"documents_read": c.read, "documents_kept": c.kept,
               "documents_dropped": sum(c.dropped.values()), "dropped_by_reason": c.dropped,
               "content_tokens": c.content_tokens,
               "chars_per_token": round(c.characters / max(c.content_tokens, 1), 4),
               "seconds": round(seconds, 3), "runs": packer.runs,
               "tokens_per_second": round(c.content_tokens / max(seconds, 1e-9), 1),
               "this_run_seconds": round(run_seconds, 3),
               "this_run_tokens_per_second": round(packer.new_tokens / max(run_seconds, 1e-9), 1),
               "workers": job.workers, "batch": job.batch,
               "stopped_at_max_files": packer.capped},
        truncated=packer.capped, settings=job.settings())
    if (meta["totals"]["tokens"], meta["totals"]["documents"]) != (c.tokens, c.kept):
        raise RuntimeError(f"packing bookkeeping error: shards hold {meta['totals']['tokens']} tokens "
                           f"of {meta['totals']['documents']} documents, counted {c.tokens} of {c.kept}")
    return meta


def summary(meta: dict) -> str:
    """The human summary both stages print at the end."""
    t, s = meta["totals"], meta["stats"]
    lines = [f"documents: {s['documents_read']:,} read, {t['documents']:,} kept"
             + (f", dropped {s['dropped_by_reason']}" if s["dropped_by_reason"] else ""),
             f"tokens:    {t['tokens']:,} in {t['shards']} shard(s) ({meta['dtype']}), "
             f"{s['content_tokens']:,} without BOS/EOS",
             f"characters per token: {s['chars_per_token']:.3f}",
             f"speed:     {s['tokens_per_second']:,.0f} tokens/s over {s['seconds']:.1f} s"
             + (f" ({s['runs']} runs)" if s.get("runs", 1) > 1 else "")]
    if meta.get("truncated"):
        lines.append(f"stopped early: reached the cap of {len(meta['shards'])} shard files (--max-files)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- inputs
def file_identity(paths: Iterable[Path]) -> list:
    """Inputs as recorded for resume checks: path, size and modification time."""
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append({"path": str(p), "bytes": st.st_size, "mtime": int(st.st_mtime)})
    return out


def cleaned_article_stream(paths: list[Path]) -> Stream:
    """Stream over cleaned article files (one escaped article per line, blank lines skipped)."""
    def open_stream(start: int, resume: Optional[dict] = None) -> Iterator[tuple[str, Optional[str]]]:
        # Local files: skipping documents is cheap, no saved stream state is needed.
        def documents() -> Iterator[tuple[str, Optional[str]]]:
            for text in itertools.islice(iter_articles(paths), start, None):   # TextFileError: a PipelineError
                yield text, None
        return documents()
    return open_stream


# --------------------------------------------------------------------------- stage plumbing
def add_output_flags(parser, default_dir: str) -> None:
    """Flags every prep stage shares (window, shard size, output folder, --force, progress)."""
    parser.config_flag("--window", key="dataset.window", type=int, metavar="N",
                       help="training window length recorded with the shards (windows are cut at "
                            "read time)")
    parser.config_flag("--shard-tokens", key="dataset.shard_tokens", type=int, metavar="N",
                       help="a shard is closed once it holds this many tokens")
    parser.add_argument("--output-dir", type=cli_path, metavar="DIR", default=None,
                        help=f"shard directory (default: {default_dir})")
    parser.add_argument("--force", action="store_true",
                        help="delete an existing or unfinished shard set and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_fast_tokenizer(cfg) -> tuple[Any, dict]:
    """The configured tokenizer and its description; prep needs a fast (tokenizers) backend."""
    tok = load_tokenizer(cfg)
    if not getattr(tok, "is_fast", False):
        raise PipelineError(f"tokenizer '{cfg.tokenizer.name}' has no fast (tokenizers) backend; "
                            "token shards are built with its batch encoder.")
    return tok, describe(tok, cfg.tokenizer.name)


def run_job(job: PackJob, headline: str) -> int:
    """Print what is about to happen, pack, and print the summary (stage mains end here)."""
    print(f"{headline} -> {job.out_dir} ({job.workers} worker(s), tokenizer "
          f"{job.tokenizer_info.get('name')})", flush=True)
    meta = pack(job)
    if not meta.get("up_to_date"):
        print(summary(meta))
        print(f"wrote {job.out_dir}")
    return 0
