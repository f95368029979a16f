"""`python main.py report`: a run's report from what the stages wrote, checked against those
files themselves.

One module-scoped set of real runs, each made by the CLI a user types: a tiny pre-training run
interrupted by SIGINT after step 4 and resumed to step 12 (tests/conftest.py's shard set of
the real news sample), an SFT run fine-tuned from its best checkpoint, and two benchmark
result files with the same settings (the base checkpoint in one, the SFT checkpoint in the
other, so the report must bring them together as scored on the same items). Reports are
written through main.py as subprocesses.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pytest

from tests.conftest import (SPM_MODEL, paused_env, popen_main, run_main, run_stage, wait_for_line,
                            write_config)
from utils.training.logging_utils import latest_per_step, read_jsonl

TOTAL = 12
FLAGS = ["--window", "32", "--batch-size", "2", "--eval-batches", "2", "--sample-tokens", "4",
         "--log-every", "2", "--warmup-steps", "2", "--eval-steps", "4"]
BENCH = ["--test", "--tasks", "perplexity,lambada", "--limit", "perplexity=2", "--limit", "lambada=2"]


def ok(proc, code: int = 0):
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def work(tmp_path_factory, train_shards, samples):
    root = tmp_path_factory.mktemp("report")
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                              "dataset": {"wikipedia_test_dir": str(train_shards)},
                              "logging": {"tensorboard": False}})
    train = ["train", "--test", "--config", cfg, *FLAGS, "--name", "base", "--max-steps", TOTAL]
    p = popen_main(*train, env=paused_env(4))
    wait_for_line(p, "paused after step 4")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 130, f"{out}\n{err}"
    ok(run_stage(*train, "--resume", "auto", timeout=300))
    ok(run_stage("sft", "prepare", "--config", cfg, "--dataset", "samples", "--limit", "24",
                "--max-length", "96"))
    base = root / "checkpoints" / "base" / "checkpoint_best.pt"
    ok(run_stage("sft", "train", "--config", cfg, "--checkpoint", base, "--name", "rep",
                "--batch-size", "4", "--max-steps", "4", "--log-every", "1", "--sample-tokens", "4",
                timeout=300))
    sft = next((root / "checkpoints").glob("sft_rep_*"))
    results = root / "benchmark_results"
    ok(run_stage("benchmark", "--config", cfg, *BENCH, base, "--output-dir", results, timeout=300))
    ok(run_stage("benchmark", "--config", cfg, *BENCH, sft / "checkpoint_best.pt", "--output-dir",
                results, timeout=300))
    return {"root": root, "cfg": cfg, "sft": sft.name, "results": sorted(results.glob("*.json"))}


def report(work, *args, out="reports", process=False):
    """`main.py report` in this process (conftest.run_stage), or with ``process`` as its own."""
    return (run_main if process else run_stage)("report", "--config", work["cfg"], *map(str, args),
                                                "--out", work["root"] / out, timeout=300)


@pytest.fixture(scope="module")
def written(work):
    """The reports of the base and the SFT run (with their comparison), written twice: the
    first time by `python main.py report` as its own process, as a user runs it."""
    first = ok(report(work, "base", work["sft"], "--html", out="first", process=True))
    ok(report(work, "base", work["sft"], "--html", out="second"))
    return {"out": work["root"] / "first", "stdout": first.stdout,
            "md": (work["root"] / "first" / "base" / "report.md").read_text(encoding="utf-8")}


def cell(md: str, label: str) -> str:
    """The value column of a two-column table row ``| label | value |``."""
    m = re.search(rf"^\| {re.escape(label)} \| (.*) \|$", md, re.M)
    assert m, f"no row {label!r} in:\n{md[:3000]}"
    return m.group(1)


def test_numbers_are_the_logs(work, written):
    md = written["md"]
    recs = read_jsonl(work["root"] / "logs" / "raw_metrics" / "base.jsonl")
    train = latest_per_step(recs, "train")
    val = latest_per_step(recs, "val")
    assert cell(md, "steps") == f"{TOTAL} of {TOTAL}"
    assert train[-1]["step"] == TOTAL
    assert cell(md, "tokens trained").startswith(f"{train[-1]['tokens_seen']:,} ")
    assert train[-1]["tokens_seen"] == TOTAL * 2 * 32
    assert cell(md, "final validation loss") == f"{val[-1]['val_loss']:.4f} (step {TOTAL})"
    assert cell(md, "best validation loss") == f"{min(r['val_loss'] for r in val):.4f}"
    assert cell(md, "final validation bits per byte") == f"{val[-1]['bits_per_byte']:.4f}"
    # The interruption after step 4 and the resume, in the starts table.
    assert "2 start(s): 1 interrupted" in md and "1 resumed" in md
    assert re.search(r"^\| 1 \| start \| .* \| 0 \| 4 \| .* \| interrupted \|$", md, re.M), md
    assert re.search(rf"^\| 2 \| resume \| .* \| 4 \| {TOTAL} \| .* \| done \|$", md, re.M), md
    # The model's size from its settings, and the resolved device and precision.
    from model import ModelArgs, create_model
    from utils.run import load_checkpoint
    ck = load_checkpoint(work["root"] / "checkpoints" / "base" / "checkpoint_latest.pt")
    n = create_model(ModelArgs.from_dict(ck["model_args"])).num_params()
    assert cell(md, "parameters").startswith(f"{n:,} ")
    assert cell(md, "device") == "cpu, world size 1" and cell(md, "precision") == "float32"
    # The data: the shard set's own counts.
    meta = json.loads((work["root"] / "checkpoints" / "base" / "config.json").read_text())
    shards = json.loads((Path(meta["dataset"]["wikipedia_test_dir"]) / "metadata.json").read_text())
    assert cell(md, "tokens").startswith(f"{shards['totals']['tokens']:,} ")
    samples = [r for r in recs if r.get("type") == "sample"]
    assert samples and samples[-1]["text"] in md


def test_the_chain_of_runs_survives_moving_the_project(work, tmp_path):
    """Runs that start from runs name their base by run folder, not by an absolute path: a
    copy of the project elsewhere still finds the SFT run from its base (report) and the base
    from the SFT run (report and status), though sft_config.json's path names the old place."""
    moved = tmp_path / "elsewhere"
    for sub in ("checkpoints", "logs"):
        shutil.copytree(work["root"] / sub, moved / sub)
    cfg = write_config(moved, {"tokenizer": {"name": str(SPM_MODEL)}, "logging": {"tensorboard": False}})
    sc = json.loads((moved / "checkpoints" / work["sft"] / "sft_config.json").read_text())
    assert sc["base_checkpoint"].startswith(str(work["root"]))           # the old, absolute place
    assert sc["base"] == {"run": "base", "file": "checkpoint_best.pt", "path": sc["base_checkpoint"],
                          "imported": False}
    ok(run_stage("report", "--config", cfg, "base", work["sft"], "--out", moved / "reports", timeout=300))
    md = (moved / "reports" / "base" / "report.md").read_text(encoding="utf-8")
    assert f"| `{work['sft']}` | sft | `checkpoint_best.pt` |" in md
    md = (moved / "reports" / work["sft"] / "report.md").read_text(encoding="utf-8")
    assert cell(md, "started from") == f"base → {work['sft']}".replace("_", "\\_")
    status = ok(run_stage("status", "--config", cfg, work["sft"]))
    assert f"sft          started from base\n" in status.stdout


