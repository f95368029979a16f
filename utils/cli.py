"""Shared command-line plumbing for stage scripts.

Every stage parses its arguments with :class:`StageParser` (which adds ``--config``,
``--test`` and ``--debug`` and maps flags onto config keys) and runs its ``main`` through
:func:`run_stage`, which keeps the pipeline's exit-code contract for every stage at once:

- 0 success;
- 130 stopped by Ctrl-C (SIGINT) or SIGTERM: run_stage turns SIGTERM into the same
  ``KeyboardInterrupt`` path as Ctrl-C (as :class:`Terminated`), so a stage's cleanup code
  runs for both; completed work stays on disk. A stage main.py started gets that SIGTERM when
  main.py dies without forwarding one (killed with SIGKILL): it does not run on, orphaned;
- 2 usage or configuration error (:class:`UsageError`, ``ConfigError``);
- 1 an expected failure (:class:`PipelineError`: its message is the whole report), or an
  unexpected exception: one paragraph saying what failed and where (the innermost frame of
  the project's own code), with the full traceback written to
  ``<paths.logs_dir>/errors/<stage>_<time>.log`` (named in the paragraph) and printed too
  with ``--debug`` (or ``LLM_PIPELINE_DEBUG=1``). No bare traceback reaches the user.

Docs: docs/DESIGN.md section 2 (configuration rules, error classes, exit codes).
"""
from __future__ import annotations

import argparse
import datetime
import errno
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from utils.config import PROJECT_ROOT, ConfigError, Config, load_config
from utils.processes import available_cpus, die_with_parent
from utils.disk import FULL, WriteError, named
from utils.stdio import (drop_standard_output, mark_standard_output, open_standard_streams, refused_line,
                         stdout_refused)

from utils.errors import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE,  # noqa: F401 (re-exported)
                          PipelineError, UsageError)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so the same cleanup runs (exit 130)."""


DEBUG_ENV = "LLM_PIPELINE_DEBUG"
ROUTER_PID_ENV = "LLM_PIPELINE_ROUTER_PID"   # set by main.py for the stages it starts (the same name there)


class _StageContext:
    """What :func:`run_stage` needs to know about the running stage once its arguments are
    parsed: the loaded config (for the error-log folder), its name and ``--debug``. One stage
    runs per process, so one instance serves; StageParser.parse fills it."""

    def __init__(self):
        self.cfg: Optional[Config] = None
        self.name: Optional[str] = None
        self.debug: bool = False


_CONTEXT = _StageContext()


def cli_path(value: str) -> str:
    """argparse type for paths given on the command line: relative to the current directory.
    An empty or all-space value is refused (exit 2, naming the flag): it would resolve to the
    current directory itself (an output folder there could take the whole checkout)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            f"{'empty' if not value else 'only spaces'}: as a path it would mean the current "
            f"folder ({os.getcwd()}) itself. Give a path.")
    if re.match(r"/(dev|proc/self|proc/\d+)/fd/\d+$", value):
        raise argparse.ArgumentTypeError(
            f"'{value}' is an open pipe (a shell's <(...) process substitution): main.py runs "
            "each stage as its own process, which cannot read it, and a stage may read a file "
            "more than once. Write it to a file and pass that file's path.")
    try:
        return str(Path(os.path.expanduser(value)).resolve())
    except (RuntimeError, OSError) as e:   # a symlink loop (RuntimeError before Python 3.13)
        raise argparse.ArgumentTypeError(f"'{value}' cannot be resolved ({e}): a symbolic link "
                                         "that leads back to itself? Give the real path.") from None


def cli_names(value: str) -> list[str]:
    """A comma-separated list of names (``q_proj,v_proj``), blanks dropped."""
    return [v.strip() for v in value.split(",") if v.strip()]


def cli_lora_flags(p: "StageParser") -> None:
    """``--lora`` and the ``lora`` section's flags, the same on every training stage that takes
    an adapter (sft train, dpo train, rl; utils/lora.py, docs/lora.md)."""
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter (peft) on the frozen model instead of all weights; "
                        "checkpoints hold the base weights and the adapter, and every stage that "
                        "reads them gets the merged model")
    p.config_flag("--lora-rank", key="lora.rank", type=int, metavar="R", help="adapter rank")
    p.config_flag("--lora-alpha", key="lora.alpha", type=float, metavar="A",
                  help="adapter scale alpha (output x alpha / rank)")
    p.config_flag("--lora-dropout", key="lora.dropout", type=float, metavar="P",
                  help="dropout on the adapter's input")
    p.config_flag("--lora-target-modules", key="lora.target_modules", type=cli_names,
                  metavar="NAMES", help="comma-separated projections: q_proj,v_proj,... (or ours: "
                                        "wq,wv,...; or all-linear)")


