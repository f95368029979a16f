"""Stage `clean` (alias `cleanup`): Wikipedia dumps -> cleaned articles, one per line.

    python main.py clean                       # every dump in wikipedia.raw_dir
    python main.py clean --test                # first cleaning.test_max_articles per file
    python main.py clean --input-dir data/samples/enwiki --force
    python main.py clean --shard 2/4           # this machine's quarter of the input files

This file is the stage: it finds and reads dumps, runs the workers and reports. Turning
wikitext and article text into clean text is the library :mod:`utils.data.wikitext`. What the
stage tolerates and how it reports it: docs/data_stages.md.

Input: a folder of dumps; the format of each file is detected from its first bytes:

- Wikimedia Enterprise structured-contents JSONL (``*.jsonl``, ``*.json``, ``*.jsonl.bz2``):
  one article per line with ``name`` and ``sections`` (required) and ``abstract``; sections
  are a tree of parts ``{type, name, value, has_parts}``. Text comes from ``paragraph`` and
  ``list_item`` values walked in document order. The top-level ``abstract`` is the lead
  paragraph only when no section is named "Abstract" (which holds the same text).
- MediaWiki pages-articles XML (``*.xml``, ``*.xml.bz2``): parsed streaming with expat;
  a DOCTYPE (and so any entity declaration) is refused, so no entity is ever expanded and no
  external resource is fetched. Only pages in ``wikipedia.namespaces`` are kept, redirects
  are skipped, and wikitext becomes plain text (:func:`utils.data.wikitext.render`).

Cleaning (both formats): sections whose title matches ``cleaning.drop_sections`` by words
("Selected bibliography" matches "Bibliography") are dropped with everything under them and
counted by title in the summary; Unicode normalization; whitespace collapsed; paragraphs
joined with "\\n"; headings dropped unless ``cleaning.keep_headings``; articles shorter than
``cleaning.min_chars`` dropped.

Output: ``<cleaning.output_dir or paths.cleaned_dir>/cleaned_<input stem>.txt``, one article
per line (:mod:`utils.data.textio`), written through :mod:`utils.atomic` (temp file, fsync,
rename) and replaced only when the input is complete and kept at least one article: a
failed, interrupted or empty re-run (``--force`` included) leaves an earlier output
byte-identical. A re-run skips inputs whose output exists unless ``--force``. Next to the
outputs: ``resolved_config.json`` and ``cleaning_summary.json``.

Bad input vs. our bugs: a bad record (invalid JSON or UTF-8, a missing required key,
nesting too deep to convert) is skipped and counted with ``file:line`` (or the page title)
and reason; lone surrogates are replaced and control characters removed (counted as
repairs). A bad file (truncated, not a dump, unsafe XML, unreadable) fails that file only.
An exception inside our own conversion is not bad input: it fails the file naming the page
(exit 1), with the traceback in the summary file.

Parallelism (``--workers`` W, 0 = the CPUs this process may use), streaming either way: one
file (a single big XML dump is the usual download) is read here and its records are
converted by all W workers, in order, so the output is byte-identical to a serial run. F
files: min(F, W) at once, each read by its own process, with W // F converters of its own
when F < W (27 part files on 32 cores: 27 readers; 4 files: 4 readers with 8 converters
each): one reader decompressing .bz2 feeds only a few converters (docs/data_stages.md).
Only raw bytes/strings cross to the workers (JSON is parsed there), so no record can fail
to pickle. ``--test`` reads only the first ``cleaning.test_max_articles``
records of each file. Exit 1 if any file failed or no usable article came out at all; 130
on Ctrl-C (finished outputs kept, unfinished ones never appear).

Across machines (``--shard I/N``): machine I of N cleans the input files at positions I,
I+N, I+2N, ... of the sorted list, so N machines given the same folder (Wikimedia publishes
the articles dump in part files) clean every file exactly once; each writes its outputs and
``cleaning_summary_shardIofN.json``, so they may share one output folder. Costs and a
full-dump estimate: docs/data_stages.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence
from xml.parsers import expat

from tqdm import tqdm

from utils.atomic import atomic_open, temp_path, write_json_atomic
from utils.disk import WriteError
from utils.cli import PipelineError, StageParser, cli_path, run_stage, workers_or_cores
from utils.processes import die_with_parent, os_parent_of_workers

from utils.data.parallel import ordered_map
from utils.data.textio import escape_article
from utils.data.mediawiki import (CleanOptions, ConversionBug, Converted, InputFormatError, convert_record,
                                  detect_format, is_redirect_text, iter_xml_pages, open_binary)

INPUT_SUFFIXES = (".jsonl", ".json", ".xml", ".bz2")   # files considered in the input folder
STRIP_SUFFIXES = (".bz2", ".jsonl", ".json", ".xml")   # removed from the name for the output
SUMMARY_FILE = "cleaning_summary.json"
MAX_REPORTED_PROBLEMS = 5     # bad records listed per file (all are counted)
PROGRESS_SECONDS = 0.5        # seconds between progress messages from a worker


@dataclass
class FileResult:
    """What happened to one input file; summed into the run summary."""
    input: str
    output: str
    status: str = "ok"            # ok | failed | no_output | exists
    format: str = ""
    read: int = 0
    kept: int = 0
    skipped: dict = field(default_factory=dict)           # reason class -> records
    malformed: dict = field(default_factory=dict)         # bad-record reason -> records
    repaired: dict = field(default_factory=dict)          # repair -> records (kept)
    sections_dropped: dict = field(default_factory=dict)  # section title -> times
    chars_in: int = 0
    chars_out: int = 0
    seconds: float = 0.0
    error: str = ""
    traceback: str = ""           # only for a bug in our own conversion
    problems: list = field(default_factory=list)          # first few "file:line: reason"
    refused_write: dict = field(default_factory=dict)     # the output's device refused it (utils.disk)



def _ignore_stop_signals() -> None:
    """Pool initializer: Ctrl-C and SIGTERM (a terminal's or a supervisor's, to the whole
    process group) are the parent's job: it stops the pool, whose workers finish the batch
    at hand. A converter stopped in the middle of taking a batch off the shared queue would
    leave its lock held and hang the others."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _convert_batch(job: tuple) -> list[Converted]:
    fmt, opts, records = job
    return [convert_record(fmt, raw, where, opts) for raw, where in records]


