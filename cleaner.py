"""Stage `clean` (alias `cleanup`): Wikipedia dumps -> cleaned articles, one per line.

    python main.py clean                       # every dump in wikipedia.raw_dir
    python main.py clean --test                # first cleaning.test_max_articles per file
    python main.py clean --input-dir data/samples/enwiki --force

Input: a folder of dumps; the format of each file is detected from its first bytes:

- Wikimedia Enterprise structured-contents JSONL (``*.jsonl``, ``*.json``, ``*.jsonl.bz2``):
  one article per line with ``name``, ``abstract`` and ``sections``, a tree of parts
  ``{type, name, value, has_parts}``. Text comes from ``paragraph`` and ``list_item`` values
  walked in document order through nested parts. The top-level ``abstract`` is used as
  the lead paragraph only when no section is named "Abstract" (which holds the same text).
- MediaWiki pages-articles XML (``*.xml``, ``*.xml.bz2``): parsed streaming with expat;
  a DOCTYPE (and so any entity declaration) is refused, so no entity is ever expanded and no
  external resource is fetched. Only pages in ``wikipedia.namespaces`` are kept, redirects
  are skipped, and wikitext becomes plain text with mwparserfromhell: templates, <ref>s,
  tables, files/images, categories, interlanguage links, comments and math are dropped; the
  visible text of links and formatting is kept (plus a few inline templates whose text is
  prose: lang, nowrap, convert).

Cleaning (both formats): Unicode normalization (``cleaning.unicode_normalization``), sections
whose title is in ``cleaning.drop_sections`` are dropped with everything under them
(case-insensitive), whitespace inside a paragraph is collapsed to single spaces, and
paragraphs are joined with "\\n". Headings are dropped by default (``cleaning.keep_headings``
keeps each as its own paragraph, but only when some text follows it). The article title is
not added to the text. Articles shorter than ``cleaning.min_chars`` are dropped.

Output: ``<cleaning.output_dir or paths.cleaned_dir>/cleaned_<input stem>.txt``, one article
per line in the reversible format of :mod:`utils.textio` (paragraph breaks as ``\\n``). Each
file is written to a hidden temp file and renamed when its input is finished, so a
``cleaned_*.txt`` file is always complete. A re-run skips inputs whose output exists unless
``--force``. Next to the outputs: ``resolved_config.json`` and ``cleaning_summary.json``.

Parallelism (``--workers``, 0 = all cores), streaming either way: with at least as many input
files as workers, one worker process per file; with fewer (a single big XML dump is the usual
download), files are read one after another here and each file's articles are converted by
all workers, in order, so the output is byte-identical to a serial run. A broken input
(truncated .bz2, invalid XML, a worker killed) fails only that file, and a malformed JSON line
is counted and skipped. ``--test`` reads only the first
``cleaning.test_max_articles`` records (pages or lines, redirects included) of each file.
Exit 1 if any file failed or no usable article came out at all; 130 on Ctrl-C (workers are
terminated and their temp files removed).
"""
from __future__ import annotations

import bz2
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import time
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Iterable, Iterator, Optional, Sequence
from xml.parsers import expat

import mwparserfromhell
import mwparserfromhell.nodes as mw

from utils.atomic import write_json_atomic
from utils.cli import PipelineError, StageParser, cli_path, run_stage, workers_or_cores
from utils.config import Config, ConfigError
from utils.parallel import ordered_map
from utils.textio import escape_article

INPUT_SUFFIXES = (".jsonl", ".json", ".xml", ".bz2")   # files considered in the input folder
STRIP_SUFFIXES = (".bz2", ".jsonl", ".json", ".xml")   # removed from the name for the output
SUMMARY_FILE = "cleaning_summary.json"
MAX_REPORTED_PROBLEMS = 5     # malformed lines / articles listed per file
PROGRESS_SECONDS = 0.5        # seconds between progress messages from a worker
READ_CHUNK = 1 << 20          # bytes per XML parser feed


class InputFormatError(Exception):
    """An input file that cannot be read as a dump (fails that file only)."""


class UnsafeXMLError(InputFormatError):
    """An XML file with a DOCTYPE / entity declaration: refused, never expanded."""


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class CleanOptions:
    """Everything a worker needs to clean one file (picklable, no Config object)."""
    drop_sections: tuple = ()
    normalization: str = "NFC"
    min_chars: int = 0
    keep_headings: bool = False
    namespaces: tuple = (0,)
    skip_redirects: bool = True
    max_articles: Optional[int] = None   # --test: stop after this many records per file
    record_workers: int = 1              # processes converting the records of one file

    @classmethod
    def from_config(cls, cfg: Config) -> "CleanOptions":
        c, w = cfg.cleaning, cfg.wikipedia
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in w.namespaces):
            raise ConfigError([f"wikipedia.namespaces: expected a list of namespace numbers "
                               f"(0 = articles), got {json.dumps(w.namespaces)}"])
        return cls(drop_sections=tuple(section_key(s) for s in c.drop_sections),
                   normalization=c.unicode_normalization, min_chars=c.min_chars,
                   keep_headings=c.keep_headings, namespaces=tuple(int(n) for n in w.namespaces),
                   skip_redirects=w.skip_redirects,
                   max_articles=c.test_max_articles if cfg.test else None)


