"""Shared command-line plumbing for stage scripts.

Every stage parses its arguments with :class:`StageParser` (which adds ``--config`` and
``--test`` and maps flags onto config keys) and runs its ``main`` through :func:`run_stage`,
which turns expected failures into exit codes: 0 success, 130 Ctrl-C, 2 usage or
configuration error, 1 other failure with a one-paragraph message and no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from utils.config import ConfigError, Config, load_config

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class PipelineError(Exception):
    """An expected failure (missing file, bad input, unreachable hub): exit code 1."""

    exit_code = EXIT_FAILURE


class UsageError(PipelineError):
    """Wrong combination of arguments: exit code 2."""

    exit_code = EXIT_USAGE


def cli_path(value: str) -> str:
    """argparse type for paths given on the command line: relative to the current directory."""
    return str(Path(os.path.expanduser(value)).resolve())


class _HelpFormatter(argparse.HelpFormatter):
    """Show a flag's default only when it means something (not None/False: those defer to config)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


class StageParser(argparse.ArgumentParser):
    """ArgumentParser that knows which flags override which config keys."""

    def __init__(self, prog: str, description: str, **kw):
        super().__init__(prog=prog, description=description,
                         formatter_class=_HelpFormatter, **kw)
        self._config_keys: dict[str, str] = {}
        self.add_argument("--config", type=cli_path, default=None, metavar="FILE",
                          help="JSON file layered over config.json (precedence: defaults < "
                               "config.json < --config < flags)")
        self.add_argument("--test", action="store_true",
                          help="quick mode: small inputs, small model, few steps")

    def config_flag(self, *flags: str, key: str, help: str, **kw) -> None:
        """Add a flag whose value, when given, overrides config key ``key`` (``section.name``)."""
        dest = "cfg__" + key.replace(".", "__")
        self._config_keys[dest] = key
        kw.setdefault("default", None)
        self.add_argument(*flags, dest=dest, help=f"{help} [config: {key}]", **kw)

    def parse(self, argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, Config]:
        args = self.parse_args(argv)
        overrides: dict[str, Any] = {}
        for dest, key in self._config_keys.items():
            value = getattr(args, dest)
            if value is not None:
                overrides[key] = value
        cfg = load_config(args.config, overrides=overrides, test=args.test)
        return args, cfg


def run_stage(main_fn: Callable[[Optional[Sequence[str]]], Optional[int]],
              argv: Optional[Sequence[str]] = None) -> None:
    """Run a stage's main and exit with the pipeline's exit-code contract."""
    prog = Path(sys.argv[0]).name
    try:
        code = main_fn(argv) or EXIT_OK
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted by user (Ctrl-C); completed work is kept on disk.",
              file=sys.stderr)
        code = EXIT_INTERRUPTED
    except ConfigError as e:
        print(f"{prog}: configuration error: {e}", file=sys.stderr)
        code = EXIT_USAGE
    except PipelineError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        code = e.exit_code
    except BrokenPipeError:
        code = EXIT_FAILURE
    sys.stdout.flush()
    sys.exit(code)


def workers_or_cores(n: int) -> int:
    """0 means all cores."""
    return n if n and n > 0 else (os.cpu_count() or 1)
