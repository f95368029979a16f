"""What a report says about a run, gathered from what the stages wrote (library; read-only).

Sources, each optional except the first two (one of which must exist):

- ``logs/raw_metrics/<run>.jsonl`` (utils/training/logging_utils.py: ``read_log``; damaged
  lines are skipped and counted): curves, starts/resumes/interruptions, samples, the
  hyperparameters and, for runs started since it was recorded, the environment;
- the run folder ``checkpoints/<run>/`` through the run layer (utils/run.py): its checkpoint
  files, one checkpoint's metadata (the latest, memory-mapped through the one loader), the
  stored config (``config.json``; SFT runs: ``sft_config.json``), its tokenizer copy, and the
  SFT runs started from its checkpoints;
- the shard set the stored config names (utils/data/shards.py ``read_metadata``) or, for an
  SFT run, its prepared data (utils/data/sft.py ``read_metadata``);
- ``benchmark_results/benchmark_*.json`` (utils/bench): every model entry whose checkpoint
  lies in the run folder.

A part that is missing or unreadable becomes a one-line ``problems`` entry of its section,
never an exception; only a run with neither a log nor a folder is an error.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from model import ModelArgs, create_model
from utils.cli import PipelineError
from utils.config import Config
from utils.data.sft import read_metadata as read_sft_metadata
from utils.data.shards import read_metadata as read_shard_metadata
from utils.data.tok import INFO_FILE
from utils.run import (RUN_TOKENIZER_DIR, checkpoint_bytes, lineage, load_checkpoint, read_stage_config,
                       run_checkpoints, run_kind, runs_started_from, stored_config)
from utils.training.logging_utils import (TERMINAL_EVENTS, LogRead, finite, latest_per_step,
                                          read_log)


@dataclass
class Segment:
    """One start or resume of the run, from its start event to its last record."""
    kind: str                 # "start" | "resume"
    step0: int
    t0: float
    step1: int
    t1: float
    end: Optional[str] = None   # the terminal event (TERMINAL_EVENTS), None: none logged
    config: Optional[dict] = None   # the config record logged just before it (hparams, environment)


@dataclass
class CheckpointMeta:
    path: Path
    kind: str
    step: Optional[int]
    tokens_seen: Optional[int]
    best_val_loss: Optional[float]
    model_args: Optional[dict]
    tokenizer: Optional[dict]
    bytes_per_token: Optional[float]


@dataclass
class BenchGroup:
    """Benchmark models scored on the same items (same tasks, item counts, seed and data),
    from one or more result files; ``ours`` marks the run's own checkpoints."""
    files: list
    settings: dict
    models: list              # {"name" (label), "results", "ours", "identity"}


@dataclass
class RunFacts:
    name: str
    run_dir: Path
    log: LogRead
    kind: str = "pretrain"
    train: list = field(default_factory=list)
    val: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    configs: list = field(default_factory=list)
    events: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    checkpoint_files: list = field(default_factory=list)      # (name, bytes)
    ckpt: Optional[CheckpointMeta] = None
    cfg: Optional[Config] = None
    sft_config: Optional[dict] = None       # a post-training run's stage config (sft_config.json, dpo_..., rl_...)
    chain: list = field(default_factory=list)  # utils.run.lineage: [first base, ..., this run]
    rl_val: list = field(default_factory=list)  # an RL run's validations (held-out pass@1)
    dpo_config: Optional[dict] = None       # a DPO run's dpo_config.json (= sft_config)
    tokenizer_copy: Optional[dict] = None
    shards: Optional[dict] = None
    shards_dir: Optional[Path] = None
    sft_data: Optional[dict] = None
    model_numbers: Optional[dict] = None
    children: list = field(default_factory=list)
    benchmarks: list = field(default_factory=list)
    problems: dict = field(default_factory=dict)              # section -> [one-line notes]
    out_of_range: Counter = field(default_factory=Counter)    # log key -> values left out

    def note(self, section: str, text: str) -> None:
        self.problems.setdefault(section, []).append(text)

    @property
    def hparams(self) -> dict:
        """The last start's hyperparameters (else the last config record's)."""
        configs = [s.config for s in self.segments if s.config] or self.configs
        return configs[-1]["hparams"] if configs else {}

    @property
    def config(self) -> dict:
        """The resolved config the last start logged (else the last config record's)."""
        configs = [s.config for s in self.segments if s.config] or self.configs
        return as_dict(configs[-1].get("config")) if configs else {}


# ----------------------------------------------------------------------------- the run
def log_path(cfg: Config, run: str) -> Path:
    return cfg.path("paths.logs_dir") / "raw_metrics" / f"{run}.jsonl"