@dataclass
class FileResult:
    """What happened to one input file; summed into the run summary."""
    input: str
    output: str
    status: str = "ok"            # ok | failed | no_output | exists
    format: str = ""
    read: int = 0
    kept: int = 0
    skipped: dict = field(default_factory=dict)
    chars_in: int = 0
    chars_out: int = 0
    seconds: float = 0.0
    error: str = ""
    problems: list = field(default_factory=list)   # first few "file:line: reason"


# --------------------------------------------------------------------------- text helpers
_WS = re.compile(r"\s+")
_EMPTY_PARENS = re.compile(r"\(\s*(?:[,;:]\s*)*\)")
_PAREN_OPEN_PUNCT = re.compile(r"\(\s*[,;:]\s*")     # "(; born 1950" -> "(born 1950"
_PAREN_CLOSE_PUNCT = re.compile(r"\s*[,;:]\s*\)")    # "Akhilleus, )" -> "Akhilleus)"
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?])(?=\s|$)")


def section_key(title: str) -> str:
    """Canonical form of a section title for matching: whitespace-collapsed, casefolded."""
    return " ".join(str(title).split()).casefold()


def normalize_unicode(text: str, form: str) -> str:
    """Apply the configured normalization form ("NFC", "NFKC" or "none")."""
    return text if form == "none" else unicodedata.normalize(form, text)


def clean_paragraph(text: str, form: str = "NFC") -> str:
    """Normalize Unicode, collapse runs of whitespace (newlines included) to one space,
    and tidy what removed markup leaves behind: empty parentheses, spaces before punctuation."""
    text = normalize_unicode(text, form)
    text = _WS.sub(" ", text).strip()
    if "(" in text:
        text = _EMPTY_PARENS.sub("", text)
        text = _PAREN_CLOSE_PUNCT.sub(")", _PAREN_OPEN_PUNCT.sub("(", text))
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return _WS.sub(" ", text).strip()


class ArticleBuilder:
    """Collects an article's paragraphs while tracking sections.

    ``heading(level, title)`` opens a section; a section whose title is in ``drop`` is
    dropped with everything under it until a heading of the same or a higher level.
    With ``keep_headings`` a heading becomes a paragraph only once text follows it, so
    a section left empty by cleaning leaves no orphan title.
    """

    def __init__(self, opts: CleanOptions):
        self.opts = opts
        self.drop = set(opts.drop_sections)
        self.paragraphs: list[str] = []
        self._drop_level: Optional[int] = None
        self._pending: list[tuple[int, str]] = []   # (level, title) headings awaiting text

    def heading(self, level: int, title: str) -> None:
        if self._drop_level is not None and level <= self._drop_level:
            self._drop_level = None
        if self._drop_level is not None:
            return
        if section_key(title) in self.drop:
            self._drop_level = level
            return
        self._pending = [(lv, t) for lv, t in self._pending if lv < level]
        title = clean_paragraph(title, self.opts.normalization)
        if title:
            self._pending.append((level, title))

    def end_section(self, level: int) -> None:
        """Close a section (nested formats): ends a drop started at this level."""
        if self._drop_level is not None and level <= self._drop_level:
            self._drop_level = None
        self._pending = [(lv, t) for lv, t in self._pending if lv < level]

    @property
    def dropping(self) -> bool:
        return self._drop_level is not None

    def add_text(self, text: str) -> None:
        """Add raw text; blank lines split it into paragraphs, other whitespace collapses."""
        if self.dropping or not text:
            return
        for block in re.split(r"\n\s*\n", text):
            para = clean_paragraph(block, self.opts.normalization)
            if para:
                if self.opts.keep_headings:
                    self.paragraphs.extend(t for _, t in self._pending)
                self._pending = []
                self.paragraphs.append(para)

    def text(self) -> str:
        return "\n".join(self.paragraphs)


# --------------------------------------------------------------------------- JSONL
SKIP_PART_TYPES = {"table", "image", "infobox", "reference", "references", "citation", "math"}
TEXT_PART_TYPES = {"paragraph", "list_item"}


