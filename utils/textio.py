"""The cleaned-article text format shared by the cleaner and the prep stages.

``data/cleaned_articles/cleaned_<input>.txt`` holds one article per line (UTF-8). Paragraph
breaks survive in a reversible escaped form: a newline inside an article is written as the
two characters ``\\n`` and a literal backslash as ``\\\\``. :func:`unescape_article`
restores the exact text, so prep tokenizes articles with their real paragraph breaks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator


def escape_article(text: str) -> str:
    """Article text -> one line (no newline characters)."""
    return text.replace("\\", "\\\\").replace("\r", "").replace("\n", "\\n")


def unescape_article(line: str) -> str:
    """One line (without its trailing newline) -> the article text."""
    if "\\" not in line:
        return line
    out, i, n = [], 0, len(line)
    while i < n:
        c = line[i]
        if c == "\\" and i + 1 < n:
            nxt = line[i + 1]
            if nxt == "n":
                out.append("\n")
                i += 2
                continue
            if nxt == "\\":
                out.append("\\")
                i += 2
                continue
        out.append(c)
        i += 1
    return "".join(out)


def iter_articles(paths: Iterable[Path]) -> Iterator[str]:
    """Yield unescaped articles from cleaned files, in the given file order, skipping blank lines."""
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line:
                    yield unescape_article(line)
