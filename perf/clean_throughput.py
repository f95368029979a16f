#!/usr/bin/env python3
"""Cleaning a MediaWiki XML dump: `python main.py clean` against wikiextractor 3.1.0.

    python perf/clean_throughput.py                       # 20 copies, 1 and 2 processes, 3 repeats
    python perf/clean_throughput.py --copies 100 --processes 4 --repeats 5 --bz2
    python perf/clean_throughput.py --profile             # where the worker processes spend CPU

The dump: the offline sample's 206 pages (106 articles, 99 redirects, one page outside the
article namespace; data/samples/enwiki) repeated ``--copies`` times, each copy with new page
ids and titles, as plain XML (``--bz2``: compressed, like the download). 20 copies: 4,120
pages, 2,120 articles, 122 MB of XML.

The contenders, on the same file with the same process count: ``main.py clean --workers N``
(this checkout; the defaults of the config dataclasses, so a local config.json changes
nothing) and ``wikiextractor --no-templates --processes N`` (3.1.0, installed by this script
from the package index into its own virtual environment, ``--tool-venv``, cached between runs;
never a project dependency). Each runs ``--repeats`` times at 1 process and at ``--processes``,
contenders alternating (their order flips every repeat), after one untimed warm-up each.
Printed per contender: wall seconds and CPU seconds (user + sys of the whole process tree,
from the kernel's rusage of the children) as min / median / max, both per article too;
peak memory of the whole process tree (the largest sum of the processes' PSS, sampled every
50 ms, so shared pages are counted once); the ratios wikiextractor / ours of wall time (>=
1.0: ours is as fast or faster) and of CPU time, per repeat and of the medians; and the
speed-up from 1 to N processes. Both tools keep N cores busy, so on a quiet machine the wall
ratio follows the CPU ratio; on a machine other work shares, the wall ratio also reflects how
many processes each tool runs (wikiextractor runs a reader and a writer besides its N
extractors, and the scheduler shares the cores by process). Per article means per input
article (non-redirect page of the article namespace), the same denominator for both. For
estimates of other dumps it also prints our CPU seconds per MB of article wikitext and how
fast one core reads XML into pages (from .xml.bz2 and from .xml), the serial part of a run.

So that speed is never bought with text, both outputs are scored with the template-probe
measure of docs/data_stages.md (perf/wikitext_gaps.py): for each text-carrying template in
running text of the sample, a probe taken from its arguments must appear in the output. The
score is taken on the first copy's articles (every copy is cleaned the same way; the script
checks that ours are identical across copies).

``--profile``: one run of ours at ``--processes`` under py-spy (installed into the same tool
environment), sampling the stage and its worker processes; printed separately: the functions
where the workers spend their samples (stacks under concurrent.futures' ``_process_worker``)
and where the stage's own process does (reading, XML parsing, writing).
"""
from __future__ import annotations

import argparse
import bz2
import datetime as dt
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

SAMPLE_DIR = ROOT / "data" / "samples" / "enwiki"
SAMPLE = SAMPLE_DIR / "enwiki-sample-pages-articles.xml.bz2"
WIKIEXTRACTOR = "wikiextractor==3.1.0"
PY_SPY = "py-spy==0.4.3"
ID_STRIDE = 10 ** 9           # page ids of copy k: original + k * ID_STRIDE (sample ids are smaller)
DEFAULT_VENV = Path.home() / ".cache" / "llm-pipeline" / "perf-tools"