def _walk_parts(parts: Iterable, builder: ArticleBuilder, level: int) -> None:
    """Depth-first walk of structured-contents parts, in document order."""
    for part in parts or ():
        if not isinstance(part, dict):
            continue
        kind = str(part.get("type", "")).lower()
        if kind in SKIP_PART_TYPES:
            continue
        if kind == "section":
            name = part.get("name") or ""
            # The lead section is called "Abstract" in Enterprise dumps: not a real heading.
            builder.heading(level, "" if section_key(name) == "abstract" else str(name))
            _walk_parts(part.get("has_parts"), builder, level + 1)
            builder.end_section(level)
            continue
        value = part.get("value")
        if kind in TEXT_PART_TYPES and isinstance(value, str):
            builder.add_text(value + "\n\n")
        _walk_parts(part.get("has_parts"), builder, level)


def structured_article_text(article: dict, opts: CleanOptions) -> str:
    """Cleaned text of one Wikimedia Enterprise structured-contents article."""
    builder = ArticleBuilder(opts)
    sections = article.get("sections") or []
    abstract = article.get("abstract")
    has_abstract_section = any(isinstance(s, dict) and section_key(s.get("name") or "") == "abstract"
                               for s in sections)
    if isinstance(abstract, str) and not has_abstract_section:
        builder.add_text(abstract + "\n\n")
    _walk_parts(sections, builder, level=2)
    return builder.text()


# --------------------------------------------------------------------------- wikitext
DROP_TAGS = {"ref", "references", "table", "gallery", "math", "chem", "ce", "score", "timeline",
             "imagemap", "templatedata", "graph", "mapframe", "maplink", "syntaxhighlight",
             "source", "hiero", "inputbox", "categorytree", "noinclude", "includeonly"}
BREAK_TAGS = {"p", "div", "hr", "blockquote", "li", "dd", "dt", "ul", "ol", "dl", "center"}
DROP_LINK_NAMESPACES = {"file", "image", "media", "category"}
INLINE_TEMPLATES = {"nowrap", "nobr", "small", "smaller", "big", "linktext", "nobold", "noitalic"}
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]+)*$|^simple$")


def _template_text(tpl) -> str:
    """Visible text of the few inline templates that carry prose; '' for all others."""
    name = str(tpl.name).strip().lower().replace("_", " ")

    def param(i: int) -> str:
        key = str(i)
        return wikicode_text(tpl.get(key).value.nodes).strip() if tpl.has(key) else ""

    if name in INLINE_TEMPLATES:
        return param(1)
    if name == "lang":
        return param(2)
    if name.startswith("lang-"):
        return param(1)
    if name in ("convert", "cvt") and param(1):
        unit = param(2)
        return f"{param(1)} {unit}" if unit and unit.isalpha() else param(1)
    return ""


def _link_text(link) -> str:
    """Visible text of a [[wikilink]], or '' for files, categories and interlanguage links."""
    title = str(link.title).strip()
    colon_prefixed = title.startswith(":")      # [[:Category:X]] links to the page, shows text
    title = title.lstrip(":")
    prefix = title.split(":", 1)[0].strip().lower() if ":" in title else ""
    if not colon_prefixed and prefix in DROP_LINK_NAMESPACES:
        return ""
    if link.text is None:
        if not colon_prefixed and prefix and _LANG_PREFIX.match(prefix):
            return ""   # [[fr:Anarchisme]]: an interlanguage link, not text
        return title
    text = wikicode_text(link.text.nodes)
    if not text.strip():                        # pipe trick [[Foo (bar)|]] shows "Foo"
        return re.sub(r"\s*\(.*?\)\s*$", "", title.split(":", 1)[-1])
    return text


@dataclass(frozen=True)
class HeadingMark:
    """A section heading met while rendering wikitext (see :func:`render_wikicode`)."""
    level: int
    title: str


def render_wikicode(nodes, out: list) -> None:
    """Render mwparserfromhell nodes into ``out``: plain-text strings, plus a HeadingMark
    wherever a heading occurs, even nested (an unclosed '' can swallow later headings)."""
    for node in nodes:
        if isinstance(node, mw.Text):
            out.append(node.value)
        elif isinstance(node, mw.Wikilink):
            out.append(_link_text(node))
        elif isinstance(node, mw.Tag):
            tag = str(node.tag).strip().lower()
            markup = node.wiki_markup
            if tag in DROP_TAGS:
                continue
            if markup in ("*", "#", ";", ":", "----"):
                out.append("\n\n")              # list item / indent / rule: new paragraph
            elif tag == "br":
                out.append(" ")
            elif tag in BREAK_TAGS:
                out.append("\n\n")
            if node.contents is not None and not node.self_closing:
                render_wikicode(node.contents.nodes, out)
                if tag in BREAK_TAGS:
                    out.append("\n\n")
        elif isinstance(node, mw.HTMLEntity):
            out.append(node.normalize())
        elif isinstance(node, mw.ExternalLink):
            if node.title is not None:
                render_wikicode(node.title.nodes, out)
        elif isinstance(node, mw.Template):
            out.append(_template_text(node))
        elif isinstance(node, mw.Heading):
            out.append(HeadingMark(node.level, wikicode_text(node.title.nodes)))
        # Comment, Argument ({{{1}}}) and anything else: dropped