def collect(run: str, cfg: Config, children: bool = True) -> RunFacts:
    """Everything the report of ``run`` shows (module docstring); PipelineError (exit 1) when
    the run has neither a log nor a folder."""
    run_dir = cfg.path("paths.checkpoints_dir") / run
    path = log_path(cfg, run)
    if not path.is_file() and not run_dir.is_dir():
        raise PipelineError(f"no run '{run}': neither its log {path} nor its folder {run_dir} "
                            "exists. `python main.py status` lists the runs.")
    f = RunFacts(run, run_dir, read_log(path))
    _read_log_parts(f)
    _read_run_folder(f)
    _read_data(f)
    _count_model(f)
    if children:
        f.children = [collect(r.name, cfg, children=False)
                      for r in runs_started_from(cfg.path("paths.checkpoints_dir"), run_dir)]
        f.chain = lineage(cfg.path("paths.checkpoints_dir"), run_dir)
        f.benchmarks = benchmark_groups(cfg.path("paths.benchmark_dir"), run_dir, f)
    return f


# Numbers a log can hold (JSON has no limits) that no stage writes and the report cannot show:
# they are left out like values of the wrong type, and counted (RunFacts.out_of_range).
NUMBER_LIMIT = 1e100                   # beyond it, axis ranges and spans overflow in the plots
INT_LIMIT = 2 ** 63                    # steps, tokens, sizes: what numpy and torch hold
TIME_RANGE = (-62135596800.0, 253402300799.0)     # 0001-01-01 .. 9999-12-31 23:59:59 UTC