def cli_nonblank(value: str) -> str:
    """argparse type for a value that names a file, folder, run or model (``--resume PATH|auto``,
    benchmark's CHECKPOINT and --hf-model): an empty or all-space value is refused (exit 2,
    naming the flag) instead of being taken as "not given" or as the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{'empty' if not value else 'only spaces'}: give a value.")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Show a flag's default only when it means something (not None/False: those defer to
    config) and its help does not already say it (``%(default)s`` or a written "(default")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "%(default)" not in text and "(default" not in text):
            text += " (default: %(default)s)"
        return text


NO_TEST_MODE = "accepted, and changes nothing here (the quick mode is for the stages that read data or train)"


class StageParser(argparse.ArgumentParser):
    """ArgumentParser that knows which flags override which config keys.

    ``prog`` is how the user runs the stage (``main.py STAGE``, ``main.py sft train``: the
    usage line starts with it); ``test`` is what ``--test`` does in this stage (the flags every
    stage shares, --config, --test and --debug, are listed apart, once)."""

    def __init__(self, prog: str, description: str, test: str = NO_TEST_MODE, **kw):
        super().__init__(prog=prog, description=description,
                         formatter_class=_HelpFormatter, **kw)
        self._config_keys: dict[str, str] = {}
        shared = self.add_argument_group("shared by every stage")
        shared.add_argument("--config", type=cli_path, action="append", default=None, metavar="FILE",
                            help="JSON file layered over config.json; repeatable, later files over "
                                 "earlier ones (precedence: defaults < config.json < --config "
                                 "files in order < flags)")
        shared.add_argument("--test", action="store_true", help=test)
        shared.add_argument("--debug", action="store_true",
                            help="on an unexpected error, print the full traceback here (it is "
                                 "always written to <paths.logs_dir>/errors/)")

    def config_flag(self, *flags: str, key: str, help: str, **kw) -> None:
        """Add a flag whose value, when given, overrides config key ``key`` (``section.name``)."""
        dest = "cfg__" + key.replace(".", "__")
        self._config_keys[dest] = key
        kw.setdefault("default", None)
        if kw.get("action") is None and "choices" not in kw:          # not the internal dest in --help
            kw.setdefault("metavar", {int: "N", float: "X"}.get(kw.get("type"),
                                                               flags[-1].lstrip("-").upper().replace("-", "_")))
        self.add_argument(*flags, dest=dest, help=f"{help} [config: {key}]", **kw)

    def parse(self, argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, Config]:
        args = self.parse_args(argv)
        self._refuse_undecodable(args)
        words = self.prog.split()
        _CONTEXT.name = words[1] if words[0] == "main.py" and len(words) > 1 else words[-1]   # the stage
        _CONTEXT.debug = _CONTEXT.debug or args.debug
        overrides: dict[str, Any] = {}
        for dest, key in self._config_keys.items():
            value = getattr(args, dest)
            if value is not None:
                overrides[key] = value
        cfg = load_config(args.config, overrides=overrides, test=args.test)
        _CONTEXT.cfg = cfg
        return args, cfg

    def _refuse_undecodable(self, args: argparse.Namespace) -> None:
        """Text given on the command line must be UTF-8: bytes that are not (Python keeps them
        in argv as lone surrogates) were encoded as U+FFFD by --encode, or broke a write of the
        value later; a usage error naming the flag. Paths (``cli_path``, ``cli_nonblank``) may
        hold any bytes, as file names may."""
        for action in self._actions:
            if action.type in (cli_path, cli_nonblank):
                continue
            value = getattr(args, action.dest, None)
            for text in value if isinstance(value, list) else [value]:
                if not isinstance(text, str):
                    continue
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    flag = "/".join(action.option_strings) or action.dest
                    locale = sys.getfilesystemencoding()
                    if locale.replace("-", "").lower() != "utf8":   # e.g. LC_ALL=C with PYTHONUTF8=0
                        self.error(f"argument {flag}: holds bytes this process reads as {locale}, which "
                                   f"takes no such bytes (at character {e.start + 1}): run with a UTF-8 "
                                   f"locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1.")
                    self.error(f"argument {flag}: holds bytes that are not UTF-8 text (at character "
                               f"{e.start + 1}); pass UTF-8 text.")


def _on_stop(signum, frame):
    """SIGINT -> KeyboardInterrupt, SIGTERM -> Terminated, once. A second stop signal while the
    stage is already stopping (a supervisor's killpg reaches the stage and main.py, which also
    forwards it; an impatient second Ctrl-C) is ignored, so it cannot interrupt the cleanup
    that keeps completed work intact."""
    if os.getpid() != _MAIN_PID[0]:   # a forked worker inherited this: die as by default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _STOPPING[0]:
        return
    _STOPPING[0] = signum
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


_MAIN_PID = [os.getpid()]
_STOPPING: list = [False]          # the stop signal's number once one arrived


def _where(tb) -> str:
    """The innermost frame of code that is not a library (not under the Python install,
    site-/dist-packages or a venv, nor the <frozen ...> runners); else the innermost frame."""
    frames = traceback.extract_tb(tb)
    libs = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(PROJECT_ROOT / ".venv")}

    def library(fn: str) -> bool:
        return (fn.startswith("<") or any(fn.startswith(p + os.sep) for p in libs)
                or "site-packages" in fn or "dist-packages" in fn)
    ours = [f for f in frames if not library(f.filename)]
    f = (ours or frames or [None])[-1]
    if f is None:
        return "an unknown place"
    try:
        name = str(Path(f.filename).relative_to(PROJECT_ROOT))
    except ValueError:
        name = f.filename
    return f"{name}, line {f.lineno}, in {f.name}()"


def _error_log_dir() -> Path:
    cfg = _CONTEXT.cfg
    base = cfg.path("paths.logs_dir") if cfg is not None else PROJECT_ROOT / "logs"
    return base / "errors"


def printable(text: str, keep: str = "") -> str:
    """``text`` for a terminal or a log line: each character that is not printable (control
    characters: escape sequences, carriage returns, newlines) shown as U+FFFD, except those in
    ``keep``. A run folder's name or a model's reply could otherwise clear the screen, set the
    window title, or add a line to a listing or to a log of one line per request."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in keep else "\ufffd" for ch in text)