def wikicode_text(nodes) -> str:
    """Plain text of mwparserfromhell nodes (a heading inside becomes its own paragraph)."""
    out: list = []
    render_wikicode(nodes, out)
    return "".join(f"\n\n{x.title}\n\n" if isinstance(x, HeadingMark) else x for x in out)


def wikitext_article_text(wikitext: str, opts: CleanOptions) -> str:
    """Cleaned plain text of one article's wikitext (sections tracked through headings)."""
    builder = ArticleBuilder(opts)
    pieces: list = []
    render_wikicode(mwparserfromhell.parse(wikitext).nodes, pieces)
    run: list[str] = []          # text since the last heading
    for piece in pieces:
        if isinstance(piece, HeadingMark):
            builder.add_text(strip_leftover_markup("".join(run)))
            run = []
            builder.heading(piece.level, strip_leftover_markup(piece.title))
        else:
            run.append(piece)
    builder.add_text(strip_leftover_markup("".join(run)))
    return builder.text()


# Leftovers of constructs mwparserfromhell could not parse (it keeps them as plain text,
# e.g. a table with broken quoting or a bold/italic run that never closes).
_LEFTOVER_HINT = re.compile(r"\[\[|\{\{|\{\||<|''|^\s*\|", re.M)
_LEFTOVER_SUBS = [
    (re.compile(r"<!--.*?(?:-->|$)", re.S), ""),
    (re.compile(r"<ref[^<>]*/>|<ref[^<>]*>.*?</ref>", re.S | re.I), ""),
    (re.compile(r"^\{\|.*?^\|\}", re.S | re.M), "\n\n"),          # a whole table
    (re.compile(r"^[ \t]*(?:\{\||\|).*$", re.M), ""),                # stray table rows
]
_LEFTOVER_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_LEFTOVER_FILE_LINK = re.compile(r"\[\[\s*(?:file|image|media|category)\s*:[^\[\]]*\]\]", re.I)
_LEFTOVER_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*(?:\s[^<>]*)?/?>")
_LEFTOVER_QUOTES = re.compile(r"'{2,}")


def strip_leftover_markup(text: str) -> str:
    """Regex fallback for wikitext that survived parsing as plain text: refs, templates,
    tables, file/category links and tags are dropped, [[link|text]] becomes text."""
    if not _LEFTOVER_HINT.search(text):
        return text
    for pattern, repl in _LEFTOVER_SUBS:
        text = pattern.sub(repl, text)
    for _ in range(20):                      # innermost first, until nothing nested is left
        new = _LEFTOVER_TEMPLATE.sub("", text)
        new = _LEFTOVER_FILE_LINK.sub("", new)
        new = _LEFTOVER_LINK.sub(r"\1", new)
        if new == text:
            break
        text = new
    text = _LEFTOVER_TAG.sub("", text)
    return _LEFTOVER_QUOTES.sub("", text)


def is_redirect_text(wikitext: str) -> bool:
    """True for '#REDIRECT [[Target]]' pages (when the dump has no <redirect> element)."""
    return wikitext.lstrip()[:9].upper() == "#REDIRECT"


# --------------------------------------------------------------------------- reading files
def open_binary(path: Path) -> IO[bytes]:
    """Open a dump for streaming reads, decompressing .bz2 on the fly."""
    if path.suffix.lower() == ".bz2":
        return bz2.open(path, "rb")
    return open(path, "rb")


def detect_format(path: Path) -> str:
    """'jsonl' or 'xml' from the first non-blank bytes of the (decompressed) content."""
    with open_binary(path) as f:
        head = f.read(4096)
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"<"):
        return "xml"
    if head.startswith(b"{"):
        return "jsonl"
    if not head:
        raise InputFormatError("the file is empty")
    raise InputFormatError("not a Wikipedia dump: expected MediaWiki XML (starting with '<') "
                           "or structured-contents JSONL (one JSON object per line)")


@dataclass
class Page:
    """One <page> of a MediaWiki XML dump."""
    title: str = ""
    ns: int = 0
    redirect: bool = False
    text: str = ""


