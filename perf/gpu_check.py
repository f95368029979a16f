"""`make gpu-check`: the GPU paths of the pipeline run once on a GPU box, as a user runs them,
in at most 8 minutes on one H100-class GPU, written as one JSON summary and a short table.

    python perf/gpu_check.py [--device auto|cuda|cuda:N|cpu] [--parts all|P1,P2,...] [--steps N]
                             [--out DIR] [--budget-s S] [--dry-run]

Parts (each a subprocess with its own timeout, inside one overall budget, so one hang cannot
eat the rest; the budget's last seconds go to whichever parts are left, then they are
reported "skipped: the budget was spent"):

- ``cuda-tests``: ``pytest -m cuda`` over the test files that hold cuda-marked tests.
- ``train-flash`` / ``train-sdpa``: ``main.py train`` on the 200m preset in bf16 (``--dtype
  auto``, a user's default: bf16 on CUDA) with ``--compile``, ``--steps`` optimizer steps on
  the offline Wikipedia sample (``clean`` and ``prepare`` run first), once with flash-attn
  (when it imports) and once with PyTorch SDPA (flash-attn hidden from that run by a package
  that refuses to import). tokens/s, MFU and
  peak memory come from the run's own raw-metrics JSONL (median over the logged intervals
  after the first, which holds the compile); goal: MFU >= 45% (what nanochat and litgpt
  report on H100s). Each run also draws its validation sample: generation under autocast.
- ``resume``: a run stopped by SIGTERM after its first numbered checkpoint (exit 130), then
  ``--resume auto``, against the same run uninterrupted: bit-exact, or within the bf16
  tolerance below (CUDA's atomics make some kernels non-deterministic).
- ``fsdp``: ``--parallel fsdp --cpu-offload`` on one rank (torchrun, one process): the run must
  say it sharded with its state in CPU memory, save a sharded checkpoint and learn.
- ``decode``: ``Engine(model, compile="on")`` on CUDA: greedy tokens equal to the eager
  step's, and CUDA graphs recorded, none skipped (inductor's ``cudagraph_skips`` counter).
- ``serve``: ``main.py serve`` on 127.0.0.1 (a free port) with 8 concurrent streamed chat
  requests (the standard library's HTTP client): aggregate tokens/s and time to first token.

Outputs under ``--out`` (default gpu_check/, git-ignored): summary.json, summary.txt (the
table), logs/PART.log (each subprocess's output), work/ (the runs: a config layer rooted
there, data, checkpoints, logs). Exit 0 when no part failed (skipped parts allowed), 1 when
one did, 2 on bad arguments or when no CUDA device is there and ``--dry-run`` is not given,
130 on Ctrl-C or SIGTERM (the running part's processes get SIGTERM, so a training run saves its
checkpoint; the summary holds the parts done so far).

``--dry-run``: the same plumbing on whatever device is given (CPU here): the tiny preset, a
handful of steps, no ``--compile``, the default dtype; parts that need CUDA are reported
"skipped: no CUDA" (``cuda-tests`` then only counts the tests ``-m cuda`` selects).

The parent process imports nothing heavy (no torch): the device probe, the checks on
checkpoints and the decode check run as children of this script (``--child NAME``).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import http.client
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SAMPLES = ROOT / "data" / "samples"
SPM_MODEL = SAMPLES / "tokenizers" / "mistral-v1" / "tokenizer.model"

PARTS = ("cuda-tests", "train-flash", "train-sdpa", "resume", "fsdp", "decode", "serve")
NEEDS_CUDA = {"train-flash", "fsdp", "decode"}       # skipped in --dry-run without CUDA
NEEDS_DATA = {"train-flash", "train-sdpa", "resume", "fsdp"}
# seconds per part on a GPU box (upper bounds, estimated: make gpu-check has not run on a GPU
# yet, docs/gpu.md) and in --dry-run on a CPU
TIMEOUTS = {"data": 60, "cuda-tests": 100, "train-flash": 110, "train-sdpa": 110, "resume": 80,
            "fsdp": 50, "decode": 60, "serve": 120}
DRY_TIMEOUTS = {"data": 120, "cuda-tests": 180, "train-flash": 240, "train-sdpa": 240,
                "resume": 300, "fsdp": 240, "decode": 240, "serve": 240}
BUDGET_S = 480                 # the whole check: 8 minutes
DRY_BUDGET_S = 1200
MFU_GOAL = 0.45
STREAMS = 8
# resume on CUDA: the final training loss within this relative difference, and the final
# weights within this relative L2 distance (||a - b|| / ||a||), of the uninterrupted run's
RESUME_LOSS_RTOL = 2e-2
RESUME_WEIGHT_RTOL = 1e-2
STATUSES = ("pass", "fail", "skipped", "timeout", "error")


# ----------------------------------------------------------------------------- results
@dataclass
class Goal:
    goal: str                   # e.g. "MFU >= 45%"
    met: Optional[bool]         # None: not measurable here (e.g. MFU on a CPU)
    value: Any = None


@dataclass
class PartResult:
    name: str
    status: str                 # one of STATUSES
    summary: str                # one line for the table
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    goals: list = field(default_factory=list)
    log: Optional[str] = None   # relative to --out

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")


def fmt_num(x: Any, kind: str = "") -> str:
    """Numbers for the table: tokens/s and MB with thousands separators, MFU as a percentage,
    seconds with one decimal; None (not measured) as "n/a"."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if kind == "pct":
        return f"{x:.1%}"
    if kind == "s":
        return f"{x:.1f} s"
    if kind == "ms":
        return f"{x * 1000:,.0f} ms"
    if isinstance(x, float) and abs(x) < 100:
        return f"{x:.3g}"
    return f"{x:,.0f}"


