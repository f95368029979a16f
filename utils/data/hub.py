"""Hugging Face hub datasets, streamed: the one place the pipeline opens one (library).

:func:`open_hub_dataset` wraps ``datasets.load_dataset(name, config, split=split,
streaming=True)``: no data is downloaded until iteration, and a dataset *folder* given as
``name`` streams the same way offline. It turns every failure (no network, offline mode,
unknown name or config) into one :class:`~utils.cli.PipelineError` whose text says what to do,
so no caller prints a traceback. Callers open the dataset once and iterate it as many times as
they need (each ``iter`` starts a new pass; ``state_dict`` / ``load_state_dict`` resume one).

:func:`load_table` loads a whole small dataset (SFT and preference records): a hub name, or
offline its local copy: a folder written by ``save_to_disk`` (a Dataset, or a DatasetDict whose
split is taken) or a folder of data files (parquet, JSON lines, CSV: datasets' own builders).

:func:`iter_rows` iterates every row of such a dataset in order, also inside a torch
``DataLoader`` worker: plain ``iter(ds)`` there would silently give each worker only its share
of the dataset's files (datasets' own worker sharding), which breaks readers that assign
documents to workers and to splits by their position in the whole stream.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from utils.cli import PipelineError
from utils.errors import error_line

OFFLINE_HINT = ("The hub is unreachable or offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); "
                "use a local copy of the data instead.")


def open_hub_dataset(name: str, config: Optional[str] = None, split: str = "train", *,
                     explain: Optional[Callable[[BaseException], str]] = None):
    """``datasets.load_dataset(name, config, split=split, streaming=True)`` (an
    ``IterableDataset``), or a PipelineError: ``explain(error)`` when given, else a generic
    message naming the dataset, the error and :data:`OFFLINE_HINT`."""
    try:
        import datasets     # 0.9 s: only to open one; fineweb from parquet and train from shards do not
        return datasets.load_dataset(name, name=config, split=split, streaming=True)
    except Exception as e:   # offline, no network, unknown name: all end the same way
        if explain is not None:
            raise PipelineError(explain(e)) from e
        raise PipelineError(f"cannot stream dataset '{name}' (config {config!r}, split {split!r}) from "
                            f"the Hugging Face hub: {error_line(e)}. {OFFLINE_HINT}") from e


def load_table(source: str, split: str, explain: Callable[[BaseException], str]):
    """The ``split`` of a hub dataset or of its local copy (module docstring), whole (a
    ``datasets.Dataset``); any failure is a PipelineError with ``explain(error)``'s text."""
    p = Path(source).expanduser()
    saved = p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json"))
    try:
        import datasets     # 0.9 s: only for these sources; a JSONL file needs none
        if not saved:
            return datasets.load_dataset(str(p) if p.is_dir() else source, split=split)
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # offline, gated, a missing split, a damaged folder: the reason, in one line
        raise PipelineError(explain(e)) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PipelineError(f"{p} holds the splits {sorted(ds)}, not '{split}': save that split, "
                                "or the Dataset itself, with save_to_disk.")
        ds = ds[split]
    return ds


def iter_rows(ds: Any, batch_size: int = 256) -> Iterator[dict]:
    """Every row of a streamed dataset, in order, in any process (see the module docstring)."""
    for batch in ds.iter(batch_size=batch_size):
        keys = list(batch)
        if not keys:
            continue
        for values in zip(*(batch[k] for k in keys)):
            yield dict(zip(keys, values))