def iter_xml_pages(stream: IO[bytes], chunk_size: int = READ_CHUNK) -> Iterator[Page]:
    """Stream <page>s out of a MediaWiki XML dump, safely.

    expat is fed fixed-size chunks; only completed pages are held in memory. A DOCTYPE,
    and with it every entity declaration, is refused (UnsafeXMLError), so no entity is
    expanded and no external entity is resolved. Malformed XML raises expat.ExpatError.
    """
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    done: list[Page] = []
    page: Optional[Page] = None
    stack: list[str] = []
    buf: list[str] = []

    def refuse(*_):
        raise UnsafeXMLError("the XML declares a DOCTYPE or entities; refused for safety "
                             "(MediaWiki dumps never need them)")

    def start(name, attrs):
        nonlocal page
        stack.append(name)
        if name == "page":
            page = Page()
        elif page is not None and name == "redirect":
            page.redirect = True
        buf.clear()

    def end(name):
        nonlocal page
        stack.pop()
        if page is not None:
            parent = stack[-1] if stack else ""
            if name == "title" and parent == "page":
                page.title = "".join(buf)
            elif name == "ns" and parent == "page":
                try:
                    page.ns = int("".join(buf).strip())
                except ValueError:
                    page.ns = -999
            elif name == "text" and parent == "revision":
                page.text = "".join(buf)
            elif name == "page":
                done.append(page)
                page = None
        buf.clear()

    def chars(data):
        if page is not None and stack and stack[-1] in ("title", "ns", "text"):
            buf.append(data)

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.UnparsedEntityDeclHandler = refuse
    parser.ExternalEntityRefHandler = refuse
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = chars
    parser.buffer_text = True
    while True:
        chunk = stream.read(chunk_size)
        parser.Parse(chunk, not chunk)
        yield from done
        done.clear()
        if not chunk:
            break
    if parser.ErrorCode:  # pragma: no cover - expat raises before this
        raise expat.ExpatError(expat.ErrorString(parser.ErrorCode))


def _iter_raw(path: Path, fmt: str, opts: CleanOptions, result: FileResult,
              problem) -> Iterator[tuple[object, str]]:
    """Yield ``(record, where)`` for each record of one file that passes the cheap filters
    (namespace, redirect, JSON validity); the expensive text conversion happens later."""
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
                try:
                    article = json.loads(raw)
                except json.JSONDecodeError as e:
                    problem(str(lineno), f"invalid JSON: {e.msg} at character {e.pos + 1}")
                    continue
                except ValueError:
                    problem(str(lineno), "not valid UTF-8")
                    continue
                if not isinstance(article, dict):
                    problem(str(lineno), f"expected a JSON object, got {type(article).__name__}")
                    continue
                result.chars_in += len(raw.decode("utf-8", "replace").rstrip("\r\n"))
                yield article, str(lineno)
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


def convert_record(fmt: str, record, opts: CleanOptions) -> tuple[str, Optional[str]]:
    """A record's cleaned text, or ``("", reason)`` when its wikitext cannot be parsed (a
    parser failure on one page must not end the file). JSONL records cannot fail here."""
    if fmt == "jsonl":
        return structured_article_text(record, opts), None
    try:
        return wikitext_article_text(record, opts), None
    except Exception as e:
        return "", f"wikitext could not be parsed ({type(e).__name__}: {e})"


_CONVERTER: dict = {}


