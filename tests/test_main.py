"""The router: CLI mode through subprocess runs, the interactive menu through a real pty."""
from __future__ import annotations

import ast
import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from tests.conftest import (ROOT, default_signals, main_command, offline_env, run_main, stage_pid,
                            wait_until_blocked)

sys.path.insert(0, str(ROOT))
import main  # noqa: E402

# Root-level Python files that are libraries, not stages.
LIBRARIES = {"main.py", "model.py", "dataloader.py"}


def test_help_lists_every_stage_with_description():
    proc = run_main("--help")
    assert proc.returncode == 0
    for name, stage in main.STAGES.items():
        line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(name + " "))
        assert stage.description in line
    assert "alias: cleanup" in proc.stdout and "alias: inference" in proc.stdout


def test_unknown_stage_exits_2_with_suggestion():
    proc = run_main("trian")
    assert proc.returncode == 2
    assert "unknown stage 'trian'" in proc.stderr and "Did you mean 'train'?" in proc.stderr


def test_aliases_resolve_to_their_stage():
    assert main.resolve_stage("cleanup") == "clean"
    assert main.resolve_stage("inference") == "infer"
    proc = run_main("cleanup", "--help")
    assert proc.returncode == 0 and "usage: " in proc.stdout and "--input-dir" in proc.stdout


def test_double_dash_forwards_arguments_verbatim():
    proc = run_main("samples", "--", "--list")
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer.model" in proc.stdout and "mistral-common==1.13.1" in proc.stdout
    # Without "--" the same arguments reach the stage too.
    assert run_main("samples", "--list").stdout == proc.stdout


def test_stage_exit_code_propagates(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {"lr": "fast"}}')
    proc = run_main("samples", "--config", bad)
    assert proc.returncode == 2
    assert "training.lr: expected a number" in proc.stderr
    proc = run_main("samples", "--config", tmp_path / "missing.json")
    assert proc.returncode == 2 and "missing.json: file not found" in proc.stderr