def _converted_in_parallel(raw: Iterator[tuple[object, str]], fmt: str, opts: CleanOptions,
                           batch: int = 16) -> Iterator[tuple[Converted, str]]:
    """Convert records in ``opts.record_workers`` processes, in input order, ``batch`` records
    per task (utils.data.parallel.ordered_map: bounded in flight, so memory does not grow with the
    file). Each task carries its own (fmt, opts): no state lives in the workers. A worker
    that dies (killed, out of memory) raises BrokenProcessPool here, which fails this file."""
    batches = iter(lambda: [r for _, r in zip(range(batch), raw)], [])
    for chunk, converted in ordered_map(_convert_batch, batches, opts.record_workers,
                                        arg=lambda chunk: (fmt, opts, chunk),
                                        initializer=_ignore_stop_signals):
        yield from zip(converted, (where for _, where in chunk))



def _iter_raw(path: Path, fmt: str, opts: CleanOptions,
              result: FileResult) -> Iterator[tuple[object, str]]:
    """Yield ``(raw record, where)`` for each record of one file that passes the cheap filters
    (namespace, redirect); parsing and conversion happen later, possibly in workers.
    ``where`` is the line number (JSONL) or the page title (XML)."""
    skipped = result.skipped

    def limit_reached() -> bool:
        return opts.max_articles is not None and result.read >= opts.max_articles

    with open_binary(path) as f:
        if fmt == "jsonl":
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if limit_reached():
                    return
                result.read += 1
                result.chars_in += len(raw.decode("utf-8", "replace").rstrip("\r\n"))
                yield raw, str(lineno)
        else:
            for page in iter_xml_pages(f):
                if limit_reached():
                    return
                result.read += 1
                if page.ns not in opts.namespaces:
                    skipped["namespace"] += 1
                    continue
                if opts.skip_redirects and (page.redirect or is_redirect_text(page.text)):
                    skipped["redirect"] += 1
                    continue
                result.chars_in += len(page.text)
                yield page.text, page.title or "?"