def _init_converter(fmt: str, opts: CleanOptions) -> None:
    """Pool initializer for record conversion; Ctrl-C is the parent's job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _CONVERTER.update(fmt=fmt, opts=opts)


def _convert_batch(records: list) -> list[tuple[str, Optional[str]]]:
    return [convert_record(_CONVERTER["fmt"], r, _CONVERTER["opts"]) for r in records]


def _converted_in_parallel(raw: Iterator[tuple[object, str]], fmt: str, opts: CleanOptions,
                           batch: int = 16) -> Iterator[tuple[tuple[str, Optional[str]], str]]:
    """Convert records in ``opts.record_workers`` processes, in input order, ``batch`` records
    per task (utils.parallel.ordered_map: bounded in flight, so memory does not grow with the
    file). A worker that dies (killed, out of memory) raises BrokenProcessPool here, which
    fails this file."""
    batches = iter(lambda: [r for _, r in zip(range(batch), raw)], [])
    for chunk, texts in ordered_map(_convert_batch, batches, opts.record_workers,
                                    arg=lambda chunk: [record for record, _ in chunk],
                                    initializer=_init_converter, initargs=(fmt, opts)):
        yield from zip(texts, (where for _, where in chunk))


def iter_records(path: Path, fmt: str, opts: CleanOptions, result: FileResult) -> Iterator[str]:
    """Yield the cleaned text of each usable record of one file (possibly '').

    Counts reads, characters in and skip reasons into ``result`` (whose ``skipped`` is a
    Counter); malformed records are counted, the first few reported as ``file:line``
    (JSONL) or ``file:title`` (XML), and skipped. With ``opts.record_workers > 1`` the text
    conversion (the expensive part: wikitext parsing) runs in that many processes, in order,
    so the output is identical to a serial run.
    """
    def problem(where: str, reason: str) -> None:
        result.skipped["malformed"] += 1
        if len(result.problems) < MAX_REPORTED_PROBLEMS:
            result.problems.append(f"{path.name}:{where}: {reason}")

    raw = _iter_raw(path, fmt, opts, result, problem)
    if opts.record_workers > 1:
        converted = _converted_in_parallel(raw, fmt, opts)
    else:
        converted = ((convert_record(fmt, record, opts), where) for record, where in raw)
    for (text, error), where in converted:
        if error:
            problem(where, error)
            continue
        yield text


# --------------------------------------------------------------------------- one file
_PROGRESS = None   # the parent's message queue in worker processes, None in-process


def _report(n: int) -> None:
    """Tell the parent that n more records were read (for the articles/s bar)."""
    if _PROGRESS is not None and n:
        _PROGRESS.put(("progress", None, n))


def _worker_main(index: int, task: tuple, messages) -> None:
    """Worker process: clean one file and send its FileResult back.

    Ctrl-C is ignored here: the parent handles it by terminating workers and removing
    their temp files, so a worker is never killed halfway through a rename.
    """
    global _PROGRESS
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _PROGRESS = messages
    messages.put(("done", index, clean_file(*task)))


def temp_path(output: Path) -> Path:
    """The hidden temp name an output is written under until complete (never cleaned_*.txt)."""
    return output.with_name(f".{output.name}.partial")


def clean_file(input_path: str | Path, output_path: str | Path, opts: CleanOptions) -> FileResult:
    """Clean one dump into one output file, atomically.

    Never raises for bad input: the returned FileResult says ``failed`` with a message
    instead, and no output (not even a partial temp file) is left for that input.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    result = FileResult(input=str(input_path), output=str(output_path), skipped=Counter())
    tmp = temp_path(output_path)
    start = last_report = time.time()
    reported = 0
    try:
        result.format = detect_format(input_path)
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            for text in iter_records(input_path, result.format, opts, result):
                if not text:
                    result.skipped["empty"] += 1
                elif len(text) < opts.min_chars:
                    result.skipped["too_short"] += 1
                else:
                    out.write(escape_article(text) + "\n")
                    result.kept += 1
                    result.chars_out += len(text)
                if time.time() - last_report >= PROGRESS_SECONDS:
                    _report(result.read - reported)
                    reported, last_report = result.read, time.time()
        if result.read == 0:
            bad = result.skipped.get("malformed", 0)
            raise InputFormatError(f"no articles found ({bad} malformed record(s))" if bad
                                   else "no articles found")
        if result.kept == 0:          # nothing usable: no (stale) output for this input
            result.status = "no_output"
            tmp.unlink(missing_ok=True)
            output_path.unlink(missing_ok=True)
        else:
            os.replace(tmp, output_path)
    except BaseException as e:        # KeyboardInterrupt included: never leave a temp file
        tmp.unlink(missing_ok=True)
        if not isinstance(e, Exception):
            raise
        result.status = "failed"
        result.error = describe_error(e)
    finally:
        _report(result.read - reported)
        result.seconds = round(time.time() - start, 3)
        result.skipped = dict(sorted(result.skipped.items()))
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
        return f"cannot read the file ({e.strerror or e})"
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- the run
def find_inputs(input_dir: Path) -> list[Path]:
    """Dump files in a folder (or the one file given), sorted by name; hidden files ignored."""
    if input_dir.is_file():
        return [input_dir]
    return sorted(p for p in input_dir.iterdir()
                  if p.is_file() and not p.name.startswith(".")
                  and p.name.lower().endswith(INPUT_SUFFIXES))


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


class _BarFeed:
    """Stands in for the workers' message queue when files are cleaned in this process."""

    def __init__(self, bar):
        self.bar = bar

    def put(self, message) -> None:
        self.bar.update(message[2])


def run_in_process(tasks: list[tuple], workers: int) -> list[FileResult]:
    """Fewer files than cores (e.g. one big XML dump): clean one file at a time here, each
    file's records converted by ``workers`` processes (in order: same output as serial)."""
    global _PROGRESS
    from tqdm import tqdm

    bar = tqdm(total=None, unit=" articles", desc="cleaning", dynamic_ncols=True, mininterval=0.5)
    _PROGRESS = _BarFeed(bar)
    results = []
    try:
        for i, (inp, out, opts) in enumerate(tasks):
            results.append(clean_file(inp, out, replace(opts, record_workers=workers)))
            bar.set_postfix(files=f"{i + 1}/{len(tasks)}", refresh=False)
        return results
    finally:
        _PROGRESS = None
        bar.close()