def test_stage_code_comes_from_the_pipeline_not_the_working_folder(tmp_path):
    """A user runs main.py from their own project folder, which holds a ``utils/`` package and
    a ``status.py`` of its own: the stage still runs the pipeline's code, not theirs."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text('raise SystemExit("the folder\'s utils ran")\n')
    (tmp_path / "status.py").write_text('raise SystemExit("the folder\'s status.py ran")\n')
    (tmp_path / "model.py").write_text('raise SystemExit("the folder\'s model.py ran")\n')
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"paths": {"root": str(tmp_path / "work")}}))
    proc = run_main("status", "--config", cfg, cwd=tmp_path)
    assert "ran" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "No training runs yet" in proc.stdout, proc.stdout


@pytest.mark.parametrize("closed", [">&-", "2>&-", "<&-"])
def test_a_stage_started_with_a_closed_standard_stream_runs_and_exits_0(tmp_path, closed):
    """``main.py status >&-`` ended in an AttributeError traceback (a None sys.stdout flushed),
    exit 1; the menu's input() failed on a closed stdin. Now a closed descriptor is /dev/null
    (utils/stdio.py): the stage runs and says nothing where nothing can be read."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"paths": {"root": str(tmp_path / "work")}}))
    cmd = " ".join(shlex.quote(str(a)) for a in main_command("status", "--config", cfg))
    proc = subprocess.run(["/bin/sh", "-c", f"{cmd} {closed}"], capture_output=True, text=True,
                          env=offline_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert ("No training runs yet" in proc.stdout) == (closed != ">&-"), proc.stdout


def test_the_menu_with_stdin_closed_ends_as_at_end_of_input():
    """``main.py <&-``: input() raised RuntimeError("lost sys.stdin"), a traceback."""
    menu = " ".join(shlex.quote(str(a)) for a in main_command())
    proc = subprocess.run(["/bin/sh", "-c", f"{menu} <&-"], capture_output=True, text=True,
                          env=offline_env(), timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "LLM training pipeline" in proc.stdout


def test_python_older_than_3_11_is_named():
    assert main.python_too_old((3, 11, 0)) is None and main.python_too_old((3, 13, 1, "final", 0)) is None
    why = main.python_too_old((3, 10, 13, "final", 0))
    assert "needs Python 3.11 or newer" in why and "Python 3.10.13" in why


def test_an_older_python_running_main_py_gets_that_message_and_exit_1(tmp_path):
    """With Python 3.10 the stages failed with "Unknown option: -P" (stage_command)."""
    import glob
    import shutil

    def runs_older(path) -> bool:                      # a pyenv shim may name one it cannot run
        r = subprocess.run([path, "-c", "import sys; print(sys.version_info < (3, 11))"],
                           capture_output=True, text=True, timeout=30)
        return r.returncode == 0 and r.stdout.strip() == "True"
    found = [shutil.which(f"python3.{m}") for m in (10, 9, 8)]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.[89]*/bin/python")))
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python")))
    old = next((p for p in found if p and runs_older(p)), None)
    if old is None:
        pytest.skip("no Python 3.8-3.10 installed to run main.py with")
    proc = subprocess.run([old, str(ROOT / "main.py"), "status"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "needs Python 3.11 or newer" in proc.stderr and "Unknown option" not in proc.stderr


def test_an_empty_pythonpath_entry_does_not_let_the_working_folder_in(tmp_path):
    """``PYTHONPATH=/x:`` (an empty entry: the working folder to Python) put a difflib.py of
    the folder into the router and a numpy.py into the stage, ahead of the standard library
    and the installed packages."""
    for name in ("difflib", "numpy", "json"):
        (tmp_path / f"{name}.py").write_text(f'raise SystemExit("the folder\'s {name}.py ran")\n')
    cfg = tmp_path / "config.json"
    cfg.write_text('{"paths": {"root": "%s"}}' % (tmp_path / "work"))
    for pythonpath in (f"{tmp_path / 'elsewhere'}:", ":"):
        env = offline_env(PYTHONPATH=pythonpath)
        for args in (("status", "--config", cfg), ("nosuchstage",), ("tokenize", "--config", cfg, "--encode", "hi")):
            proc = run_main(*args, cwd=tmp_path, env=env)
            assert "ran" not in proc.stdout + proc.stderr, (args, proc.stderr)
            assert proc.returncode in (0, 1, 2) and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert run_main("status", "--config", cfg, cwd=tmp_path, env=env).returncode == 0


def test_standard_output_that_refuses_its_bytes_is_named_not_a_bug(tmp_path):
    """``> /dev/full``: a stage reported "unexpected error ... may be a bug" and wrote a traceback
    log each time; the router ended in two tracebacks. Both now name standard output, exit 1."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"paths": {"root": str(tmp_path / "work")}}))
    for args, prog in ((("status", "--config", cfg), "status.py"), (("--help",), "main.py")):
        with open("/dev/full", "w") as full:
            proc = subprocess.run(main_command(*args), stdout=full, stderr=subprocess.PIPE, text=True,
                                  env=offline_env(), timeout=120, cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip() == (f"{prog}: error: cannot write to standard output: No space left on "
                                       f"device; send the output somewhere that takes it."), proc.stderr
    assert not (tmp_path / "work" / "logs" / "errors").exists()


def test_utf8_text_under_an_ascii_locale_is_told_to_use_a_utf8_one(tmp_path):
    """LC_ALL=C with PYTHONUTF8=0: Python reads argv as ASCII, so a UTF-8 run name was called
    "bytes that are not UTF-8 text"; the advice now names the locale."""
    env = offline_env(LC_ALL="C", PYTHONUTF8="0")
    proc = subprocess.run(main_command("status", "démo"), capture_output=True, env=env, timeout=60, cwd=tmp_path)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "LC_ALL=C.UTF-8" in err and "not UTF-8 text" not in err, err


def _open_fifo_writer(fifo: Path, timeout: float = 60.0) -> int:
    """Open a FIFO for writing once a reader has it open (i.e. the stage is blocked on it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_ctrl_c_in_stage_exits_130_cli(tmp_path):
    """A stage waiting on its --config (a FIFO) is interrupted; the router returns 130."""
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "samples", "--config", str(fifo)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=offline_env(), start_new_session=True,
                            preexec_fn=default_signals)   # as a terminal would, even under nohup
    fd = _open_fifo_writer(fifo)
    try:
        wait_until_blocked(stage_pid(proc.pid))  # in read(), not just past open()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 130, err
    assert "interrupted by user" in err and "Traceback" not in err


def test_registry_matches_scripts_on_disk():
    stage_scripts = {p.name for p in ROOT.glob("*.py")} - LIBRARIES
    registered = {st.script.name for st in main.STAGES.values() if st.script.parent == ROOT}
    assert stage_scripts <= registered, f"stage scripts missing from STAGES: {stage_scripts - registered}"
    for name in main.MENU_ORDER:
        assert name in main.STAGES
    assert set(main.MENU_ORDER) == set(main.STAGES)
    # The DESIGN's stage scripts are all registered, built or not.
    for script in ["cleaner.py", "tokenizer.py", "dataset_prep.py", "fineweb_prep.py", "train.py",
                   "post_training.py", "inference.py", "benchmark.py"]:
        assert script in registered


@pytest.mark.parametrize("name", list(main.STAGES))
def test_each_stage_is_built_and_importable_or_says_not_built(name, tmp_path):
    """A stage's script exists (or it is marked planned), imports without side effects, guards
    its main, and parses --help under -OO, listing --config and --test."""
    stage = main.STAGES[name]
    if stage.planned:
        # Only a stage marked planned may lack its script, and the mark goes once it exists.
        assert not stage.built, f"{stage.script.name} exists: drop planned= from STAGES['{name}']"
        proc = run_main(name, "--test")
        assert proc.returncode == 2 and f"is not built yet ({stage.planned})" in proc.stderr
        return
    assert stage.built, f"stage '{name}': {stage.script} is missing"
    # Importing a stage module has no side effects: no output, no files written.
    code = f"import {stage.module}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=offline_env(PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []
    # Its main is guarded and it accepts --config and --test.
    tree = ast.parse(stage.script.read_text())
    guarded = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guarded, f"{stage.script.name} has no `if __name__ == '__main__'` guard"
    # Its --help, under PYTHONOPTIMIZE=2 (-OO strips docstrings: three stages built their parser
    # from theirs, AttributeError on None).
    proc = run_main(name, "--help", env=offline_env(PYTHONOPTIMIZE="2"), timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
    helptext = proc.stdout
    assert "--config" in helptext and "--test" in helptext
    assert "CFG__" not in helptext, "a config flag shows its internal dest as its metavar"


# ----------------------------------------------------------------------------- menu (pty)
def _spawn_menu(tmp_path):
    child = pexpect.spawn(sys.executable, [str(ROOT / "main.py")], cwd=str(tmp_path),
                          env=offline_env(), encoding="utf-8", timeout=120, dimensions=(50, 200),
                          preexec_fn=default_signals)   # a terminal's defaults, even under nohup
    child.expect(r"Choose a stage \[1-(\d+)\]: ")
    return child


def _menu_number(name: str) -> str:
    return str(main.MENU_ORDER.index(name) + 1)


def test_menu_runs_stage_then_another_then_quits(tmp_path):
    child = _spawn_menu(tmp_path)
    for name in main.MENU_ORDER:
        assert name in child.before
    child.sendline(_menu_number("samples"))
    child.expect("Arguments for 'samples'")
    child.sendline("--list")
    child.expect("mistral-common==1.13.1")
    child.expect("Stage 'samples' finished successfully.")
    child.expect(r"Run another stage\? \[y/N\]: ")
    child.sendline("y")
    child.expect(r"Choose a stage")
    bad = tmp_path / "bad config.json"  # a space: arguments are split like a shell would
    bad.write_text("{ not json")
    child.sendline("samples")  # names work as well as numbers
    child.expect("Arguments for 'samples'")
    child.sendline(f"--config '{bad}'")
    child.expect(r"line 1 column 3: invalid JSON")
    child.expect("Stage 'samples' failed with code 2.")
    child.expect(r"Run another stage\? \[y/N\]: ")
    child.sendline("y")
    child.expect(r"Choose a stage \[1-(\d+)\]: ")
    quit_no = child.match.group(1)
    child.sendline("42")
    child.expect("not a menu choice")
    child.expect(r"Choose a stage")
    child.sendline(quit_no)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2  # the last stage's code


def test_menu_ctrl_c_in_stage_returns_to_menu(tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    child = _spawn_menu(tmp_path)
    child.sendline(_menu_number("samples"))
    child.expect("Arguments for 'samples'")
    child.sendline(f"--config {fifo}")
    fd = _open_fifo_writer(fifo)  # the stage has its config open
    try:
        wait_until_blocked(stage_pid(child.pid))  # and now waits in read()
        child.sendintr()  # Ctrl-C on the terminal
        child.expect("interrupted by user")
        child.expect(r"Stage 'samples' was interrupted \(exit 130\); completed work is kept")
    finally:
        os.close(fd)
    child.expect(r"Run another stage\? \[y/N\]: ")
    child.sendline("y")
    child.expect(r"Choose a stage")  # the menu survived
    child.sendline("quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130  # the last stage's code


def test_menu_ctrl_c_at_prompt_exits_130(tmp_path):
    child = _spawn_menu(tmp_path)
    wait_until_blocked(child.pid)  # waiting for the choice
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130


def test_router_pid_variable_has_one_name_in_main_and_the_stages():
    """main.py does not import the project's modules (its start stays fast), so the name of the
    variable that tells a stage its router's pid is written in both; they must agree, or a
    stage would run on after main.py is killed (tests/test_train.py drives that case)."""
    from utils import cli
    assert main.ROUTER_PID_ENV == cli.ROUTER_PID_ENV
