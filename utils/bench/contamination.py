"""Contamination check: which eval items' n-grams occur in a run's training token shards.

The rule (GPT-3's 13-gram overlap, Brown et al. 2020 appendix C, and Llama 2's token
coverage, Touvron et al. 2023 section A.6, on token ids of the run's own tokenizer):

- An item's text is what a leak would copy: its question or passage and its gold answer,
  each piece tokenized alone, without the prompt's template ("Question:", "Answer:", the
  option letters) and without few-shot examples (:func:`item_segments`).
- Its n-grams (n = 13 tokens by default) are every run of n consecutive tokens within a
  piece. Pieces shorter than n tokens have none; an item with no n-gram at all is counted
  ``too_short`` and not judged.
- coverage = the share of the item's tokens (in pieces of at least n tokens) that lie in at
  least one n-gram found in the training shards. The item is **contaminated** when coverage
  >= the threshold (default 0.8, Llama 2's "dirty" bar) and **touched** when any n-gram is
  found (GPT-3's rule: one shared 13-gram makes an item dirty).

Streaming: the shards are memory-mapped and read in chunks of ``chunk`` tokens (n - 1 tokens
of overlap), so memory is bounded by a few arrays of ``chunk`` 64-bit hashes whatever the
shard set's size. Each chunk's n-gram hashes are a polynomial hash computed with n vectorized
multiply-adds (uint32, wrapping); a 2**24-entry table of the eval n-grams' 32-bit hashes lets
almost every training n-gram be rejected with one lookup, and the few that pass get their
64-bit hash (the same polynomial in uint64), checked exactly against the sorted eval hashes. perf/contamination_speed.py measures it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from utils.bench import tasks as T
from utils.run import base_run_name, read_stage_config, run_kind, stored_config

PRIME = np.uint64(1099511628211)            # FNV-64's prime: the exact hash's base
PRIME32 = np.uint32(16777619)                # FNV-32's prime: the filter hash's base
TABLE_BITS = 24
DEFAULT_CHUNK = 1 << 22                      # tokens per chunk (32 MiB of uint64 hashes)
_TEMPLATE = re.compile(r"^(?:Question:|Answer:|Q:|A:|[A-E]\. )\s*")


def _strip_template(text: str) -> list[str]:
    """The lines of a prompt without lm-eval's template words; empty lines dropped."""
    out = []
    for line in text.split("\n"):
        line = _TEMPLATE.sub("", line.strip()).strip()
        if line:
            out.append(line)
    return out


def item_segments(item) -> list[str]:
    """The pieces of text of one item a leak would hold: question / passage and gold answer."""
    if isinstance(item, T.PartialItem):
        return _strip_template(item.contexts[item.gold] + item.continuation)
    if isinstance(item, T.MCItem):
        gold = item.choices[item.gold]
        lines = _strip_template(item.context)
        if len(gold.strip()) > 1:               # lettered options: the letter is no text
            lines.append(gold.strip())
        return lines
    if isinstance(item, (T.GreedyItem, T.LambadaItem)):
        return _strip_template(item.context + item.target)
    if isinstance(item, T.GenItem):
        return _strip_template(item.context) + [item.targets[0]]
    if isinstance(item, T.TextItem):
        return [item.text]
    if isinstance(item, T.CompletionItem):
        return [item.prompt + " " + item.reference]
    raise TypeError(f"no text for {type(item).__name__}")


def ngram_hashes(tokens: np.ndarray, n: int, bits: int = 64) -> np.ndarray:
    """The polynomial hash of every n-gram of ``tokens`` (len - n + 1 values; uint64, or
    uint32 for ``bits=32``: the filter's, half the memory traffic)."""
    dtype, prime = (np.uint64, PRIME) if bits == 64 else (np.uint32, PRIME32)
    t = np.asarray(tokens).astype(dtype, copy=False)
    m = len(t) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=dtype)
    h = t[:m].copy()
    with np.errstate(over="ignore"):
        for j in range(1, n):
            h *= prime
            h += t[j:j + m]
    return h


def _filter_index(h32: np.ndarray) -> np.ndarray:
    return h32 >> np.uint32(32 - TABLE_BITS)


@dataclass
class EvalGrams:
    """The n-grams of a set of eval items: per item, its pieces' token counts and hashes."""
    n: int
    items: list = field(default_factory=list)     # per item: list of (hashes) per piece
    sorted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    table: np.ndarray = field(default_factory=lambda: np.zeros(1 << TABLE_BITS, dtype=bool))


def eval_grams(item_token_pieces: Sequence[Sequence[Sequence[int]]], n: int,
               table: Optional[np.ndarray] = None) -> EvalGrams:
    """``item_token_pieces[i]``: the token ids of item i's pieces; ``table``: the filter table
    to mark (one shared by every task: 16 MiB)."""
    g = EvalGrams(n=n, table=table if table is not None else np.zeros(1 << TABLE_BITS, dtype=bool))
    for pieces in item_token_pieces:
        g.items.append([ngram_hashes(np.asarray(p, dtype=np.int64), n) for p in pieces])
    allh = [h for its in g.items for h in its if len(h)]
    g.sorted = np.unique(np.concatenate(allh)) if allh else np.zeros(0, dtype=np.uint64)
    for pieces in item_token_pieces:
        for p in pieces:
            g.table[_filter_index(ngram_hashes(np.asarray(p, dtype=np.int64), n, 32))] = True
    return g


