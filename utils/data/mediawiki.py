"""Wikipedia dumps as data: reading them and turning one record into an article's clean text.

Library (no side effects); the ``clean`` stage (cleaner.py) runs it over files and workers,
``utils/bench/data.py`` uses it for the held-out perplexity dump.

- Reading: :func:`open_binary` (``.bz2`` decompressed on the fly), :func:`detect_format`
  ('xml' or 'jsonl' from the first bytes), :func:`iter_xml_pages` (MediaWiki XML streamed with
  expat, a fixed-size buffer per feed; a DOCTYPE and so every entity declaration is refused:
  :class:`UnsafeXMLError`), :func:`is_redirect_text`.
- Converting: :class:`CleanOptions` (what the config asks for, picklable for workers),
  :func:`convert_record` (a JSONL line or a page's wikitext -> :class:`Converted`; bad input
  comes back as a reason, an exception of our own as :class:`ConversionBug`),
  :func:`wikitext_article_text`, :func:`structured_article_text`.

Wikitext rendering itself is :mod:`utils.data.wikitext`.
"""
from __future__ import annotations

import bz2
import json
import traceback
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Iterable, Iterator, NamedTuple, Optional
from pathlib import Path
from xml.parsers import expat

from utils.config import Config, ConfigError, json_error_text
from utils.data.wikitext import ArticleBuilder, SectionMatcher, article_text, section_key

READ_CHUNK = 1 << 20          # bytes per XML parser feed
MAX_PART_DEPTH = 200          # structured-contents parts nested deeper: a bad record
REQUIRED_KEYS = {"name": str, "sections": list}   # structured-contents record schema


class InputFormatError(Exception):
    """An input file that cannot be read as a dump (fails that file only)."""


class UnsafeXMLError(InputFormatError):
    """An XML file with a DOCTYPE / entity declaration: refused, never expanded."""


class BadRecord(Exception):
    """One record the input got wrong: skipped and counted, the file goes on."""


class ConversionBug(Exception):
    """Our own conversion raised on a record: a bug to fix, never counted as bad input."""

    def __init__(self, where: str, detail: str, trace: str = ""):
        super().__init__(where, detail, trace)
        self.where, self.detail, self.trace = where, detail, trace

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class CleanOptions:
    """Everything a worker needs to clean one file (picklable, no Config object)."""
    drop_sections: tuple = ()            # section titles as configured (matched by words)
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
        return cls(drop_sections=tuple(str(s) for s in c.drop_sections),
                   normalization=c.unicode_normalization, min_chars=c.min_chars,
                   keep_headings=c.keep_headings, namespaces=tuple(int(n) for n in w.namespaces),
                   skip_redirects=w.skip_redirects,
                   max_articles=c.test_max_articles if cfg.test else None)

    def builder(self) -> ArticleBuilder:
        return ArticleBuilder(_matcher(self.drop_sections), self.normalization, self.keep_headings)


@lru_cache(maxsize=8)
def _matcher(titles: tuple) -> SectionMatcher:
    return SectionMatcher(titles)



class Converted(NamedTuple):
    """One record after conversion (what a worker sends back)."""
    text: str
    bad: Optional[str] = None       # why the record is bad input (then text is "")
    dropped: tuple = ()             # titles of the sections dropped
    repairs: tuple = ()             # kinds of repair made (surrogates, control characters)


# --------------------------------------------------------------------------- JSONL
SKIP_PART_TYPES = {"table", "image", "infobox", "reference", "references", "citation", "math"}
TEXT_PART_TYPES = {"paragraph", "list_item"}


def _walk_parts(parts: Iterable, builder: ArticleBuilder, level: int, depth: int = 0) -> None:
    """Depth-first walk of structured-contents parts, in document order."""
    if depth > MAX_PART_DEPTH:
        raise BadRecord(f"parts nested deeper than {MAX_PART_DEPTH} levels")
    if not isinstance(parts, list):
        return
    for part in parts:
        if not isinstance(part, dict):
            continue
        kind = str(part.get("type", "")).lower()
        if kind in SKIP_PART_TYPES:
            continue
        if kind == "section":
            name = part.get("name") or ""
            # The lead section is called "Abstract" in Enterprise dumps: not a real heading.
            builder.heading(level, "" if section_key(name) == "abstract" else str(name))
            _walk_parts(part.get("has_parts"), builder, level + 1, depth + 1)
            builder.end_section(level)
            continue
        value = part.get("value")
        if kind in TEXT_PART_TYPES and isinstance(value, str):
            builder.add_text(value + "\n\n")
        _walk_parts(part.get("has_parts"), builder, level, depth + 1)