def test_pictures_are_valid_pngs(written):
    from PIL import Image
    pngs = sorted(written["out"].rglob("*.png"))
    assert len(pngs) == 4, pngs          # base: curves + its SFT run's; SFT run: curves; comparison
    for p in pngs:
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            assert im.format == "PNG" and im.width >= 800 and im.height >= 300, (p, im.size)
            im.load()
        assert b"Software" not in p.read_bytes()[:4096]        # no version/date text chunks
    assert "![training curves of base](curves.png)" in written["md"]


def test_sft_run_and_benchmarks_are_shown(work, written):
    md, sft = written["md"], work["sft"]
    assert "## Runs started from this run (SFT, DPO, RL)" in md
    assert f"| `{sft}` | sft | `checkpoint_best.pt` |" in md
    assert (written["out"] / "base" / f"{sft}.png").is_file()
    assert f"![fine-tuning curves of {sft.replace('_', chr(92) + '_')}]({sft}.png)" in md
    # Both result files were scored on the same items: one table with both checkpoints.
    from utils.bench.report import fmt_value
    files = [json.loads(p.read_text()) for p in work["results"]]
    assert len(files) == 2
    table = md[md.index("## Benchmarks"):md.index("## Sample generations")]
    assert table.count("Scored on the same items") == 1
    for f in files:
        m = f["models"][0]
        ppl = m["results"]["perplexity"]["metrics"]["perplexity"]
        assert fmt_value("perplexity", ppl["value"], ppl["stderr"]) in table
        assert m["name"].replace("_", "\\_") in table
    assert "(this run)" in table
    # The SFT run's own report names what it was fine-tuned from and its data.
    sft_md = (written["out"] / sft / "report.md").read_text()
    assert "Supervised fine-tuning (SFT) run" in sft_md
    assert str(work["root"] / "checkpoints" / "base" / "checkpoint_best.pt") in sft_md


