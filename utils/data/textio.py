"""The cleaned-article text format shared by the cleaner and the prep stages.

``data/cleaned_articles/cleaned_<input>.txt`` holds one article per line (UTF-8). Paragraph
breaks survive in a reversible escaped form: a newline inside an article is written as the
two characters ``\\n`` and a literal backslash as ``\\\\``. :func:`unescape_article`
restores the exact text, so prep tokenizes articles with their real paragraph breaks.

:func:`replace_surrogates` is the one repair of text that is not valid Unicode: a lone
surrogate (JSON may carry ``"\\ud800"``; no tokenizer and no UTF-8 file takes it) becomes
U+FFFD. The cleaner (utils.data.wikitext.sanitize), the tokenizer's encoder
(utils.data.tok.encode_plain) and the benchmark's data reader use it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator

from utils.cli import PipelineError


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def replace_surrogates(text: str) -> tuple[str, int]:
    """``text`` with each lone surrogate (U+D800-U+DFFF: a ``str`` holds a valid pair as one
    character, so every surrogate in it is lone) replaced by U+FFFD, and how many were."""
    if text.isascii():
        return text, 0
    return _SURROGATE.subn("\ufffd", text)


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


class TextFileError(PipelineError):
    """A text file that cannot be read as UTF-8 lines (the message names ``file:line``)."""


def text_lines(path: Path, advice: str) -> Iterator[str]:
    """The non-empty lines of a UTF-8 text file, without their line ends. A line that is not
    UTF-8, or a file that cannot be read, raises TextFileError naming ``file:line`` and ending
    with ``advice`` (what the user can do about it)."""
    lineno = 0
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.decode("utf-8").rstrip("\n")
                if line:
                    yield line
    except UnicodeDecodeError as e:
        raise TextFileError(f"{path}:{lineno}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                            f"{e.start} of the line); {advice}") from None
    except OSError as e:
        raise TextFileError(f"{path}: cannot be read ({e.strerror or e})") from None


def iter_articles(paths: Iterable[Path]) -> Iterator[str]:
    """Yield unescaped articles from cleaned files, in the given file order, skipping blank lines.
    A damaged file is a TextFileError: cleaned files are the cleaner's output, so this means
    damage, not data."""
    for p in paths:
        for line in text_lines(p, "cleaned files are written by `python main.py clean`: re-run it "
                                  "for this input, or remove the file"):
            yield unescape_article(line)