def summarize(results: list[PartResult], meta: dict) -> dict:
    """The JSON summary: ``meta`` (device, mode, times) and every part's result; ``ok`` is
    True when no part failed, timed out or errored (skipped parts do not count against it)."""
    bad = [r.name for r in results if r.status in ("fail", "timeout", "error")]
    return {**meta, "ok": not bad, "failed": bad,
            "counts": {s: sum(r.status == s for r in results) for s in STATUSES},
            "parts": [asdict(r) for r in results]}


def table(summary: dict) -> str:
    """The short text table of a summary (what summary.txt holds and the run prints)."""
    d = summary.get("device", {})
    head = (f"make gpu-check  {summary.get('finished', '')}  {d.get('name') or 'no GPU'}  "
            f"torch {d.get('torch') or '?'}  flash-attn {d.get('flash_attn') or 'not importable'}  "
            f"mode {summary.get('mode', '?')}  {fmt_num(summary.get('seconds'), 's')} "
            f"of a {summary.get('budget_s')} s budget")
    rows = [("part", "status", "time", "result")]
    for p in summary["parts"]:
        goals = "; ".join(f"goal {g['goal']}: " + {True: "met", False: "NOT met", None: "n/a"}[g["met"]]
                          for g in p.get("goals", []))
        rows.append((p["name"], p["status"], fmt_num(p["seconds"], "s"),
                     p["summary"] + (f" ({goals})" if goals else "")))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [head, ""] + [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows]
    c = summary["counts"]
    lines += ["", f"{c['pass']} passed, {c['fail']} failed, {c['timeout']} timed out, "
                  f"{c['error']} errors, {c['skipped']} skipped: " + ("OK" if summary["ok"] else "FAILED")]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, summary: dict) -> tuple[Path, Path]:
    """summary.json and summary.txt under ``out``, each written atomically."""
    from utils.atomic import atomic_open, write_json_atomic
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "summary.json", summary)
    with atomic_open(out / "summary.txt", "w") as f:
        f.write(table(summary))
    return out / "summary.json", out / "summary.txt"


# ----------------------------------------------------------------------------- arguments
def parse_parts(text: str) -> list[str]:
    if text == "all":
        return list(PARTS)
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(PARTS)} or 'all'")
    return [p for p in PARTS if p in names]          # the documented order, each once


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return n


