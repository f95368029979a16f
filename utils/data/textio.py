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


class CleanedFileError(ValueError):
    """A cleaned-article file that cannot be read (message names ``file:line``)."""


def iter_articles(paths: Iterable[Path]) -> Iterator[str]:
    """Yield unescaped articles from cleaned files, in the given file order, skipping blank lines.

    A line that is not UTF-8 or a file that cannot be read raises CleanedFileError naming
    ``file:line``: cleaned files are the cleaner's output, so this means damage, not data."""
    for p in paths:
        lineno = 0
        try:
            with open(p, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    line = raw.decode("utf-8").rstrip("\n")
                    if line:
                        yield unescape_article(line)
        except UnicodeDecodeError as e:
            raise CleanedFileError(f"{p}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line); "
                                   "cleaned files are written by `python main.py clean`: re-run it "
                                   "for this input, or remove the file") from None
        except OSError as e:
            raise CleanedFileError(f"{p}: cannot be read ({e.strerror or e})") from None