def scan(grams: EvalGrams, chunks: Iterable[np.ndarray], progress: Optional[Callable[[int], None]] = None
         ) -> tuple[np.ndarray, int]:
    """The eval hashes (sorted, unique) found in the token stream ``chunks`` (consecutive
    chunks overlap by n - 1 tokens, :func:`shard_chunks`), and the tokens read."""
    found: list[np.ndarray] = []
    seen = 0
    offsets = np.arange(grams.n)
    for chunk in chunks:
        pos = np.flatnonzero(grams.table[_filter_index(ngram_hashes(chunk, grams.n, 32))])
        # the few n-grams past the 32-bit filter: their exact 64-bit hashes
        cand = ngram_hashes(np.asarray(chunk)[pos[:, None] + offsets].reshape(-1), grams.n)[::grams.n] \
            if len(pos) else pos
        if len(cand):
            hit = cand[np.isin(cand, grams.sorted, assume_unique=False)]
            if len(hit):
                found.append(np.unique(hit))
        seen += len(chunk)
        if progress is not None:
            progress(len(chunk))
    out = np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.uint64)
    return out, seen


def shard_chunks(shards: Sequence[np.ndarray], n: int, chunk: int = DEFAULT_CHUNK) -> Iterable[np.ndarray]:
    """Each shard (memory-mapped) in chunks of ``chunk`` tokens, consecutive chunks sharing
    n - 1 tokens; a document never spans two shards, so shards are not joined."""
    for arr in shards:
        for start in range(0, max(1, len(arr) - n + 1), chunk):
            piece = np.asarray(arr[start:start + chunk + n - 1])
            if len(piece) >= n:
                yield piece


def item_coverage(pieces: Sequence[np.ndarray], found: np.ndarray, n: int) -> tuple[int, int, int]:
    """(tokens in pieces with n-grams, of them covered by a found n-gram, n-grams found)."""
    total = covered = hits = 0
    for h in pieces:
        if not len(h):
            continue
        mask = np.isin(h, found)
        hits += int(mask.sum())
        cov = np.zeros(len(h) + n - 1, dtype=bool)
        for p in np.flatnonzero(mask):
            cov[p:p + n] = True
        total += len(cov)
        covered += int(cov.sum())
    return total, covered, hits


def task_summary(grams: EvalGrams, found: np.ndarray, threshold: float) -> dict:
    """Per task: items, judged (not too short), contaminated (coverage >= threshold), touched
    (any n-gram found), the contaminated share of the judged items, per-item coverage."""
    judged = contaminated = touched = 0
    coverage = []
    for pieces in grams.items:
        total, covered, hits = item_coverage(pieces, found, grams.n)
        if total == 0:
            coverage.append(None)
            continue
        judged += 1
        c = covered / total
        coverage.append(c)
        contaminated += c >= threshold
        touched += hits > 0
    return {"items": len(grams.items), "judged": judged, "too_short": len(grams.items) - judged,
            "contaminated": contaminated, "touched": touched,
            "share": (contaminated / judged) if judged else None,
            "touched_share": (touched / judged) if judged else None, "coverage": coverage}


def check(tasks: dict, encode: Callable[[list[str]], list[list[int]]], shards: Sequence[np.ndarray],
          n: int = 13, threshold: float = 0.8, progress=None, chunk: int = DEFAULT_CHUNK) -> dict:
    """``tasks``: {task key: items}. One pass over ``shards`` for all tasks together; returns
    {task key: task_summary} and ``_tokens``: the training tokens read."""
    per_task: dict[str, EvalGrams] = {}
    joined = eval_grams([], n)
    for key, items in tasks.items():
        per_task[key] = eval_grams([encode(item_segments(it)) for it in items], n, joined.table)
    allh = [g.sorted for g in per_task.values() if len(g.sorted)]
    joined.sorted = np.unique(np.concatenate(allh)) if allh else joined.sorted
    found, _ = scan(joined, shard_chunks(shards, n, chunk), progress)
    out = {key: task_summary(g, found, threshold) for key, g in per_task.items()}
    out["_tokens"] = int(sum(len(a) for a in shards))
    return out


def rule_text(n: int, threshold: float) -> str:
    return (f"an item is contaminated when >= {threshold:.0%} of its tokens lie in {n}-grams "
            f"(token ids of the run's tokenizer) that occur in the run's training shards "
            f"(Llama 2's coverage rule); 'touched': any one {n}-gram occurs (GPT-3's rule)")


def training_shard_dir(ckpt_path: Path, cfg) -> tuple[Optional[Path], str]:
    """The token shard folder a checkpoint's pre-training read, found through its run folder's
    record (a pre-training run's config.json; a post-training run's base, followed back to its
    pre-training run), and how it was found; (None, why) when there is no such record."""
    run_dir = Path(ckpt_path).parent
    chain = [run_dir.name]
    while run_kind(run_dir) != "pretrain":
        base = base_run_name(read_stage_config(run_dir))
        if base is None or len(chain) > 32:
            return None, f"{run_dir.name} starts from no run of this project (an imported model?)"
        run_dir = run_dir.parent / base
        chain.append(base)
        if not run_dir.is_dir():
            return None, f"its base run {base} is not under {run_dir.parent}"
    stored = stored_config(run_dir)
    if stored is None:
        return None, f"{run_dir} keeps no readable config.json (the record of its data)"
    if stored.dataset.mode == "on_the_fly":
        return None, f"{run_dir.name} tokenized its data on the fly: there are no shards to scan"
    key = f"{stored.dataset.source}_{'test' if stored.test else 'full'}_dir"
    where = cfg.resolve(getattr(stored.dataset, key), f"dataset.{key}")
    return where, f"{' <- '.join(chain)}: dataset.{key} of {run_dir.name}/config.json"