def device_arg(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: use auto, cpu, cuda or cuda:N")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perf/gpu_check.py", description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--parts", type=parse_parts, default=list(PARTS),
                   help=f"comma-separated subset of {', '.join(PARTS)} (default: all)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="optimizer steps of each train-* run (default 300; --dry-run 4)")
    p.add_argument("--out", type=Path, default=ROOT / "gpu_check", help="output folder (default gpu_check/)")
    p.add_argument("--budget-s", type=positive_int, default=None,
                   help=f"seconds for the whole check (default {BUDGET_S}; --dry-run {DRY_BUDGET_S})")
    p.add_argument("--dry-run", action="store_true",
                   help="the plumbing on any device: tiny preset, a few steps, no --compile; parts "
                        "that need CUDA are reported skipped when there is none")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("child_args", nargs="*", help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.child_args and not a.child:
        build_parser().error(f"unexpected arguments: {' '.join(a.child_args)}")
    if str(a.out).strip() in ("", "."):
        build_parser().error("--out must name a folder of its own (it gets summary.json, logs/, work/)")
    a.steps = a.steps or (4 if a.dry_run else 300)
    a.budget_s = a.budget_s or (DRY_BUDGET_S if a.dry_run else BUDGET_S)
    return a


# ----------------------------------------------------------------------------- processes
def child_env(**extra: str) -> dict:
    """The environment of every stage run: offline, the dataclass defaults as the base config
    (a user's edited config.json never changes what the check runs), unbuffered output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               LLM_PIPELINE_BASE_CONFIG="none")
    env.pop("LLM_PIPELINE_PAUSE_AT_STEP", None)
    env.update(extra)
    return env


def stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process's group (its own session), SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


_STARTED: list[subprocess.Popen] = []      # every child, so that an interrupt can stop them all


def start(cmd: list, log: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """``cmd`` in a session of its own (a hang is stopped with its whole group), its output
    appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                stdin=subprocess.DEVNULL, env=env or child_env(), start_new_session=True)
    _STARTED.append(proc)
    return proc


def stop_all() -> None:
    """Ctrl-C or SIGTERM: each child still running gets SIGTERM (a training run saves its
    checkpoint and exits 130), SIGKILL after a minute."""
    for proc in _STARTED:
        stop_group(proc, grace=60)


class PartTimeout(Exception):
    pass


class Clock:
    """One part's deadline: its own timeout, cut to what is left of the whole budget."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run(cmd: list, log: Path, clock: Clock, env: Optional[dict] = None) -> int:
    """Run ``cmd`` to its end within ``clock``; its exit code. On the deadline its process
    group is stopped and PartTimeout raised."""
    proc = start(cmd, log, env)
    try:
        return proc.wait(timeout=max(clock.left(), 0.1))
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise PartTimeout(f"{' '.join(Path(str(c)).name for c in cmd[1:3])} did not finish in time")


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, clock: Clock) -> str:
    """The first line of ``log`` matching ``pattern`` (a regex), polled while ``proc`` runs."""
    rx = re.compile(pattern)
    while clock.left() > 0:
        for line in log.read_text(errors="replace").splitlines():
            if rx.search(line):
                return line
        if proc.poll() is not None:
            raise RuntimeError(f"the process exited with {proc.returncode} before printing {pattern!r}")
        time.sleep(0.2)
    stop_group(proc)
    raise PartTimeout(f"no line matching {pattern!r} in time")


def child(name: str, *args, log: Path, clock: Clock) -> dict:
    """``python perf/gpu_check.py --child NAME ARGS``: its JSON answer (its last stdout line)."""
    out = log.with_suffix(f".{name}.json")
    code = run([sys.executable, Path(__file__), "--child", name, *args, str(out)], log, clock)
    if code != 0 or not out.exists():
        raise RuntimeError(f"child {name} exited with {code} (see {log.name})")
    return json.loads(out.read_text())


def tail(log: Path, n: int = 3) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    return " | ".join(x.strip()[:200] for x in lines[-n:])


# ----------------------------------------------------------------------------- context
@dataclass
class Context:
    args: argparse.Namespace
    out: Path
    device: dict                 # the probe's answer
    deadline: float
    data_ok: Optional[bool] = None
    data_note: str = ""

    @property
    def dry(self) -> bool:
        return self.args.dry_run

    @property
    def cuda(self) -> bool:
        return self.device["type"] == "cuda"

    @property
    def work(self) -> Path:
        return self.out / "work"

    def log(self, part: str) -> Path:
        return self.out / "logs" / f"{part}.log"

    def clock(self, part: str) -> Clock:
        own = (DRY_TIMEOUTS if self.dry else TIMEOUTS)[part]
        return Clock(min(own, self.deadline - time.monotonic()))

    def config_args(self) -> list[str]:
        return ["--config", str(ROOT / "configs" / "offline.json"), "--config", str(self.work / "gpu_check.json")]

    def fresh_run(self, name: str) -> None:
        """Remove run ``name``'s folders under work/ (an earlier check's), so it starts anew."""
        for p in (self.work / "checkpoints" / name, self.work / "logs" / "tensorboard" / name):
            shutil.rmtree(p, ignore_errors=True)
        (self.work / "logs" / "raw_metrics" / f"{name}.jsonl").unlink(missing_ok=True)

    def metrics_log(self, name: str) -> Path:
        return self.work / "logs" / "raw_metrics" / f"{name}.jsonl"


def write_config_layer(work: Path) -> Path:
    """The config layer of every stage run: rooted in ``work``, the offline samples of this
    checkout (configs/offline.json's relative paths would resolve under ``work``)."""
    from utils.atomic import write_json_atomic
    work.mkdir(parents=True, exist_ok=True)
    layer = {"_comment": "written by perf/gpu_check.py: outputs under this folder, the project's offline samples",
             "paths": {"root": str(work), "samples_dir": str(SAMPLES), "cache_dir": str(ROOT / ".cache")},
             "tokenizer": {"name": str(SPM_MODEL)},
             "wikipedia": {"raw_dir": str(SAMPLES / "enwiki")},
             "fineweb": {"data_dir": str(SAMPLES / "fineweb_substitute")}}
    write_json_atomic(work / "gpu_check.json", layer)
    return work / "gpu_check.json"


def probe_device(requested: str, log: Path) -> dict:
    """What the device is: a child process imports torch and asks (CUDA's initialisation can
    hang on a broken driver); ``cpu`` needs no asking (flash-attn runs on CUDA only)."""
    if requested == "cpu":
        from importlib import metadata
        return {"type": "cpu", "name_arg": "cpu", "torch": metadata.version("torch"), "cuda_version": None,
                "name": None, "flash_attn": None, "flash_attn_error": "not probed: --device cpu"}
    return child("probe", requested, log=log, clock=Clock(120))


# ----------------------------------------------------------------------------- parts
def main_cmd(*args) -> list:
    return [sys.executable, ROOT / "main.py", *args]


def ensure_data(ctx: Context) -> Optional[str]:
    """``clean`` and ``prepare`` the offline Wikipedia sample once (full mode, the shards every
    training part reads); None when ready, else why not."""
    if ctx.data_ok is None:
        log, clock = ctx.log("data"), ctx.clock("data")
        log.unlink(missing_ok=True)
        try:
            for stage in ("clean", "prepare"):
                code = run(main_cmd(stage, *ctx.config_args()), log, clock)
                if code != 0:
                    raise RuntimeError(f"main.py {stage} exited with {code}: {tail(log, 2)}")
            ctx.data_ok = True
        except (PartTimeout, RuntimeError) as e:
            ctx.data_ok, ctx.data_note = False, f"data preparation failed ({e}; logs/data.log)"
    return None if ctx.data_ok else ctx.data_note


def train_sizes(ctx: Context) -> dict:
    if ctx.dry:
        return dict(preset="tiny", window=64, batch=4, eval_batches=1, compile=False)
    return dict(preset="200m", window=512, batch=32, eval_batches=4, compile=True)


def train_args(ctx: Context, name: str, steps: int, *, preset: str, window: int, batch: int,
               eval_batches: int, compile: bool, eval_steps: Optional[int] = None,
               checkpoint_every: Optional[int] = None, log_every: Optional[int] = None) -> list[str]:
    a = [*ctx.config_args(), "--name", name, "--preset", preset, "--window", str(window),
         "--batch-size", str(batch), "--max-steps", str(steps), "--eval-steps", str(eval_steps or steps),
         "--eval-batches", str(eval_batches), "--log-every", str(log_every or max(1, steps // 20)),
         "--device", ctx.device["name_arg"], "--dtype", "auto", "--sample-tokens", "16"]   # auto: bf16 on CUDA
    if checkpoint_every:
        a += ["--checkpoint-every", str(checkpoint_every)]
    return a + (["--compile"] if compile else [])


def train_records(path: Path) -> list[dict]:
    from utils.training.logging_utils import latest_per_step, read_log
    return latest_per_step(read_log(path).records)


def run_facts(path: Path) -> dict:
    """What the run's log says it ran with (its last start's config record): precision,
    parameters, compile, device."""
    from utils.training.logging_utils import read_log
    hp = next((r.get("hparams") or {} for r in reversed(read_log(path).records) if r.get("type") == "config"), {})
    return {k: hp.get(k) for k in ("dtype", "params", "compile", "device", "window", "batch_size")}


def throughput(records: list[dict]) -> dict:
    """tokens/s and MFU (medians over the logged intervals after the first, which holds the
    compile and the first steps' allocations), peak memory (the largest logged), first and
    last loss."""
    steady = records[1:] or records
    rates = [r["tokens_per_s"] for r in steady if isinstance(r.get("tokens_per_s"), (int, float))]
    mfus = [r["mfu"] for r in steady if isinstance(r.get("mfu"), (int, float))]
    mem = [r["peak_memory_mb"] for r in records if isinstance(r.get("peak_memory_mb"), (int, float))]
    return {"tokens_per_s": statistics.median(rates) if rates else None,
            "mfu": statistics.median(mfus) if mfus else None,
            "peak_memory_mb": max(mem) if mem else None,
            "intervals": len(steady), "steps": records[-1]["step"] if records else 0,
            "first_loss": records[0].get("loss") if records else None,
            "last_loss": records[-1].get("loss") if records else None}


def part_train(ctx: Context, flash: bool) -> PartResult:
    name = "train-flash" if flash else "train-sdpa"
    if flash and not ctx.device.get("flash_attn"):
        return PartResult(name, "skipped", "flash-attn is not importable (" +
                          (ctx.device.get("flash_attn_error") or "?")[:120] + "): pip install -r requirements-gpu.txt")
    why = ensure_data(ctx)
    if why:
        return PartResult(name, "error", why)
    run_name = "gc_" + name.replace("-", "_")
    ctx.fresh_run(run_name)
    log, clock = ctx.log(name), ctx.clock(name)
    env = child_env()
    if not flash:                                  # flash-attn hidden from this run alone
        hide = ctx.work / "hide_flash_attn" / "flash_attn"
        hide.mkdir(parents=True, exist_ok=True)
        (hide / "__init__.py").write_text('raise ImportError("hidden by perf/gpu_check.py for its SDPA run")\n')
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide.parent), env.get("PYTHONPATH")]))
    code = run(main_cmd("train", *train_args(ctx, run_name, ctx.args.steps, **train_sizes(ctx))), log, clock, env)
    text = log.read_text(errors="replace")
    kernel = next((ln.split("attention:", 1)[1].strip() for ln in text.splitlines()
                   if ln.startswith("attention:")), None)
    jsonl = ctx.metrics_log(run_name)
    m = {"attention": kernel, **run_facts(jsonl), **throughput(train_records(jsonl))}
    if code != 0:
        return PartResult(name, "fail", f"main.py train exited with {code}: {tail(log, 2)}", metrics=m)
    want = "flash-attn" if flash else "PyTorch SDPA"
    bf16 = m["dtype"] == "torch.bfloat16" or not ctx.cuda
    ok = bool(kernel and kernel.startswith(want)) and m["tokens_per_s"] is not None and bf16
    mfu_goal = Goal(f"MFU >= {MFU_GOAL:.0%}", None if m["mfu"] is None else m["mfu"] >= MFU_GOAL, m["mfu"])
    line = (f"{fmt_num(m['tokens_per_s'])} tokens/s, MFU {fmt_num(m['mfu'], 'pct')}, peak "
            f"{fmt_num(m['peak_memory_mb'])} MB, loss {fmt_num(m['first_loss'])} -> {fmt_num(m['last_loss'])} "
            f"over {m['steps']} steps")
    if kernel is None or not kernel.startswith(want):
        line = f"attention was {kernel!r}, not {want}; " + line
    if not bf16:
        line = f"trained in {m['dtype']}, not bf16; " + line
    return PartResult(name, "pass" if ok else "fail", line, metrics=m, goals=[mfu_goal])


