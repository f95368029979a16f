"""`make gpu-check` (perf/gpu_check.py) without a GPU: its arguments, the summary and table it
writes from given part results, that every part is listed everywhere it must be, and a
--dry-run of the parts that need CUDA on this CPU machine writing a valid summary. The whole
--dry-run (a tiny training run, a SIGTERM and resume, the server with 8 streams on the CPU) is
the slow opt-in test at the end (about 3 minutes on 2 cores)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from perf import gpu_check as G
from tests.conftest import ROOT, default_signals, offline_env, wait_for_line


def _exit_code(argv) -> int:
    with pytest.raises(SystemExit) as e:
        G.parse_args(argv)
    return e.value.code


def test_arguments_defaults_subsets_and_refusals(capsys):
    a = G.parse_args([])
    assert (a.parts, a.steps, a.budget_s, a.device, a.dry_run) == (list(G.PARTS), 300, 480, "auto", False)
    assert a.out == ROOT / "gpu_check"
    d = G.parse_args(["--dry-run", "--device", "cpu", "--steps", "6", "--out", "x"])
    assert (d.steps, d.budget_s, d.device, str(d.out)) == (6, G.DRY_BUDGET_S, "cpu", "x")
    assert G.parse_args(["--parts", "serve,decode,serve"]).parts == ["decode", "serve"]   # documented order, once
    assert G.parse_args(["--device", "cuda:1", "--budget-s", "100"]).budget_s == 100
    capsys.readouterr()
    for bad, said in ((["--parts", "decode,trian"], "unknown part(s) trian"), (["--parts", ""], "none given"),
                      (["--steps", "0"], "positive integer"), (["--device", "gpu"], "auto, cpu, cuda or cuda:N"),
                      (["--out", ""], "folder of its own"), (["--budget-s", "-5"], "positive integer")):
        assert _exit_code(bad) == 2, bad
        assert said in capsys.readouterr().err, bad


def test_summary_and_table_from_given_part_results(tmp_path):
    results = [
        G.PartResult("train-flash", "pass", "512,346 tokens/s", 95.25,
                     metrics={"tokens_per_s": 512345.6, "mfu": 0.4712},
                     goals=[G.Goal("MFU >= 45%", True, 0.4712)]),
        G.PartResult("train-sdpa", "fail", "attention was 'x'", 80.0, goals=[G.Goal("MFU >= 45%", False, 0.301)]),
        G.PartResult("fsdp", "skipped", "no CUDA"),
        G.PartResult("decode", "timeout", "no line in time", 60.0),
        G.PartResult("serve", "error", "RuntimeError: child exited with 1", 3.0,
                     goals=[G.Goal("MFU >= 45%", None)]),
    ]
    with pytest.raises(ValueError, match="status must be one of"):
        G.PartResult("serve", "passed", "")
    s = G.summarize(results, {"mode": "full", "finished": "2026-12-07 21:00 UTC", "seconds": 238.25,
                              "budget_s": 480, "device": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0+cu130",
                                                          "flash_attn": "2.8.3"}})
    assert s["ok"] is False and s["failed"] == ["train-sdpa", "decode", "serve"]
    assert s["counts"] == {"pass": 1, "fail": 1, "skipped": 1, "timeout": 1, "error": 1}
    assert [p["name"] for p in s["parts"]] == ["train-flash", "train-sdpa", "fsdp", "decode", "serve"]
    assert json.loads(json.dumps(s)) == s                      # plain JSON
    t = G.table(s)
    assert "NVIDIA H100 80GB HBM3" in t and "torch 2.13.0+cu130" in t and "238.2 s of a 480 s budget" in t
    assert re.search(r"^train-flash\s+pass\s+95\.2 s\s+512,346 tokens/s \(goal MFU >= 45%: met\)$", t, re.M), t
    assert "(goal MFU >= 45%: NOT met)" in t and "(goal MFU >= 45%: n/a)" in t
    assert re.search(r"^fsdp\s+skipped\s+0\.0 s\s+no CUDA$", t, re.M), t
    assert t.rstrip().endswith("1 passed, 1 failed, 1 timed out, 1 errors, 1 skipped: FAILED")
    assert G.summarize([results[0], results[2]], {})["ok"] is True      # skipped parts do not fail a check
    assert (G.fmt_num(512345.6), G.fmt_num(0.4712, "pct"), G.fmt_num(None), G.fmt_num(float("nan")),
            G.fmt_num(0.0784, "ms"), G.fmt_num(12.3456)) == ("512,346", "47.1%", "n/a", "n/a", "78 ms", "12.3")
    js, txt = G.write_outputs(tmp_path / "out", s)
    assert json.loads(js.read_text()) == s and txt.read_text() == t


def test_train_metrics_and_pytest_report_are_read_as_written(tmp_path):
    recs = [{"step": 10, "loss": 10.4, "tokens_per_s": 1000.0, "mfu": 0.05, "peak_memory_mb": 900.0},
            {"step": 20, "loss": 9.0, "tokens_per_s": 5000.0, "mfu": 0.40, "peak_memory_mb": 1200.0},
            {"step": 30, "loss": 8.5, "tokens_per_s": 6000.0, "mfu": 0.50, "peak_memory_mb": 1100.0},
            {"step": 40, "loss": 8.0, "tokens_per_s": 5500.0, "mfu": 0.45, "peak_memory_mb": 1000.0}]
    m = G.throughput(recs)                 # the first interval (the compile) left out of the medians
    assert (m["tokens_per_s"], m["mfu"], m["peak_memory_mb"]) == (5500.0, 0.45, 1200.0)
    assert (m["steps"], m["first_loss"], m["last_loss"], m["intervals"]) == (40, 10.4, 8.0, 3)
    assert G.throughput([])["tokens_per_s"] is None
    xml = tmp_path / "r.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="6" failures="1" '
                   'errors="0" skipped="2"></testsuite></testsuites>')
    assert G.junit_counts(xml) == {"tests": 6, "failed": 1, "errors": 0, "skipped": 2, "passed": 3}


def test_every_part_is_listed_and_every_cuda_test_selected_by_the_marker():
    assert set(G.PARTS) == set(G.PART_FUNCS) == set(G.TIMEOUTS) - {"data"} == set(G.DRY_TIMEOUTS) - {"data"}
    assert G.NEEDS_CUDA <= set(G.PARTS) and G.NEEDS_DATA <= set(G.PARTS)
    assert max(G.TIMEOUTS.values()) < G.BUDGET_S
    doc = (ROOT / "docs" / "gpu.md").read_text()
    assert all(f"`{p}`" in doc for p in G.PARTS), [p for p in G.PARTS if f"`{p}`" not in doc]
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bgpu-check\b", make, re.M) and re.search(r"^gpu-check:", make, re.M)
    assert "/gpu_check/" in (ROOT / ".gitignore").read_text().splitlines()
    # tests/test_compiled.py's GPU test takes tests/test_model.py's `cuda`: the marker itself
    # (which tests/conftest.py turns into a skip without CUDA), so `pytest -m cuda` selects it
    model_src = (ROOT / "tests" / "test_model.py").read_text()
    compiled_src = (ROOT / "tests" / "test_compiled.py").read_text()
    assert re.search(r"^cuda = pytest\.mark\.cuda$", model_src, re.M)
    assert re.search(r"^from tests\.test_model import .*\bcuda\b", compiled_src, re.M)
    assert "@cuda\ndef test_compiled_step_with_cuda_graphs_equals_the_eager_one_on_cuda" in compiled_src
    names = {p.name for p in G.cuda_test_files()}
    assert {"test_model.py", "test_compiled.py", "test_fsdp.py"} <= names


def test_dry_run_on_the_cpu_writes_a_valid_summary(tmp_path, capsys):
    """The parts that need CUDA, asked for on this CPU machine: each reported skipped, the
    summary and table written, and `cuda-tests` listing what `pytest -m cuda` selects (the
    compiled step's GPU test among them); without --dry-run the check refuses to start (exit 2)."""
    out = tmp_path / "gc"
    assert G.main(["--device", "cpu", "--parts", "decode", "--out", str(out)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not (out / "summary.json").exists()
    code = G.main(["--dry-run", "--device", "cpu", "--parts", "cuda-tests,train-flash,fsdp,decode", "--out", str(out)])
    assert code == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["mode"] == "dry-run" and s["ok"] is True and s["device"]["type"] == "cpu"
    assert s["device"]["torch"].startswith("2.13")
    tests, n = s["parts"][0]["metrics"]["tests"], len(G.cuda_test_files())
    assert [(p["name"], p["status"], p["summary"]) for p in s["parts"]] == [
        ("cuda-tests", "skipped", f"no CUDA ({len(tests)} tests selected by -m cuda in {n} files)"),
        ("train-flash", "skipped", "no CUDA"), ("fsdp", "skipped", "no CUDA"), ("decode", "skipped", "no CUDA")]
    assert {"tests/test_compiled.py::test_compiled_step_with_cuda_graphs_equals_the_eager_one_on_cuda",
            "tests/test_model.py::test_cuda_bf16_paths_match_sdpa"} <= set(tests)
    assert all("cuda" in t or "gpu" in t for t in tests), tests         # only the GPU tests
    assert s["parts"][0]["log"] == "logs/cuda-tests.log"
    assert (out / "summary.txt").read_text() == G.table(s)
    cfg = json.loads((out / "work" / "gpu_check.json").read_text())
    assert cfg["paths"]["root"] == str(out / "work")


def test_sigterm_stops_the_running_part_and_keeps_what_was_done(tmp_path, capsys, monkeypatch):
    """SIGTERM (or Ctrl-C) during a part: its processes are stopped, the summary holds the
    parts done so far and the interrupted one, exit 130. --out naming a file, or the offline
    samples missing: exit 2, nothing written."""
    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert G.main(["--dry-run", "--device", "cpu", "--parts", "decode", "--out", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err and afile.read_text() == "x"
    with monkeypatch.context() as m:
        m.setattr(G, "SPM_MODEL", G.SAMPLES / "tokenizers" / "no-such" / "tokenizer.model")
        assert G.main(["--dry-run", "--device", "cpu", "--parts", "decode", "--out", str(tmp_path / "o")]) == 2
    assert "run `make samples`" in capsys.readouterr().err and not (tmp_path / "o").exists()
    out = tmp_path / "gc"
    proc = subprocess.Popen([sys.executable, str(ROOT / "perf" / "gpu_check.py"), "--dry-run", "--device", "cpu",
                             "--parts", "decode,serve", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=offline_env(), preexec_fn=default_signals)
    wait_for_line(proc, "gpu-check: serve ...", timeout=60)          # its first child starting
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest
    s = json.loads((out / "summary.json").read_text())
    assert [(p["name"], p["status"]) for p in s["parts"]] == [("decode", "skipped"), ("serve", "error")]
    assert s["parts"][1]["summary"] == "interrupted (SIGTERM): its processes were stopped"
    assert "interrupted during serve" in rest


@pytest.mark.slow
def test_dry_run_of_every_part_on_the_cpu(tmp_path):
    """The whole --dry-run as `make gpu-check` starts it, on the CPU: the tiny training run
    (SDPA), SIGTERM then --resume auto bit for bit, 8 streamed chats through the server,
    the cuda tests counted; the CUDA-only parts skipped."""
    out = tmp_path / "gc"
    p = subprocess.run([sys.executable, str(ROOT / "perf" / "gpu_check.py"), "--dry-run", "--device", "auto",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, env=offline_env())
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["device"]["type"] == "cpu" and s["device"]["flash_attn_error"]      # probed: no CUDA here
    parts = {x["name"]: x for x in s["parts"]}
    assert {k: v["status"] for k, v in parts.items()} == {
        "cuda-tests": "skipped", "train-flash": "skipped", "train-sdpa": "pass", "resume": "pass",
        "fsdp": "skipped", "decode": "skipped", "serve": "pass"}
    assert parts["resume"]["metrics"]["bit_exact"] and parts["resume"]["metrics"]["losses_equal"]
    assert parts["train-sdpa"]["metrics"]["attention"].startswith("PyTorch SDPA")
    assert parts["train-sdpa"]["metrics"]["tokens_per_s"] > 0
    assert parts["serve"]["metrics"]["ok_streams"] == 8 and parts["serve"]["metrics"]["exit_code"] == 130
    assert parts["cuda-tests"]["metrics"]["selected"] >= 5
