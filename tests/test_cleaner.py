"""Tests for cleaner.py (stage `clean`, alias `cleanup`).

End-to-end runs go through `python main.py clean --config CFG` with a tmp-rooted config,
on the real enwiki XML sample and on structured-contents JSONL fixtures written here.
Pure functions (wikitext and structured-contents conversion, safe XML) are tested directly.
"""
from __future__ import annotations

import bz2
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

import cleaner
from utils.data import mediawiki
from utils.data.mediawiki import CleanOptions
from utils.data.wikitext import section_key
from tests.conftest import ENWIKI_XML, ROOT, child_pids, default_signals, offline_env, run_stage
from utils.data.textio import iter_articles, unescape_article

DROP = ("References", "External links", "See also", "Further reading", "Notes")
OPTS = CleanOptions(drop_sections=tuple(section_key(s) for s in DROP), min_chars=0)


# --------------------------------------------------------------------------- fixtures
def para(text: str) -> dict:
    return {"type": "paragraph", "value": text}


def section(name: str, *parts: dict) -> dict:
    return {"type": "section", "name": name, "has_parts": list(parts)}


def bullet_list(*items: str) -> dict:
    return {"type": "list", "has_parts": [{"type": "list_item", "value": v} for v in items]}


LONG = "It is a long enough sentence to pass any reasonable minimum length filter. " * 3

ARTICLES = [
    {"name": "Café", "abstract": "Café is the lead (from the abstract section).",
     "sections": [
         # NFD input ("e" + combining acute) must come out NFC.
         section("Abstract", para(unicodedata.normalize("NFD", "A café in Zürich serves crème brûlée. ") + LONG)),
         section("History",
                 para("Coffee houses   spread\tacross Europe. 咖啡馆 means café in Chinese."),
                 section("Early days", para("The first café opened long ago."),
                         bullet_list("Espresso bars", "Tea rooms")),
                 {"type": "table", "has_parts": [para("TABLE CELL TEXT")]}),
         section("References", para("REFERENCE TEXT Smith 2001."),
                 section("Sub of references", para("NESTED REFERENCE TEXT."))),
         section("Legacy", para("Cafés remain popular. A backslash \\ survives too.")),
     ]},
    {"name": "No abstract section", "abstract": "Lead only in the abstract field. " + LONG,
     "sections": [section("Body", para("Body text follows the lead."))]},
    {"name": "Tiny", "abstract": "Too short.", "sections": []},
    {"name": "Listy", "sections": [section("Abstract", para("Lists below. " + LONG),
                                           bullet_list("First item", "Second item"))]},
]