def part_resume(ctx: Context) -> PartResult:
    """An uninterrupted run against one stopped by SIGTERM right after its first numbered
    checkpoint (LLM_PIPELINE_PAUSE_AT_STEP holds it there, so the signal lands at a known
    step) and resumed with --resume auto."""
    why = ensure_data(ctx)
    if why:
        return PartResult("resume", "error", why)
    log, clock = ctx.log("resume"), ctx.clock("resume")
    steps, every = (8, 4) if ctx.dry else (40, 20)
    sizes = dict(preset="tiny", window=64, batch=4, eval_batches=1, compile=False) if ctx.dry else \
        dict(preset="default", window=512, batch=16, eval_batches=2, compile=False)
    kw = dict(eval_steps=every, checkpoint_every=every, log_every=1, **sizes)
    for n in ("gc_resume_full", "gc_resume_cut"):
        ctx.fresh_run(n)
    code = run(main_cmd("train", *train_args(ctx, "gc_resume_full", steps, **kw)), log, clock)
    if code != 0:
        return PartResult("resume", "fail", f"the uninterrupted run exited with {code}: {tail(log, 2)}")
    cut_args = train_args(ctx, "gc_resume_cut", steps, **kw)
    proc = start(main_cmd("train", *cut_args), log, child_env(LLM_PIPELINE_PAUSE_AT_STEP=str(every + 1)))
    try:
        wait_for(log, rf"paused after step {every + 1}\b", proc, clock)
        proc.send_signal(signal.SIGTERM)                # main.py forwards it to the stage
        code = proc.wait(timeout=max(clock.left(), 1))
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise PartTimeout("the stopped run did not exit after SIGTERM in time")
    if code != 130:
        return PartResult("resume", "fail", f"SIGTERM: exit {code}, expected 130: {tail(log, 2)}")
    code = run(main_cmd("train", *cut_args, "--resume", "auto"), log, clock)
    if code != 0:
        return PartResult("resume", "fail", f"--resume auto exited with {code}: {tail(log, 2)}")
    ck = ctx.work / "checkpoints"
    cmp = child("compare", ck / "gc_resume_full" / "checkpoint_latest.pt",
                ck / "gc_resume_cut" / "checkpoint_latest.pt", log=log, clock=clock)
    full, cut = train_records(ctx.metrics_log("gc_resume_full")), train_records(ctx.metrics_log("gc_resume_cut"))
    a = {r["step"]: r["loss"] for r in full}
    b = {r["step"]: r["loss"] for r in cut}
    after = [s for s in sorted(a) if s > every + 1 and s in b]
    if not after:
        return PartResult("resume", "fail", f"no logged step after the resume to compare (steps {sorted(b)})")
    loss_rdiff = max(abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in after)
    m = {"stopped_at": every + 1, "steps": steps, "bit_exact": cmp["equal"], "weights_rel_l2": cmp["rel_l2"],
         "losses_equal": all(a[s] == b[s] for s in after), "loss_max_rel_diff": loss_rdiff}
    if ctx.cuda:
        ok = cmp["equal"] or (loss_rdiff <= RESUME_LOSS_RTOL and cmp["rel_l2"] <= RESUME_WEIGHT_RTOL)
        rule = (f"bit-exact, or losses within {RESUME_LOSS_RTOL:g} relative and weights within "
                f"{RESUME_WEIGHT_RTOL:g} relative L2 (bf16, CUDA's non-deterministic kernels)")
    else:
        ok = cmp["equal"] and m["losses_equal"]
        rule = "bit-exact (CPU)"
    line = (f"SIGTERM at step {every + 1}: exit 130; resumed to {steps}: "
            + ("weights bit-exact" if cmp["equal"] else f"weights rel. L2 {cmp['rel_l2']:.2e}")
            + f", losses max rel. diff {loss_rdiff:.2e}; rule: {rule}")
    return PartResult("resume", "pass" if ok else "fail", line, metrics=m)


