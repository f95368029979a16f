"""Stage `fineweb`: FineWeb (Hugging Face streaming or local parquet) -> token shards.

    python main.py fineweb                         # HuggingFaceFW/fineweb, sample-10BT, streamed
    python main.py fineweb --data-dir DIR          # local parquet files in FineWeb's schema
    python main.py fineweb --test --workers 2      # first fineweb.test_max_documents documents

Filters (the seed's, configurable): ``language_score >= fineweb.min_language_score`` (0.65)
and at least ``fineweb.min_tokens`` (100) tokens after tokenization; the counts of kept and
dropped documents by reason go into ``metadata.json``. ``--max-files`` caps the number of
shard files (the seed's 38): when reached the run stops and the metadata says so
(``truncated: true``). A missing (null), NaN or non-numeric ``language_score`` fails the
filter and is counted as ``language_score_missing``.

Local parquet inputs are checked before anything is tokenized or written: a file that is not
parquet, is empty (0 bytes), has a damaged footer, lacks a column or has one of the wrong type
(``text`` must be string, ``language_score`` a number), or a data folder whose files have no
rows, ends the run with exit 1 naming the file; a row group that cannot be read mid-run does
the same (completed shards are kept, a re-run resumes). Output: ``dataset.fineweb_full_dir`` (``fineweb_test_dir`` with
``--test``), in the same format and through the same engine as `prepare`
(:mod:`utils.data.packing`): resumable, byte-identical output for any ``--workers``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from utils.cli import PipelineError, StageParser, cli_path, run_stage, workers_or_cores
from utils.config import Config
from utils.data.hub import open_hub_dataset
from utils.data.packing import (PackJob, Stream, add_output_flags, file_identity, load_fast_tokenizer,
                           run_job)

SCORE_COLUMN = "language_score"


def hub_help(cfg: Config, error: BaseException) -> str:
    f = cfg.fineweb
    return (f"cannot stream {f.dataset} (config {f.config_name}, split {f.split}) from the Hugging "
            f"Face hub: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. "
            "The hub is unreachable or offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE). "
            "Use local parquet files in FineWeb's schema instead (columns text and language_score, "
            "e.g. the sample/10BT/*.parquet files of the dataset): `python main.py fineweb --data-dir "
            "DIR` or set fineweb.data_dir in config.json.")


def _bad_parquet(path: Path, what: str) -> PipelineError:
    return PipelineError(f"{path}: {what}. Every *.parquet file under fineweb.data_dir / --data-dir "
                         "must be a FineWeb parquet file (columns text: string and language_score: "
                         "number); fix or remove this one and re-run.")


def check_parquet(path: Path, text_column: str) -> int:
    """Open one parquet file and check FineWeb's schema without reading its data; returns its
    row count. Not parquet, empty (0 bytes), a damaged footer, a missing column or a column of
    the wrong type is a PipelineError naming the file."""
    try:
        if path.stat().st_size == 0:
            raise _bad_parquet(path, "the file is empty (0 bytes)")
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        rows = pf.metadata.num_rows
    except PipelineError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _bad_parquet(path, f"cannot be read as parquet ({first}); it may be truncated or "
                                 "not a parquet file") from None
    missing = {text_column, SCORE_COLUMN} - set(schema.names)
    if missing:
        raise _bad_parquet(path, f"missing column(s) {', '.join(sorted(missing))} (fineweb.text_column "
                                 f"= {text_column!r})")
    t = schema.field(text_column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise _bad_parquet(path, f"column {text_column!r} has type {t}, expected string (UTF-8 text)")
    t = schema.field(SCORE_COLUMN).type
    if not (pa.types.is_floating(t) or pa.types.is_integer(t)):
        raise _bad_parquet(path, f"column {SCORE_COLUMN!r} has type {t}, expected a number")
    return rows


def parquet_files(data_dir: Path, text_column: str = "text") -> list[Path]:
    """The parquet files under ``data_dir`` (sorted), each checked by :func:`check_parquet`
    before anything is tokenized or written. Files with no rows are named; if no file has a
    row it is an error."""
    files = sorted(p for p in data_dir.rglob("*.parquet") if p.is_file()) if data_dir.is_dir() else []
    if not files:
        raise PipelineError(f"no parquet files in {data_dir} (fineweb.data_dir / --data-dir); expected "
                            "FineWeb parquet files with columns text and language_score.")
    empty = [p for p in files if check_parquet(p, text_column) == 0]
    if len(empty) == len(files):
        raise PipelineError(f"no documents: the parquet input(s) have no rows ({', '.join(map(str, empty))}); "
                            "point fineweb.data_dir / --data-dir at FineWeb parquet files with data.")
    for p in empty:
        print(f"note: {p} has no rows", flush=True)
    return files


def _decide(text, score, min_score: float) -> tuple[str, Optional[str]]:
    """(text, drop reason): a missing, NaN or non-numeric score fails the filter
    (``language_score_missing``), like a low one (``language_score``)."""
    if not isinstance(text, str):
        return "", "empty"
    if isinstance(score, bool) or not isinstance(score, (int, float)) or math.isnan(score):
        return text, "language_score_missing"
    if score < min_score:
        return text, "language_score"
    return text, None


def parquet_stream(files: list[Path], text_column: str, min_score: float) -> Stream:
    """Documents of local parquet files, one row group at a time (never a whole file in memory)."""
    def open_stream(start: int, resume: Optional[dict] = None) -> Iterator[tuple[str, Optional[str]]]:
        skip = start   # row groups are skipped unread, so no saved state is needed
        for path in files:
            check_parquet(path, text_column)
            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                rows = pf.metadata.row_group(g).num_rows
                if skip >= rows:   # resume: skip whole row groups without reading them
                    skip -= rows
                    continue
                try:
                    table = pf.read_row_group(g, columns=[text_column, SCORE_COLUMN])
                    texts = table.column(text_column).to_pylist()[skip:]
                    scores = table.column(SCORE_COLUMN).to_pylist()[skip:]
                except (pa.ArrowException, OSError, UnicodeDecodeError, ValueError) as e:
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise _bad_parquet(path, f"row group {g} cannot be read ({first}); the file may "
                                             "be truncated or damaged") from None
                skip = 0
                del table
                for text, score in zip(texts, scores):
                    yield _decide(text, score, min_score)
    return open_stream


class HubDocuments:
    """Iterator over a streamed hub dataset that can checkpoint its position.

    ``checkpoint()`` is the dataset's own ``state_dict()`` (shard and row within it) for the
    next document; given ``resume`` from an earlier run it restores that state and skips only
    the few documents between it and ``start``, instead of reading the stream from the
    beginning again (``IterableDataset.skip`` would download everything before ``start``).
    """

    def __init__(self, ds, start: int, resume: Optional[dict], decide, on_error):
        self.decide, self.on_error = decide, on_error
        self.n = start
        skip = start
        state = (resume or {}).get("state")
        if state is not None and resume.get("position", start + 1) <= start:
            ds.load_state_dict(state)
            skip = start - resume["position"]
        self.ds = ds
        self.it = iter(ds)
        try:
            for _ in range(skip):
                next(self.it)
        except StopIteration:
            pass
        except Exception as e:
            raise on_error(e, self.n) from e

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, Optional[str]]:
        try:
            row = next(self.it)
        except StopIteration:
            raise
        except Exception as e:
            raise self.on_error(e, self.n) from e
        self.n += 1
        return self.decide(row)

    def checkpoint(self) -> Optional[dict]:
        state = getattr(self.ds, "state_dict", None)
        return json.loads(json.dumps(state())) if state else None


def hub_stream(cfg: Config) -> Stream:
    """The real default: ``datasets.load_dataset(..., streaming=True)`` from the hub (a local
    dataset folder given as ``fineweb.dataset`` streams the same way, offline)."""
    f = cfg.fineweb

    # opened once (fail fast, before the tokenizer loads); every open_stream reuses it
    ds = open_hub_dataset(f.dataset, f.config_name, f.split, explain=lambda e: hub_help(cfg, e))

    def decide(row: dict) -> tuple[str, Optional[str]]:
        return _decide(row.get(f.text_column), row.get(SCORE_COLUMN), f.min_language_score)

    def on_error(e: BaseException, n: int) -> PipelineError:
        return PipelineError(hub_help(cfg, e) + f" (The stream failed after {n:,} documents; "
                             "completed shards are kept and a re-run resumes.)")

    def open_stream(start: int, resume: Optional[dict] = None) -> HubDocuments:
        return HubDocuments(ds, start, resume, decide, on_error)
    return open_stream


def build_parser() -> StageParser:
    p = StageParser("main.py fineweb", "FineWeb (hub streaming or local parquet) -> token shards.",
                    test="quick mode: at most fineweb.test_max_documents documents, into "
                         "dataset.fineweb_test_dir (the shards `train --test` reads)")
    p.config_flag("--data-dir", key="fineweb.data_dir", type=cli_path, metavar="DIR",
                  help="local folder of FineWeb parquet files (instead of the hub)")
    p.config_flag("--workers", key="fineweb.workers", type=int, metavar="N",
                  help="tokenizer processes (0 = all cores); output is identical for any N")
    p.config_flag("--batch-size", key="fineweb.batch_size", type=int, metavar="N",
                  help="documents read per tokenization batch")
    p.config_flag("--max-files", key="fineweb.max_files", type=int, metavar="N",
                  help="stop after this many shard files")
    p.config_flag("--min-language-score", key="fineweb.min_language_score", type=float, metavar="X",
                  help="drop documents with a lower language_score")
    p.config_flag("--min-tokens", key="fineweb.min_tokens", type=int, metavar="N",
                  help="drop documents with fewer tokens")
    add_output_flags(p, "dataset.fineweb_test_dir / fineweb_full_dir")
    return p


def make_job(cfg: Config, *, output_dir: Optional[Path] = None, force: bool = False,
             progress_bar: bool = True) -> PackJob:
    """The fineweb job for this config (opens the source, then loads the tokenizer)."""
    f = cfg.fineweb
    if f.data_dir:
        files = parquet_files(cfg.resolve(f.data_dir), f.text_column)
        stream = parquet_stream(files, f.text_column, f.min_language_score)
        inputs, identity = [str(p) for p in files], file_identity(files)
        origin = {"origin": "local parquet"}
    else:
        stream = hub_stream(cfg)
        name = f"hf://datasets/{f.dataset}/{f.config_name or ''}/{f.split}"
        inputs, identity = [name], [name]
        origin = {"origin": "huggingface streaming", "dataset": f.dataset, "config": f.config_name,
                  "split": f.split}
    tok, tok_info = load_fast_tokenizer(cfg)
    return PackJob(
        out_dir=Path(output_dir) if output_dir else cfg.shard_dir("fineweb"),
        tokenizer=tok, tokenizer_info=tok_info, kind="fineweb",
        inputs=inputs, input_identity=identity, open_stream=stream, window=cfg.dataset.window,
        stride=cfg.stride, shard_tokens=cfg.dataset.shard_tokens, batch=f.batch_size,
        workers=workers_or_cores(f.workers, "fineweb.workers"), max_documents=f.test_max_documents if cfg.test else None,
        max_files=f.max_files, min_tokens=f.min_tokens,
        filters={"min_language_score": f.min_language_score, "min_tokens": f.min_tokens},
        test=cfg.test, force=force, progress_bar=progress_bar, extra_source=origin,
        on_complete=cfg.save_resolved)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    job = make_job(cfg, output_dir=args.output_dir, force=args.force, progress_bar=not args.no_progress)
    return run_job(job, f"fineweb: {job.extra_source['origin']} ({len(job.inputs)} input(s))")


if __name__ == "__main__":
    run_stage(main)