def write_jsonl(path: Path, articles=ARTICLES, bad_lines=((2, '{"name": "broken", '),)) -> Path:
    """JSONL fixture; bad_lines = ((index, raw line), ...) inserted before that article."""
    lines = [json.dumps(a, ensure_ascii=False) for a in articles]
    for index, raw in sorted(bad_lines, reverse=True):
        lines.insert(index, raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def xml_dump(pages: list[tuple[str, int, str]], header: str = "") -> str:
    """A small MediaWiki XML dump: pages = [(title, ns, wikitext)]; '#REDIRECT' texts get <redirect>."""
    from xml.sax.saxutils import escape
    out = [header + '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">',
           "<siteinfo><sitename>Test</sitename></siteinfo>"]
    for i, (title, ns, text) in enumerate(pages, 1):
        redirect = '<redirect title="X" />' if text.startswith("#REDIRECT") else ""
        out.append(f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>{i}</id>{redirect}"
                   f"<revision><id>{i}</id><model>wikitext</model>"
                   f'<text xml:space="preserve">{escape(text)}</text></revision></page>')
    out.append("</mediawiki>\n")
    return "\n".join(out)


WIKITEXT = """{{Infobox thing|name=Thing}}
'''Thing''' is a [[concept|idea]] in [[philosophy]]<ref>Cited, 2001.</ref> with {{lang|fr|une chose}} flavour.
[[File:Thing.jpg|thumb|A caption with [[link]]]]

Second paragraph about [http://example.com the web] and http://bare.example.com things.
<!-- a comment -->
== History ==
Things have a history.
* A listed fact
* Another fact
{| class="wikitable"
| TABLECELL || more
|}
=== Early ===
Early things.
== References ==
{{reflist}}
REFERENCE BODY TEXT
=== Sub of references ===
NESTED REFERENCE TEXT
== Legacy ==
Things endure.
[[Category:Things]]
[[fr:Chose]]
"""


def cfg_for(tmp_config, tmp_path, raw_dir, **cleaning):
    sections = {"wikipedia": {"raw_dir": str(raw_dir)},
                "cleaning": {"min_chars": 20, "workers": 2, **cleaning}}
    return tmp_config(sections)


def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "data" / "cleaned_articles"


def read_out(path: Path) -> list[str]:
    return list(iter_articles([path]))


def no_partials(directory: Path) -> bool:
    """No temp file of utils.atomic (or the old .partial scheme) is left in directory."""
    return not list(directory.glob(".*tmp-*")) + list(directory.glob(".*partial*")) \
        if directory.exists() else True


def snapshot(directory: Path) -> dict:
    """{name: bytes} of the cleaned outputs in directory."""
    return {p.name: p.read_bytes() for p in sorted(directory.glob("cleaned_*.txt"))}


# --------------------------------------------------------------------------- unit tests
def test_wikitext_to_plain_text():
    text = mediawiki.wikitext_article_text(WIKITEXT, OPTS)
    paras = text.split("\n")
    assert paras[0] == "Thing is a idea in philosophy with une chose flavour."
    assert "Second paragraph about the web and things." in paras
    assert "A listed fact" in paras and "Another fact" in paras
    assert "Things have a history." in paras and "Early things." in paras
    assert paras[-1] == "Things endure."             # section after a dropped one is kept
    for junk in ("REFERENCE", "TABLECELL", "caption", "Category", "Chose", "comment",
                 "History", "[[", "{{", "<ref", "'''", "http"):
        assert junk not in text, junk


def test_keep_headings_only_before_text():
    opts = CleanOptions(drop_sections=OPTS.drop_sections, keep_headings=True)
    paras = mediawiki.wikitext_article_text(WIKITEXT, opts).split("\n")
    assert paras[paras.index("History") + 1] == "Things have a history."
    assert "Early" in paras and "References" not in paras
    empty = "Lead text.\n== Empty ==\n{{only a template}}\n== Full ==\nBody."
    assert mediawiki.wikitext_article_text(empty, opts).split("\n") == ["Lead text.", "Full", "Body."]


def test_unclosed_italics_do_not_hide_reference_sections():
    # mwparserfromhell lets an unclosed '' swallow later headings; they must still count.
    wt = "Intro ''unclosed italics here.\n\n== References ==\nREF TEXT\n== More ==\nMore text."
    text = mediawiki.wikitext_article_text(wt, OPTS)
    assert "REF TEXT" not in text and "More text." in text and "''" not in text


def test_structured_contents_walk():
    text = mediawiki.structured_article_text(ARTICLES[0], OPTS)
    paras = text.split("\n")
    assert paras[0].startswith("A café in Zürich serves crème brûlée.")
    assert unicodedata.is_normalized("NFC", text)
    assert "Coffee houses spread across Europe. 咖啡馆 means café in Chinese." in paras
    assert paras[2:6] == ["The first café opened long ago.", "Espresso bars", "Tea rooms",
                          "Cafés remain popular. A backslash \\ survives too."]
    assert "abstract" not in text          # top-level abstract duplicates the Abstract section
    for junk in ("REFERENCE", "TABLE CELL", "History"):
        assert junk not in text
    # no Abstract section: the abstract is the lead
    assert mediawiki.structured_article_text(ARTICLES[1], OPTS).startswith("Lead only in the abstract")


def test_output_name():
    assert cleaner.output_name(Path("enwiki-x-pages-articles.xml.bz2")) == "cleaned_enwiki-x-pages-articles.txt"
    assert cleaner.output_name(Path("enwiki_namespace_0_0.jsonl")) == "cleaned_enwiki_namespace_0_0.txt"
    assert cleaner.output_name(Path("part.jsonl.bz2")) == "cleaned_part.txt"


def test_xml_pages_namespaces_and_redirects(tmp_path):
    dump = xml_dump([("Good", 0, "Good article text here."), ("Talk:Good", 1, "talk text"),
                     ("Old name", 0, "#REDIRECT [[Good]]"), ("Empty", 0, "{{stub}}")])
    src = tmp_path / "small.xml"
    src.write_text(dump, encoding="utf-8")
    res = cleaner.clean_file(src, tmp_path / "cleaned_small.txt", OPTS)
    assert res.status == "ok" and res.format == "xml"
    assert (res.read, res.kept) == (4, 1)
    assert res.skipped == {"empty": 1, "namespace": 1, "redirect": 1}
    assert read_out(tmp_path / "cleaned_small.txt") == ["Good article text here."]


def test_xml_entities_refused():
    evil = ('<?xml version="1.0"?>\n<!DOCTYPE m [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;">]>\n'
            '<mediawiki><page><title>&b;</title><ns>0</ns></page></mediawiki>')
    with pytest.raises(mediawiki.UnsafeXMLError):
        list(mediawiki.iter_xml_pages(io.BytesIO(evil.encode())))
    external = ('<?xml version="1.0"?>\n<!DOCTYPE m SYSTEM "http://example.com/x.dtd">\n'
                '<mediawiki></mediawiki>')
    with pytest.raises(mediawiki.UnsafeXMLError):
        list(mediawiki.iter_xml_pages(io.BytesIO(external.encode())))


def test_xml_streams_in_chunks():
    dump = xml_dump([(f"P{i}", 0, f"Text of page {i}.") for i in range(50)]).encode()
    pages = list(mediawiki.iter_xml_pages(io.BytesIO(dump), chunk_size=97))
    assert [p.text for p in pages] == [f"Text of page {i}." for i in range(50)]


# --------------------------------------------------------------------------- end to end
def test_clean_enwiki_xml_sample(samples, tmp_config, tmp_path):
    cfg = tmp_config({"wikipedia": {"raw_dir": str(ENWIKI_XML.parent)}})
    proc = run_stage("clean", "--config", cfg, "--workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # One file, two cores: its articles are converted by two processes, in order.
    assert "its articles converted by 2 worker processes" in proc.stdout
    out = out_dir(tmp_path) / "cleaned_enwiki-sample-pages-articles.txt"
    articles = read_out(out)
    assert len(articles) == 106
    anarchism = next(a for a in articles if a.startswith("Anarchism is a political philosophy"))
    assert ("Anarchism is a political philosophy that advocates self-governed societies based "
            "on voluntary institutions.") in anarchism
    assert "\n" in anarchism                                    # paragraph breaks kept
    assert "People Without Government" not in anarchism         # its Further reading section
    text = "\n".join(articles)
    for junk in ("[[", "]]", "{{", "}}", "<ref", "</ref>", "#REDIRECT", "Category:"):
        assert junk not in text, junk
    summary = json.loads((out_dir(tmp_path) / "cleaning_summary.json").read_text())
    totals = summary["totals"]
    assert totals["articles_read"] == 206 and totals["articles_kept"] == 106
    assert totals["skipped"]["redirect"] == 99 and totals["skipped"]["namespace"] == 1
    assert 0 < totals["chars_out"] < totals["chars_in"]
    assert (out_dir(tmp_path) / "resolved_config.json").exists()
    assert "106 kept" in proc.stdout and "articles/s" in proc.stdout

    # A serial run (one process for the file) writes exactly the same bytes.
    serial = tmp_path / "serial"
    proc = run_stage("clean", "--config", cfg, "--workers", "1", "--output-dir", serial)
    assert proc.returncode == 0, proc.stderr
    assert "1 worker process(es), one file each" in proc.stdout
    assert (serial / out.name).read_bytes() == out.read_bytes()


def test_more_workers_than_the_machine_runs_are_capped(tmp_config, tmp_path):
    """--workers 100000 (the run started a million processes and took the machine's memory
    before): capped at 4 per usable CPU, said once, the output as with 1 worker."""
    from utils.cli import WORKERS_PER_CPU
    from utils.processes import available_cpus
    raw = tmp_path / "raw"
    write_jsonl(raw / "enwiki_namespace_0_0.jsonl")
    cfg = cfg_for(tmp_config, tmp_path, raw)
    proc = run_stage("clean", "--config", cfg, "--workers", "100000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    note = f"note: cleaning.workers 100,000 is more than {WORKERS_PER_CPU} per usable CPU: using "
    assert proc.stderr.count(note) == 1 and f"{note}{WORKERS_PER_CPU * available_cpus()}." in proc.stderr
    one = run_stage("clean", "--config", cfg, "--workers", "1", "--output-dir", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    name = "cleaned_enwiki_namespace_0_0.txt"
    assert (out_dir(tmp_path) / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_clean_jsonl_end_to_end_and_rerun(tmp_config, tmp_path):
    raw = tmp_path / "raw"
    write_jsonl(raw / "enwiki_namespace_0_0.jsonl")
    cfg = cfg_for(tmp_config, tmp_path, raw)
    proc = run_stage("clean", "--config", cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = out_dir(tmp_path) / "cleaned_enwiki_namespace_0_0.txt"
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3                                    # "Tiny" is too short
    first = unescape_article(lines[0])
    assert first == mediawiki.structured_article_text(ARTICLES[0], OPTS)
    assert first.count("\n") == 5 and "\\" in first           # breaks and backslash round-trip
    assert "crème brûlée" in first and unicodedata.is_normalized("NFC", first)
    assert "REFERENCE" not in out.read_text(encoding="utf-8")
    # the malformed line is counted and reported as file:line
    assert "enwiki_namespace_0_0.jsonl:3" in proc.stdout
    summary = json.loads((out_dir(tmp_path) / "cleaning_summary.json").read_text())
    assert summary["totals"]["skipped"] == {"malformed": 1, "too_short": 1}
    assert summary["totals"]["articles_read"] == 5

    # a re-run skips the finished input; --force redoes it (via the `cleanup` alias)
    out.write_text("sentinel\n", encoding="utf-8")
    proc = run_stage("clean", "--config", cfg)
    assert proc.returncode == 0 and "exists" in proc.stdout
    assert out.read_text(encoding="utf-8") == "sentinel\n"
    proc = run_stage("cleanup", "--config", cfg, "--force")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3


def test_shard_splits_the_input_files_across_machines(tmp_config, tmp_path):
    """--shard I/N: each "machine" cleans every Nth file by name from the Ith, into one shared
    folder; together they write every output once, each with its own summary."""
    raw = tmp_path / "raw"
    names = [f"part{k}.jsonl" for k in range(1, 6)]
    for name in names:
        write_jsonl(raw / name, bad_lines=())
    cfg = cfg_for(tmp_config, tmp_path, raw)
    written = {}
    for i in (1, 2):
        proc = run_stage("clean", "--config", cfg, "--shard", f"{i}/2")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = json.loads((out_dir(tmp_path) / f"cleaning_summary_shard{i}of2.json").read_text())
        written[i] = [Path(f["input"]).name for f in summary["files"]]
        assert f"Shard {i}/2: {len(written[i])} of the 5 input file(s)" in proc.stdout
    assert written == {1: ["part1.jsonl", "part3.jsonl", "part5.jsonl"], 2: ["part2.jsonl", "part4.jsonl"]}
    assert sorted(p.name for p in out_dir(tmp_path).glob("cleaned_*.txt")) == \
        [cleaner.output_name(Path(n)) for n in names]
    assert not (out_dir(tmp_path) / "cleaning_summary.json").exists()

    proc = run_stage("clean", "--config", cfg, "--shard", "7/9")     # more machines than files
    assert proc.returncode == 0 and "this shard holds none of the input files" in proc.stdout
    for bad in ("0/2", "3/2"):
        proc = run_stage("clean", "--config", cfg, "--shard", bad)
        assert proc.returncode == 2 and "expected I/N with 1 <= I <= N" in proc.stderr, proc.stderr


def test_fewer_files_than_workers_each_get_converters(tmp_config, tmp_path):
    """Two files, four workers: two file processes, each converting with two processes of its
    own; every output byte-identical to a serial run."""
    raw = tmp_path / "raw"
    for name in ("a.jsonl", "b.jsonl"):
        write_jsonl(raw / name, bad_lines=())
    cfg = cfg_for(tmp_config, tmp_path, raw)
    proc = run_stage("clean", "--config", cfg, "--workers", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 worker processes, one file each, each with 2 converter processes" in proc.stdout
    proc = run_stage("clean", "--config", cfg, "--workers", "1", "--output-dir", tmp_path / "serial")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert snapshot(out_dir(tmp_path)) == snapshot(tmp_path / "serial") != {}


def test_min_chars_and_test_limit(tmp_config, tmp_path):
    raw = tmp_path / "raw"
    write_jsonl(raw / "a.jsonl", bad_lines=())
    cfg = cfg_for(tmp_config, tmp_path, raw, test_max_articles=2)
    proc = run_stage("clean", "--config", cfg, "--test", "--min-chars", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_out(out_dir(tmp_path) / "cleaned_a.txt")) == 2
    lengths = sorted(len(mediawiki.structured_article_text(a, OPTS)) for a in ARTICLES)
    threshold = lengths[-2]                          # keeps the two longest articles only
    proc = run_stage("clean", "--config", cfg, "--force", "--min-chars", threshold)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = read_out(out_dir(tmp_path) / "cleaned_a.txt")
    assert sorted(map(len, kept)) == lengths[-2:]
    # nothing long enough at all: a failure, not "0 articles, success"; and the earlier
    # output is not lost (even with --force): it stays byte-identical
    before = snapshot(out_dir(tmp_path))
    proc = run_stage("clean", "--config", cfg, "--force", "--min-chars", "100000")
    assert proc.returncode == 1
    assert "no usable article" in proc.stderr and "min_chars" in proc.stderr
    assert "left as it was" in proc.stdout
    assert snapshot(out_dir(tmp_path)) == before and no_partials(out_dir(tmp_path))


def test_truncated_bz2_fails_only_that_file(tmp_config, tmp_path):
    raw = tmp_path / "raw"
    write_jsonl(raw / "good.jsonl", bad_lines=())
    data = bz2.compress(xml_dump([(f"P{i}", 0, f"Page {i} text. " * 50) for i in range(200)]).encode())
    (raw / "broken-pages-articles.xml.bz2").write_bytes(data[: len(data) // 2])
    proc = run_stage("clean", "--config", cfg_for(tmp_config, tmp_path, raw))
    assert proc.returncode == 1
    assert "broken-pages-articles.xml.bz2" in proc.stderr and "truncated" in proc.stderr
    assert not (out_dir(tmp_path) / "cleaned_broken-pages-articles.txt").exists()
    assert no_partials(out_dir(tmp_path))
    # the surviving output is complete and identical to a run on the good file alone
    alone = tmp_path / "alone"
    proc = run_stage("clean", "--config", cfg_for(tmp_config, tmp_path, raw / "good.jsonl"),
                    "--output-dir", alone)
    assert proc.returncode == 0, proc.stderr
    good = (out_dir(tmp_path) / "cleaned_good.txt").read_bytes()
    assert good == (alone / "cleaned_good.txt").read_bytes()
    assert len(read_out(out_dir(tmp_path) / "cleaned_good.txt")) == 3


def test_xml_with_entities_refused_end_to_end(tmp_config, tmp_path):
    raw = tmp_path / "raw"
    header = '<?xml version="1.0"?>\n<!DOCTYPE mediawiki [<!ENTITY boom "BOOM">]>\n'
    raw.mkdir()
    (raw / "evil.xml").write_text(xml_dump([("A", 0, "Some text &boom; here.")], header=header))
    proc = run_stage("clean", "--config", cfg_for(tmp_config, tmp_path, raw))
    assert proc.returncode == 1
    assert "evil.xml" in proc.stderr and "DOCTYPE" in proc.stderr
    assert not list(out_dir(tmp_path).glob("cleaned_*")) and no_partials(out_dir(tmp_path))


def test_missing_and_empty_input_dir(tmp_config, tmp_path):
    missing = tmp_path / "nowhere"
    proc = run_stage("clean", "--config", cfg_for(tmp_config, tmp_path, missing))
    assert proc.returncode == 1
    assert str(missing) in proc.stderr and "wikipedia.raw_dir" in proc.stderr and "--input-dir" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_stage("clean", "--config", cfg_for(tmp_config, tmp_path, missing), "--input-dir", empty)
    assert proc.returncode == 1 and "no input files found" in proc.stderr and str(empty) in proc.stderr


@pytest.mark.parametrize("workers, files, sig", [
    ("1", 1, signal.SIGINT), ("2", 1, signal.SIGINT), ("4", 2, signal.SIGINT),
    ("2", 1, signal.SIGTERM), ("4", 2, signal.SIGTERM)],
    ids=["process-per-file", "records-in-parallel", "files-with-converters",
         "records-in-parallel-sigterm", "files-with-converters-sigterm"])
def test_ctrl_c_exits_130_without_partial_output(samples, tmp_config, tmp_path, workers, files, sig):
    """Ctrl-C (SIGINT) or a supervisor's SIGTERM, to the whole process group, mid-run: exit 130,
    no partial output, and no process left hanging (converters included)."""
    raw = ENWIKI_XML.parent
    if files > 1:                                        # the sample under several names
        raw = tmp_path / "raw"
        raw.mkdir()
        for k in range(files):
            (raw / f"{k}-{ENWIKI_XML.name}").symlink_to(ENWIKI_XML)
    cfg = tmp_config({"wikipedia": {"raw_dir": str(raw)}})
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "clean", "--config", str(cfg),
                             "--workers", workers],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=offline_env(), cwd=ROOT, start_new_session=True,
                            preexec_fn=default_signals)   # as a terminal would, even under nohup
    assert proc.stdout.readline().startswith(f"Cleaning {files} of {files}")
    # wait until the file is being written and every process is up: stage, file processes,
    # converters (main.py -> stage -> ...)
    processes = 1 + {("1", 1): 1, ("2", 1): 2, ("4", 2): 2 + 2 * 2}[workers, files]
    deadline = time.monotonic() + 60
    while not list(out_dir(tmp_path).glob(".*tmp-*")) or len(descendants(proc.pid)) < processes:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    tree = descendants(proc.pid)
    os.killpg(proc.pid, sig)                         # what Ctrl-C in a terminal does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    out = out_dir(tmp_path)
    assert not list(out.glob("cleaned_*")) and no_partials(out)
    deadline = time.monotonic() + 20                 # nothing left behind, even orphaned
    while (alive := [p for p in tree if Path(f"/proc/{p}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"processes left running: {alive}"


@pytest.mark.parametrize("workers, files", [("2", 1), ("4", 2)],
                         ids=["records-in-parallel", "files-with-converters"])
def test_stage_killed_with_sigkill_leaves_no_worker_running(samples, tmp_config, tmp_path, workers, files):
    """The stage itself killed with SIGKILL mid-run (the out-of-memory killer, `kill -9`, a
    supervisor after its grace period), which it cannot catch to stop its workers: every worker
    process dies with it (they ran on, orphaned, before), main.py says how the stage ended, and
    file workers, which get SIGTERM, remove their temp files."""
    raw = ENWIKI_XML.parent
    if files > 1:
        raw = tmp_path / "raw"
        raw.mkdir()
        for k in range(files):
            (raw / f"{k}-{ENWIKI_XML.name}").symlink_to(ENWIKI_XML)
    cfg = tmp_config({"wikipedia": {"raw_dir": str(raw)}})
    err_file = tmp_path / "stderr.txt"
    below: list[int] = []
    with err_file.open("w") as err_out:                  # a file: orphans would hold a pipe open
        proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "clean", "--config", str(cfg),
                                 "--workers", workers], stdout=subprocess.PIPE, stderr=err_out, text=True,
                                env=offline_env(), cwd=ROOT, start_new_session=True,
                                preexec_fn=default_signals)
    try:
        assert proc.stdout.readline().startswith(f"Cleaning {files} of {files}")
        workers_up = {("2", 1): 2, ("4", 2): 2 + 2 * 2}[workers, files]   # below the stage
        deadline = time.monotonic() + 60
        while not list(out_dir(tmp_path).glob(".*tmp-*")) or len(descendants(proc.pid)) < 1 + workers_up:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        (stage,) = child_pids(proc.pid)
        below = descendants(stage)
        assert len(below) == workers_up
        os.kill(stage, signal.SIGKILL)
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
        deadline = time.monotonic() + 20
        while (alive := [p for p in below if Path(f"/proc/{p}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, f"worker processes left running after the stage was killed: {alive}"
    finally:
        for pid in [proc.pid] + below:                   # nothing outlives a failed test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
        proc.stdout.close()
    assert "Stage 'clean' was killed by SIGKILL (exit 137)" in err_file.read_text()
    if files > 1:                                    # the files were the workers' to write
        assert not list(out_dir(tmp_path).glob("cleaned_*")) and no_partials(out_dir(tmp_path))


@pytest.mark.skipif(cleaner.mp.get_start_method() != "fork", reason="patches the forked worker")
def test_dead_worker_fails_its_file_only(tmp_path, monkeypatch):
    good, bad = write_jsonl(tmp_path / "good.jsonl", bad_lines=()), write_jsonl(tmp_path / "bad.jsonl")
    real = cleaner.clean_file

    def flaky(inp, out, opts, progress=None):
        if Path(inp).name == "bad.jsonl":
            os._exit(3)                      # as if killed (e.g. out of memory)
        return real(inp, out, opts, progress)

    monkeypatch.setattr(cleaner, "clean_file", flaky)
    tasks = [(str(p), str(tmp_path / cleaner.output_name(p)), OPTS) for p in (good, bad)]
    good_result, bad_result = cleaner.run_workers(tasks, workers=2)
    assert good_result.status == "ok" and good_result.kept == 4
    assert bad_result.status == "failed" and "exit code 3" in bad_result.error
    assert not (tmp_path / "cleaned_bad.txt").exists() and no_partials(tmp_path)


def descendants(pid: int) -> list[int]:
    kids = child_pids(pid)
    return kids + [d for k in kids for d in descendants(k)]


def _die(records):
    os._exit(3)                              # as if killed (e.g. out of memory)


@pytest.mark.skipif(cleaner.mp.get_start_method() != "fork", reason="patches the forked worker")
def test_dead_record_worker_fails_the_file_not_hangs(tmp_path, monkeypatch):
    """Records converted in parallel: a converter process that dies fails the file cleanly."""
    src = write_jsonl(tmp_path / "bad.jsonl")
    monkeypatch.setattr(cleaner, "_convert_batch", _die)
    opts = dataclasses.replace(OPTS, record_workers=2)
    result = cleaner.clean_file(src, tmp_path / "cleaned_bad.txt", opts)
    assert result.status == "failed" and "worker process died" in result.error
    assert not (tmp_path / "cleaned_bad.txt").exists() and no_partials(tmp_path)