def iter_records(path: Path, fmt: str, opts: CleanOptions, result: FileResult) -> Iterator[str]:
    """Yield the cleaned text of each usable record of one file (possibly '').

    Counts reads, characters in, skip reasons, bad records (the first few reported as
    ``file:line`` or ``file: page 'Title'``), repairs and dropped section titles into
    ``result`` (whose dict fields are Counters). With ``opts.record_workers > 1`` the
    conversion runs in that many processes, in order, so the output is identical to a
    serial run. A ConversionBug propagates."""
    def problem(where: str, reason: str) -> None:
        if len(result.problems) < MAX_REPORTED_PROBLEMS:
            loc = f"{path.name}:{where}" if fmt == "jsonl" else f"{path.name}: page '{where}'"
            result.problems.append(f"{loc}: {reason}")

    raw = _iter_raw(path, fmt, opts, result)
    if opts.record_workers > 1:
        converted = _converted_in_parallel(raw, fmt, opts)
    else:
        converted = ((convert_record(fmt, record, where, opts), where) for record, where in raw)
    for conv, where in converted:
        if conv.bad:
            result.skipped["malformed"] += 1
            result.malformed[conv.bad.split(":")[0]] += 1
            problem(where, conv.bad)
            continue
        result.sections_dropped.update(conv.dropped)
        if conv.repairs:
            result.repaired.update(conv.repairs)
            problem(where, ", ".join(conv.repairs) + " (repaired, kept)")
        yield conv.text


# --------------------------------------------------------------------------- one file
class _NothingKept(Exception):
    """Raised inside the atomic write to abandon it: no article of the input was kept."""


def clean_file(input_path: str | Path, output_path: str | Path, opts: CleanOptions,
               progress: Optional[Callable[[int], None]] = None) -> FileResult:
    """Clean one dump into one output file, atomically (utils.atomic).

    Never raises for bad input: the returned FileResult says ``failed`` (with a message)
    or ``no_output`` instead, and then the output file is left exactly as it was before
    (an earlier run's complete output stays). ``progress(n)`` is told every so often that
    n more records were read. Ctrl-C / SystemExit propagate, leaving no temp file."""
    input_path, output_path = Path(input_path), Path(output_path)
    result = FileResult(input=str(input_path), output=str(output_path), skipped=Counter(),
                        malformed=Counter(), repaired=Counter(), sections_dropped=Counter())
    start = last_report = time.monotonic()
    reported = 0

    def report() -> None:
        nonlocal reported, last_report
        if progress is not None and result.read > reported:
            progress(result.read - reported)
        reported, last_report = result.read, time.monotonic()

    try:
        result.format = detect_format(input_path)
        with atomic_open(output_path, "w") as out:
            for text in iter_records(input_path, result.format, opts, result):
                if not text:
                    result.skipped["empty"] += 1
                elif len(text) < opts.min_chars:
                    result.skipped["too_short"] += 1
                else:
                    out.write(escape_article(text) + "\n")
                    result.kept += 1
                    result.chars_out += len(text)
                if time.monotonic() - last_report >= PROGRESS_SECONDS:
                    report()
            if result.read == 0:
                raise InputFormatError("no articles found")
            if result.kept == 0:
                raise _NothingKept()
    except _NothingKept:
        result.status = "no_output"
    except WriteError as e:           # the output's device, not the input: it ends the run (verdict)
        result.status, result.error = "failed", str(e)
        result.refused_write = {"path": str(e.path), "what": e.what, "written": e.written, "needed": e.needed,
                                "free": e.free}
    except ConversionBug as e:
        result.status = "failed"
        page = f"line {e.where}" if result.format == "jsonl" else f"page '{e.where}'"
        result.error = (f"internal error while converting {page} ({e.detail}); this is a bug "
                        f"in the cleaner, not bad input: please report it with that {page.split()[0]}")
        result.traceback = e.trace
    except Exception as e:
        result.status = "failed"
        result.error = describe_error(e)
    finally:
        report()
        result.seconds = round(time.monotonic() - start, 3)
        for name in ("skipped", "malformed", "repaired"):
            setattr(result, name, dict(sorted(getattr(result, name).items())))
        result.sections_dropped = dict(result.sections_dropped.most_common())
    return result