def parse_json_record(raw: bytes) -> dict:
    """One JSONL line -> a structured-contents article; BadRecord says what is wrong."""
    try:
        article = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRecord(f"invalid JSON: {json_error_text(e)} at character {e.pos + 1}") from None
    except UnicodeDecodeError:
        raise BadRecord("not valid UTF-8") from None
    except (ValueError, RecursionError) as e:           # too deep, an integer of 4,300+ digits
        raise BadRecord(f"invalid JSON: {json_error_text(e)}") from None
    if not isinstance(article, dict):
        raise BadRecord(f"expected a JSON object, got {type(article).__name__}")
    for key, kind in REQUIRED_KEYS.items():
        if key not in article:
            raise BadRecord(f"missing required key '{key}'")
        if not isinstance(article[key], kind):
            raise BadRecord(f"key '{key}' must be a {'string' if kind is str else 'list'}, "
                            f"got {type(article[key]).__name__}")
    return article


def _structured(article: dict, builder: ArticleBuilder) -> str:
    sections = article.get("sections") or []
    abstract = article.get("abstract")
    has_abstract_section = any(isinstance(s, dict) and section_key(s.get("name") or "") == "abstract"
                               for s in sections)
    if isinstance(abstract, str) and not has_abstract_section:
        builder.add_text(abstract + "\n\n")
    _walk_parts(sections, builder, level=2)
    return builder.text()


def structured_article_text(article: dict, opts: CleanOptions) -> str:
    """Cleaned text of one Wikimedia Enterprise structured-contents article."""
    return _structured(article, opts.builder())


def wikitext_article_text(wikitext: str, opts: CleanOptions) -> str:
    """Cleaned plain text of one article's wikitext (see utils.data.wikitext)."""
    return article_text(wikitext, opts.builder())


def convert_record(fmt: str, raw, where: str, opts: CleanOptions) -> Converted:
    """A raw record (JSONL line bytes or page wikitext) -> Converted.

    Bad input (BadRecord, or nesting so deep that Python's recursion limit is reached) comes
    back as ``Converted("", reason)``. Any other exception is a bug in our conversion and is
    raised as ConversionBug naming the record, never counted as bad input."""
    builder = opts.builder()
    try:
        if fmt == "jsonl":
            text = _structured(parse_json_record(raw), builder)
        else:
            text = article_text(raw, builder)
    except BadRecord as e:
        return Converted("", str(e))
    except RecursionError:
        return Converted("", "nested too deeply to convert (recursion limit)")
    except Exception as e:
        raise ConversionBug(where, f"{type(e).__name__}: {e}", traceback.format_exc()) from None
    return Converted(text, None, tuple(builder.dropped.elements()), tuple(builder.repairs))


# --------------------------------------------------------------------------- reading files
def is_redirect_text(wikitext: str) -> bool:
    """True for '#REDIRECT [[Target]]' pages (when the dump has no <redirect> element)."""
    return wikitext.lstrip()[:9].upper() == "#REDIRECT"


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
    parser = _safe_parser()
    done: list[Page] = []
    parser.StartElementHandler, parser.EndElementHandler, parser.CharacterDataHandler = \
        _page_handlers(done)
    parser.buffer_text = True
    while True:
        chunk = stream.read(chunk_size)
        parser.Parse(chunk, not chunk)
        yield from done
        done.clear()
        if not chunk:
            break


def _safe_parser():
    """An expat parser that refuses a DOCTYPE and every entity declaration (UnsafeXMLError)."""
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)

    def refuse(*_):
        raise UnsafeXMLError("the XML declares a DOCTYPE or entities; refused for safety "
                             "(MediaWiki dumps never need them)")
    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.UnparsedEntityDeclHandler = refuse
    parser.ExternalEntityRefHandler = refuse
    return parser


def _page_handlers(done: list[Page]):
    """expat's (start, end, character data) handlers that append each completed <page> to
    ``done``: its title, namespace (-999 when not a number), redirect flag and revision text."""
    page: Optional[Page] = None
    stack: list[str] = []
    buf: list[str] = []

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
    return start, end, chars
