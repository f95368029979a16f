"""Token shards -> training batches (library; importing it does no work).

The trainer calls :func:`build_loaders`::

    train_loader, val_loader, info = build_loaders(cfg, tokenizer, device=device,
                                                   rank=rank, world_size=world_size)
    for x, y in train_loader:          # one epoch (the rest of it, after a resume)
        x, y = to_device((x, y), device)  # (B, T) int64 each, y = x shifted left by one
        ...
    state = train_loader.state_dict()   # store in the checkpoint; load_state_dict() resumes

Item format
    A *window* is ``window + 1`` consecutive tokens ``w`` of one shard; the item is the pair
    ``x = w[:-1]``, ``y = w[1:]`` (int64, shape ``(T,)`` with ``T = dataset.window``), so a
    batch is ``(x, y)`` with both ``(B, T)``. Windows start every ``stride`` tokens
    (``cfg.stride``; default ``window // 2``, the seed's 50% overlap) and never cross a shard
    boundary (nor a train/validation block boundary, below). Document boundaries are kept as
    the BOS/EOS tokens stored in the shards; windows run across documents like nanoGPT's.
    A batch is fetched with one vectorized index lookup (``__getitems__``), tensors contiguous.

Start-up cost
    Shards are memory-mapped through :func:`utils.data.shards.open_shard` (the ``.npy`` header is
    parsed and checked without pickle, the data is mapped read-only and not read), the token-id
    range comes from each shard's ``max_token_id`` in ``metadata.json``, and every count is
    computed arithmetically from the per-shard token counts there: start-up reads no token
    data and its time and memory do not grow with the dataset (only the block table below, a
    few bytes per 16k tokens, does). A set whose metadata predates ``max_token_id`` costs one
    sequential max over each shard, once per start-up (a note says so).

Train/validation split (no leakage)
    Each shard's token range is cut into *blocks* of ``split_block_windows * stride`` tokens
    (64 * 256 = 16,384 tokens by default; the last block of a shard may be shorter). A seeded
    RNG (``dataset.seed``) picks ``round(val_split * n_blocks)`` blocks for validation.
    Windows are cut only inside maximal runs of consecutive same-split blocks of one shard, so
    every token position belongs to exactly one split and no token of a validation window
    (input or target) appears in a training window, despite the 50% overlap. The cost is
    O(number of blocks); a few windows' worth of tokens at each train/val border are unused.

Sampler (resumable, DDP-aware)
    :class:`ResumableSampler`: epoch ``e`` uses a permutation of all training windows keyed
    by ``np.random.default_rng([seed, e])``; rank ``r`` of ``W`` takes
    ``perm[r::W]`` truncated to ``N // W`` windows, so ranks are disjoint and equally long
    (at most ``W - 1`` windows per epoch are skipped, different ones each epoch). The
    permutation is never materialized: :class:`IndexPermutation` (a keyed Feistel bijection
    with cycle-walking) computes ``perm[p]`` for a chunk of positions on demand: O(1) memory
    and start-up at any N (``np.random.permutation`` would take time and memory in proportion
    to N at every start and epoch). :class:`TrainLoader` counts the batches the trainer has *consumed* (not the ones
    worker processes prefetched) and its ``state_dict()`` is::

        {"epoch": e, "index": windows of this rank's epoch slice already consumed,
         "seed": ..., "rank": ..., "world_size": ..., "num_windows": N, "batch_size": B}

    ``load_state_dict()`` makes the next iteration yield exactly the batches an uninterrupted
    run would have yielded next. Training batches drop the last partial batch of an epoch
    (fixed shapes). Validation uses one fixed seeded order (identical at every evaluation and
    every run, never reshuffled, spread over the whole validation set so that the first
    ``eval_batches`` batches are representative), split across ranks the same way.
    Starting an epoch draws nothing from torch's global RNG (each DataLoader has its own
    seeded ``generator`` for its workers' seeds), so a resumed run's dropout masks, drawn from
    the RNG state restored from the checkpoint, are the uninterrupted run's.

On-the-fly mode (``dataset.mode = "on_the_fly"``, seeds/000)
    :class:`OnTheFlyDataset` streams raw text from a Hugging Face dataset name
    (``datasets.load_dataset(..., streaming=True)``) or local parquet / jsonl / txt files,
    tokenizes in batches with the fast tokenizer, adds BOS/EOS per document and packs windows
    of the same shape. Documents are assigned to validation by a seeded hash of their index
    and to ranks/workers by index modulo, so all streams are disjoint. Its length is unknown:
    the trainer bounds training with ``training.max_steps``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from utils.cli import PipelineError, StageParser, capped_workers, cli_path, run_stage
from utils.errors import error_line
from utils.config import BASE_CONFIG_ENV, DEFAULT_CONFIG_FILE, PROJECT_ROOT, Config
from utils.data.hub import iter_rows, open_hub_dataset
from utils.data.packing import encode_frame
from utils.data.shards import (ShardSetError, load_shards, open_shard, read_metadata, rebuild_command,
                          validate_metadata)
from utils.data.textio import unescape_article
from utils.data.tok import describe, load_tokenizer

# Fields of ShardSetError that mean "this set was built differently": rebuild with --force.
# (A missing or incomplete set is finished by a plain re-run: prep is resumable.)
_INCOMPLETE_FIELDS = ("directory", "metadata.json", "complete")


# --------------------------------------------------------------------------- tokenizer info
def tokenizer_info(cfg: Config, tokenizer: Any = None) -> dict:
    """``utils.data.tok.describe`` of the tokenizer; ``tokenizer`` may be None (load the configured
    one), a tokenizer object, or an already-described dict (returned as is)."""
    if isinstance(tokenizer, dict):
        return tokenizer
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    return describe(tok, cfg.tokenizer.name)


# --------------------------------------------------------------------------- shard set
def _rebuild(cfg: Config, directory: Optional[Path] = None) -> str:
    """The pasteable prep command for this config (its --config files, and --output-dir when
    the set is not in the configured folder)."""
    files = [s for s in cfg.sources if s != "command-line flags"
             and Path(s).resolve() != Path(DEFAULT_CONFIG_FILE).resolve()]
    custom = directory is not None and Path(directory).resolve() != cfg.shard_dir().resolve()
    return rebuild_command(cfg.dataset.source, cfg.test, config_file=files or None,
                           output_dir=str(directory) if custom else None)


def _check(cfg: Config, directory: Path, tok_info: dict,
           log: Optional[Callable[[str], None]] = None) -> tuple[dict, list[np.ndarray]]:
    """read_metadata + validate against the tokenizer + open every shard (headers only, plus
    the token-id range from metadata). Raises ShardSetError."""
    rebuild = _rebuild(cfg, directory)
    meta = read_metadata(directory, rebuild)
    validate_metadata(meta, directory, tokenizer_info=tok_info, rebuild=rebuild)
    arrays = load_shards(directory, meta, rebuild=rebuild, **({"log": log} if log else {}))
    return meta, arrays


def run_prep(cfg: Config, force: bool, output_dir: Optional[Path] = None) -> None:
    """Run the prep stage for ``cfg.dataset.source`` as a subprocess with the current config
    (written to a temporary JSON file that reproduces ``cfg``); output inherits our stdout."""
    module = "fineweb_prep" if cfg.dataset.source == "fineweb" else "dataset_prep"
    with tempfile.TemporaryDirectory(prefix="autoprep-") as tmp:
        cfg_file = Path(tmp) / "config.json"
        cfg_file.write_text(json.dumps(cfg.to_dict(), indent=2), encoding="utf-8")
        flags = ["--test"] if cfg.test else []
        flags += ["--force"] if force else []
        flags += ["--output-dir", str(output_dir)] if output_dir is not None else []
        print(f"dataloader: dataset.auto_prepare: the shard set is {'stale' if force else 'missing or incomplete'}"
              f"; running python -m {module} --config <current config> {' '.join(flags)}",
              file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", module, "--config", str(cfg_file), *flags]
        # the file reproduces cfg whole: no base layer under it (a relative
        # $LLM_PIPELINE_BASE_CONFIG named a file of the caller's folder, not of this one)
        proc = subprocess.run(cmd, cwd=str(PROJECT_ROOT), env={**os.environ, BASE_CONFIG_ENV: "none"})
    if proc.returncode != 0:
        raise PipelineError(f"dataset.auto_prepare: the prep stage `python -m {module}` failed "
                            f"(exit code {proc.returncode}); see its output above. Run "
                            f"`{_rebuild(cfg, output_dir)}` by hand to investigate.")


def open_shard_set(cfg: Config, tokenizer: Any = None, directory: Optional[Path] = None,
                   log: Optional[Callable[[str], None]] = None) -> tuple[Path, dict, list[np.ndarray]]:
    """Validate and memory-map the configured shard set: (directory, metadata, arrays).

    Refuses (ShardSetError, exit code 1) a missing, incomplete, damaged or stale set (other
    tokenizer), malformed shard files, token ids outside the vocabulary and a vocabulary that
    does not fit ``model.vocab_size``, naming the file or field and the rebuild command
    (:mod:`utils.data.shards`; docs/data_stages.md). With ``dataset.auto_prepare`` a missing/incomplete
    set is finished and a stale or damaged one rebuilt (``--force``) by running the prep stage
    first, then re-checked; a metadata.json that cannot be read or parsed is never acted on.
    """
    d = Path(directory) if directory is not None else cfg.shard_dir()
    info = tokenizer_info(cfg, tokenizer)
    try:
        meta, arrays = _check(cfg, d, info, log)
    except ShardSetError as e:
        if not cfg.dataset.auto_prepare or not e.auto_rebuild:
            raise
        run_prep(cfg, force=e.field not in _INCOMPLETE_FIELDS,
                 output_dir=Path(directory) if directory is not None else None)
        meta, arrays = _check(cfg, d, info, log)
    # The model check comes after any rebuild: rebuilding with the same tokenizer cannot fix it.
    validate_metadata(meta, d, model_vocab_size=cfg.model.vocab_size, rebuild=_rebuild(cfg, d))
    return d, meta, arrays


# --------------------------------------------------------------------------- split
def _n_windows(length: np.ndarray | int, span: int, stride: int):
    """Windows of ``span`` tokens at ``stride`` that fit in ``length`` tokens (vectorized)."""
    length = np.asarray(length, dtype=np.int64)
    return np.where(length >= span, (length - span) // stride + 1, 0)


@dataclasses.dataclass
class WindowIndex:
    """The windows of one split, as runs of evenly spaced windows: O(runs) memory.

    Run ``i`` holds ``counts[i]`` windows of ``span`` tokens starting at
    ``starts[i] + k * stride`` in shard ``shards[i]``.
    """
    shards: np.ndarray   # (R,) int64
    starts: np.ndarray   # (R,) int64 token offset of the run's first window
    counts: np.ndarray   # (R,) int64 windows in the run
    tokens: int          # tokens covered by this split's blocks
    span: int
    stride: int

    def __post_init__(self):
        self.cum = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)  # (R+1,)

    def __len__(self) -> int:
        return int(self.cum[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """Window i -> (shard index, token offset of its first token)."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        r = int(np.searchsorted(self.cum, i, side="right")) - 1
        return int(self.shards[r]), int(self.starts[r] + (i - self.cum[r]) * self.stride)

    def locate_many(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorized :meth:`locate`: (shard indices, token offsets), each like idx."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        r = np.searchsorted(self.cum, idx, side="right") - 1
        return self.shards[r], self.starts[r] + (idx - self.cum[r]) * self.stride


def split_windows(shard_tokens: Sequence[int], *, window: int, stride: int, val_split: float,
                  seed: int, block_windows: int = 64) -> tuple[WindowIndex, WindowIndex, dict]:
    """Deterministic, leak-free train/val split of the windows of a shard set.

    Works on the shard lengths only (from metadata), in O(number of blocks).
    Returns (train index, val index, split summary).
    """
    span = window + 1
    block = max(block_windows * stride, span)
    lengths = np.asarray(shard_tokens, dtype=np.int64)
    nb = -(-lengths // block)                                    # blocks per shard
    n_blocks = int(nb.sum())
    n_val = int(round(val_split * n_blocks)) if n_blocks else 0
    if val_split > 0 and n_blocks >= 2:
        n_val = min(max(n_val, 1), n_blocks - 1)                 # both splits non-empty
    elif n_blocks < 2:
        n_val = 0
    is_val = np.zeros(n_blocks, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_blocks)[:n_val]] = True

    runs = {False: ([], [], [], [0]), True: ([], [], [], [0])}
    first = 0
    for s, (length, k) in enumerate(zip(lengths.tolist(), nb.tolist())):
        if k == 0:
            continue
        lab = is_val[first:first + k]
        first += k
        # maximal runs of equal labels: [b0, b1) in block units
        cuts = np.flatnonzero(np.diff(lab.astype(np.int8))) + 1
        b0 = np.concatenate([[0], cuts])
        b1 = np.concatenate([cuts, [k]])
        t0 = b0 * block
        t1 = np.minimum(b1 * block, length)
        cnt = _n_windows(t1 - t0, span, stride)
        for flag in (False, True):
            m = lab[b0] == flag
            sh, st, ct, tk = runs[flag]
            sh.append(np.full(int(m.sum()), s, dtype=np.int64))
            st.append(t0[m])
            ct.append(cnt[m])
            tk.append(int((t1 - t0)[m].sum()))

    def build(flag):
        sh, st, ct, tk = runs[flag]
        cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)
        return WindowIndex(cat(sh), cat(st), cat(ct), sum(tk), span, stride)

    train, val = build(False), build(True)
    total = int(lengths.sum())
    summary = {"block_tokens": block, "blocks": n_blocks, "val_blocks": n_val,
               "train_windows": len(train), "val_windows": len(val),
               "train_tokens": train.tokens, "val_tokens": val.tokens,
               "val_fraction": (val.tokens / total) if total else 0.0}
    return train, val, summary


