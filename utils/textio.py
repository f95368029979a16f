"""The cleaned-article text format shared by the cleaner and the prep stages.

``data/cleaned_articles/cleaned_<input>.txt`` holds one article per line (UTF-8). Paragraph
breaks survive in a reversible escaped form: a newline inside an article is written as the
two characters ``\\n`` and a literal backslash as ``\\\\``. :func:`unescape_article`
restores the exact text, so prep tokenizes articles with their real paragraph breaks.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator


def escape_article(text: str) -> str:
    """Article text -> one line (no newline characters)."""
    return text.replace("\\", "\\\\").replace("\r", "").replace("\n", "\\n")


_ESCAPE = re.compile(r"\\([n\\])")


def unescape_article(line: str) -> str:
    """One line (without its trailing newline) -> the article text.

    Only the two escapes ``\\n`` and ``\\\\`` are decoded; any other backslash is kept as is.
    The common cases run at C speed (str.replace / one regex pass)."""
    if "\\" not in line:
        return line
    if "\\\\" not in line:
        return line.replace("\\n", "\n")
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else "\\", line)


def iter_articles(paths: Iterable[Path]) -> Iterator[str]:
    """Yield unescaped articles from cleaned files, in the given file order, skipping blank lines."""
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line:
                    yield unescape_article(line)