def run_workers(tasks: list[tuple], workers: int) -> list[FileResult]:
    """Clean files in parallel, one worker process per input file, at most ``workers`` at
    a time, with one tqdm bar (articles/s) for the whole run.

    A worker that dies without reporting (killed, out of memory) fails its file only.
    On Ctrl-C every worker is terminated and its temp file removed before re-raising.
    """
    from tqdm import tqdm

    ctx = mp.get_context()
    messages = ctx.Queue()
    todo = list(enumerate(tasks))
    running: dict[int, mp.process.BaseProcess] = {}
    results: dict[int, FileResult] = {}
    bar = tqdm(total=None, unit=" articles", desc="cleaning", dynamic_ncols=True, mininterval=0.5)

    def handle(message) -> None:
        kind, index, payload = message
        if kind == "progress":
            bar.update(payload)
        else:
            results[index] = payload

    try:
        while todo or running:
            while todo and len(running) < workers:
                index, task = todo.pop(0)
                proc = ctx.Process(target=_worker_main, args=(index, task, messages),
                                   name=f"clean-{Path(task[0]).name}", daemon=True)
                proc.start()
                running[index] = proc
            try:
                handle(messages.get(timeout=0.2))
            except queue.Empty:
                pass
            exited = [i for i, proc in running.items() if not proc.is_alive()]
            try:                      # an exited worker's messages are all in the pipe now
                while True:
                    handle(messages.get_nowait())
            except queue.Empty:
                pass
            for index in exited:
                proc = running.pop(index)
                proc.join()
                if index not in results:
                    inp, out, _ = tasks[index]
                    temp_path(Path(out)).unlink(missing_ok=True)
                    results[index] = FileResult(inp, out, status="failed",
                                                error=f"the worker process died (exit code {proc.exitcode}; "
                                                      f"killed or out of memory?)")
            bar.set_postfix(files=f"{len(results)}/{len(tasks)}", refresh=False)
        bar.n = sum(r.read for r in results.values())   # exact, whatever was still queued
        bar.refresh()
        return [results[i] for i in range(len(tasks))]
    except BaseException:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            proc.join()
        for _, output, _ in tasks:
            temp_path(Path(output)).unlink(missing_ok=True)
        raise
    finally:
        bar.close()


def summarize(results: list[FileResult], seconds: float) -> dict:
    """Totals over all files of a run."""
    skipped: Counter = Counter()
    for r in results:
        skipped.update(r.skipped)
    done = [r for r in results if r.status != "exists"]
    return {
        "files": len(results),
        "files_ok": sum(r.status == "ok" for r in results),
        "files_failed": sum(r.status == "failed" for r in results),
        "files_no_output": sum(r.status == "no_output" for r in results),
        "files_already_done": sum(r.status == "exists" for r in results),
        "articles_read": sum(r.read for r in done),
        "articles_kept": sum(r.kept for r in done),
        "skipped": dict(sorted(skipped.items())),
        "chars_in": sum(r.chars_in for r in done),
        "chars_out": sum(r.chars_out for r in done),
        "seconds": round(seconds, 2),
    }


def print_summary(results: list[FileResult], totals: dict) -> None:
    """Human-readable per-file lines and totals."""
    print("\nCleaning summary")
    for r in results:
        name = Path(r.input).name
        if r.status == "exists":
            print(f"  {name}: skipped, {Path(r.output).name} exists (use --force to redo)")
        elif r.status == "failed":
            print(f"  {name}: FAILED: {r.error}")
        else:
            skipped = ", ".join(f"{k} {v:,}" for k, v in r.skipped.items()) or "none"
            where = Path(r.output).name if r.status == "ok" else "no output (nothing kept)"
            print(f"  {name} [{r.format}]: read {r.read:,}, kept {r.kept:,}, skipped: {skipped}"
                  f" -> {where} ({r.seconds:.1f}s)")
        for p in r.problems:
            print(f"      malformed: {p}")
    t = totals
    rate = t["articles_read"] / t["seconds"] if t["seconds"] > 0 else 0.0
    skipped = ", ".join(f"{k} {v:,}" for k, v in t["skipped"].items()) or "none"
    print(f"  total: {t['articles_read']:,} articles read, {t['articles_kept']:,} kept; "
          f"skipped: {skipped}")
    print(f"  characters: {t['chars_in']:,} in -> {t['chars_out']:,} out; "
          f"{t['seconds']:.1f}s ({rate:,.0f} articles/s)")