# --------------------------------------------------------------------------- the dump
def build_dump(copies: int, out: Path, compress: bool) -> tuple[Path, int, int, int]:
    """The sample's pages repeated ``copies`` times (new page ids and titles from the second
    copy on) -> (path, pages, articles, characters of article wikitext). Articles:
    article-namespace pages that are not redirects, counted the way the cleaner reads them."""
    from utils.data.mediawiki import is_redirect_text, iter_xml_pages
    with bz2.open(SAMPLE) as f:
        texts = [p.text for p in iter_xml_pages(f)
                 if p.ns == 0 and not p.redirect and not is_redirect_text(p.text)]
    text = bz2.decompress(SAMPLE.read_bytes()).decode("utf-8")
    start, end = text.index("  <page>"), text.rindex("</mediawiki>")
    pages = re.findall(r"  <page>.*?</page>\n", text[start:end], re.S)
    assert "".join(pages) == text[start:end], "unexpected sample layout"

    def copy(page: str, k: int) -> str:
        if k == 0:
            return page
        page = re.sub(r"<title>(.*?)</title>", lambda m: f"<title>{m.group(1)} (copy {k})</title>",
                      page, count=1)
        return re.sub(r"(</ns>\s*<id>)(\d+)(</id>)",
                      lambda m: f"{m.group(1)}{int(m.group(2)) + k * ID_STRIDE}{m.group(3)}", page, count=1)

    path = out / ("enwiki-repeated-pages-articles.xml" + (".bz2" if compress else ""))
    opener = bz2.open if compress else open
    with opener(path, "wb") as f:
        f.write(text[:start].encode())
        for k in range(copies):
            f.write("".join(copy(p, k) for p in pages).encode())
        f.write(text[end:].encode())
    return path, len(pages) * copies, len(texts) * copies, sum(map(len, texts)) * copies


def reader_rates() -> tuple[float, float]:
    """MB/s of XML that one core reads into pages (what the stage's own process does before
    handing pages to converters), from the sample: (from .xml.bz2, from plain .xml)."""
    from utils.data.mediawiki import iter_xml_pages
    import io
    raw = bz2.decompress(SAMPLE.read_bytes())
    rates = []
    for opener in (lambda: bz2.open(SAMPLE), lambda: io.BytesIO(raw)):
        best = min(_cpu_seconds(lambda: sum(1 for _ in iter_xml_pages(opener()))) for _ in range(3))
        rates.append(len(raw) / 1e6 / best)
    return rates[0], rates[1]


def _cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


# --------------------------------------------------------------------------- tools
def tool_python(venv: Path, *packages: str) -> Path:
    """The Python of the tool environment, created with ``python -m venv`` and the pinned
    ``packages`` pip-installed from the index the first time (a marker file per package)."""
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"creating the tool environment {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for pkg in packages:
        marker = venv / f".installed-{pkg}"
        if not marker.exists():
            print(f"pip install {pkg} into {venv} ...", flush=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", pkg],
                           check=True)
            marker.touch()
    return py


def ours_command(dump: Path, out: Path, procs: int) -> list[str]:
    return [sys.executable, str(ROOT / "main.py"), "clean", "--input-dir", str(dump),
            "--output-dir", str(out), "--force", "--workers", str(procs)]


def theirs_command(py: Path, dump: Path, out: Path, procs: int) -> list[str]:
    return [str(py.parent / "wikiextractor"), str(dump), "--no-templates", "--processes", str(procs),
            "-q", "-o", str(out)]


def env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                LLM_PIPELINE_BASE_CONFIG="none", PYTHONWARNINGS="ignore")


# --------------------------------------------------------------------------- measuring
def tree_pss_mb(root: int) -> float:
    """Sum of the PSS of process ``root`` and all its descendants (MB; 0 when gone)."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue                   # exited meanwhile
    return total / 1024


def run_measured(cmd: list[str], log: Path) -> dict:
    """Run ``cmd``; wall seconds, CPU seconds of the whole tree (rusage of the waited-for
    child, which includes its reaped descendants) and the peak tree PSS (sampled)."""
    peak = [0.0]
    done = threading.Event()
    with open(log, "w") as logf:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env(), cwd=ROOT)

        def sample() -> None:
            while not done.wait(0.05):
                peak[0] = max(peak[0], tree_pss_mb(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output is in {log}:\n"
                 + log.read_text()[-3000:])
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "pss": peak[0]}


def spread(xs: list[float], scale: float = 1.0, fmt: str = "{:6.2f}") -> str:
    xs = [x * scale for x in xs]
    return " / ".join(fmt.format(v) for v in (min(xs), statistics.median(xs), max(xs)))


# --------------------------------------------------------------------------- outputs
def ours_text(out: Path, copies: int) -> tuple[str, bool]:
    """Our cleaned articles of the first copy, and whether every copy came out identical."""
    from utils.data.textio import unescape_article
    lines = next(out.glob("cleaned_*.txt")).read_text(encoding="utf-8").splitlines()
    per = len(lines) // copies
    same = len(lines) % copies == 0 and all(lines[k * per:(k + 1) * per] == lines[:per] for k in range(copies))
    return "\n".join(unescape_article(line) for line in lines[:per]), same


_DOC = re.compile(r'<doc id="(\d+)"[^>]*>\n(.*?)</doc>', re.S)


def theirs_text(out: Path) -> str:
    """wikiextractor's documents of the first copy, without the <doc> line and the title line
    that starts each document's text."""
    docs = []
    for f in sorted(p for p in out.rglob("wiki_*") if p.is_file()):
        for m in _DOC.finditer(f.read_text(encoding="utf-8")):
            if int(m.group(1)) < ID_STRIDE:
                docs.append(m.group(2).split("\n", 1)[1] if "\n" in m.group(2) else "")
    return "\n".join(docs)