def describe_error(e: BaseException) -> str:
    """A one-line, user-facing reason for a failed file."""
    if isinstance(e, EOFError):
        return f"the compressed stream ends early (truncated download?): {e}"
    if isinstance(e, expat.ExpatError):
        return f"invalid XML ({e}); the file may be truncated or not a MediaWiki dump"
    if isinstance(e, InputFormatError):
        return str(e)
    if type(e).__name__ == "BrokenProcessPool":
        return "a record-conversion worker process died (killed or out of memory?)"
    if isinstance(e, OSError):
        return f"cannot read or write ({e.strerror or e}{': ' + e.filename if e.filename else ''})"
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- the run
def find_inputs(input_dir: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """Dump files in a folder (or the one file given), sorted by name, and the entries with
    a dump's name that are not regular files ``[(name, why)]``. Hidden files are ignored."""
    if input_dir.is_file():
        return [input_dir], []
    files, not_files = [], []
    for p in sorted(input_dir.iterdir()):
        if p.name.startswith(".") or not p.name.lower().endswith(INPUT_SUFFIXES):
            continue
        if p.is_file():
            files.append(p)
        elif p.is_symlink() and not p.exists():
            not_files.append((p.name, "a dangling symbolic link"))
        elif p.is_dir():
            not_files.append((p.name, "a directory, not a file"))
        else:
            not_files.append((p.name, "not a regular file"))
    return files, not_files


def output_name(input_path: Path) -> str:
    """enwiki-...-articles.xml.bz2 -> cleaned_enwiki-...-articles.txt"""
    name = input_path.name
    changed = True
    while changed:
        changed = False
        for suffix in STRIP_SUFFIXES:
            if name.lower().endswith(suffix) and len(name) > len(suffix):
                name, changed = name[: -len(suffix)], True
    return f"cleaned_{name}.txt"


def _new_bar():
    return tqdm(total=None, unit=" articles", desc="cleaning", dynamic_ncols=True, mininterval=0.5)


def run_in_process(tasks: list[tuple], workers: int) -> list[FileResult]:
    """Fewer files than cores (e.g. one big XML dump): clean one file at a time here, each
    file's records converted by ``workers`` processes (in order: same output as serial)."""
    bar = _new_bar()
    results = []
    try:
        for i, (inp, out, opts) in enumerate(tasks):
            results.append(clean_file(inp, out, replace(opts, record_workers=workers),
                                      progress=bar.update))
            bar.set_postfix(files=f"{i + 1}/{len(tasks)}", refresh=False)
        return results
    finally:
        bar.close()


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: a second one (the group's, then the
    raise SystemExit(128 + signum)     # parent's) must not cut the unwinding (temp file, pool)


def _worker_main(index: int, task: tuple, messages, parent: Optional[int]) -> None:
    """Worker process: clean one file and send its FileResult back.

    Ctrl-C is ignored here: the parent handles it by terminating workers (SIGTERM, which
    unwinds this process so its temp file is removed); a finished output is never touched.
    The same SIGTERM comes when the parent dies without stopping it (killed with SIGKILL:
    ``die_with_parent``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    die_with_parent(parent, signal.SIGTERM)
    result = clean_file(*task, progress=lambda n: messages.put(("progress", index, n)))
    messages.put(("done", index, result))


def _remove_temp(output: str, pid: Optional[int]) -> None:
    """Remove the temp file a dead worker (pid) left for output (utils.atomic's naming)."""
    if pid is not None:
        temp_path(Path(output), pid).unlink(missing_ok=True)


def _per_file(tasks: list[tuple], workers: int) -> list[tuple[int, tuple]]:
    """(index, task) per file; with fewer files than ``workers`` each file's process converts
    its records with ``workers // files`` processes of its own (so it is not daemonic)."""
    converters = max(1, workers // max(1, len(tasks)))
    return [(i, (inp, out, replace(opts, record_workers=converters)))
            for i, (inp, out, opts) in enumerate(tasks)]


def run_workers(tasks: list[tuple], workers: int) -> list[FileResult]:
    """Clean files in parallel, one worker process per input file (:func:`_per_file`), at
    most ``workers`` at a time, with one tqdm bar (articles/s) for the whole run.

    A worker that dies without reporting (killed, out of memory) fails its file only.
    On Ctrl-C every worker is terminated and its temp file removed before re-raising;
    outputs already finished stay."""
    todo = _per_file(tasks, workers)
    pool = _FileWorkers(tasks)
    try:
        while todo or pool.running:
            while todo and len(pool.running) < workers:
                pool.start(*todo.pop(0))
            pool.collect()
        return pool.results_in_order()
    except BaseException:
        pool.stop()
        raise
    finally:
        pool.bar.close()


class _FileWorkers:
    """run_workers' worker processes (index -> process), what they report (progress on the
    bar, each file's FileResult) and the files whose worker died."""

    def __init__(self, tasks: list[tuple]):
        self.tasks = tasks
        self.ctx = mp.get_context()
        self.messages = self.ctx.Queue()
        self.running: dict[int, mp.process.BaseProcess] = {}
        self.results: dict[int, FileResult] = {}
        self.bar = _new_bar()

    def start(self, index: int, task: tuple) -> None:
        proc = self.ctx.Process(target=_worker_main,
                                args=(index, task, self.messages, os_parent_of_workers(self.ctx)),
                                name=f"clean-{Path(task[0]).name}")
        proc.start()
        self.running[index] = proc

    def _handle(self, message) -> None:
        kind, index, payload = message
        if kind == "progress":
            self.bar.update(payload)
        else:
            self.results[index] = payload

    def collect(self) -> None:
        """Wait a little for a message, then take every message of the workers that exited and
        fail the file of each that died without reporting."""
        try:
            self._handle(self.messages.get(timeout=0.2))
        except queue.Empty:
            pass
        exited = [i for i, proc in self.running.items() if not proc.is_alive()]
        try:                      # an exited worker's messages are all in the pipe now
            while True:
                self._handle(self.messages.get_nowait())
        except queue.Empty:
            pass
        for index in exited:
            proc = self.running.pop(index)
            proc.join()
            if index not in self.results:
                inp, out, _ = self.tasks[index]
                _remove_temp(out, proc.pid)
                self.results[index] = FileResult(inp, out, status="failed",
                                                 error=f"the worker process died (exit code {proc.exitcode}; "
                                                       f"killed or out of memory?)")
        self.bar.set_postfix(files=f"{len(self.results)}/{len(self.tasks)}", refresh=False)

    def results_in_order(self) -> list[FileResult]:
        self.bar.n = sum(r.read for r in self.results.values())   # exact, whatever was still queued
        self.bar.refresh()
        return [self.results[i] for i in range(len(self.tasks))]

    def stop(self) -> None:
        """Terminate every running worker and remove the temp file it leaves."""
        for proc in self.running.values():
            proc.terminate()
        for index, proc in self.running.items():
            proc.join()
            _remove_temp(self.tasks[index][1], proc.pid)


def summarize(results: list[FileResult], seconds: float) -> dict:
    """Totals over all files of a run."""
    counters = {name: Counter() for name in ("skipped", "malformed", "repaired", "sections_dropped")}
    done = [r for r in results if r.status != "exists"]
    for r in done:
        for name, counter in counters.items():
            counter.update(getattr(r, name))
    return {
        "files": len(results),
        "files_ok": sum(r.status == "ok" for r in results),
        "files_failed": sum(r.status == "failed" for r in results),
        "files_no_output": sum(r.status == "no_output" for r in results),
        "files_already_done": sum(r.status == "exists" for r in results),
        "articles_read": sum(r.read for r in done),
        "articles_kept": sum(r.kept for r in done),
        "skipped": dict(sorted(counters["skipped"].items())),
        "malformed": dict(sorted(counters["malformed"].items())),
        "repaired": dict(sorted(counters["repaired"].items())),
        "sections_dropped": dict(counters["sections_dropped"].most_common()),
        "chars_in": sum(r.chars_in for r in done),
        "chars_out": sum(r.chars_out for r in done),
        "seconds": round(seconds, 2),
    }


def _counts(d: dict, limit: int = 0) -> str:
    items = list(d.items())
    text = ", ".join(f"{k} {v:,}" for k, v in (items[:limit] if limit else items)) or "none"
    return text + (f", ... ({len(items) - limit} more titles)" if limit and len(items) > limit else "")


def print_summary(results: list[FileResult], totals: dict, not_files: Sequence = ()) -> None:
    """Human-readable per-file lines and totals."""
    print("\nCleaning summary")
    for name, why in not_files:
        print(f"  {name}: skipped, {why}")
    for r in results:
        name = Path(r.input).name
        if r.status == "exists":
            print(f"  {name}: skipped, {Path(r.output).name} exists (use --force to redo)")
        elif r.status == "failed":
            print(f"  {name}: FAILED: {r.error}")
        else:
            where = Path(r.output).name if r.status == "ok" else "no output (nothing kept)"
            if r.status == "no_output" and Path(r.output).exists():
                where += f"; the earlier {Path(r.output).name} is left as it was"
            print(f"  {name} [{r.format}]: read {r.read:,}, kept {r.kept:,}, skipped: "
                  f"{_counts(r.skipped)} -> {where} ({r.seconds:.1f}s)")
        if r.malformed:
            print(f"      bad records: {_counts(r.malformed)}")
        for p in r.problems:
            print(f"      {p}")
    t = totals
    rate = t["articles_read"] / t["seconds"] if t["seconds"] > 0 else 0.0
    print(f"  total: {t['articles_read']:,} articles read, {t['articles_kept']:,} kept; "
          f"skipped: {_counts(t['skipped'])}")
    if t["repaired"]:
        print(f"  repaired (kept): {_counts(t['repaired'])}")
    print(f"  sections dropped: {_counts(t['sections_dropped'], limit=12)}")
    print(f"  characters: {t['chars_in']:,} in -> {t['chars_out']:,} out; "
          f"{t['seconds']:.1f}s ({rate:,.0f} articles/s)")


def build_parser() -> StageParser:
    p = StageParser("main.py clean", "Wikipedia dumps (structured-contents JSONL or MediaWiki XML) "
                                  "-> cleaned articles, one per line",
                    test="quick mode: the first cleaning.test_max_articles articles of each file")
    p.config_flag("--input-dir", key="wikipedia.raw_dir", type=cli_path, metavar="DIR",
                  help="folder of *.jsonl / *.json / *.xml / *.xml.bz2 dumps (or one file)")
    p.config_flag("--output-dir", key="cleaning.output_dir", type=cli_path, metavar="DIR",
                  help="where cleaned_*.txt go (default paths.cleaned_dir)")
    p.config_flag("--min-chars", key="cleaning.min_chars", type=int, metavar="N",
                  help="drop articles shorter than N characters after cleaning")
    p.config_flag("--workers", key="cleaning.workers", type=int, metavar="N",
                  help="worker processes (0 = the CPUs this process may use): one input file each, "
                       "or, with fewer files than workers, the articles of one file")
    p.add_argument("--force", action="store_true",
                   help="redo inputs whose output already exists (it is replaced only when the "
                        "new one is complete)")
    p.add_argument("--shard", type=shard_spec, default=None, metavar="I/N",
                   help="clean only shard I of N: the input files (sorted by name) whose position "
                        "is I, I+N, I+2N, ... (split a dump across N machines, each writing its own "
                        "cleaned files and cleaning_summary_shardIofN.json)")
    return p


def shard_spec(text: str) -> tuple[int, int]:
    """``--shard I/N`` -> (I, N), 1 <= I <= N."""
    i, _, n = text.partition("/")
    if not (i.strip().isdigit() and n.strip().isdigit() and 1 <= int(i) <= int(n)):
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N (e.g. 2/4), got {text!r}")
    return int(i), int(n)


def take_shard(inputs: list, outputs: list, shard: Optional[tuple[int, int]]) -> tuple[list, list]:
    """The inputs and outputs of shard I/N: every Nth input file by name, from the Ith."""
    if shard is None:
        return inputs, outputs
    i, n = shard
    print(f"Shard {i}/{n}: {len(inputs[i - 1::n])} of the {len(inputs)} input file(s)", flush=True)
    return inputs[i - 1::n], outputs[i - 1::n]


def summary_file(shard: Optional[tuple[int, int]]) -> str:
    """cleaning_summary.json, or cleaning_summary_shardIofN.json: shards may share a folder."""
    return SUMMARY_FILE if shard is None else f"cleaning_summary_shard{shard[0]}of{shard[1]}.json"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    input_dir = cfg.path("wikipedia.raw_dir")
    output_dir = cfg.resolve(cfg.cleaning.output_dir) or cfg.path("paths.cleaned_dir")
    inputs, outputs, not_files = find_work(input_dir, output_dir)
    inputs, outputs = take_shard(inputs, outputs, args.shard)
    opts = CleanOptions.from_config(cfg)
    results, tasks = plan_files(inputs, outputs, opts, args.force)
    workers = workers_or_cores(cfg.cleaning.workers, "cleaning.workers")
    run = announce(cfg, tasks, inputs, input_dir, output_dir, opts, not_files, workers)
    start = time.monotonic()
    if tasks:
        for r in run(tasks, workers):
            results[r.input] = r
    ordered = [results[str(p)] for p in inputs]
    totals = summarize(ordered, time.monotonic() - start)
    print_summary(ordered, totals, not_files)
    summary = output_dir / summary_file(args.shard)
    write_summary(cfg, input_dir, summary, ordered, totals, not_files)
    return verdict(ordered, totals, tasks, inputs, summary, opts)


# --------------------------------------------------------------------------- steps of main
def find_work(input_dir: Path, output_dir: Path) -> tuple[list[Path], list[Path], list]:
    """The dumps in ``input_dir``, their output files, and what was skipped (with why); the
    output folder exists afterwards."""
    if not input_dir.exists():
        raise PipelineError(f"input folder {input_dir} does not exist. Set wikipedia.raw_dir in "
                            f"config.json or pass --input-dir DIR (the offline sample: "
                            f"`python main.py samples`, then --input-dir data/samples/enwiki).")
    inputs, not_files = find_inputs(input_dir)
    if not inputs:
        also = "".join(f"; {name} skipped: {why}" for name, why in not_files)
        raise PipelineError(f"no input files found in {input_dir} (expected *.jsonl, *.json, "
                            f"*.xml, *.xml.bz2 or *.jsonl.bz2){also}; set wikipedia.raw_dir or --input-dir.")
    outputs = [output_dir / output_name(p) for p in inputs]
    clashes = [o.name for o in set(outputs) if outputs.count(o) > 1]
    if clashes:
        raise PipelineError(f"several inputs would be written to the same output ({', '.join(clashes)}); "
                            f"rename one of them in {input_dir}.")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineError(f"cannot create the output folder {output_dir} ({e.strerror or e}); "
                            f"set cleaning.output_dir or --output-dir to a writable folder.") from None
    return inputs, outputs, not_files


def plan_files(inputs, outputs, opts: CleanOptions, force: bool) -> tuple[dict, list]:
    """Files whose output exists (kept unless --force) and the tasks to run, biggest first
    (better balance)."""
    results: dict[str, FileResult] = {}
    tasks = []
    for inp, out in zip(inputs, outputs):
        if out.exists() and not force:
            results[str(inp)] = FileResult(str(inp), str(out), status="exists")
        else:
            tasks.append((str(inp), str(out), opts))
    tasks.sort(key=lambda t: -Path(t[0]).stat().st_size)
    return results, tasks


def announce(cfg, tasks, inputs, input_dir, output_dir, opts: CleanOptions, not_files, workers: int) -> Callable:
    """Say what runs how, and return the runner. One file (the common download) on several
    cores: read here, its records spread over all of them. Several files: one process per
    file, with converters of its own when there are fewer files than cores."""
    mode = f"test mode, first {opts.max_articles:,} articles per file" if cfg.test else "full run"
    per_file = len(tasks) > 1 or workers == 1
    if not per_file:
        how = f"one file at a time, its articles converted by {workers} worker processes"
    elif len(tasks) >= workers:
        how = f"{min(workers, max(1, len(tasks)))} worker process(es), one file each"
    else:
        how = (f"{len(tasks)} worker processes, one file each, each with {workers // len(tasks)} "
               f"converter processes")
    print(f"Cleaning {len(tasks)} of {len(inputs)} file(s) from {input_dir} -> {output_dir} "
          f"({how}; {mode})", flush=True)
    for name, why in not_files:
        print(f"  skipped {name}: {why}", flush=True)
    return run_workers if per_file else run_in_process


def write_summary(cfg, input_dir, summary_path: Path, ordered, totals, not_files) -> None:
    """resolved_config.json and the summary (``summary_path``) next to the outputs (atomically)."""
    output_dir = summary_path.parent
    cfg.save_resolved(output_dir)
    summary = {"test": cfg.test, "input_dir": str(input_dir), "output_dir": str(output_dir),
               "inputs_skipped": [{"name": n, "reason": why} for n, why in not_files],
               "totals": totals, "files": [asdict(r) for r in ordered]}
    write_json_atomic(summary_path, summary)


def verdict(ordered, totals, tasks, inputs, summary_path: Path, opts: CleanOptions) -> int:
    """Exit 1 (raised) when a file failed or nothing usable came out; else say what was written."""
    output_dir = summary_path.parent
    failed = [r for r in ordered if r.status == "failed"]
    refused = [r.refused_write for r in failed if r.refused_write]
    if refused:                        # a full disk (or a read-only one): said as such, nothing more
        raise WriteError(refused[0]["path"], refused[0]["what"], written=refused[0]["written"],
                         needed=refused[0]["needed"], free=refused[0]["free"],
                         note="Files cleaned before are unchanged")
    if failed:
        names = "; ".join(f"{Path(r.input).name}: {r.error}" for r in failed)
        more = f" The traceback is in {summary_path}." if any(r.traceback for r in failed) else ""
        raise PipelineError(f"{len(failed)} of {len(inputs)} input file(s) failed ({names}). "
                            f"Other files were cleaned and earlier outputs of the failed ones are "
                            f"unchanged; fix or remove the failed ones and re-run.{more}")
    if not inputs:
        print("Nothing to do: this shard holds none of the input files.")
        return 0
    if not tasks:
        print(f"Nothing to do: every output exists in {output_dir} (use --force to redo).")
        return 0
    if totals["articles_kept"] == 0:
        raise PipelineError(f"no usable article came out of {len(tasks)} file(s): all "
                            f"{totals['articles_read']:,} articles read were skipped "
                            f"({_counts(totals['skipped'])}); earlier outputs are unchanged. "
                            f"Check the inputs, or lower cleaning.min_chars / --min-chars "
                            f"(now {opts.min_chars}).")
    print(f"Wrote {totals['articles_kept']:,} articles to {output_dir}")
    return 0


if __name__ == "__main__":
    run_stage(main)