def build_parser() -> StageParser:
    p = StageParser("main.py clean", "Wikipedia dumps (structured-contents JSONL or MediaWiki XML) "
                                  "-> cleaned articles, one per line")
    p.config_flag("--input-dir", key="wikipedia.raw_dir", type=cli_path, metavar="DIR",
                  help="folder of *.jsonl / *.json / *.xml / *.xml.bz2 dumps (or one file)")
    p.config_flag("--output-dir", key="cleaning.output_dir", type=cli_path, metavar="DIR",
                  help="where cleaned_*.txt go (default paths.cleaned_dir)")
    p.config_flag("--min-chars", key="cleaning.min_chars", type=int, metavar="N",
                  help="drop articles shorter than N characters after cleaning")
    p.config_flag("--workers", key="cleaning.workers", type=int, metavar="N",
                  help="worker processes (0 = all cores): one input file each, or, with fewer files than "
                       "workers, the articles of one file")
    p.add_argument("--force", action="store_true", help="redo inputs whose output already exists")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    input_dir = cfg.path("wikipedia.raw_dir")
    output_dir = cfg.resolve(cfg.cleaning.output_dir) or cfg.path("paths.cleaned_dir")
    if not input_dir.exists():
        raise PipelineError(f"input folder {input_dir} does not exist. Set wikipedia.raw_dir in "
                            f"config.json or pass --input-dir DIR (the offline sample: "
                            f"`python main.py samples`, then --input-dir data/samples/enwiki).")
    inputs = find_inputs(input_dir)
    if not inputs:
        raise PipelineError(f"no input files found in {input_dir} (expected *.jsonl, *.json, "
                            f"*.xml, *.xml.bz2 or *.jsonl.bz2); set wikipedia.raw_dir or --input-dir.")
    outputs = [output_dir / output_name(p) for p in inputs]
    clashes = [o.name for o in set(outputs) if outputs.count(o) > 1]
    if clashes:
        raise PipelineError(f"several inputs would be written to the same output ({', '.join(clashes)}); "
                            f"rename one of them in {input_dir}.")
    output_dir.mkdir(parents=True, exist_ok=True)
    opts = CleanOptions.from_config(cfg)

    results: dict[str, FileResult] = {}
    tasks = []
    for inp, out in zip(inputs, outputs):
        if out.exists() and not args.force:
            results[str(inp)] = FileResult(str(inp), str(out), status="exists")
        else:
            tasks.append((str(inp), str(out), opts))
    tasks.sort(key=lambda t: -Path(t[0]).stat().st_size)   # biggest first: better balance
    workers = workers_or_cores(cfg.cleaning.workers)
    mode = f"test mode, first {opts.max_articles:,} articles per file" if cfg.test else "full run"
    # As many files as cores: one process per file. Fewer (a single big XML dump is the common
    # download): files one after another, each file's records spread over all cores.
    per_file = len(tasks) >= workers or workers == 1
    how = (f"{min(workers, max(1, len(tasks)))} worker process(es), one file each" if per_file
           else f"one file at a time, its articles converted by {workers} worker processes")
    print(f"Cleaning {len(tasks)} of {len(inputs)} file(s) from {input_dir} -> {output_dir} "
          f"({how}; {mode})")

    start = time.time()
    if tasks:
        run = run_workers if per_file else run_in_process
        for r in run(tasks, workers):
            results[r.input] = r
    ordered = [results[str(p)] for p in inputs]
    totals = summarize(ordered, time.time() - start)
    print_summary(ordered, totals)

    cfg.save_resolved(output_dir)
    summary = {"test": cfg.test, "input_dir": str(input_dir), "output_dir": str(output_dir),
               "totals": totals, "files": [asdict(r) for r in ordered]}
    write_json_atomic(output_dir / SUMMARY_FILE, summary)

    failed = [r for r in ordered if r.status == "failed"]
    if failed:
        names = "; ".join(f"{Path(r.input).name}: {r.error}" for r in failed)
        raise PipelineError(f"{len(failed)} of {len(inputs)} input file(s) failed ({names}). "
                            f"Other files were cleaned; fix or remove the failed ones and re-run.")
    if not tasks:
        print(f"Nothing to do: every output exists in {output_dir} (use --force to redo).")
        return 0
    if totals["articles_kept"] == 0:
        skipped = ", ".join(f"{k} {v:,}" for k, v in totals["skipped"].items()) or "none"
        raise PipelineError(f"no usable article came out of {len(tasks)} file(s): all "
                            f"{totals['articles_read']:,} articles read were skipped ({skipped}). "
                            f"Check the inputs, or lower cleaning.min_chars / --min-chars "
                            f"(now {opts.min_chars}).")
    print(f"Wrote {totals['articles_kept']:,} articles to {output_dir}")
    return 0


if __name__ == "__main__":
    run_stage(main)