def wrapped_for(stream, text: str, indent: str = "") -> str:
    """``text`` as ``stream`` should show it: on a terminal, each line wrapped at word
    boundaries to the terminal's width (continuation lines start with ``indent``), since the
    terminal itself would cut a long line mid-word; elsewhere (a pipe, a log file) unchanged, one
    line per message for grep. A word wider than the terminal (a long path) stays whole."""
    if not getattr(stream, "isatty", lambda: False)():
        return text
    try:
        width = os.get_terminal_size(stream.fileno()).columns       # stderr may be the terminal alone
    except (AttributeError, OSError, ValueError):
        width = shutil.get_terminal_size().columns
    return "\n".join(textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False,
                                    break_on_hyphens=False) or line for line in text.split("\n"))


def _readable_utf8(text: str) -> bytes:
    """``text`` as UTF-8, a byte of a command line or file name that is not UTF-8 (Python's
    surrogate for it) written as ``\\xNN``, any other lone surrogate as ``\\udNNN``."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace").encode("utf-8")


def _write_error_log(stage: str, text: str) -> Optional[Path]:
    """Write the traceback to logs/errors/<stage>_<time>.log (or the temp dir); None if neither."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    rank = os.environ.get("RANK")
    name = f"{stage}_{stamp}{'_rank' + rank if rank not in (None, '0') else ''}.log"
    for d in (_error_log_dir(), Path(tempfile.gettempdir()) / "llm-pipeline-errors"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            path = d / name
            path.write_bytes(_readable_utf8(text))
            return path
        except OSError:
            continue
    return None


def _log_exception(prog: str, exc: BaseException) -> tuple[str, str, Optional[Path]]:
    """(stage, traceback text, the error log written with the command, or None)."""
    stage = _CONTEXT.name or Path(prog).stem
    tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log = _write_error_log(stage, f"command: {' '.join(sys.argv)}\ncwd: {os.getcwd()}\n\n{tb_text}")
    return stage, tb_text, log


def report_unexpected(prog: str, exc: BaseException) -> None:
    """Print the one-paragraph report of an unexpected exception; log its traceback."""
    stage, tb_text, log = _log_exception(prog, exc)
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if _CONTEXT.debug:
        print(tb_text, file=sys.stderr, end="")
    where_tb = (f"The full traceback is in {log}" if log else
                "The traceback could not be written to a log file")
    debug = "" if _CONTEXT.debug else " (run again with --debug to print it here)"
    print(f"{prog}: unexpected error in stage '{stage}': {what} (at {_where(exc.__traceback__)}). "
          f"This is not one of the problems the stage checks for, so it may be a bug or a problem "
          f"with the machine (permissions, disk space, memory). {where_tb}{debug}; please include "
          f"it when you report the problem.", file=sys.stderr)


def report_cut_short(prog: str, exc: BaseException) -> int:
    """A stop signal arrived and then something else failed: most often the signal's own
    doing (a Ctrl-C in the first seconds lands inside ``import torch``, whose native modules
    then fail to load: "cannot load module more than once per process"). It is the stop the
    user asked for (exit 130), said once with what it cut short; the traceback is logged."""
    log = _log_exception(prog, exc)[2]
    how = "stopped by SIGTERM" if _STOPPING[0] == signal.SIGTERM else "interrupted by user (Ctrl-C)"
    where = f" (traceback: {log})" if log else ""
    print(f"\n{prog}: {how}; it cut short {type(exc).__name__}: {exc}{where}. Completed work is kept "
          f"on disk.", file=sys.stderr)
    return EXIT_INTERRUPTED


def run_stage(main_fn: Callable[[Optional[Sequence[str]]], Optional[int]],
              argv: Optional[Sequence[str]] = None) -> None:
    """Run a stage's main and exit with the pipeline's exit-code contract (module docstring)."""
    open_standard_streams()
    mark_standard_output()
    prog = Path(sys.argv[0]).name
    _begin(list(sys.argv[1:] if argv is None else argv))
    try:
        router = os.environ.get(ROUTER_PID_ENV, "")
        if router.isdigit() and int(router) == os.getppid():   # started by main.py (not its workers)
            die_with_parent(int(router), signal.SIGTERM)   # main.py killed: stop as on SIGTERM
        code = main_fn(argv) or EXIT_OK
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - the one place errors become exit codes
        code = exit_code(prog, e)
    code = _flush_output(prog, code)
    if _torchrun_rank_script():
        sys.stderr.flush()
        # A rank skips the interpreter's teardown: its atexit hook would destroy the process
        # group before the teardown frees whatever still holds a DDP model (a traceback), whose
        # Reducer would then free the group with the GIL held while a gloo worker waits for the
        # GIL (utils/training/distributed.py shutdown: a rank hung at exit in test_ddp). Its
        # output is flushed and its log closed (utils/stage.py) already.
        os._exit(code)
    sys.exit(code)


def _torchrun_rank_script() -> bool:
    """This process is a rank torchrun started with a stage script as its program (not a
    stage run in another program's process, as the tests run them)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is None or not sys.argv or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return (int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
            and os.path.realpath(main_file) == os.path.realpath(sys.argv[0]))


def _begin(raw_args: list[str]) -> None:
    """A stage starts: no config read yet, ``--debug`` (or LLM_PIPELINE_DEBUG), and Ctrl-C and
    SIGTERM taken as stops (a signal ignored when the stage started stays ignored)."""
    _MAIN_PID[0] = os.getpid()
    _CONTEXT.cfg, _CONTEXT.name = None, None
    _CONTEXT.debug = "--debug" in raw_args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    _STOPPING[0] = False
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:   # nohup / `cmd &` keep ignoring
            signal.signal(signum, _on_stop)


def exit_code(prog: str, e: BaseException) -> int:
    """The exit code of a stage that ``e`` ended, after saying why on stderr (module docstring);
    called where ``e`` is being handled (``--debug`` prints its traceback)."""
    if isinstance(e, Terminated):
        print(f"\n{prog}: stopped by SIGTERM; completed work is kept on disk.", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(e, KeyboardInterrupt):
        print(f"\n{prog}: interrupted by user (Ctrl-C); completed work is kept on disk.",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(e, ConfigError):
        print(f"{prog}: configuration error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, PipelineError):
        if _CONTEXT.debug:
            traceback.print_exc()
        if isinstance(e, WriteError) and e.setting is None and _CONTEXT.cfg is not None:
            e.setting = setting_for(e.path, _CONTEXT.cfg)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    if isinstance(e, BrokenPipeError):
        return EXIT_FAILURE
    if isinstance(e, OSError):
        return _os_error_code(prog, e)
    if _STOPPING[0]:
        return report_cut_short(prog, e)
    report_unexpected(prog, e)
    return EXIT_FAILURE


def _os_error_code(prog: str, e: OSError) -> int:
    """An OSError that ended the stage: standard output refused, a path the file system refused
    (said with what to do, :data:`_PATH_ERRORS`), a stop's doing, or an unexpected error."""
    advice = _PATH_ERRORS.get(e.errno) if e.filename is not None else None
    # a full or read-only disk met by a writer outside utils/atomic.py (mkdir, a library's own
    # save): only about writing; EACCES or ENOENT could be a read, left to _PATH_ERRORS
    full = named(e.filename, e) if e.filename is not None and e.errno in (*FULL, errno.EROFS) else None
    if stdout_refused(e):                      # > /dev/full: not a bug, nothing to log
        print(refused_line(prog, e), file=sys.stderr)
        return EXIT_FAILURE
    if full is not None:
        full.setting = setting_for(full.path, _CONTEXT.cfg) if _CONTEXT.cfg is not None else None
        print(f"{prog}: error: {full}", file=sys.stderr)
        return EXIT_FAILURE
    if advice is None and _STOPPING[0]:
        return report_cut_short(prog, e)
    if advice is None:
        report_unexpected(prog, e)
        return EXIT_FAILURE
    if _CONTEXT.debug:
        traceback.print_exc()
    print(f"{prog}: error: cannot use {e.filename}: {e.strerror}; {advice}", file=sys.stderr)
    return EXIT_FAILURE


def _flush_output(prog: str, code: int) -> int:
    """The stage's output flushed: standard output refusing the last of it is said on stderr
    (exit 1 if the stage had succeeded); a reader that left (``| head``) is not."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    except OSError as e:                           # the last of the output refused
        drop_standard_output()
        print(refused_line(prog, e), file=sys.stderr)
        code = code or EXIT_FAILURE
    return code


def setting_for(path: Path, cfg: Config) -> Optional[str]:
    """The config key whose folder holds ``path`` (the innermost of every section's ``*_dir``
    keys; ``paths.*`` first on a tie), or None: what a refused write says to point elsewhere."""
    sections = [("paths", cfg.paths)] + [(n, v) for n, v in vars(cfg).items()
                                         if n != "paths" and hasattr(v, "__dataclass_fields__")]
    keys = [f"{name}.{k}" for name, sec in sections for k, v in vars(sec).items()
            if k.endswith("_dir") and isinstance(v, str) and v]
    best: tuple[int, Optional[str]] = (-1, None)
    target = Path(os.path.abspath(path))
    for key in keys:
        try:
            folder = cfg.path(key)
        except (TypeError, ValueError, AttributeError):     # not a folder key after all
            continue
        if folder in target.parents and len(folder.parts) > best[0]:
            best = (len(folder.parts), key)
    return best[1]


# A file system's refusal of a path a stage was given (a flag, a paths.* key, a run name):
# what to do about it. Any other OSError is an unexpected error.
_PATH_ERRORS = {
    errno.ENOTDIR: "a part of this path is a file, not a folder: give another path (the flag or "
                   "paths.* key that sets it).",
    errno.EEXIST: "a file of that name is in the way: give another path or move the file.",
    errno.EISDIR: "it is a folder where a file was expected: give another path.",
    errno.ENAMETOOLONG: "a name in it is longer than the file system takes (255 bytes): use a "
                        "shorter name.",
    errno.ENOSPC: "the disk is full: free space and run the command again.",
    errno.EDQUOT: "the disk quota is used up: free space and run the command again.",
    errno.EROFS: "the file system is read-only: give a writable folder.",
    errno.EACCES: "give a folder you can write to, or fix its permissions.",
    errno.EPERM: "the operation is not permitted there: give another folder.",
    errno.ELOOP: "a symbolic link is in the way (a loop, or a link where the pipeline writes a file "
                 "of its own, which it does not write through): remove it or give another path.",
}


def argv_without(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` without the given value-taking flags (``--flag VALUE`` and ``--flag=VALUE``):
    what a printed resume command keeps of the user's own arguments."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


WORKERS_PER_CPU = 4      # most worker processes per usable CPU (more never run faster)


def capped_workers(n: int, setting: str) -> int:
    """``n`` worker processes, at most WORKERS_PER_CPU per usable CPU (said once on stderr):
    a million would never start, and their memory would take the machine down first."""
    cap = WORKERS_PER_CPU * available_cpus()
    if n > cap:
        print(f"note: {setting} {n:,} is more than {WORKERS_PER_CPU} per usable CPU: using {cap}.",
              file=sys.stderr, flush=True)
        return cap
    return n


def workers_or_cores(n: int, setting: str = "workers") -> int:
    """0 means all usable CPUs (utils/processes.py ``available_cpus``); more than
    WORKERS_PER_CPU per CPU is capped (``capped_workers``)."""
    return capped_workers(n, setting) if n and n > 0 else available_cpus()
