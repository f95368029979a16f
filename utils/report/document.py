"""A report as a list of blocks, rendered to Markdown or to one self-contained HTML page.

Blocks: :class:`Heading`, :class:`Para`, :class:`Bullets`, :class:`Table`, :class:`Image`,
:class:`CodeBlock`, :class:`Details` (a folded section). Inline text is a ``str`` (plain text,
escaped by each renderer), :class:`Code` (a code span) or :class:`Bold`, or a list of these.
Every string from a run (names, paths, sample text) is data: the Markdown renderer escapes
what Markdown would read as markup (a line break in inline text is a space), the HTML renderer
escapes everything, and nothing from a run becomes a link. An :class:`Image` holds its PNG
bytes: Markdown refers to the file beside the report (its name made by :func:`image_file`,
the link target percent-encoded), HTML inlines it as a ``data:`` URI, so the page needs
nothing else.
"""
from __future__ import annotations

import base64
import hashlib
import html
import re
from urllib.parse import quote
from dataclasses import dataclass, field
from typing import Sequence, Union


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Bold:
    text: str


Inline = Union[str, Code, Bold, Sequence["Inline"]]


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    content: Inline


@dataclass
class Bullets:
    items: list


@dataclass
class Table:
    header: list
    rows: list
    align: str = ""          # one letter per column, "l" or "r" (default: left)


@dataclass
class Image:
    filename: str            # beside the Markdown file (image_file() for a name from a run)
    alt: str
    png: bytes


_UNSAFE_FILE = re.compile(r"[^A-Za-z0-9._-]+")


def image_file(stem: str, taken=()) -> str:
    """A PNG file name for ``stem`` (a run name: any characters) that is safe in a folder and
    in a Markdown link: ``stem.png`` when ``stem`` is only letters, digits, ``.``, ``_`` and
    ``-`` and the name is not in ``taken``; else the safe characters of ``stem`` and a hash of
    it (``sft_x_img_src_x-3f2a9c0b1d.png``), so two names never share a file."""
    safe = _UNSAFE_FILE.sub("_", stem).strip("._-")[:80]
    if safe == stem and f"{stem}.png" not in taken:
        return f"{stem}.png"
    digest = hashlib.sha256(stem.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{safe or 'image'}-{digest}.png"


@dataclass
class CodeBlock:
    text: str
    lang: str = ""


@dataclass
class Details:
    summary: str
    blocks: list = field(default_factory=list)


# ----------------------------------------------------------------------------- Markdown
_MD_SPECIAL = re.compile(r"([\\`*_\[\]{}<>#|!~&])")


def _md_text(s: str) -> str:
    s = re.sub(r"[\r\n]+", " ", s)                 # inline text is one line: no heading, list
    s = _MD_SPECIAL.sub(r"\\\1", s)                 # or setext underline from a name
    return re.sub(r"^(\s*)([+\-]|\d+\.)(\s)", r"\1\\\2\3", s)   # no list marker at a line start


def _md_code(s: str) -> str:
    s = s.replace("\n", " ")
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _md_inline(x: Inline) -> str:
    if isinstance(x, Code):
        return _md_code(x.text)
    if isinstance(x, Bold):
        return f"**{_md_text(x.text)}**"
    if isinstance(x, str):
        return _md_text(x)
    return "".join(_md_inline(p) for p in x)


def _md_cell(x: Inline) -> str:
    return _md_inline(x).replace("\n", " ").replace("|", "\\|") or " "


def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    return "`" * (longest + 1)


def _md_block(b) -> list[str]:
    if isinstance(b, Heading):
        return ["#" * b.level + " " + _md_text(b.text), ""]
    if isinstance(b, Para):
        return [_md_inline(b.content), ""]
    if isinstance(b, Bullets):
        return [f"- {_md_inline(i)}" for i in b.items] + [""]
    if isinstance(b, Table):
        align = b.align.ljust(len(b.header), "l")
        lines = ["| " + " | ".join(_md_cell(h) for h in b.header) + " |",
                 "|" + "|".join(" ---: " if a == "r" else " --- " for a in align) + "|"]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
        return lines + [""]
    if isinstance(b, Image):
        return [f"![{_md_text(b.alt)}]({quote(b.filename, safe='')})", ""]
    if isinstance(b, CodeBlock):
        f = _fence(b.text)
        return [f + b.lang, b.text.rstrip("\n"), f, ""]
    if isinstance(b, Details):
        inner = [line for x in b.blocks for line in _md_block(x)]
        return ["<details>", f"<summary>{html.escape(b.summary)}</summary>", "", *inner,
                "</details>", ""]
    raise TypeError(f"not a report block: {type(b).__name__}")


def to_markdown(blocks: Sequence) -> str:
    lines = [line for b in blocks for line in _md_block(b)]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- HTML
_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; color: #1f2328; line-height: 1.5; }
h1, h2, h3 { border-bottom: 1px solid #d8dee4; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .5em 0 1em; }
th, td { border: 1px solid #d0d7de; padding: .25em .6em; vertical-align: top; }
th { background: #f6f8fa; }
td.r, th.r { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, Consolas, monospace; background: #f6f8fa; }
code { padding: .1em .3em; border-radius: 4px; }
pre { padding: .8em; overflow-x: auto; white-space: pre-wrap; border-radius: 6px; }
img { max-width: 100%; }
"""


def _h(s: str) -> str:
    return html.escape(s, quote=True)


def _html_inline(x: Inline) -> str:
    if isinstance(x, Code):
        return f"<code>{_h(x.text)}</code>"
    if isinstance(x, Bold):
        return f"<strong>{_h(x.text)}</strong>"
    if isinstance(x, str):
        return _h(x)
    return "".join(_html_inline(p) for p in x)


def _html_block(b) -> str:
    if isinstance(b, Heading):
        return f"<h{b.level}>{_h(b.text)}</h{b.level}>"
    if isinstance(b, Para):
        return f"<p>{_html_inline(b.content)}</p>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        align = b.align.ljust(len(b.header), "l")
        cls = [' class="r"' if a == "r" else "" for a in align]
        head = "".join(f"<th{c}>{_html_inline(h)}</th>" for h, c in zip(b.header, cls))
        body = "".join("<tr>" + "".join(f"<td{c}>{_html_inline(x)}</td>" for x, c in zip(row, cls))
                       + "</tr>" for row in b.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if isinstance(b, Image):
        data = base64.b64encode(b.png).decode("ascii")
        return f'<p><img alt="{_h(b.alt)}" src="data:image/png;base64,{data}"></p>'
    if isinstance(b, CodeBlock):
        return f"<pre><code>{_h(b.text.rstrip())}</code></pre>"
    if isinstance(b, Details):
        return (f"<details><summary>{_h(b.summary)}</summary>"
                + "\n".join(_html_block(x) for x in b.blocks) + "</details>")
    raise TypeError(f"not a report block: {type(b).__name__}")


def to_html(blocks: Sequence, title: str) -> str:
    """One page with its style and pictures inside: no external ``src`` or ``href``."""
    body = "\n".join(_html_block(b) for b in blocks)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{_h(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n{body}\n"
            "</body>\n</html>\n")