def part_fsdp(ctx: Context) -> PartResult:
    """FSDP2 with CPU offload on one rank: torchrun with one process, as a multi-GPU launch
    would start each rank."""
    why = ensure_data(ctx)
    if why:
        return PartResult("fsdp", "error", why)
    log, clock = ctx.log("fsdp"), ctx.clock("fsdp")
    ctx.fresh_run("gc_fsdp")
    steps = 20
    args = train_args(ctx, "gc_fsdp", steps, preset="default", window=512, batch=16, eval_batches=2,
                      compile=False, log_every=5)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           ROOT / "train.py", *args, "--parallel", "fsdp", "--cpu-offload"]
    code = run(cmd, log, clock)
    text = log.read_text(errors="replace")
    recs = train_records(ctx.metrics_log("gc_fsdp"))
    m = throughput(recs)
    said = next((ln.strip() for ln in text.splitlines() if "FSDP2:" in ln or "training.parallel fsdp" in ln), None)
    m["start_line"] = said
    if code != 0:
        return PartResult("fsdp", "fail", f"torchrun train.py exited with {code}: {tail(log, 2)}", metrics=m)
    sharded = bool(said and said.startswith("FSDP2:") and "CPU memory" in said)
    saved = (ctx.work / "checkpoints" / "gc_fsdp" / "checkpoint_latest.dcp").is_dir()
    learned = m["first_loss"] is not None and m["last_loss"] is not None and m["last_loss"] < m["first_loss"]
    line = (f"{fmt_num(m['tokens_per_s'])} tokens/s, peak {fmt_num(m['peak_memory_mb'])} MB, loss "
            f"{fmt_num(m['first_loss'])} -> {fmt_num(m['last_loss'])}; sharded checkpoint: {'yes' if saved else 'NO'}")
    if not sharded:
        line = f"the run did not shard with CPU offload (it said: {said!r}); " + line
    return PartResult("fsdp", "pass" if sharded and saved and learned else "fail", line, metrics=m)


