"""Run reports (``python main.py report RUN [RUN ...]``): one file that says what a run was
trained on, how long it took, what it cost and how good it got (library; nothing runs on
import; docs/report.md).

    facts = collect(run, cfg)                 # utils/report/facts.py: read what the stages wrote
    blocks = build_run(facts)                 # utils/report/build.py: sections, tables, pictures
    written = write_report(folder, blocks, title, html=False)

Output (``paths.reports_dir``, default ``reports/``): ``<run>/report.md`` with its PNGs beside
it and, with ``html``, ``<run>/report.html`` (one self-contained page, pictures inlined); for
several runs also ``compare_<A>_vs_<B>/``. Every file is written atomically
(utils/atomic.py), and the same inputs give byte-identical files; PNGs a previous report left
in the folder that this one does not write are removed. Cost: reading the log and one
checkpoint (memory-mapped), and drawing each figure with matplotlib.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from utils.atomic import atomic_open
from utils.disk import named
from utils.cli import PipelineError
from utils.report.build import build_comparison, build_run
from utils.report.document import Image, to_html, to_markdown
from utils.report.facts import collect

__all__ = ["build_comparison", "build_run", "collect", "comparison_folder", "write_report"]

MAX_FOLDER_NAME = 120


def _images(blocks: list) -> list[Image]:
    out = []
    for b in blocks:
        if isinstance(b, Image):
            out.append(b)
        out += _images(getattr(b, "blocks", []))
    return out


def _write(path: Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_report(folder: Path, blocks: list, title: str, html: bool = False) -> list[Path]:
    """report.md and its PNGs (and report.html) in ``folder``; returns the paths written.
    A folder that cannot be made or written (a file in the way, no permission, a full disk) is
    one PipelineError naming it."""
    folder = Path(folder)
    try:
        return _write_report(folder, blocks, title, html)
    except OSError as e:
        refused = named(e.filename or folder, e, setting="--out or paths.reports_dir")
        if refused is not None:          # read-only, full, no permission: the device and what to do
            raise refused from None
        raise PipelineError(f"cannot write the report to {folder}: {e.strerror or e} "
                            f"({e.filename or folder}). Pass another --out (or set "
                            "paths.reports_dir).") from None


def _write_report(folder: Path, blocks: list, title: str, html: bool) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for img in _images(blocks):
        _write(folder / img.filename, img.png)
        written.append(folder / img.filename)
    for stale in sorted(folder.glob("*.png")):
        if stale not in written:
            stale.unlink()
    _write(folder / "report.md", to_markdown(blocks).encode("utf-8"))
    written.insert(0, folder / "report.md")
    if html:
        _write(folder / "report.html", to_html(blocks, title).encode("utf-8"))
        written.insert(1, folder / "report.html")
    return written


def comparison_folder(out: Path, runs: list[str]) -> Path:
    """``compare_<A>_vs_<B>...`` (a hash of the names when that is too long for a folder)."""
    name = "compare_" + "_vs_".join(runs)
    if len(name) > MAX_FOLDER_NAME:
        digest = hashlib.sha256("\n".join(runs).encode("utf-8")).hexdigest()[:12]
        name = f"compare_{len(runs)}_runs_{digest}"
    return Path(out) / name