def probe_score(text: str, probes: dict, raw: str) -> str:
    from wikitext_gaps import measure
    per = measure(text, probes, raw)[0]
    found, total = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    fams = ", ".join(f"{fam} {v[0]}/{v[1]}" for fam, v in sorted(per.items()))
    return f"{found}/{total} ({100 * found / max(total, 1):.1f}%)  [{fams}]"


# --------------------------------------------------------------------------- profile
def profile(py: Path, dump: Path, work: Path, procs: int, top: int = 25) -> None:
    """One run of ours under py-spy (all processes); top functions of the workers and of the
    stage's own process, by samples where the function is the innermost frame (self) and
    anywhere on the stack (total)."""
    raw = work / "py-spy.txt"
    cmd = [str(py.parent / "py-spy"), "record", "--subprocesses", "--rate", "200", "--format", "raw",
           "--nonblocking", "-o", str(raw), "--", *ours_command(dump, work / "profiled", procs)]
    subprocess.run(cmd, check=True, env=env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    groups = {"workers": (Counter(), Counter()), "stage process": (Counter(), Counter())}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [re.sub(r" \((.*/)?([^/]+\.py):\d+\)$", r" (\2)", f) for f in stack.split(";")]
        if any("_process_worker" in f for f in frames):
            own, total = groups["workers"]
        elif any("clean_file" in f for f in frames):
            own, total = groups["stage process"]
        else:
            continue                   # main.py waiting, start-up, pool plumbing
        own[frames[-1]] += int(count)
        for f in set(frames):
            total[f] += int(count)
    for name, (own, total) in groups.items():
        n = sum(own.values())
        print(f"\n{name}: {n} samples at 200 Hz; top functions by self samples (self %, total %)")
        for f, c in own.most_common(top):
            print(f"  {100 * c / n:5.1f}%  {100 * total[f] / n:5.1f}%  {f}")


# --------------------------------------------------------------------------- main
def machine() -> str:
    from perf.machine import cpu_model
    from utils.processes import available_cpus
    import mwparserfromhell
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return (f"{platform.node()} | {platform.platform()} | {cpu_model()} | {available_cpus()} usable "
            f"cores, {mem:.0f} GiB RAM | Python {platform.python_version()}, mwparserfromhell "
            f"{mwparserfromhell.__version__}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=20, help="times the sample's pages are repeated")
    ap.add_argument("--processes", type=int, default=2, help="process count N (1 is also measured)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bz2", action="store_true", help="compress the dump (like the download)")
    ap.add_argument("--tool-venv", type=Path, default=DEFAULT_VENV,
                    help="virtual environment for wikiextractor (and py-spy), kept between runs")
    ap.add_argument("--profile", action="store_true", help="profile ours under py-spy instead of timing")
    a = ap.parse_args()
    if not SAMPLE.exists():
        sys.exit(f"no sample dump at {SAMPLE}: run `python main.py samples` first")
    py = tool_python(a.tool_venv, WIKIEXTRACTOR, *([PY_SPY] if a.profile else []))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # temp dir goes
    work = Path(tempfile.mkdtemp(prefix="clean-throughput-"))
    try:
        dump, pages, articles, article_chars = build_dump(a.copies, work, a.bz2)
        size = dump.stat().st_size / 1e6
        print(f"clean throughput: {dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M} UTC | {machine()}")
        print(f"dump: the offline sample x {a.copies} = {pages:,} pages, {articles:,} articles, "
              f"{size:.1f} MB ({'bz2' if a.bz2 else 'plain XML'}); load average at start: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if a.profile:
            profile(py, dump, work, a.processes)
            return 0
        return compare(a, py, dump, work, articles, article_chars)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(a, py: Path, dump: Path, work: Path, articles: int, article_chars: int) -> int:
    contenders = {"ours (main.py clean)": lambda out, n: ours_command(dump, out, n),
                  "wikiextractor 3.1.0": lambda out, n: theirs_command(py, dump, out, n)}
    names = list(contenders)
    counts = sorted({1, a.processes})
    outs = {name: work / f"out{i}" for i, name in enumerate(names)}
    for name in names:                                   # warm-up; these outputs are scored
        run_measured(contenders[name](outs[name], a.processes), work / "warmup.log")
    results = {(name, n): [] for name in names for n in counts}
    for r in range(a.repeats):
        for n in counts:
            for name in (names if r % 2 == 0 else names[::-1]):
                out = work / "timed"
                shutil.rmtree(out, ignore_errors=True)
                results[name, n].append(run_measured(contenders[name](out, n), work / "run.log"))
                print(".", end="", flush=True)
    print(f"\n{a.repeats} interleaved repeats each; min / median / max; per article = per input "
          f"article ({articles:,})")
    for n in counts:
        print(f"  {n} process(es)")
        for name in names:
            rs = results[name, n]
            walls, cpus = [x["wall"] for x in rs], [x["cpu"] for x in rs]
            print(f"    {name:22s} wall s {spread(walls)}   CPU s {spread(cpus)}   "
                  f"ms/article wall {spread(walls, 1000 / articles, '{:5.1f}')}, CPU "
                  f"{spread(cpus, 1000 / articles, '{:5.1f}')}   peak tree PSS "
                  f"{max(x['pss'] for x in rs):5.0f} MB")
    ours, theirs = names
    print("ratios (medians; per interleaved repeat in brackets):")
    for n in counts:
        per = [t["wall"] / o["wall"] for o, t in zip(results[ours, n], results[theirs, n])]
        med = (statistics.median(x["wall"] for x in results[theirs, n])
               / statistics.median(x["wall"] for x in results[ours, n]))
        print(f"  {n} process(es): wikiextractor wall / ours wall = {med:4.2f}   "
              f"[{', '.join(f'{x:.2f}' for x in per)}]   (>= 1.0: ours as fast or faster)")
        per = [t["cpu"] / o["cpu"] for o, t in zip(results[ours, n], results[theirs, n])]
        med = (statistics.median(x["cpu"] for x in results[theirs, n])
               / statistics.median(x["cpu"] for x in results[ours, n]))
        print(f"  {n} process(es): wikiextractor CPU / ours CPU   = {med:4.2f}   "
              f"[{', '.join(f'{x:.2f}' for x in per)}]   (less sensitive to other load)")
    if len(counts) > 1:
        for name in names:
            one, many = (statistics.median(x["wall"] for x in results[name, n]) for n in counts)
            print(f"  speed-up 1 -> {a.processes} processes, {name:22s} {one / many:4.2f}x")
    cpu_one = statistics.median(x["cpu"] for x in results[ours, 1])
    bz2_rate, xml_rate = reader_rates()
    print(f"for estimates: ours at 1 process, {cpu_one / (article_chars / 1e6):.3f} CPU s per MB of "
          f"article wikitext ({article_chars / articles / 1e3:.1f} kB per article here); one core "
          f"reads {bz2_rate:.0f} MB/s of XML into pages from .xml.bz2, {xml_rate:.0f} MB/s from .xml")
    from wikitext_gaps import dump_probes
    probes, raw = dump_probes(SAMPLE_DIR)
    text, same = ours_text(outs[ours], a.copies)
    print("template-probe score (docs/data_stages.md), first copy's articles:")
    print(f"  ours           {probe_score(text, probes, raw)}; every copy identical: {same}")
    print(f"  wikiextractor  {probe_score(theirs_text(outs[theirs]), probes, raw)}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
