"""Stage ``report``: a run's report card, from what the stages already wrote.

    python main.py report RUN                    reports/RUN/report.md + its PNGs
    python main.py report RUN --html             also reports/RUN/report.html (self-contained)
    python main.py report RUN_A RUN_B            both reports, and reports/compare_RUN_A_vs_RUN_B/
    python main.py report RUN --out /tmp/r       another output folder (default: paths.reports_dir)

Sections: data (source, shard set, documents, tokens, tokenizer and its compression, filters
and skipped documents), model (parameters, FLOPs per token, settings), training (steps,
tokens, wall time, tokens/s, MFU, device, precision, starts and resumes), curves, SFT runs
started from it, benchmark results naming its checkpoints, sample generations, environment.
Read-only on the run; a missing part is one line in the report, a damaged log line is
skipped and counted. Same inputs, same bytes. The library is utils/report/; docs/report.md.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from utils.cli import StageParser, cli_path, run_stage
from utils.report import build_comparison, build_run, collect, comparison_folder, write_report
from utils.run import check_run_name


def build_parser() -> StageParser:
    p = StageParser("main.py report", "Write the report of training runs (Markdown with PNG "
                    "curves; --html: one self-contained page) and, for several runs, their "
                    "comparison.")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run name: a folder of paths.checkpoints_dir or a log of "
                        "paths.logs_dir/raw_metrics (python main.py status lists them)")
    p.add_argument("--out", type=cli_path, default=None, metavar="DIR",
                   help="output folder (default: paths.reports_dir, reports/)")
    p.add_argument("--html", action="store_true",
                   help="also write report.html: one file, pictures inlined, nothing external")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(list(sys.argv[1:] if argv is None else argv))
    runs = check_names(args.runs)
    out = Path(args.out) if args.out else cfg.path("paths.reports_dir")
    facts = [collect(run, cfg) for run in runs]         # every run found before anything is written
    for f in facts:
        write_run(f, out, args.html)
    if len(facts) > 1:
        write_comparison(facts, out, args.html)
    return 0


def check_names(runs: Sequence[str]) -> list[str]:
    """Run names as given, once each; a name is a folder name, never a path."""
    out: list[str] = []
    for run in runs:
        check_run_name(run, "RUN")
        if run not in out:
            out.append(run)
    return out


def write_run(facts, out: Path, html: bool) -> None:
    written = write_report(out / facts.name, build_run(facts), f"Run report: {facts.name}", html)
    bad = f" ({len(facts.log.bad_lines)} damaged log line(s) skipped)" if facts.log.bad_lines else ""
    if facts.out_of_range:
        bad += f" ({sum(facts.out_of_range.values())} out-of-range value(s) left out)"
    print(f"report: {facts.name}: wrote {', '.join(str(p) for p in written)}{bad}")


def write_comparison(facts: list, out: Path, html: bool) -> None:
    names = [f.name for f in facts]
    folder = comparison_folder(out, names)
    written = write_report(folder, build_comparison(facts), "Comparison: " + ", ".join(names), html)
    print(f"report: comparison: wrote {', '.join(str(p) for p in written)}")


if __name__ == "__main__":
    run_stage(main)