def part_decode(ctx: Context) -> PartResult:
    log, clock = ctx.log("decode"), ctx.clock("decode")
    r = child("decode", ctx.device["name_arg"], log=log, clock=clock)
    ok = r["tokens_equal"] and r["cudagraph_skips"] == 0 and (r["graphs_recorded"] or 0) > 0
    line = (f"greedy tokens {'equal to' if r['tokens_equal'] else 'DIFFERENT from'} the eager step's; "
            f"CUDA graphs recorded {r['graphs_recorded']}, skipped {r['cudagraph_skips']}; "
            f"batch 1: {fmt_num(r['compiled_tokens_per_s'])} tokens/s compiled, "
            f"{fmt_num(r['eager_tokens_per_s'])} eager; compile {fmt_num(r['compile_s'], 's')}")
    return PartResult("decode", "pass" if ok else "fail", line, metrics=r)


def part_cuda_tests(ctx: Context) -> PartResult:
    log, clock = ctx.log("cuda-tests"), ctx.clock("cuda-tests")
    files = cuda_test_files()
    if not ctx.cuda:
        code = run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-m", "cuda",
                    *files], log, clock)
        ids = re.findall(r"^(tests/\S+::\S+)$", log.read_text(errors="replace"), re.M)
        if code not in (0, 5):
            return PartResult("cuda-tests", "fail", f"pytest --collect-only exited with {code}: {tail(log, 2)}")
        return PartResult("cuda-tests", "skipped",
                          f"no CUDA ({len(ids)} tests selected by -m cuda in {len(files)} files)",
                          metrics={"selected": len(ids), "tests": ids,
                                   "files": [str(f.relative_to(ROOT)) for f in files]})
    xml = ctx.out / "cuda_tests.xml"
    xml.unlink(missing_ok=True)
    code = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", f"--junitxml={xml}",
                *files], log, clock)
    m = junit_counts(xml) if xml.exists() else {}
    if not m:
        return PartResult("cuda-tests", "fail", f"pytest exited with {code} and wrote no report: {tail(log, 2)}")
    ok = code == 0 and m["failed"] == 0 and m["errors"] == 0 and m["passed"] > 0
    line = f"{m['passed']} passed, {m['failed']} failed, {m['errors']} errors, {m['skipped']} skipped"
    return PartResult("cuda-tests", "pass" if ok else "fail", line, metrics=m)


def cuda_test_files() -> list[Path]:
    """The test files holding cuda-marked tests: ``pytest -m cuda`` over these alone needs only
    requirements.txt (collecting every file would import the test-only packages too)."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py")
                  if re.search(r"pytest\.mark\.cuda\b|^@cuda\b", p.read_text(encoding="utf-8"), re.M))


def junit_counts(xml: Path) -> dict:
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"tests": n["tests"], "failed": n["failures"], "errors": n["errors"], "skipped": n["skipped"],
            "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"]}


def part_serve(ctx: Context) -> PartResult:
    log, clock = ctx.log("serve"), ctx.clock("serve")
    ck = ctx.work / "checkpoints" / "gc_serve" / "checkpoint_best.pt"
    child("serve-checkpoint", "tiny" if ctx.dry else "default", ck, log=log, clock=clock)
    t0 = time.monotonic()
    proc = start(main_cmd("serve", *ctx.config_args(), "--checkpoint", ck, "--host", "127.0.0.1", "--port", "0",
                          "--max-batch", str(STREAMS), "--device", ctx.device["name_arg"]), log)
    try:
        url = wait_for(log, r"listening on http://", proc, clock).split("listening on ", 1)[1].strip()
        startup = time.monotonic() - t0
        m = drive_server(url, 16 if ctx.dry else 128, clock)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_group(proc, grace=5)
            code = None
    m.update(startup_s=startup, exit_code=code)
    ok = m["ok_streams"] == STREAMS and m["tokens"] > 0 and code == 130
    line = (f"{m['ok_streams']}/{STREAMS} streams: {fmt_num(m['tokens_per_s'])} tokens/s in all, TTFT median "
            f"{fmt_num(m['ttft_median_s'], 'ms')}, max {fmt_num(m['ttft_max_s'], 'ms')}; start-up "
            f"{fmt_num(startup, 's')}; SIGTERM: exit {code}")
    if m["errors"]:
        line += "; " + m["errors"][0][:160]
    return PartResult("serve", "pass" if ok else "fail", line, metrics=m)


def stream_chat(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streamed chat completion read with http.client: time to the first content, the
    completion tokens (from the usage chunk) and whether the stream ended with [DONE]."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        ttft, tokens, done = None, 0, False
        for raw in resp:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
                break
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return {"ttft": ttft, "tokens": tokens, "done": done, "seconds": time.perf_counter() - t0}
    finally:
        conn.close()


def drive_server(url: str, max_tokens: int, clock: Clock) -> dict:
    """One warm-up request, then STREAMS concurrent streamed chats (one thread each)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    per = max(5.0, clock.left() - 5)
    stream_chat(url, model, "Hello", 8, per)
    prompts = [f"Tell me about topic number {i} in a few sentences." for i in range(STREAMS)]
    t0 = time.perf_counter()
    ex = cf.ThreadPoolExecutor(STREAMS)
    futs = [ex.submit(stream_chat, url, model, p, max_tokens, per) for p in prompts]
    got = []
    for f in futs:
        try:
            got.append(f.result(timeout=max(clock.left(), 1)))
        except (OSError, cf.TimeoutError, http.client.HTTPException, ValueError) as e:
            got.append({"error": f"{type(e).__name__}: {e}"})
    wall = time.perf_counter() - t0
    ex.shutdown(wait=False, cancel_futures=True)   # a stream still open ends when the server stops
    ok = [g for g in got if "error" not in g and g["done"]]
    ttfts = [g["ttft"] for g in ok if g["ttft"] is not None]
    tokens = sum(g["tokens"] for g in ok)
    return {"model": model, "streams": STREAMS, "max_tokens": max_tokens, "ok_streams": len(ok), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None, "ttft_max_s": max(ttfts) if ttfts else None,
            "errors": [g["error"] for g in got if "error" in g]
            + [f"stream {i} did not end with [DONE]" for i, g in enumerate(got) if "error" not in g and not g["done"]]}