# --------------------------------------------------------------------------- dataset
class ShardWindowDataset(Dataset):
    """Map-style dataset over one split's windows: item i -> (x, y), each (T,) int64.

    Shards are opened lazily per process (memory maps are not pickled to workers).
    """

    def __init__(self, paths: Sequence[Path], index: WindowIndex,
                 arrays: Optional[list[np.ndarray]] = None, vocab_size: Optional[int] = None):
        self.paths = [str(p) for p in paths]
        self.index = index
        self._arrays = arrays
        self.vocab_size = vocab_size    # ids at or above it: a ShardSetError naming the shard

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arrays"] = None
        return state

    @property
    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:   # a worker process: re-open (headers re-validated, no pickle)
            self._arrays = [open_shard(Path(p)) for p in self.paths]
        return self._arrays

    def window(self, i: int) -> np.ndarray:
        """The raw ``window + 1`` tokens of window i (a view into the memory map)."""
        s, off = self.index.locate(i)
        return self.arrays[s][off:off + self.index.span]

    def position(self, i: int) -> tuple[int, int]:
        """(shard, first token offset) of window i; covers [offset, offset + window + 1)."""
        return self.index.locate(i)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, off = self.index.locate(int(i))
        raw = self.arrays[s][off:off + self.index.span]             # (T+1,) as window(i)
        self._check(raw[None], [s])
        w = torch.from_numpy(raw.astype(np.int64))
        return w[:-1], w[1:]                                        # (T,), (T,)

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once (DataLoader calls this with the batch's indices; the loaders
        here pair it with :func:`collate_batch`): (x, y), each (B, T) int64, contiguous."""
        shards, offs = self.index.locate_many(np.asarray(indices))
        span, arrays = self.index.span, self.arrays
        out = np.empty((len(offs), span), dtype=np.int64)           # (B, T+1)
        for j, (s, off) in enumerate(zip(shards.tolist(), offs.tolist())):
            out[j] = arrays[s][off:off + span]
        self._check(out, shards.tolist())
        w = torch.from_numpy(out)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()         # (B, T), (B, T)

    def _check(self, rows: np.ndarray, shards: list[int]) -> None:
        """Token ids below the vocabulary (one max over the batch): start-up trusts each shard's
        ``max_token_id`` in metadata.json instead of reading the data, and an id beyond the
        vocabulary was an IndexError deep in the model's embedding."""
        if self.vocab_size is None or not rows.size or int(rows.max()) < self.vocab_size:
            return
        j = int(np.argmax(rows.max(axis=1) >= self.vocab_size))
        raise ShardSetError(f"{self.paths[shards[j]]}: holds token id {int(rows[j].max()):,}, outside the "
                            f"{self.vocab_size:,}-token vocabulary its metadata.json promises (its "
                            "max_token_id is wrong: the set was edited or damaged). Rebuild the set "
                            "(python main.py prepare --force).", "shards")


