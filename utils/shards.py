"""Token shard sets on disk: the contract between prep stages and their readers.

A shard set is a directory of ``tokens_NNNNN.npy`` files plus ``metadata.json``.
Each shard is a 1-D array (uint16 if the vocabulary fits, else uint32) of whole documents,
each stored as BOS + tokens + EOS; a document never spans two shards. Training windows are
cut at read time, so no token is stored twice.

``metadata.json`` is written last and atomically; a set without it, or with
``complete: false``, is incomplete. Readers memory-map shards and validate the metadata
against the current tokenizer and model before use.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from utils.atomic import atomic_open
from utils.cli import PipelineError

FORMAT_NAME = "llm-pipeline-token-shards"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
SHARD_PATTERN = "tokens_{:05d}.npy"


class ShardSetError(PipelineError):
    """A missing, incomplete or stale shard set (exit code 1)."""

    def __init__(self, message: str, field: Optional[str] = None):
        self.field = field
        super().__init__(message)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(index: int) -> str:
    return SHARD_PATTERN.format(index)


def save_npy_atomic(path: Path, arr: np.ndarray) -> None:
    """Write a .npy so that it appears only when complete (temp file, fsync, rename)."""
    with atomic_open(path) as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)


def rebuild_command(source: Optional[str], test: bool) -> str:
    stage = "fineweb" if source == "fineweb" else "prepare"
    return f"python main.py {stage}{' --test' if test else ''} (add --force to start over)"


def read_metadata(directory: Path, rebuild: str = "python main.py prepare") -> dict:
    """Read and check the structural fields of a shard set's metadata.json."""
    d = Path(directory)
    mpath = d / METADATA_FILE
    if not d.is_dir():
        raise ShardSetError(f"token shard set {d} does not exist. Build it with: {rebuild}", "directory")
    if not mpath.exists():
        raise ShardSetError(f"{d} has no {METADATA_FILE}: the shard set is incomplete (an interrupted "
                            f"prep?). Finish it with: {rebuild}", "metadata.json")
    try:
        meta = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardSetError(f"{mpath} is not valid JSON ({e}). Rebuild with: {rebuild}", "metadata.json")
    if meta.get("format") != FORMAT_NAME:
        raise ShardSetError(f"{mpath}: format is {meta.get('format')!r}, expected {FORMAT_NAME!r}. "
                            f"Rebuild with: {rebuild}", "format")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ShardSetError(f"{mpath}: format_version is {meta.get('format_version')!r}, this code reads "
                            f"version {FORMAT_VERSION}. Rebuild with: {rebuild}", "format_version")
    if meta.get("complete") is not True:
        raise ShardSetError(f"{mpath}: complete is not true (an interrupted prep). Finish it with: "
                            f"{rebuild}", "complete")
    for s in meta.get("shards", []):
        if not (d / s["file"]).exists():
            raise ShardSetError(f"{d}: shard {s['file']} listed in {METADATA_FILE} is missing. "
                                f"Rebuild with: {rebuild}", "shards")
    return meta


def validate_metadata(meta: dict, directory: Path, *, tokenizer_info: Optional[dict] = None,
                      model_vocab_size: Optional[int] = None, rebuild: str = "python main.py prepare") -> None:
    """Refuse a shard set that does not match the current tokenizer or model.

    ``tokenizer_info`` is :func:`utils.tok.describe` of the configured tokenizer.
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
    if model_vocab_size is not None and tmeta.get("vocab_size", 0) > model_vocab_size:
        raise ShardSetError(f"{where}: tokenizer.vocab_size {tmeta.get('vocab_size')} does not fit "
                            f"model.vocab_size {model_vocab_size}; raise model.vocab_size or rebuild the "
                            f"shards with a smaller tokenizer ({rebuild} --force)", "tokenizer.vocab_size")


def load_shards(directory: Path, meta: dict) -> list[np.ndarray]:
    """Memory-map every shard (read-only, no pickle); checks dtype and length against metadata."""
    d = Path(directory)
    out = []
    for s in meta["shards"]:
        arr = np.load(d / s["file"], mmap_mode="r", allow_pickle=False)
        if arr.ndim != 1 or str(arr.dtype) != meta["dtype"] or len(arr) != s["tokens"]:
            raise ShardSetError(f"{d / s['file']}: shape {arr.shape} dtype {arr.dtype} does not match "
                                f"{METADATA_FILE} ({s['tokens']} tokens of {meta['dtype']}); the set is "
                                "corrupt, rebuild it with --force", "shards")
        out.append(arr)
    return out