PART_FUNCS: dict[str, Callable[[Context], PartResult]] = {
    "cuda-tests": part_cuda_tests,
    "train-flash": lambda ctx: part_train(ctx, flash=True),
    "train-sdpa": lambda ctx: part_train(ctx, flash=False),
    "resume": part_resume,
    "fsdp": part_fsdp,
    "decode": part_decode,
    "serve": part_serve,
}


def run_part(ctx: Context, name: str) -> PartResult:
    """One part, timed, its failures turned into a result (the next part still runs)."""
    t0 = time.monotonic()
    log = ctx.log(name)
    if name in NEEDS_CUDA and not ctx.cuda:
        r = PartResult(name, "skipped", "no CUDA")
    elif ctx.deadline - time.monotonic() < 5:
        r = PartResult(name, "skipped", f"the {ctx.args.budget_s} s budget was spent")
    else:
        log.unlink(missing_ok=True)
        try:
            r = PART_FUNCS[name](ctx)
        except PartTimeout as e:
            own = (DRY_TIMEOUTS if ctx.dry else TIMEOUTS)[name]
            r = PartResult(name, "timeout", f"{e} (the part's limit: {own} s, or the budget's end)")
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            r = PartResult(name, "error", f"{type(e).__name__}: {e}")
    r.seconds = time.monotonic() - t0
    if log.exists():
        r.log = str(log.relative_to(ctx.out))
    return r


# ----------------------------------------------------------------------------- children
def child_probe(requested: str, out: str) -> None:
    import torch
    from utils.cli import UsageError
    from utils.device import resolve_device
    try:
        dev = resolve_device(requested, "--device")
    except UsageError as e:                             # no such device here: the answer says why
        info = {"type": "none", "error": str(e)}
    else:
        info = {"type": dev.type, "name_arg": str(dev), "torch": torch.__version__,
                "cuda_version": torch.version.cuda, "name": None}
        if dev.type == "cuda":
            info["name"] = torch.cuda.get_device_name(dev)
            info["memory_gb"] = torch.cuda.get_device_properties(dev).total_memory / 2**30
    try:
        import flash_attn
        info["flash_attn"], info["flash_attn_error"] = flash_attn.__version__, None
    except (ImportError, OSError, RuntimeError) as e:     # not installed, or built for another torch
        info["flash_attn"], info["flash_attn_error"] = None, f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(info))


def child_compare(a: str, b: str, out: str) -> None:
    """Two checkpoints' weights: equal bit for bit, and their relative L2 distance."""
    import torch
    from utils.training.checkpoint import read_checkpoint
    wa, wb = read_checkpoint(a)["model"], read_checkpoint(b)["model"]
    if wa.keys() != wb.keys():
        raise SystemExit(f"the two checkpoints hold different weights: {sorted(wa.keys() ^ wb.keys())[:4]}")
    equal = all(torch.equal(wa[k], wb[k]) for k in wa)
    num = sum(float((wa[k].double() - wb[k].double()).pow(2).sum()) for k in wa)
    den = sum(float(wa[k].double().pow(2).sum()) for k in wa)
    Path(out).write_text(json.dumps({"equal": equal, "rel_l2": math.sqrt(num / max(den, 1e-300))}))


