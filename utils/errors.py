"""The pipeline's error classes and exit codes (library; no imports, so every module, the
lowest ones included, can raise them; utils.cli re-exports them and turns them into exits).

- :class:`PipelineError`: an expected failure (missing file, bad input, a full disk): its
  message is the whole report, exit code 1;
- :class:`UsageError`: a wrong combination of arguments, exit code 2.
"""
from __future__ import annotations

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def error_line(e: BaseException) -> str:
    """An error's type and the first line of its text (at most 200 characters): what a one-line
    message says of an exception it reports."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


class PipelineError(Exception):
    """An expected failure (missing file, bad input, unreachable hub): exit code 1."""

    exit_code = EXIT_FAILURE


class UsageError(PipelineError):
    """Wrong combination of arguments: exit code 2."""

    exit_code = EXIT_USAGE
