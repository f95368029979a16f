"""The exit-code contract of utils/cli.run_stage, driven as a user meets it: a stage that hits
an error nobody planned for ends with one paragraph naming what failed and where (exit 1);
the traceback goes into a log file that the message names, or to the terminal with --debug."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT, default_signals, offline_env, write_config

STAGE = textwrap.dedent("""
    import sys
    from utils.cli import StageParser, run_stage

    def helper(n):
        return 1 / n                      # the bug

    def main(argv=None):
        args, cfg = StageParser("demo_stage.py", "a stage with a bug").parse(argv)
        return helper(0)

    if __name__ == "__main__":
        run_stage(main)
""")


def _run(tmp_path, *args):
    script = tmp_path / "demo_stage.py"
    script.write_text(STAGE)
    cfg = write_config(tmp_path, {"paths": {"logs_dir": str(tmp_path / "logs")}})
    return subprocess.run([sys.executable, str(script), "--config", str(cfg), *args],
                          capture_output=True, text=True, timeout=120,
                          env=offline_env(PYTHONPATH=ROOT), cwd=tmp_path)


def test_unexpected_error_is_one_paragraph_and_a_log(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert "Traceback" not in err and "\n" not in err, err          # one paragraph
    assert "unexpected error in stage" in err and "ZeroDivisionError: division by zero" in err
    assert "demo_stage.py" in err and "helper" in err                # where it happened
    log = Path(re.search(r"The full traceback is in (\S+?\.log)", err).group(1))
    assert log.parent == tmp_path / "logs" / "errors"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "return 1 / n" in text
    assert "--debug" in err


def test_an_unexpected_error_in_a_command_with_non_utf8_bytes_is_reported_and_logged(tmp_path):
    """A --config path that is not UTF-8: the error log's writer failed on its bytes
    (UnicodeEncodeError), printed two tracebacks and left an empty log; the byte is now
    written as \\xff."""
    script = tmp_path / "demo_stage.py"
    script.write_text(STAGE)
    cfg = Path(os.fsdecode(bytes(tmp_path) + b"/c\xff.json"))
    cfg.write_text(json.dumps({"paths": {"logs_dir": str(tmp_path / "logs")}}))
    proc = subprocess.run([sys.executable, str(script), "--config", str(cfg)], capture_output=True, text=True,
                          timeout=120, env=offline_env(PYTHONPATH=ROOT), cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "unexpected error in stage" in proc.stderr and "ZeroDivisionError" in proc.stderr
    logs = list((tmp_path / "logs" / "errors").glob("*.log"))
    assert len(logs) == 1 and "c\\xff.json" in logs[0].read_text() and "return 1 / n" in logs[0].read_text()


def test_a_stop_signal_that_breaks_something_on_its_way_is_still_a_stop_exit_130(tmp_path):
    """Ctrl-C in a stage's first seconds lands inside ``import torch``; its native modules then
    fail with ImportError ("cannot load module more than once per process"), which was
    reported as an unexpected error, exit 1, "may be a bug". A failure after the stop signal
    is the stop: exit 130, naming what it cut short; the traceback is logged."""
    script = tmp_path / "slow_import.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        from utils.cli import StageParser, run_stage

        def main(argv=None):
            StageParser("slow_import.py", "a stage whose import a signal breaks").parse(argv)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            except KeyboardInterrupt:
                raise ImportError("cannot load module more than once per process") from None

        if __name__ == "__main__":
            run_stage(main)
    """))
    cfg = write_config(tmp_path, {"paths": {"logs_dir": str(tmp_path / "logs")}})
    proc = subprocess.run([sys.executable, str(script), "--config", str(cfg)], capture_output=True, text=True,
                          timeout=120, env=offline_env(PYTHONPATH=ROOT), cwd=tmp_path,
                          preexec_fn=default_signals)             # a Ctrl-C as a terminal's, even under nohup
    assert proc.returncode == 130, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("slow_import.py: interrupted by user (Ctrl-C); it cut short ImportError: cannot load "
                          "module more than once per process (traceback: "), err
    assert "unexpected error" not in err and "Traceback" not in err
    log = Path(re.search(r"\(traceback: (\S+?\.log)\)", err).group(1))
    assert "raise ImportError" in log.read_text()


def test_debug_prints_the_traceback(tmp_path):
    proc = _run(tmp_path, "--debug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "return 1 / n" in proc.stderr


def test_real_stage_output_dir_that_cannot_be_created(tmp_path):
    """A path blocked by a file: the stage says so in one paragraph, exit 1, no traceback."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    cfg = write_config(tmp_path, {"paths": {"logs_dir": str(tmp_path / "logs")}})
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "clean", "--config", str(cfg),
                           "--input-dir", str(ROOT / "data" / "samples" / "enwiki"),
                           "--output-dir", str(blocker / "out"), "--test"],
                          capture_output=True, text=True, timeout=300, env=offline_env())
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(blocker) in proc.stderr
    assert blocker.read_text() == "a file, not a folder"


def test_cuda_asked_for_without_cuda_is_a_usage_error(tmp_path):
    """One device rule (utils/device.py) for every stage: no silent CPU fallback."""
    import pytest
    import torch
    from utils.cli import UsageError
    from utils.device import resolve_device
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen here")
    assert resolve_device("auto").type == "cpu" and resolve_device("cpu").type == "cpu"
    for setting in ("training.device", "inference.device", "benchmark.device"):
        with pytest.raises(UsageError, match=re.escape(f"{setting} is 'cuda:1'")):
            resolve_device("cuda:1", setting)
    cfg = write_config(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "train", "--config", str(cfg),
                           "--test", "--device", "cuda", "--name", "x"], capture_output=True,
                          text=True, env=offline_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "training.device is 'cuda' but CUDA is not available" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "checkpoints" / "x").exists()


def test_argv_without_drops_flags_and_their_values():
    from utils.cli import argv_without
    argv = ["--test", "--resume", "auto", "--name=x", "--lr", "1e-3", "--resume=p.pt", "--name", "y"]
    assert argv_without(argv, ("--resume", "--name")) == ["--test", "--lr", "1e-3"]
    assert argv_without(["--resumeX", "1"], ("--resume",)) == ["--resumeX", "1"]


def test_no_flag_of_any_stage_states_its_default_twice(monkeypatch):
    """A help text that wrote its default itself ("... (default: other)") got the formatter's
    added too: `export --help` said "(default: other) (default: other)". Every stage's parsers
    are built in process (parse stops at once) and every flag's help is expanded as --help
    prints it."""
    import importlib

    import pytest

    import main as router
    from utils.cli import StageParser
    parsers = []

    class Built(Exception):
        pass

    def built(self, argv=None):
        parsers.append(self)
        raise Built

    monkeypatch.setattr(StageParser, "parse", built)
    for name, stage in router.STAGES.items():
        module = importlib.import_module(stage.module)
        for argv in ([["prepare"], ["train"]] if name in ("sft", "dpo") else [[]]):
            with pytest.raises(Built):
                module.main(argv)
    assert len(parsers) == len(router.STAGES) + 2
    twice = [f"{p.prog} {'/'.join(a.option_strings)}: {text}" for p in parsers for a in p._actions
             if a.help and (text := p._get_formatter()._expand_help(a)).count("(default:") > 1]
    assert not twice, twice
