"""Stage `prepare`: cleaned Wikipedia articles -> token shards (DESIGN.md section 3).

    python main.py prepare                     # every data/cleaned_articles/cleaned_*.txt
    python main.py prepare --test              # first dataset.test_max_documents articles
    python main.py prepare --workers 4 --shard-tokens 10000000 --force

Reads ``paths.cleaned_dir/cleaned_*.txt`` (sorted; one article per line, paragraph breaks
restored from the escaped form of :mod:`utils.data.textio`), tokenizes with the configured fast
tokenizer in worker processes and packs BOS + tokens + EOS per article into
``tokens_NNNNN.npy`` shards in ``dataset.wikipedia_full_dir`` (``wikipedia_test_dir`` with
``--test``). The engine is :mod:`utils.data.packing` (shared with `fineweb`): resumable after
Ctrl-C or a crash (re-run the same command), byte-identical output for any ``--workers``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from utils.cli import PipelineError, StageParser, cli_path, run_stage, workers_or_cores
from utils.config import Config
from utils.data.packing import (PackJob, add_output_flags, cleaned_article_stream, file_identity,
                           load_fast_tokenizer, run_job)


def build_parser() -> StageParser:
    p = StageParser("main.py prepare", "Cleaned Wikipedia articles -> token shards (tokens_*.npy + metadata.json).",
                    test="quick mode: at most dataset.test_max_documents articles, into "
                         "dataset.wikipedia_test_dir (the shards `train --test` reads)")
    p.config_flag("--batch", key="dataset.batch", type=int, metavar="N",
                  help="articles read per tokenization batch")
    p.config_flag("--workers", key="dataset.workers", type=int, metavar="N",
                  help="tokenizer processes (0 = all cores)")
    p.config_flag("--input-dir", key="paths.cleaned_dir", type=cli_path, metavar="DIR",
                  help="folder of cleaned_*.txt files")
    add_output_flags(p, "dataset.wikipedia_test_dir / wikipedia_full_dir")
    return p


def find_cleaned(input_dir: Path) -> list[Path]:
    files = sorted(input_dir.glob("cleaned_*.txt")) if input_dir.is_dir() else []
    if not files:
        raise PipelineError(f"no cleaned articles (cleaned_*.txt) in {input_dir}. Run "
                            "`python main.py clean` first (or pass --input-dir).")
    return files


def make_job(cfg: Config, *, output_dir: Optional[Path] = None, force: bool = False,
             progress_bar: bool = True, log=print) -> PackJob:
    """The prepare job for this config (loads the tokenizer)."""
    files = find_cleaned(cfg.path("paths.cleaned_dir"))
    tok, tok_info = load_fast_tokenizer(cfg)
    ds = cfg.dataset
    return PackJob(
        out_dir=Path(output_dir) if output_dir else cfg.shard_dir("wikipedia"),
        tokenizer=tok, tokenizer_info=tok_info, kind="wikipedia",
        inputs=[str(f) for f in files], input_identity=file_identity(files),
        open_stream=cleaned_article_stream(files), window=ds.window, stride=cfg.stride,
        shard_tokens=ds.shard_tokens, batch=ds.batch, workers=workers_or_cores(ds.workers, "dataset.workers"),
        max_documents=ds.test_max_documents if cfg.test else None, filters={}, test=cfg.test,
        force=force, progress_bar=progress_bar, on_complete=cfg.save_resolved)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    job = make_job(cfg, output_dir=args.output_dir, force=args.force, progress_bar=not args.no_progress)
    return run_job(job, f"prepare: {len(job.inputs)} cleaned file(s)")


if __name__ == "__main__":
    run_stage(main)