def collate_batch(data):
    """collate_fn: a batch already built by ``__getitems__`` passes through; a list of items
    is stacked by torch's default_collate."""
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        return data
    return torch.utils.data.default_collate(data)


# --------------------------------------------------------------------------- sampler
_U64 = np.uint64
_MIX1, _MIX2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def mix64(x) -> np.ndarray:
    """splitmix64 finalizer: a fixed, platform-independent 64-bit hash, elementwise on a uint64
    array (wrapping arithmetic); Python ints are taken modulo 2**64. The one hash behind the
    shuffle (:class:`IndexPermutation`) and the on-the-fly validation split (:func:`is_val_doc`)."""
    if isinstance(x, int):
        x = np.uint64(x & _MASK64)
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _MIX1
        x = x ^ (x >> _U64(27))
        x = x * _MIX2
        return x ^ (x >> _U64(31))


class IndexPermutation:
    """A pseudo-random permutation of ``range(n)`` evaluated lazily: O(1) memory and set-up.

    A keyed 4-round Feistel network is a bijection on ``[0, 2**bits)`` (``2**bits < 4n``);
    cycle-walking (re-encrypting values >= n) restricts it to a bijection on ``[0, n)``. The
    keys come from ``np.random.default_rng([seed, epoch])``, so the order is fixed by
    (seed, epoch) on every machine. ``perm(positions)`` maps an int array of positions to
    window indices, vectorized.
    """

    def __init__(self, n: int, seed: int, epoch: int, rounds: int = 4):
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = _U64(bits // 2)
        self.mask = _U64((1 << (bits // 2)) - 1)
        self.keys = np.random.default_rng([seed, epoch]).integers(0, 2**63, size=rounds, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"position out of range [0, {self.n})")
        with np.errstate(over="ignore"):
            x = self._encrypt(pos.astype(np.uint64))
            out = x >= self.n
            while out.any():  # expected < 4 passes: 2**bits < 4n
                x[out] = self._encrypt(x[out])
                out = x >= self.n
        return x.astype(np.int64)


class ResumableSampler(Sampler[int]):
    """Shuffled sampler over N windows: a new permutation per epoch from (seed, epoch)
    (``fixed_order=True``: the permutation of (seed, 0) for every epoch, for validation);
    rank r of W takes ``perm[r::W][:N // W]``. The permutation is an :class:`IndexPermutation`
    evaluated in chunks as batches are drawn, so set-up time and memory do not grow with N.
    Iteration starts at ``self.index`` within the current epoch (see :class:`TrainLoader`)."""

    CHUNK = 1 << 14

    def __init__(self, num_windows: int, *, seed: int, fixed_order: bool = False, rank: int = 0,
                 world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        self.num_windows, self.seed, self.fixed_order = int(num_windows), int(seed), fixed_order
        self.rank, self.world_size = rank, world_size
        self.epoch, self.index = 0, 0

    def __len__(self) -> int:
        """Windows per epoch for this rank."""
        return self.num_windows // self.world_size

    def permutation(self, epoch: int) -> IndexPermutation:
        return IndexPermutation(self.num_windows, self.seed, 0 if self.fixed_order else epoch)

    def indices(self, epoch: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Window indices at positions [start, stop) of this rank's sequence for an epoch."""
        stop = len(self) if stop is None else min(stop, len(self))
        j = np.arange(start, max(start, stop), dtype=np.int64)
        return self.permutation(epoch)(self.rank + j * self.world_size)

    def __iter__(self) -> Iterator[int]:
        return self._iter(self.epoch, self.index)  # position snapshot taken now

    def _iter(self, epoch: int, start: int) -> Iterator[int]:
        for a in range(start, len(self), self.CHUNK):
            yield from self.indices(epoch, a, a + self.CHUNK).tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_windows", "world_size"):
            if key in state and state[key] != getattr(self, key):
                why = {"seed": "dataset.seed", "world_size": "the world size (processes: torchrun "
                                                            "--nproc_per_node)"}.get(
                    key, "dataset.window or dataset.stride, the shard set, or dataset.val_split")
                raise PipelineError(f"cannot resume the data position: {key} is {state[key]} in the "
                                    f"checkpoint but {getattr(self, key)} now: {why} changed since it "
                                    "was written. Resume with the run's settings, or start a new run.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


# --------------------------------------------------------------------------- loaders
def to_device(batch, device):
    """Move a batch (tensor, or tuple/list/dict of tensors) to ``device``; non_blocking on CUDA
    (the source tensors are pinned by the loader there)."""
    device = torch.device(device)
    nb = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=nb)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return type(batch)(to_device(b, device) for b in batch)


def _dataloader(dataset, *, batch_size: int, sampler=None, drop_last: bool, device,
                num_workers: int, seed: int = 0) -> DataLoader:
    """torch's DataLoader over ``dataset``. Its own ``generator`` (seeded with ``seed``): each
    ``iter()`` draws the workers' base seed from it, not from torch's global RNG, which the
    trainer restores from a checkpoint before the loader's first ``iter()`` of a resumed run
    (a draw there would shift every dropout mask after a resume)."""
    pin = torch.device(device).type == "cuda"
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      num_workers=num_workers, pin_memory=pin, collate_fn=collate_batch,
                      persistent_workers=False, prefetch_factor=4 if num_workers else None,
                      generator=torch.Generator().manual_seed(seed))


class TrainLoader:
    """Epoch iterator over training batches ``(x, y)``, each ``(B, T)`` int64, with an exact
    resumable position. ``for x, y in loader`` yields the rest of the current epoch, then
    advances ``loader.epoch``. ``len(loader)`` is the number of batches of a full epoch."""

    def __init__(self, dataset, sampler: ResumableSampler, *, batch_size: int, device,
                 num_workers: int = 0):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.device, self.num_workers = device, num_workers

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        s = self.sampler
        if s.index + self.batch_size <= len(s):
            # The sampler reads s.index once, when the DataLoader starts iterating it.
            loader = _dataloader(self.dataset, batch_size=self.batch_size, sampler=s,
                                 drop_last=True, device=self.device, num_workers=self.num_workers,
                                 seed=s.seed + s.epoch)
            it = iter(loader)
            start = s.index
            for b, batch in enumerate(it, 1):
                s.index = start + b * self.batch_size  # consumed, not prefetched
                yield batch
        s.epoch, s.index = s.epoch + 1, 0

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class OnTheFlyLoader:
    """Batches from an :class:`OnTheFlyDataset`; resumes by skipping the batches already
    consumed (re-reading and re-tokenizing them: O(position)). One ``for`` pass = one pass
    over the source; no length (the trainer uses ``training.max_steps``)."""

    def __init__(self, dataset: "OnTheFlyDataset", *, batch_size: int, device, num_workers: int = 0):
        self.dataset, self.batch_size = dataset, batch_size
        self.device, self.num_workers = device, num_workers
        self.epoch, self.index = 0, 0  # index = batches consumed in this pass

    def __iter__(self):
        loader = _dataloader(self.dataset, batch_size=self.batch_size, drop_last=True,
                             device=self.device, num_workers=self.num_workers)
        skip = self.index
        for b, batch in enumerate(loader):
            if b < skip:
                continue
            self.index = b + 1
            yield batch
        self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "batch_size": self.batch_size,
                "mode": "on_the_fly"}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def build_loaders(cfg: Config, tokenizer: Any = None, *, batch_size: Optional[int] = None,
                  device: Any = "cpu", rank: int = 0, world_size: int = 1,
                  num_workers: Optional[int] = None, directory: Optional[Path] = None,
                  log: Optional[Callable[[str], None]] = None):
    """The trainer's entry point: ``(train_loader, val_loader, info)``.

    tokenizer: the tokenizer object (or its ``utils.data.tok.describe`` dict; None loads the
        configured one). batch_size: windows per batch (default ``training.batch_size``).
    device: where batches go (pin_memory on CUDA; use :func:`to_device`). rank/world_size:
        this process's DDP slice. num_workers: default ``training.num_workers``.
    train_loader: :class:`TrainLoader` (or :class:`OnTheFlyLoader`); val_loader: a
        DataLoader in a fixed order, or None when there is no validation data.
    log: where notes about the set go (default: stderr on rank 0, nowhere on other ranks).
    info: dict with mode, shard_dir, tokenizer, window, stride, train/val windows and tokens,
        the split summary and batches per epoch.
    """
    batch_size = batch_size or cfg.training.batch_size
    num_workers = capped_workers(cfg.training.num_workers if num_workers is None else num_workers,
                                 "training.num_workers")
    if cfg.dataset.mode == "on_the_fly":
        return _build_on_the_fly(cfg, tokenizer, batch_size=batch_size, device=device, rank=rank,
                                 world_size=world_size, num_workers=num_workers)
    if log is None and rank != 0:
        log = lambda msg: None   # noqa: E731  (notes about the set once, from rank 0)
    d, meta, arrays = open_shard_set(cfg, tokenizer, directory, log)
    ds = cfg.dataset
    train_idx, val_idx, split = split_windows(
        [s["tokens"] for s in meta["shards"]], window=ds.window, stride=cfg.stride,
        val_split=ds.val_split, seed=ds.seed, block_windows=ds.split_block_windows)
    paths = [d / s["file"] for s in meta["shards"]]
    tmeta = meta.get("tokenizer")
    vocab = tmeta.get("vocab_size") if isinstance(tmeta, dict) else None
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    train_ds = ShardWindowDataset(paths, train_idx, arrays, vocab)
    val_ds = ShardWindowDataset(paths, val_idx, arrays, vocab)
    sampler = ResumableSampler(len(train_ds), seed=ds.seed, rank=rank, world_size=world_size)
    if len(sampler) < batch_size:
        raise PipelineError(
            f"{d}: only {len(train_ds)} training windows of {ds.window + 1} tokens "
            f"({len(sampler)} for this rank): fewer than one batch of {batch_size}. Use a smaller "
            "dataset.window or training.batch_size, or prepare more data.")
    train_loader = TrainLoader(train_ds, sampler, batch_size=batch_size, device=device,
                               num_workers=num_workers)
    val_loader = None
    if len(val_ds) >= world_size:
        val_sampler = ResumableSampler(len(val_ds), seed=ds.seed + 1, fixed_order=True, rank=rank,
                                       world_size=world_size)
        val_loader = _dataloader(val_ds, batch_size=batch_size, sampler=val_sampler,
                                 drop_last=False, device=device, num_workers=num_workers,
                                 seed=ds.seed + 1)
    info = {"mode": "shards", "shard_dir": str(d), "tokenizer": meta["tokenizer"].get("name"),
            "dtype": meta["dtype"], "shards": len(arrays), "total_tokens": int(sum(len(a) for a in arrays)),
            "window": ds.window, "stride": cfg.stride, "batch_size": batch_size,
            "rank": rank, "world_size": world_size,
            "train_windows": len(train_ds), "val_windows": len(val_ds),
            "train_tokens": split["train_tokens"], "val_tokens": split["val_tokens"],
            "batches_per_epoch": len(train_loader), "split": split}
    return train_loader, val_loader, info


def describe_info(info: dict) -> str:
    """One line for logs: split sizes and where the data comes from."""
    if info.get("mode") == "on_the_fly":
        return (f"on-the-fly data from {info['source']} (window {info['window']}, stride "
                f"{info['stride']}, val_split {info['val_split']}; length unknown)")
    return (f"{info['shard_dir']}: {info['total_tokens']:,} tokens in {info['shards']} shard(s); "
            f"train {info['train_windows']:,} windows ({info['train_tokens']:,} tokens), "
            f"val {info['val_windows']:,} windows ({info['val_tokens']:,} tokens, "
            f"{info['split']['val_fraction']:.1%}); window {info['window']}, stride {info['stride']}")


# --------------------------------------------------------------------------- on-the-fly
_TEXT_SUFFIXES = (".parquet", ".jsonl", ".txt")


def is_val_doc(doc_index, seed: int, val_split: float):
    """Deterministic per-document validation assignment for on-the-fly mode: a bool for an int
    ``doc_index``, a bool array for an array of them."""
    key = mix64(seed) ^ np.asarray(doc_index, dtype=np.uint64)
    limit = math.ceil(val_split * 2.0**64)  # hash < val_split * 2**64, exactly, in integers
    h = mix64(key)
    out = np.ones(h.shape, dtype=bool) if limit >= 2**64 else h < np.uint64(max(limit, 0))
    return bool(out) if out.ndim == 0 else out


def local_text_files(path: Path) -> list[Path]:
    """A local file, or the sorted parquet/jsonl/txt files of a directory (recursive)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if files:
            return files
        raise PipelineError(f"{path} holds no .parquet, .jsonl or .txt files for on-the-fly mode.")
    raise PipelineError(f"on-the-fly source {path} does not exist.")


def iter_local_texts(files: Sequence[Path], text_column: str = "text") -> Iterator[str]:
    """Documents of local files in order: parquet (row-group streaming with pyarrow), jsonl
    (``text_column`` of each object), txt (one document per line, cleaned-article escapes
    undone with utils.data.textio)."""
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq     # 0.23 s after torch: only for parquet, not train's shards
            pf = pq.ParquetFile(f)
            if text_column not in pf.schema_arrow.names:
                raise PipelineError(f"{f}: no column '{text_column}' (columns: "
                                    f"{', '.join(pf.schema_arrow.names)}); set "
                                    "dataset.on_the_fly_text_column.")
            for rb in pf.iter_batches(batch_size=1024, columns=[text_column]):
                for t in rb.column(0).to_pylist():
                    if t:
                        yield t
        elif f.suffix == ".jsonl":
            with open(f, "rb") as fh:
                for line in fh:
                    line = line.strip()
                    if not line:
                        continue
                    try:       # bytes: invalid UTF-8 is a ValueError too
                        t = json.loads(line).get(text_column)
                    except (ValueError, RecursionError, AttributeError):
                        continue  # malformed line (not UTF-8 / JSON, too deep, not an object): skipped
                    if t and isinstance(t, str):
                        yield t
        else:
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    line = line.rstrip("\n")
                    if line.strip():
                        yield unescape_article(line)


def _hub_help(name: str, config: Optional[str], split: str) -> Callable[[BaseException], str]:
    def explain(e: BaseException) -> str:
        return (f"cannot stream dataset '{name}' (config {config!r}, split {split!r}) from the Hugging "
                f"Face hub: {error_line(e)}. Offline, set dataset.on_the_fly_source to a "
                "local .parquet/.jsonl/.txt file or folder.")
    return explain


class OnTheFlyDataset(IterableDataset):
    """Stream raw text, tokenize in batches, pack ``window + 1``-token windows at ``stride``.

    Document ``i`` of the source goes to validation iff ``is_val_doc(i, seed, val_split)``;
    within a split, global worker ``g`` of ``G = world_size * num_workers`` takes the
    documents with ``split_position % G == g``. Each document is BOS + tokens + EOS; each
    worker packs its own stream, so the content is deterministic for a fixed (G, g).
    Yields (x, y), each (T,) int64, like :class:`ShardWindowDataset`.

    A hub source is opened once (:func:`utils.data.hub.open_hub_dataset`, in the constructor, so a
    bad name fails before training starts) and every pass iterates that same object; pass
    ``hub=`` to share it between the train and validation datasets. ``local`` forces the
    source's kind (default: a path that exists or looks like one is local).
    """

    def __init__(self, source: str, tokenizer, *, window: int, stride: int, split: str = "train",
                 val_split: float = 0.1, seed: int = 42, rank: int = 0, world_size: int = 1,
                 hub_config: Optional[str] = None, hub_split: str = "train",
                 text_column: str = "text", batch_docs: int = 256, root: Optional[Path] = None,
                 local: Optional[bool] = None, hub: Any = None):
        self.source, self.tokenizer = source, tokenizer
        self.window, self.stride, self.split = window, stride, split
        self.val_split, self.seed, self.rank, self.world_size = val_split, seed, rank, world_size
        self.hub_config, self.hub_split, self.text_column = hub_config, hub_split, text_column
        self.batch_docs = batch_docs
        p = Path(os.path.expanduser(source))
        if not p.is_absolute() and root is not None:
            p = Path(root) / p
        if local is None:
            local = p.exists() or source.endswith(_TEXT_SUFFIXES) or source.startswith((".", "/", "~"))
        self.local = local
        self.files = local_text_files(p) if self.local else None
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        if self.bos is None or self.eos is None:
            raise PipelineError("on-the-fly mode needs a tokenizer with BOS and EOS tokens.")
        self.hub = None
        if not self.local:
            self.hub = hub if hub is not None else open_hub_dataset(
                source, hub_config, hub_split, explain=_hub_help(source, hub_config, hub_split))

    def texts(self) -> Iterator[str]:
        """All documents of the source, in order."""
        if self.local:
            yield from iter_local_texts(self.files, self.text_column)
        else:
            for row in iter_rows(self.hub, self.batch_docs):
                t = row.get(self.text_column)
                if t:
                    yield t

    def my_texts(self) -> Iterator[str]:
        """This split's documents for this (rank, worker)."""
        wi = get_worker_info()
        nw, wid = (wi.num_workers, wi.id) if wi is not None else (1, 0)
        G, g = self.world_size * nw, self.rank * nw + wid
        want_val, pos, i, block = self.split == "val", 0, 0, 1024
        texts = self.texts()
        while True:
            chunk = list(itertools.islice(texts, block))
            if not chunk:
                return
            val = is_val_doc(np.arange(i, i + len(chunk)), self.seed, self.val_split)
            i += len(chunk)
            for t, v in zip(chunk, val.tolist()):
                if v != want_val:
                    continue
                if pos % G == g:
                    yield t
                pos += 1

    def _encode(self, texts: list[str]) -> np.ndarray:
        """The documents framed as in the shards (utils.data.packing.encode_frame), concatenated."""
        framed, _, _ = encode_frame(self.tokenizer.backend_tokenizer, texts, np.dtype(np.int64),
                                    self.bos, self.eos)
        return framed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        span, stride = self.window + 1, self.stride
        buf = np.zeros(0, dtype=np.int64)
        batch: list[str] = []

        def drain(buf):
            n = int(_n_windows(len(buf), span, stride))
            for k in range(n):
                w = torch.from_numpy(buf[k * stride:k * stride + span].copy())  # (T+1,)
                yield w[:-1], w[1:]
            return buf[n * stride:] if n else buf

        def flush(buf, batch):
            buf = np.concatenate([buf, self._encode(batch)])
            rest = yield from drain(buf)
            return rest

        for t in self.my_texts():
            batch.append(t)
            if len(batch) >= self.batch_docs:
                buf = yield from flush(buf, batch)
                batch = []
        if batch:
            yield from flush(buf, batch)


def _build_on_the_fly(cfg: Config, tokenizer, *, batch_size, device, rank, world_size, num_workers):
    ds = cfg.dataset
    if not ds.on_the_fly_source:
        raise PipelineError("dataset.mode is 'on_the_fly' but dataset.on_the_fly_source is not set "
                            "(a hub dataset name or a local .parquet/.jsonl/.txt path).")
    if tokenizer is None or isinstance(tokenizer, dict):
        tokenizer = load_tokenizer(cfg)
    kw = dict(window=ds.window, stride=cfg.stride, val_split=ds.val_split, seed=ds.seed, rank=rank,
              world_size=world_size, hub_config=ds.on_the_fly_config, hub_split=ds.on_the_fly_split,
              text_column=ds.on_the_fly_text_column, batch_docs=ds.on_the_fly_batch_docs,
              root=cfg.root)
    train_ds = OnTheFlyDataset(ds.on_the_fly_source, tokenizer, split="train", **kw)  # opens a hub source
    val_ds = OnTheFlyDataset(ds.on_the_fly_source, tokenizer, split="val", hub=train_ds.hub, **kw)
    train_loader = OnTheFlyLoader(train_ds, batch_size=batch_size, device=device,
                                  num_workers=num_workers)
    val_loader = None
    if ds.val_split > 0:
        val_loader = _dataloader(val_ds, batch_size=batch_size, drop_last=False, device=device,
                                 num_workers=num_workers)
    info = {"mode": "on_the_fly", "source": ds.on_the_fly_source, "local": train_ds.local,
            "tokenizer": cfg.tokenizer.name, "window": ds.window, "stride": cfg.stride,
            "val_split": ds.val_split, "batch_size": batch_size, "rank": rank,
            "world_size": world_size, "train_windows": None, "val_windows": None,
            "batches_per_epoch": None}
    return train_loader, val_loader, info


# --------------------------------------------------------------------------- inspection CLI
def build_parser():
    """The inspection CLI's flags (``python dataloader.py --help``)."""
    parser = StageParser("dataloader.py", "Validate a token shard set (the configured one, or "
                         "--shards DIR) against the configured tokenizer and model, print its "
                         "train/val split and decode the first windows of a training batch.")
    parser.config_flag("--source", key="dataset.source", choices=["wikipedia", "fineweb"],
                       metavar="{wikipedia,fineweb}", help="which configured shard set to read")
    parser.add_argument("--shards", type=cli_path, default=None, metavar="DIR",
                        help="read the shard set in DIR instead of the configured folder")
    parser.config_flag("--window", key="dataset.window", type=int, metavar="N",
                       help="window length in tokens")
    parser.config_flag("--stride", key="dataset.stride", type=int, metavar="N",
                       help="tokens between window starts (default: window // 2)")
    parser.config_flag("--batch-size", key="training.batch_size", type=int, metavar="N",
                       help="windows per batch")
    parser.add_argument("--show", type=int, default=2, metavar="N",
                        help="windows of the first batch to decode")
    parser.add_argument("--chars", type=int, default=400, metavar="N",
                        help="characters shown per window")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python dataloader.py [--config FILE] [--test] [--shards DIR] ...``: validate the data set
    (building it first when ``dataset.auto_prepare`` is on), print its split and decode the
    first windows of a training batch — a quick look at exactly what the trainer will see."""
    args, cfg = build_parser().parse(argv)
    tok = load_tokenizer(cfg)
    directory = Path(args.shards) if args.shards else None
    train_loader, val_loader, info = build_loaders(cfg, tok, directory=directory)
    print(describe_info(info))
    x, y = next(iter(train_loader))
    print(f"first training batch: x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype} "
          f"(y is x shifted left by one: {bool(torch.equal(x[:, 1:], y[:, :-1]))})")
    for i in range(min(args.show, x.shape[0])):
        text = tok.decode(x[i].tolist())
        shown = text[:args.chars].replace("\n", "\\n")
        print(f"  window {i}: {shown}{' ...' if len(text) > args.chars else ''}")
    if val_loader is not None:
        vx, _ = next(iter(val_loader))
        print(f"first validation batch: x {tuple(vx.shape)}")
    return 0


if __name__ == "__main__":
    run_stage(main)