def _usable(key: str, v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return True                    # not a number: the readers check the type they need
    if key == "time":
        return finite(v) and TIME_RANGE[0] <= v <= TIME_RANGE[1]
    if isinstance(v, int):
        return -INT_LIMIT < v < INT_LIMIT
    return not math.isfinite(v) or abs(v) <= NUMBER_LIMIT    # NaN, inf: read as n/a already


def in_range(record, counts: Counter, top: str = "", depth: int = 0):
    """``record`` with every number out of range (:func:`_usable`) left out: a dict loses the
    key, a list holds None in its place; each is counted under its record's top-level key.
    Nesting deeper than any record the stages write (16) is kept as it is: nothing reads it
    as a number."""
    if depth > 16:
        return record
    if isinstance(record, dict):
        out = {}
        for k, v in record.items():
            where = top or str(k)
            if not _usable(str(k), v):
                counts[where] += 1
                continue
            out[k] = in_range(v, counts, where, depth + 1)
        return out
    if isinstance(record, list):
        out = []
        for v in record:
            if not _usable("", v):
                counts[top] += 1
                v = None
            out.append(in_range(v, counts, top, depth + 1))
        return out
    return record


def _read_log_parts(f: RunFacts) -> None:
    f.log.records[:] = [in_range(r, f.out_of_range) for r in f.log.records]
    recs = f.log.records
    if not f.log.exists:
        f.note("training", f"no metrics log: {f.log.path} does not exist.")
    f.train = latest_per_step(recs, "train")
    f.val = [r for r in latest_per_step(recs, "val") if finite(r.get("val_loss"))]
    f.rl_val = [r for r in latest_per_step(recs, "val") if finite(r.get("val_pass_at_1"))]
    f.samples = [r for r in recs if r.get("type") == "sample" and isinstance(r.get("text"), str)]
    f.configs = [r for r in recs if r.get("type") == "config" and isinstance(r.get("hparams"), dict)]
    f.events = [r for r in recs if r.get("type") == "event" and isinstance(r.get("step"), int)]
    f.segments = segments(recs)


def segments(records: list) -> list[Segment]:
    """The run's starts and resumes, each to its last record and terminal event, with the
    config record its stage logged before it (a config record with no start after it, as a
    run found already complete logs, belongs to none)."""
    out: list[Segment] = []
    config = None
    for r in records:
        step, t = r.get("step"), r.get("time")
        if r.get("type") == "config" and isinstance(r.get("hparams"), dict):
            config = r
            continue
        if r.get("type") == "event" and r.get("event") in ("start", "resume") \
                and isinstance(step, int) and finite(t):
            out.append(Segment(r["event"], step, t, step, t, config=config))
            config = None
            continue
        if not out:
            continue
        cur = out[-1]
        if finite(t):
            cur.t1 = max(cur.t1, t)
        if isinstance(step, int) and not isinstance(step, bool):
            cur.step1 = max(cur.step1, step)
        if r.get("type") == "event" and r.get("event") in TERMINAL_EVENTS:
            cur.end = r["event"]
    return out


def _read_run_folder(f: RunFacts) -> None:
    if not f.run_dir.is_dir():
        f.note("model", f"no run folder: {f.run_dir} does not exist (no checkpoint, stored "
                        "config or tokenizer copy).")
        return
    files = run_checkpoints(f.run_dir)
    f.checkpoint_files = [(p.name, checkpoint_bytes(p)) for p in files]
    f.sft_config = read_stage_config(f.run_dir)
    f.kind = run_kind(f.run_dir)
    f.dpo_config = f.sft_config if f.kind == "dpo" else None
    f.cfg = stored_config(f.run_dir)
    if f.cfg is None:
        f.note("data", f"no readable stored config in {f.run_dir} (config.json or "
                       "sft_config.json): the data the run read cannot be found.")
    f.tokenizer_copy = _tokenizer_copy(f.run_dir)
    f.ckpt = _checkpoint_meta(f, files)


def _tokenizer_copy(run_dir: Path) -> Optional[dict]:
    try:
        info = json.loads((run_dir / RUN_TOKENIZER_DIR / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def _checkpoint_meta(f: RunFacts, files: list) -> Optional[CheckpointMeta]:
    """The metadata of the run's latest checkpoint (else the next readable one)."""
    order = sorted(files, key=lambda p: p.stem != "checkpoint_latest")
    if not order:
        f.note("model", f"no checkpoint in {f.run_dir}.")
    for p in order:
        try:
            ck = load_checkpoint(p, purpose="weights", mmap=True, tensors=False)   # metadata only
        except PipelineError as e:
            f.note("model", f"{p.name} could not be read: {str(e).splitlines()[0][:300]}")
            continue
        bpt = as_dict(ck.get("metrics")).get("bytes_per_token")
        return CheckpointMeta(p, str(ck.get("kind", "pretrain")), _int(ck.get("step")),
                              _int(ck.get("tokens_seen")), _num(ck.get("best_val_loss")),
                              dict(ck["model_args"]), as_dict(ck.get("tokenizer")),
                              bpt if finite(bpt) and bpt > 0 else None)
    return None


def as_dict(x) -> dict:
    """``x`` when it is a dict, else {}: what the stages wrote is read as data of any shape."""
    return x if isinstance(x, dict) else {}


def as_list(x) -> list:
    return x if isinstance(x, list) else []


def _int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v) -> Optional[float]:
    return float(v) if finite(v) else None


# ----------------------------------------------------------------------------- data
def _read_data(f: RunFacts) -> None:
    if f.kind != "pretrain":
        if f.kind == "sft":
            _read_sft_data(f)
        return
    if f.kind == "dpo":         # dpo_config.json describes its pairs (the report's DPO section)
        return
    cfg = f.cfg
    if cfg is None:
        return
    if cfg.dataset.mode == "on_the_fly":
        f.note("data", f"the run tokenized its data on the fly ({cfg.dataset.on_the_fly_source}); "
                       "there is no shard set to describe.")
        return
    f.shards_dir = cfg.shard_dir()
    try:
        f.shards = read_shard_metadata(f.shards_dir)
    except PipelineError as e:
        f.note("data", f"shard set {f.shards_dir}: {str(e).split('. ')[0]}.")
        return
    want = f.ckpt.tokenizer if f.ckpt else {}
    have = as_dict(f.shards.get("tokenizer"))
    if want.get("fingerprint") and have.get("fingerprint") != want.get("fingerprint"):
        f.note("data", f"the shard set in {f.shards_dir} was rebuilt with another tokenizer "
                       "since this run (fingerprints differ): its numbers below are not this "
                       "run's data.")


def _read_sft_data(f: RunFacts) -> None:
    data = as_dict(as_dict(f.sft_config).get("data"))
    if not isinstance(data.get("dir"), str):
        f.note("data", "the run folder records no SFT data folder (sft_config.json).")
        return
    try:
        meta = read_sft_metadata(Path(data["dir"]))
    except PipelineError as e:
        f.note("data", f"SFT data: {str(e).split('. ')[0]}.")
        return
    if data.get("fingerprint") and meta.get("data_fingerprint") != data.get("fingerprint"):
        f.note("data", f"the SFT data in {data['dir']} was prepared again since this run "
                       "(data fingerprints differ); the counts below are what the run recorded.")
        return
    f.sft_data = meta


# ----------------------------------------------------------------------------- model
def model_args(f: RunFacts) -> Optional[dict]:
    """The run's model settings: its checkpoint's, else what the log or sft_config recorded."""
    if f.ckpt and f.ckpt.model_args:
        return f.ckpt.model_args
    for source in (f.hparams.get("model"), as_dict(f.sft_config).get("model")):
        if isinstance(source, dict):
            return source
    return None


def sequence_length(f: RunFacts, args: dict) -> int:
    """The sequence length training ran at: the window (pre-training), the SFT examples'
    mean length, else the model's context."""
    if isinstance(f.hparams.get("window"), int):
        return f.hparams["window"]
    mean = as_dict(as_dict(f.sft_data).get("lengths")).get("mean")
    if finite(mean) and mean > 0:
        return int(round(mean))
    return int(args.get("max_seq_len") or 1)


def _count_model(f: RunFacts) -> None:
    """Parameters, non-embedding parameters and training FLOPs per token of the model the
    stored settings build (on the meta device: no memory, no weights)."""
    args = model_args(f)
    if args is None:
        f.note("model", "no model settings recorded (no readable checkpoint, log config or "
                        "sft_config.json).")
        return
    try:
        with torch.device("meta"):
            m = create_model(ModelArgs.from_dict(dict(args)))
    except Exception as e:      # noqa: BLE001 - stored settings this code cannot build: say so
        f.note("model", f"the stored model settings do not build a model: {e}")
        return
    seq = sequence_length(f, args)
    f.model_numbers = {"args": dict(args), "parameters": m.num_params(),
                       "non_embedding": m.num_params(non_embedding=True),
                       "flops_per_token": m.flops_per_token(seq), "seq_len": seq}


# ----------------------------------------------------------------------------- numbers
def summary(f: RunFacts) -> dict:
    """The run's key numbers (None where unknown); what the tables and the comparison show."""
    last_train = f.train[-1] if f.train else {}
    steps = [s.step1 for s in f.segments] + [r["step"] for r in f.train + f.val]
    wall = sum(max(0.0, s.t1 - s.t0) for s in f.segments)
    tokens = _int(last_train.get("tokens_seen"))
    rates = [r["tokens_per_s"] for r in f.train if finite(r.get("tokens_per_s"))]
    mfus = [r["mfu"] for r in f.train if finite(r.get("mfu"))]
    mem = [r["peak_memory_mb"] for r in f.train if finite(r.get("peak_memory_mb"))]
    final = f.val[-1] if f.val else {}
    bpb, derived = final.get("bits_per_byte"), False
    if not finite(bpb) and final and f.ckpt and f.ckpt.bytes_per_token:
        bpb, derived = final["val_loss"] / math.log(2) / f.ckpt.bytes_per_token, True
    total = f.hparams.get("total_steps")
    return {
        "step": max(steps) if steps else None,
        "total_steps": total if _int(total) else None,
        "tokens": tokens, "tokens_at_step": _int(last_train.get("step")),
        "wall_s": wall if f.segments else None,
        "elapsed_s": (f.segments[-1].t1 - f.segments[0].t0) if f.segments else None,
        "started": f.segments[0].t0 if f.segments else None,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "tokens_per_s_mean": tokens / wall if tokens and wall > 0 else None,
        "mfu_median": statistics.median(mfus) if mfus else None,
        "peak_memory_mb": max(mem) if mem else None,
        "final_val_loss": final.get("val_loss"), "final_val_step": final.get("step"),
        "best_val_loss": min(r["val_loss"] for r in f.val) if f.val else None,
        "final_bpb": bpb if finite(bpb) else None, "bpb_derived": derived,
        "final_loss": last_train.get("loss") if finite(last_train.get("loss")) else None,
        "state": state(f),
    }


def state(f: RunFacts) -> str:
    if not f.segments:
        return "no training recorded"
    end = f.segments[-1].end
    if end in ("done", "early_stopping"):
        return "finished" + (" (early stopping)" if end == "early_stopping" else "")
    if end == "interrupted":
        return "interrupted"
    return "no final event (still running, or killed)"


def bytes_per_token(f: RunFacts) -> Optional[float]:
    return f.ckpt.bytes_per_token if f.ckpt else None


def environment(seg: Segment) -> Optional[dict]:
    """The environment a start recorded (utils/environment.py), None for a start logged before
    it was recorded (or a record without any of its parts)."""
    env = as_dict(as_dict(seg.config).get("environment"))
    return env if any(as_dict(env.get(k)) for k in ("git", "packages", "machine")) else None


def smoothing_window(f: RunFacts) -> Optional[int]:
    """The window of the logged smoothed loss (the last start's logging.smoothing_window)."""
    return _int(as_dict(f.config.get("logging")).get("smoothing_window"))


# ----------------------------------------------------------------------------- benchmarks
def _item_key(payload: dict, task: str) -> str:
    """What decides which items a task scored: its data (source, rows, valid items), its item
    count and the seed (benchmark.py: ``select(items, limit, seed)``)."""
    s = as_dict(payload.get("settings"))
    limits = as_dict(s.get("limits"))
    data = as_dict(as_dict(payload.get("data")).get(task.split(":")[0]))    # "hellaswag:10": its data
    limit = limits.get("perplexity" if task == "next_token" else task)
    return json.dumps([task, limit, s.get("seed"), data.get("source"), data.get("rows"),
                       data.get("valid")])


def _files(bench_dir: Path, f: RunFacts) -> list[tuple[str, dict]]:
    out = []
    bad = []
    for p in sorted(Path(bench_dir).glob("benchmark_*.json")):
        try:
            payload = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            payload = None
        if not (isinstance(payload, dict) and isinstance(payload.get("models"), list)):
            bad.append(p.name)
            continue
        out.append((p.name, payload))
    if bad:
        f.note("benchmarks", f"{len(bad)} unreadable result file(s) in {bench_dir} skipped: "
                             + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    return out


def _is_ours(model: dict, run_dir: Path) -> bool:
    ident = as_dict(model.get("identity"))
    path = ident.get("path")
    return (ident.get("kind") == "checkpoint" and isinstance(path, str)
            and Path(path).resolve().parent == run_dir.resolve())


def _label(model: dict) -> str:
    ident = as_dict(model.get("identity"))
    name = str(model.get("name", "?"))
    step = ident.get("step")
    return f"{name}, step {step}" if ident.get("kind") == "checkpoint" and _int(step) is not None \
        else name


def _results(results) -> dict:
    """``{task: {"metrics": {metric: {"value", "stderr"}}}}`` with only well-formed numbers
    (a hand-edited or foreign file cannot break the table; a bad value reads as n/a)."""
    out: dict = {}
    for task, r in as_dict(results).items():
        metrics = {}
        for metric, v in as_dict(as_dict(r).get("metrics")).items():
            v = as_dict(v)
            metrics[str(metric)] = {k: (float(v[k]) if finite(v.get(k)) else None)
                                    for k in ("value", "stderr")}
        out[str(task)] = {"metrics": metrics}
    return out


def benchmark_groups(bench_dir: Path, run_dir: Path, f: RunFacts) -> list[BenchGroup]:
    """Every benchmark that scored one of the run's checkpoints, with every model (from any
    result file) scored on the same items; a model scored twice with the same weights
    (fingerprint) on them appears once, from the newest file."""
    if not Path(bench_dir).is_dir():
        f.note("benchmarks", f"no benchmark results ({bench_dir} does not exist).")
        return []
    groups: dict[tuple, BenchGroup] = {}
    for name, payload in _files(bench_dir, f):
        settings = as_dict(payload.get("settings"))
        tasks = [t for t in as_list(settings.get("tasks")) if isinstance(t, str)]
        key = tuple(sorted(_item_key(payload, t) for t in tasks))
        g = groups.setdefault(key, BenchGroup([], settings, []))
        g.files.append(name)
        for m in payload["models"]:
            if isinstance(m, dict):
                core = as_dict(as_dict(m.get("results")).get("core"))
                g.models.append({"name": _label(m), "results": _results(m.get("results")),
                                 "ours": _is_ours(m, run_dir), "identity": as_dict(m.get("identity")),
                                 "file": name, "contamination": as_dict(m.get("contamination")) or None,
                                 "core_note": core.get("note") if isinstance(core.get("note"), str) else None})
    out = []
    for g in groups.values():
        if not any(m["ours"] for m in g.models):
            continue
        seen, models = set(), []
        for m in reversed(g.models):              # newest file first
            ident = (m["name"], m["identity"].get("fingerprint") or m["file"])
            if ident not in seen:
                seen.add(ident)
                models.append(m)
        names = [m["name"] for m in models]
        for m in models:                          # same label, other weights: say which file
            if names.count(m["name"]) > 1:
                m["name"] = f"{m['name']} [{m['file'].removeprefix('benchmark_').removesuffix('.json')}]"
        models.sort(key=lambda m: (not m["ours"], m["file"], m["name"]))
        g.models = models
        out.append(g)
    if not out:
        f.note("benchmarks", f"no benchmark result in {bench_dir} names a checkpoint of this run "
                             f"(python main.py benchmark {f.name}).")
    return out