def test_same_inputs_give_identical_bytes(work, written):
    first, second = written["out"], work["root"] / "second"
    names = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    assert len(names) == 10, names   # 3 x (report.md + report.html) + 4 PNGs
    for n in names:
        assert (first / n).read_bytes() == (second / n).read_bytes(), n
    assert re.search(r"20\d\d-\d\d-\d\d", written["md"])          # the run's own start time
    assert not list(first.rglob(".*.tmp-*"))                      # atomic writes left nothing


def test_html_is_self_contained(written):
    for page in written["out"].rglob("report.html"):
        text = page.read_text(encoding="utf-8")
        srcs = re.findall(r'\bsrc="([^"]*)"', text)
        assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs), page
        assert "href=" not in text and "<link" not in text and "<script" not in text
        assert "url(" not in text and "@import" not in text
        assert text.count("<img") == len(list(page.parent.glob("*.png")))


def test_comparison_of_several_runs(work, written):
    folder = written["out"] / f"compare_base_vs_{work['sft']}"
    md = (folder / "report.md").read_text()
    assert md.startswith("# Comparison: base, " + work["sft"].replace("_", "\\_"))
    assert (folder / "comparison.png").is_file() and "(comparison.png)" in md
    assert "comparison: wrote" in written["stdout"]


def test_environment_is_recorded_for_new_runs(written):
    md = written["md"]
    env = md[md.index("## Environment"):]
    import torch
    assert f"torch {torch.__version__}" in cell(env, "packages")
    code = cell(env, "code")
    assert re.fullmatch(r"`[0-9a-f]{12}` \((clean tree|uncommitted changes)\)", code) or \
        code.startswith("unknown ("), code


def test_the_recorded_commit_is_the_checkout_s_even_with_git_dir_set(tmp_path, monkeypatch):
    """Started from a git hook (which sets GIT_DIR), a run recorded the hook's repository's
    commit as its own code's."""
    import subprocess
    from utils.environment import git_state
    other = tmp_path / "other"
    other.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(other)]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    theirs = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    mine = git_state(tmp_path)                        # not a checkout: no commit
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    got = git_state(tmp_path)
    assert got.get("commit") != theirs and got == mine, got


