"""Stage `fineweb`: FineWeb (Hugging Face streaming or local parquet) -> token shards.

    python main.py fineweb                         # HuggingFaceFW/fineweb, sample-10BT, streamed
    python main.py fineweb --data-dir DIR          # local parquet files in FineWeb's schema
    python main.py fineweb --test --workers 2      # first fineweb.test_max_documents documents

Filters (the seed's, configurable): ``language_score >= fineweb.min_language_score`` (0.65)
and at least ``fineweb.min_tokens`` (100) tokens after tokenization; the counts of kept and
dropped documents by reason go into ``metadata.json``. ``--max-files`` caps the number of
shard files (the seed's 38): when reached the run stops and the metadata says so
(``truncated: true``). Output: ``dataset.fineweb_full_dir`` (``fineweb_test_dir`` with
``--test``), in the same format and through the same engine as `prepare`
(:mod:`utils.packing`): resumable, byte-identical output for any ``--workers``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Sequence

from utils.cli import PipelineError, StageParser, cli_path, run_stage, workers_or_cores
from utils.config import Config
from utils.packing import (PackJob, Stream, add_output_flags, file_identity, load_fast_tokenizer,
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


def parquet_files(data_dir: Path) -> list[Path]:
    files = sorted(data_dir.rglob("*.parquet")) if data_dir.is_dir() else []
    if not files:
        raise PipelineError(f"no parquet files in {data_dir} (fineweb.data_dir / --data-dir); expected "
                            "FineWeb parquet files with columns text and language_score.")
    return files


def _decide(text, score, min_score: float) -> tuple[str, Optional[str]]:
    if text is None:
        return "", "empty"
    if score is None or score < min_score:
        return text, "language_score"
    return text, None


def parquet_stream(files: list[Path], text_column: str, min_score: float) -> Stream:
    """Documents of local parquet files, one row group at a time (never a whole file in memory)."""
    import pyarrow.parquet as pq

    def open_stream(start: int, resume: Optional[dict] = None) -> Iterator[tuple[str, Optional[str]]]:
        skip = start   # row groups are skipped unread, so no saved state is needed
        for path in files:
            pf = pq.ParquetFile(path)
            missing = {text_column, SCORE_COLUMN} - set(pf.schema_arrow.names)
            if missing:
                raise PipelineError(f"{path}: missing column(s) {', '.join(sorted(missing))}; FineWeb "
                                    f"parquet files have text and {SCORE_COLUMN} (fineweb.text_column "
                                    f"= {text_column!r}).")
            for g in range(pf.num_row_groups):
                rows = pf.metadata.row_group(g).num_rows
                if skip >= rows:   # resume: skip whole row groups without reading them
                    skip -= rows
                    continue
                table = pf.read_row_group(g, columns=[text_column, SCORE_COLUMN])
                texts = table.column(text_column).to_pylist()[skip:]
                scores = table.column(SCORE_COLUMN).to_pylist()[skip:]
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

    try:
        import datasets
        ds = datasets.load_dataset(f.dataset, name=f.config_name, split=f.split, streaming=True)
    except Exception as e:   # offline, no network, unknown name: all end the same way
        raise PipelineError(hub_help(cfg, e)) from e   # fail fast, before the tokenizer loads

    def decide(row: dict) -> tuple[str, Optional[str]]:
        return _decide(row.get(f.text_column), row.get(SCORE_COLUMN), f.min_language_score)

    def on_error(e: BaseException, n: int) -> PipelineError:
        return PipelineError(hub_help(cfg, e) + f" (The stream failed after {n:,} documents; "
                             "completed shards are kept and a re-run resumes.)")

    def open_stream(start: int, resume: Optional[dict] = None) -> HubDocuments:
        return HubDocuments(ds, start, resume, decide, on_error)
    return open_stream


def build_parser() -> StageParser:
    p = StageParser("main.py fineweb", "FineWeb (hub streaming or local parquet) -> token shards.")
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
        files = parquet_files(cfg.resolve(f.data_dir))
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
        workers=workers_or_cores(f.workers), max_documents=f.test_max_documents if cfg.test else None,
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