def child_decode(device: str, out: str) -> None:
    """The compiled decode step on CUDA: CUDA graphs recorded and none skipped, tokens equal
    to the eager step's, batch-1 tokens/s of each."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees
    from model import ModelArgs, create_model
    from utils.generation.engine import Engine
    torch._logging.set_logs(perf_hints=True)           # inductor says why it skips a graph
    dev = torch.device(device)
    torch.manual_seed(0)
    m = create_model(ModelArgs(vocab_size=32000, d_model=384, n_layers=8, n_heads=6, n_kv_heads=2,
                               max_seq_len=1024, bos_id=1)).to(dev).eval()
    counters.clear()
    comp, eager = Engine(m, compile="on"), Engine(m, compile="off")
    compile_s = comp.compile_now()
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 32000, (n,), generator=g).tolist() for n in (5, 17)]
    new = 128

    def timed(engine):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        toks = [engine.generate([p], new, temperature=0)[0] for p in prompts]
        torch.cuda.synchronize(dev)
        return toks, len(prompts) * new / (time.perf_counter() - t0)
    timed(comp)                                          # the first replays record the graphs
    tc, rate_c = timed(comp)
    te, rate_e = timed(eager)
    manager = cudagraph_trees.get_manager(dev.index or 0, create_if_none_exists=False)
    recorded = sum(len(v) for v in manager.roots.values()) if manager is not None else 0
    Path(out).write_text(json.dumps({
        "tokens_equal": tc == te, "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "graphs_recorded": recorded, "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "compile_s": compile_s, "compiled_tokens_per_s": rate_c, "eager_tokens_per_s": rate_e}))


def child_serve_checkpoint(shape: str, path: str, out: str) -> None:
    """A random-initialised chat checkpoint (our template, the sample tokenizer) of a preset's
    shape to serve: what it says does not matter, its speed does."""
    import torch
    from model import ModelArgs, create_model
    from utils.config import MODEL_PRESETS
    from utils.data import sft
    from utils.data.tok import describe, load_tokenizer_from
    from utils.training.checkpoint import save_checkpoint
    tok = load_tokenizer_from(str(SPM_MODEL))
    p = MODEL_PRESETS[shape]
    args = ModelArgs(vocab_size=len(tok), d_model=p["d_model"], n_layers=p["n_layers"], n_heads=p["n_heads"],
                     n_kv_heads=p["n_kv_heads"], tie_embeddings=p["tie_embeddings"], max_seq_len=512,
                     bos_id=tok.bos_token_id)
    torch.manual_seed(0)
    m = create_model(args)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, {"kind": "sft", "model": m.state_dict(), "model_args": args.to_dict(),
                           "tokenizer": describe(tok, str(SPM_MODEL)), "chat_template": sft.default_template(),
                           "step": 0})
    Path(out).write_text(json.dumps({"path": path, "parameters": sum(t.numel() for t in m.parameters())}))


CHILDREN = {"probe": child_probe, "compare": child_compare, "decode": child_decode,
            "serve-checkpoint": child_serve_checkpoint}


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.child:
        CHILDREN[a.child](*a.child_args)
        return 0
    out = a.out.resolve()
    missing = [str(f.relative_to(ROOT)) for f in (SPM_MODEL, SAMPLES / "enwiki") if not f.exists()]
    if missing:
        print(f"gpu-check: the offline samples are missing ({', '.join(missing)}): run `make samples` "
              "(python main.py samples) first; on a box without internet, copy data/samples from a machine "
              "that has them", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"gpu-check: --out {out} is a file; give a folder (it gets summary.json, logs/, work/)", file=sys.stderr)
        return 2
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        device = probe_device(a.device, out / "logs" / "probe.log")
    except (PartTimeout, RuntimeError) as e:
        print(f"gpu-check: the device probe failed ({e}); see {out / 'logs' / 'probe.log'}", file=sys.stderr)
        return 1
    if device["type"] == "none":
        print(f"gpu-check: {device['error']}", file=sys.stderr)
        return 2
    if device["type"] != "cuda" and not a.dry_run:
        print("gpu-check: no CUDA device here; make gpu-check is for a GPU box (--dry-run runs its "
              "plumbing on the CPU: tiny preset, a few steps, CUDA-only parts skipped).", file=sys.stderr)
        return 2
    write_config_layer(out / "work")
    ctx = Context(a, out, device, deadline=t0 + a.budget_s)
    results, interrupted = run_parts(ctx)
    finished = datetime.datetime.now(datetime.timezone.utc)
    meta = {"version": 1, "mode": "dry-run" if a.dry_run else "full", "started": started.isoformat(timespec="seconds"),
            "finished": finished.strftime("%Y-%m-%d %H:%M UTC"), "seconds": time.monotonic() - t0,
            "budget_s": a.budget_s, "steps": a.steps, "parts_asked": a.parts, "device": device,
            "data": None if ctx.data_ok is None else (ctx.data_ok or ctx.data_note)}
    summary = summarize(results, meta)
    js, txt = write_outputs(out, summary)
    print(table(summary), end="")
    print(f"wrote {js} and {txt}")
    return 130 if interrupted else 0 if summary["ok"] else 1


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_parts(ctx: Context) -> tuple[list[PartResult], bool]:
    """Every part asked for, in order; Ctrl-C or SIGTERM stops the running part's processes
    and ends the check with the parts done so far (True: interrupted)."""
    results: list[PartResult] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    name, t0 = "", time.monotonic()
    try:
        for name in ctx.args.parts:
            t0 = time.monotonic()
            print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
            results.append(run_part(ctx, name))
            print(f"gpu-check: {name}: {results[-1].status}: {results[-1].summary}", file=sys.stderr, flush=True)
    except KeyboardInterrupt as e:
        stop_all()
        if not results or results[-1].name != name:
            results.append(PartResult(name, "error", f"interrupted ({e or 'Ctrl-C'}): its processes were stopped",
                                      seconds=time.monotonic() - t0))
        print(f"gpu-check: interrupted during {name}; the parts done so far are in the summary", file=sys.stderr)
        return results, True
    finally:
        signal.signal(signal.SIGTERM, previous)
    return results, False


if __name__ == "__main__":
    sys.exit(main())