def test_damaged_log_and_missing_parts_are_said_not_fatal(work):
    """A copy of the run whose log has damaged lines (garbage, invalid UTF-8, a JSON array, a
    torn last line) and records of the wrong shape, whose config records carry no environment
    (as runs logged before it was recorded), and whose stored config is gone; beside it, an
    unreadable result file and one whose values are of the wrong type. The report still comes
    out, says what it skipped and what is missing, and shows what is good."""
    root = work["root"]
    logs = root / "logs" / "raw_metrics"
    shutil.copytree(root / "checkpoints" / "base", root / "checkpoints" / "damaged")
    (root / "checkpoints" / "damaged" / "config.json").unlink()
    wrong_shape = [{"type": "config", "hparams": {"total_steps": "many", "model": "x", "device": 5},
                    "config": "s", "environment": {"packages": [1], "machine": "m"}},
                   {"type": "train", "step": "x", "loss": "y"},
                   {"type": "train", "step": 3, "loss": "high", "lr": [1], "tokens_seen": "many"},
                   {"type": "val", "step": 5, "val_loss": "NaN"}, {"type": "sample", "text": 5},
                   {"type": "event", "step": 2, "event": ["resume"], "time": "now"}]
    out = [json.dumps(r).encode() + b"\n" for r in wrong_shape]
    for i, line in enumerate((logs / "base.jsonl").read_bytes().splitlines(keepends=True)):
        rec = json.loads(line)
        rec.pop("environment", None)
        out.append(json.dumps(rec).encode() + b"\n")
        if i == 3:
            out += [b"not json at all\n", b"\xff\xfe\x00 binary\n", b"[1, 2, 3]\n"]
    out.append(b'{"type": "train", "step": 99, "loss": 1.')          # torn by a crash
    (logs / "damaged.jsonl").write_bytes(b"".join(out))
    results = root / "benchmark_results"
    (results / "benchmark_zz_bad.json").write_text("[1, 2]")
    (results / "benchmark_zz_weird.json").write_text(json.dumps({
        "settings": "s", "data": 3, "models": [
            {"name": "damaged/checkpoint_best", "results": {"perplexity": {"metrics": {
                "perplexity": {"value": "big", "stderr": None}, "bits_per_byte": [2]}}, "x": 1},
             "identity": {"kind": "checkpoint", "step": "s",
                          "path": str(root / "checkpoints" / "damaged" / "checkpoint_best.pt")}},
            "not a model"]}))
    r = ok(report(work, "damaged"))
    assert "4 damaged log line(s) skipped" in r.stdout
    md = (root / "reports" / "damaged" / "report.md").read_text()
    first = len(wrong_shape) + 4 + 1                                 # the garbage's line numbers
    assert re.search(rf"\*\*Damaged log:\*\* 4 line\(s\) of `.*damaged\.jsonl` are not JSON "
                     rf"records and were skipped \(line {first}, {first + 1}, {first + 2}, \d+\)",
                     md), md[:2000]
    assert cell(md, "steps") == f"{TOTAL} of {TOTAL}"                # the good records still count
    assert "Not available: no readable stored config" in md
    assert "Not recorded: this run's log predates environment recording" in md
    assert "1 unreadable result file(s)" in md and "benchmark\\_zz\\_bad.json" in md
    bench = md[md.index("## Benchmarks"):md.index("## Sample generations")]
    assert "benchmark\\_zz\\_weird.json" in bench and "hold no metric value" in bench
    assert "settings changed" not in md          # the stray config record belongs to no start


