"""Docs that cannot drift: every command line README.md and docs/*.md show is parsed by its
stage's own parser, every repository file and ``module.function`` they name exists, every
stage's ``--help`` starts with ``usage: main.py STAGE``, and docs/DESIGN.md's layer list is
tests/test_layout.py's LAYERS.

Commands are ``python main.py STAGE ...`` (also ``.venv/bin/python``, ``python3``) and
``torchrun ... SCRIPT.py ...`` lines in fenced code blocks (continuation lines joined, ``&&``,
``;`` and ``|`` split, ``# comments`` cut) and in inline code spans. Each is parsed in this
process: the stage's ``main`` runs with ``StageParser.parse`` replaced by a capture, so the
parser is the one the stage builds for those arguments (``sft train`` gets sft train's), and
the arguments are parsed by it (argparse: flags and choices exist, required arguments present),
then by the start checks of the post-training stages (exactly one of --checkpoint,
--init-from-hf and --resume). Placeholders pass: ``...`` and the brackets of ``[--flag X]``
are dropped, and an all-capitals value (``N``, ``DIR``, ``SMOLLM2_DIR``) is given a value of
the flag's type or its first choice.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = r"(?:\S*/)?python3?(?:\s+-[A-Za-z]\S*)*"       # python, python3, .venv/bin/python, python -X ...
COMMAND = re.compile(rf"(?:{PYTHON}\s+main\.py\s+[a-z]|torchrun\s+(?:\S+\s+)*?[A-Za-z_]+\.py\b)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:[|./][A-Z0-9_]+)*$")
# repository paths a doc names: under these folders (or a top-level script), not outputs
REPO_PATH = re.compile(r"(?<![\w./-])((?:utils|tests|perf|examples|configs|docs|seeds|\.ci)/[\w./-]*[\w/])")
DOTTED = re.compile(r"(?<![\w./-])(utils(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
SLASHED = re.compile(r"(?<![\w./-])(utils(?:/\w+)+)\.([A-Za-z_]\w*)\b(?!\.)")
EXTENSIONS = {"py", "md", "json", "jsonl", "txt", "sh", "png", "html", "js", "css", "toml", "cfg", "ini", "yaml",
              "yml", "gguf", "npy", "pt", "log", "model", "parquet", "xml", "bz2", "gz", "whl", "csv"}
# Pages being written on another branch, linked ahead of their merge: an entry is dropped
# once the file exists (test_pending_pages_are_still_pending fails until it is).
PENDING: dict = {}      # pages a doc links to that another change is writing (path -> who)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


# --------------------------------------------------------------------------- collecting
def _code_lines(text: str):
    """(line number, text, in a fenced block) of each logical line: a fenced block's lines with
    their backslash continuations joined; outside blocks, each inline code span."""
    fence, pending, start = False, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            if not pending:
                start = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            yield start, pending + line, True
            pending = ""
        elif not line.startswith("#"):      # a heading names a stage, it is no command
            for span in re.findall(r"`([^`]+)`", line):
                yield n, span, False


def _cut(segment: str) -> str:
    """A shell command without its trailing comment (``#`` after a space) and redirections."""
    segment = re.split(r"\s#", segment, maxsplit=1)[0]
    return re.split(r"\s(?:\d?>>?|<)\s*\S", segment, maxsplit=1)[0].strip()


def commands_in(text: str, doc: str) -> list[Command]:
    out = []
    for n, line, _ in _code_lines(text):
        for part in re.split(r"&&|\|\||;|\|", line):
            m = COMMAND.search(part)
            if m:
                out.append(Command(doc, n, _cut(part[m.start():])))
    return out


def all_commands() -> list[Command]:
    return [c for d in DOCS for c in commands_in(d.read_text(encoding="utf-8"), str(d.relative_to(ROOT)))]


# --------------------------------------------------------------------------- parsing
class _Built(Exception):
    def __init__(self, parser, argv):
        super().__init__()
        self.parser, self.argv = parser, list(argv)


def _stage_and_args(cmd: Command) -> tuple[str, list[str]]:
    """The stage (by main.py's registry) and its arguments, placeholders' brackets dropped."""
    import main as router
    words = shlex.split(cmd.text)
    if words[0] == "torchrun":
        script = next(w for w in words if w.endswith(".py"))
        module = script[:-3].replace("/", ".")
        stage = next((n for n, s in router.STAGES.items() if s.module == module), None)
        assert stage is not None, f"{cmd}: {script} is not a stage script"
        args = words[words.index(script) + 1:]
    else:
        i = words.index("main.py")
        stage = router.resolve_stage(words[i + 1])
        assert stage is not None, f"{cmd}: no stage '{words[i + 1]}' (main.py STAGES)"
        args = words[i + 2:]
    if args[:1] == ["--"]:                   # main.py STAGE -- ARGS: ARGS verbatim
        args = args[1:]
    return stage, [a.strip("[]") for a in args if a.strip("[]")]


def _fill(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Placeholders resolved: ``...`` dropped where it is not a flag's value; an all-capitals
    value (``N``, ``DIR``, ``I/N``) replaced by a value of its flag's type or its first choice,
    or, where the flag's own type (a parser function) refuses it, left out with its flag (the
    flag itself exists: it was looked up)."""
    out: list[str] = []
    for i, a in enumerate(args):
        action = parser._option_string_actions.get(args[i - 1].split("=")[0]) if i else None
        takes_value = action is not None and action.nargs != 0 and "=" not in args[i - 1]
        if a == "..." and not takes_value:
            continue
        if takes_value and PLACEHOLDER.match(a):
            if action.choices:
                a = str(next(iter(action.choices)))
            elif action.type in (int, float):
                a = "1"
            elif action.type not in (None, str) and not _takes(action.type, a):
                out.pop()
                continue
        out.append(a)
    return out


def _takes(kind, value: str) -> bool:
    try:
        kind(value)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return True


def parse_command(cmd: Command, monkeypatch) -> argparse.Namespace:
    """The command parsed by its stage's own parser; AssertionError naming the doc line and
    argparse's (or the start check's) message when the stage would refuse it."""
    from utils.cli import StageParser, UsageError
    from utils import post_start
    stage, args = _stage_and_args(cmd)
    import main as router
    module = importlib.import_module(router.STAGES[stage].module)

    def capture(self, argv=None):
        raise _Built(self, argv)
    monkeypatch.setattr(StageParser, "parse", capture)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            module.main(args)
    except _Built as built:
        parser, argv = built.parser, _fill(built.parser, built.argv)
    except (UsageError, SystemExit) as e:
        raise AssertionError(f"{cmd}\n  refused before parsing: {e} {err.getvalue()}") from None
    else:
        raise AssertionError(f"{cmd}\n  the stage ran without parsing its arguments")
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 0 and ("-h" in argv or "--help" in argv):
            return argparse.Namespace()
        why = [line for line in err.getvalue().splitlines() if " error: " in line] or [err.getvalue().strip()]
        raise AssertionError(f"{cmd}\n  {why[-1]}") from None
    if hasattr(ns, "init_from_hf") and hasattr(ns, "checkpoint") and hasattr(ns, "name") \
            and not (parser.prog.endswith(" train") and stage == "train"):
        try:
            post_start.check_start_flags(ns, parser.prog, "a checkpoint", "a run")
        except UsageError as e:
            raise AssertionError(f"{cmd}\n  {parser.prog} refuses it: {e}") from None
    return ns


COMMANDS = all_commands()


def test_the_docs_show_commands_of_every_kind():
    """The collector finds what the docs show: README's stage list, a torchrun line, inline
    commands in docs/, chained commands (`&&`)."""
    stages = {_stage_and_args(c)[0] for c in COMMANDS}
    assert len(COMMANDS) > 100 and {"train", "sft", "dpo", "rl", "infer", "serve", "export"} <= stages
    assert any(c.text.startswith("torchrun") for c in COMMANDS)
    assert any(c.doc == "README.md" and "dpo train" in c.text for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.doc}:{c.line}")
def test_every_documented_command_parses(cmd, monkeypatch):
    parse_command(cmd, monkeypatch)


def test_a_command_the_parser_lacks_a_flag_for_fails(monkeypatch):
    """The negative case: a README-like command with a flag sft train does not have, and an
    export without its required --checkpoint, fail the check, naming the doc line and why."""
    readme = ("## Stages\n\n```bash\npython main.py sft train --checkpoint checkpoints/exp1 --lora \\\n"
              "    --no-such-flag 2   # LoRA\n```\n\nThen `python main.py export --format gguf`.\n")
    bad, missing = commands_in(readme, "README.md")
    assert (bad.line, bad.text.split()) == (4, "python main.py sft train --checkpoint checkpoints/exp1 --lora "
                                                "--no-such-flag 2".split())
    with pytest.raises(AssertionError, match=r"(?s)README.md:4: .*unrecognized arguments: --no-such-flag 2"):
        parse_command(bad, monkeypatch)
    with pytest.raises(AssertionError, match=r"(?s)README.md:8: .*required: --checkpoint"):
        parse_command(missing, monkeypatch)
    wrong_start = Command("README.md", 9, "python main.py dpo train --name x")
    with pytest.raises(AssertionError, match="needs exactly one of --checkpoint"):
        parse_command(wrong_start, monkeypatch)
    parse_command(Command("README.md", 1, "python main.py sft train --checkpoint path/to/run [--epochs N]"),
                  monkeypatch)


# --------------------------------------------------------------------------- names
def missing_names(text: str, name: str, folder: Path) -> list[str]:
    """Repository paths, links (against ``folder``, the doc's) and ``utils.x.y`` / ``utils/x.y``
    names in a doc's ``text`` that do not exist (``name``: the doc, for the messages)."""
    bad, fence, quoted = [], False, False
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{name}:{n}"
        if line.lstrip().startswith("```"):
            fence = not fence                       # a block without a language quotes a program's
            quoted = fence and line.strip() == "```"    # output: its words are the program's
            continue
        if quoted:
            continue
        for target in ([] if fence else LINK.findall(line)):      # code: no Markdown links in it
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (folder / target).exists() and _in_repo(folder / target) not in PENDING:
                bad.append(f"{where}: link {target}")
        for path in REPO_PATH.findall(line):
            tail = path.rsplit("/", 1)[-1]
            if (any(ch in path for ch in "*<>{}") or ".../" in path or path.endswith("/...")
                    or PLACEHOLDER.match(tail.split(".")[0])):
                continue
            if "." in tail and tail.rsplit(".", 1)[1] not in EXTENSIONS:
                continue                      # utils/x.name: a module's attribute (below)
            if not (ROOT / path).exists() and path not in PENDING:
                bad.append(f"{where}: {path}")
        for dotted in DOTTED.findall(line):
            if not _resolves(dotted.split(".")):
                bad.append(f"{where}: {dotted}")
        for module, attr in SLASHED.findall(line):
            if attr not in EXTENSIONS and not ((ROOT / f"{module}.py").exists()
                                               and _resolves([*module.split("/"), attr])):
                bad.append(f"{where}: {module}.{attr}")
    return bad


def _in_repo(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def test_pending_pages_are_still_pending():
    """An entry of PENDING whose page now exists is stale: drop it, so its links are checked."""
    assert [p for p in PENDING if (ROOT / p).exists()] == []


def _resolves(parts: list[str]) -> bool:
    """``parts`` name a module, or a module and attributes of it."""
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_file_and_function_a_doc_names_exists(doc):
    assert not missing_names(doc.read_text(encoding="utf-8"), str(doc.relative_to(ROOT)), doc.parent)


def test_a_stale_name_fails(tmp_path):
    """The names the issue found stale (a function that does not exist, a moved constant, a
    seeds/ file outside the repository, a link to nothing) are each reported; a real one is not."""
    text = ("See `utils.training.checkpoint.load_checkpoint` and `utils/metrics.PEAK_FLOPS`,\n"
            "seeds/000/notes.md and [it](nowhere.md); `utils.run.load_checkpoint` is fine.\n")
    bad = {b.split(": ", 1)[1] for b in missing_names(text, "x.md", tmp_path)}
    assert bad == {"utils.training.checkpoint.load_checkpoint", "utils/metrics.PEAK_FLOPS",
                   "link nowhere.md", "seeds/000/notes.md"}


# --------------------------------------------------------------------------- --help and the map
def test_every_stage_help_starts_with_main_py_stage_and_words_its_test_flag(monkeypatch):
    """`--help` of every stage starts with `usage: main.py STAGE` (not train.py, inference.py,
    ...), and its shared flags come once, in their own group, --test worded for the stage."""
    import main as router
    from utils.cli import NO_TEST_MODE
    texts = {}
    for name, st in router.STAGES.items():
        module = importlib.import_module(st.module)
        for sub in (["prepare", "train"] if name in ("sft", "dpo") else [""]):
            out = io.StringIO()
            argv = [sub, "--help"] if sub else ["--help"]
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
                module.main(argv)
            label = f"{name} {sub}".strip()
            text = out.getvalue()
            assert text.startswith(f"usage: main.py {label} "), text[:80]
            assert text.count("shared by every stage:") == 1, label
            texts[label] = text
    for quick in ("train", "clean", "prepare", "fineweb", "tokenize", "sft prepare", "dpo prepare", "dpo train",
                  "rl", "benchmark"):
        assert "quick mode:" in texts[quick], quick
    for none in ("status", "report", "export", "serve", "infer"):
        assert " ".join(NO_TEST_MODE.split()[:4]) in " ".join(texts[none].split()), none


def design_layers() -> list[set[str]]:
    """docs/DESIGN.md's layer list (bottom first), as the module names LAYERS holds."""
    import tests.test_layout as layout
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    block = text.split("Imports run one way", 1)[1].split("```", 2)[1]
    rows = {}
    for line in block.strip().splitlines():
        m = re.match(r"\s*(\d+)\s+(.*)$", line)
        if not m:
            continue
        items = re.split(r"\s{2,}", m.group(2).strip())[0]
        if items == "the stage scripts":
            rows[int(m.group(1))] = set(layout.STAGES)
            continue
        names = set()
        for item in (i.strip() for i in items.split(",")):
            path = item.rstrip("/")
            path = path[:-3] if path.endswith(".py") else path
            if "/" not in path and (ROOT / "utils" / f"{path}.py").exists():
                path = f"utils/{path}"
            names.add(path.replace("/", "."))
        rows[int(m.group(1))] = names
    return [rows[k] for k in sorted(rows)]


def test_design_layer_list_is_test_layouts():
    import tests.test_layout as layout
    assert design_layers() == [set(layer) for layer in layout.LAYERS]