def test_a_capped_warm_up_is_reported_as_used(work, written):
    """The trainer caps warm-up at 20% of a run's steps: the settings line gives the configured
    value and the one the run used (the same log with warmup_steps 100 in its records)."""
    root = work["root"]
    logs = root / "logs" / "raw_metrics"
    shutil.copytree(root / "checkpoints" / "base", root / "checkpoints" / "capped")
    out = []
    for line in (logs / "base.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "config":
            rec["hparams"]["warmup_steps"] = 100
        out.append(json.dumps(rec))
    (logs / "capped.jsonl").write_text("\n".join(out) + "\n")
    ok(report(work, "capped"))
    md = (root / "reports" / "capped" / "report.md").read_text()
    assert (f"warmup\\_steps 100" in md and
            f"(warm-up used: {TOTAL // 5} steps, capped at 20% of the run's {TOTAL})" in md), md
    base = written["md"]
    assert "warmup\\_steps 2," in base and "warm-up used" not in base      # 2 <= 12 // 5: as set


def test_missing_run_and_bad_names(work, tmp_path):
    r = report(work, "nope")
    assert r.returncode == 1
    assert "no run 'nope'" in r.stderr and str(work["root"] / "logs" / "raw_metrics" / "nope.jsonl") in r.stderr
    assert "Traceback" not in r.stderr
    r = report(work, "../base")
    assert r.returncode == 2 and "is not a run name" in r.stderr
    assert not (work["root"] / "base").exists()
    blocker = work["root"] / "a_file"
    blocker.write_text("keep me")
    r = report(work, "base", out="a_file")               # --out is a file: one named error
    assert r.returncode == 1 and "Traceback" not in r.stderr and "unexpected" not in r.stderr
    assert f"cannot write {blocker / 'base'} on " in r.stderr and "a part of the path is a file, not a folder" \
        in r.stderr and "(point --out or paths.reports_dir elsewhere)" in r.stderr, r.stderr
    assert blocker.read_text() == "keep me"


def _log_copy(work, name: str, edit=None) -> None:
    """The base run's log under another run name (no run folder), each record through ``edit``."""
    logs = work["root"] / "logs" / "raw_metrics"
    lines = []
    for line in (logs / "base.jsonl").read_text().splitlines():
        rec = json.loads(line)
        lines.append(json.dumps(edit(rec) if edit else rec))
    (logs / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def test_run_names_are_shown_literally_in_pictures(work):
    """Run names are text in every PNG: 'm$^$m' made matplotlib's mathtext parser raise (the
    report aborted after writing the runs before it), 'a$x$b' was drawn as math, and a name
    starting with '_' was dropped from comparison.png's legend (so '_u' and '_w' drew the same
    picture)."""
    names = ["m$^$m", "m${$m", "a$x$b", "_u", "_w", "vv"]
    for n in names:
        _log_copy(work, n)
    r = ok(report(work, "m$^$m", "m${$m", "a$x$b", "_u", out="literal"))
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr
    out = work["root"] / "literal"
    for n in names[:4]:
        assert (out / n / "curves.png").is_file(), n
    assert len(list(out.glob("compare_*/comparison.png"))) == 1
    ok(report(work, "_u", "vv", out="legend_u"))
    ok(report(work, "_w", "vv", out="legend_w"))
    u = (work["root"] / "legend_u" / "compare__u_vs_vv" / "comparison.png").read_bytes()
    w = (work["root"] / "legend_w" / "compare__w_vs_vv" / "comparison.png").read_bytes()
    assert u != w                        # the legend names each run, '_u' and '_w' included


def test_hostile_sft_run_name_is_no_markup_and_no_broken_link(work):
    """An SFT run folder named 'sft_x) <img src=x onerror=alert(1)>' (started from a copy of
    the base run) put `![...](sft_x) <img src=x onerror=alert(1)>.png)` into report.md: live
    raw HTML in CommonMark and a broken image link. Its picture now has a safe file name and
    every image link points at a file beside the report."""
    root = work["root"]
    ck, logs = root / "checkpoints", root / "logs" / "raw_metrics"
    shutil.copytree(ck / "base", ck / "host")
    shutil.copy(logs / "base.jsonl", logs / "host.jsonl")
    evil = "sft_x) <img src=x onerror=alert(1)>"
    shutil.copytree(ck / work["sft"], ck / evil)
    shutil.copy(logs / f"{work['sft']}.jsonl", logs / f"{evil}.jsonl")
    sc = json.loads((ck / evil / "sft_config.json").read_text())
    sc["base_checkpoint"] = str(ck / "host" / "checkpoint_best.pt")
    sc["base"]["run"] = "host"
    (ck / evil / "sft_config.json").write_text(json.dumps(sc))
    ok(report(work, "host", "--html", out="evil"))
    folder = root / "evil" / "host"
    md = (folder / "report.md").read_text()
    outside_code = re.sub(r"`[^`\n]*`", "", md)
    assert not re.search(r"(?<!\\)<img", outside_code), md   # escaped text, or in a code span
    targets = re.findall(r"!\[[^\n]*?\]\(([^()\s]+)\)", md)
    assert len(targets) == 2, md                               # curves.png + the SFT run's
    from urllib.parse import unquote
    for t in targets:
        assert re.fullmatch(r"[A-Za-z0-9._-]+\.png", t), t
        assert (folder / unquote(t)).is_file(), t
    assert sorted(p.name for p in folder.glob("*.png")) == sorted(targets)
    html = (folder / "report.html").read_text()
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_out_of_range_log_numbers_are_left_out_and_counted(work):
    """A time of 1e300 or -1e12 (not a date) aborted the whole report with an OverflowError /
    ValueError; a step beyond 64 bits, a loss near float's maximum and a 400-digit token count
    are no better. Each is left out, counted, and the rest of the report is written."""
    seen = {"train": 0}

    def edit(rec):
        if rec.get("type") == "train":
            seen["train"] += 1
            k = seen["train"]
            if k == 1:
                rec["time"] = 1e300
            elif k == 2:
                rec["time"] = -1e12
            elif k == 3:
                rec["step"] = 10 ** 30
            elif k == 4:
                rec["loss"] = 1.7e308
        if rec.get("type") == "event" and rec.get("event") == "done":
            rec["tokens_seen"] = 10 ** 400
        return rec
    _log_copy(work, "odd_numbers", edit)
    r = ok(report(work, "odd_numbers", "base", "--html", out="odd"))
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr
    assert "odd_numbers: wrote" in r.stdout and "(5 out-of-range value(s) left out)" in r.stdout
    md = (work["root"] / "odd" / "odd_numbers" / "report.md").read_text()
    assert "**Values out of range:** 5 value(s) (loss 1, step 1, time 2, tokens\\_seen 1)" in md
    assert cell(md, "steps") == f"{TOTAL} of {TOTAL}"
    assert (work["root"] / "odd" / "odd_numbers" / "curves.png").is_file()
    assert (work["root"] / "odd" / "compare_odd_numbers_vs_base" / "comparison.png").is_file()


def test_the_smoothed_loss_is_labelled_as_what_it_is(tmp_path):
    """The trainer's smoothed loss is the mean of the last logging.smoothing_window steps over
    the steps there are: before step 50 (all of a 40-step run) it is the mean of every step so
    far, which lags far above a falling loss. It was labelled "mean of last 50 steps" all the
    way; now the part before the window is full is its own dashed line saying what it is."""
    from utils.report import build, facts
    train = [{"step": s, "loss": 6.0 - s / 20, "smoothed_loss": 7.0 - s / 40} for s in range(10, 90, 10)]
    runs = [facts.RunFacts(name, tmp_path, None, train=train[:n], val=[{"step": 0, "val_loss": 7.5}],
                           configs=[{"config": {"logging": {"smoothing_window": 50}}, "hparams": {}}])
            for name, n in (("short", 4), ("long", 8))]
    lines = {ln.label: (list(ln.xs), ln.style) for ln in build.curve_panels(runs[0])[0].lines if ln.xs}
    assert lines == {"train (logged step)": ([10, 20, 30, 40], "-"),
                     "train (mean of all steps so far)": ([10, 20, 30, 40], "--"),
                     "validation": ([0], "-")}
    lines = {ln.label: list(ln.xs) for ln in build.curve_panels(runs[1])[0].lines if ln.xs}
    assert lines["train (mean of all steps so far)"] == [10, 20, 30, 40]
    assert lines["train (mean of last 50 steps)"] == [50, 60, 70, 80]
