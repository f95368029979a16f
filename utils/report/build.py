"""A run's facts (utils/report/facts.py) as a report: blocks (utils/report/document.py) and the
pictures they show (utils/report/plots.py). Pure functions of the facts: the same facts give
the same blocks and the same PNG bytes; the only times shown are the run's own (its log's
record times, in UTC) and the data's own build stamps."""
from __future__ import annotations

import datetime as dt
import json
import math
from typing import Optional

import numpy as np

from utils.report import facts as F
from utils.report.document import (Bold, Bullets, Code, CodeBlock, Details, Heading, Image, Para,
                                   Table, image_file)
from utils.report.plots import COLORS, Line, Panel, figure_png
from utils.training.logging_utils import finite
from utils.training.scheduler import effective_warmup

SAMPLES_SHOWN = 5
SAMPLE_CHARS = 2000       # a sample longer than this is cut (and says so)


# ----------------------------------------------------------------------------- formatting
def num(x, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if finite(x) else "n/a"


def count(x) -> str:
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else "n/a"


def short(n) -> str:
    """2171200 -> '2.17M'."""
    if not finite(n):
        return "n/a"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:g}"


def duration(s) -> str:
    if not finite(s):
        return "n/a"
    if s < 120:
        return f"{s:.1f} s"
    m = int(round(s)) // 60
    if m < 120:
        return f"{m} min {int(round(s)) % 60:02d} s"
    return f"{m // 60} h {m % 60:02d} min"


def utc(t) -> str:
    """A log time (seconds since 1970) as a UTC date; n/a for one that is not a date (the facts
    leave such times out; this never raises on what a log holds)."""
    if not finite(t):
        return "n/a"
    try:
        when = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=t)
    except (OverflowError, ValueError):
        return "n/a"
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def out_of_range(f: F.RunFacts) -> str:
    """'3 value(s) (time 2, step 1)': the log values the facts left out as out of range."""
    by = ", ".join(f"{k} {n}" for k, n in sorted(f.out_of_range.items()))
    return f"{sum(f.out_of_range.values())} value(s) ({by})"


def rate(x) -> str:
    return f"{x:,.0f}" if finite(x) else "n/a"


def _missing(f: F.RunFacts, section: str) -> list:
    return [Para(f"Not available: {p}") for p in f.problems.get(section, [])]


# ----------------------------------------------------------------------------- curves
def _series(records: list, key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if finite(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _bpb_series(f: F.RunFacts) -> tuple[list, list, str]:
    xs, ys = _series(f.val, "bits_per_byte")
    if ys:
        return xs, ys, "validation"
    bpt = F.bytes_per_token(f)
    if bpt:
        xs, losses = _series(f.val, "val_loss")
        return xs, [v / math.log(2) / bpt for v in losses], "derived: loss / ln 2 / bytes per token"
    return [], [], ""


def smoothed_parts(f: F.RunFacts) -> tuple[tuple[list, list], tuple[list, list]]:
    """The logged smoothed loss split by what it is (the trainer's mean of the last
    ``logging.smoothing_window`` steps, over the steps there are): ``(filling, full)``, the
    points before step ``window`` (each the mean of all the steps so far, a running mean from
    step 1 that lags far behind a falling loss) and those from step ``window`` on (the mean of
    the last ``window`` steps). Without a known window every point counts as full."""
    xs, ys = _series(f.train, "smoothed_loss")
    window = F.smoothing_window(f) or 0
    cut = sum(1 for x in xs if x < window)
    return (xs[:cut], ys[:cut]), (xs[cut:], ys[cut:])


def _smoothed_lines(f: F.RunFacts) -> list[Line]:
    window = F.smoothing_window(f)
    filling, full = smoothed_parts(f)
    return [Line("train (mean of all steps so far)", *filling, COLORS[0], 1.8, style="--"),
            Line(f"train (mean of last {window} steps)" if window else "train (smoothed)", *full,
                 COLORS[0], 2.2)]


def curve_panels(f: F.RunFacts) -> list[Panel]:
    marks = [(s.step0, "resumed") for s in f.segments if s.kind == "resume"]
    last = max([r["step"] for r in f.train + f.val] or [0])
    bx, bpb, bpb_label = _bpb_series(f)

    def panel(title, ylabel, lines):
        return Panel(title, "step", ylabel, lines, marks=marks, xlim=(0, last))
    return [
        panel("Loss", "cross-entropy (nats/token)",
              [Line("train (logged step)", *_series(f.train, "loss"), COLORS[0], 1.2, 0.5),
               *_smoothed_lines(f),
               Line("validation", *_series(f.val, "val_loss"), COLORS[1], 2.0, marker="o")]),
        panel("Validation bits per byte", "bits per UTF-8 byte",
              [Line(bpb_label, bx, bpb, COLORS[1], 2.0, marker="o")]),
        panel("Learning rate", "learning rate", [Line("lr", *_series(f.train, "lr"), COLORS[2])]),
        panel("Gradient norm (before clipping)", "L2 norm",
              [Line("grad norm", *_series(f.train, "grad_norm"), COLORS[3])]),
        panel("Throughput", "tokens / s", [Line("tokens/s", *_series(f.train, "tokens_per_s"), COLORS[4])]),
        panel("Peak memory", "MB", [Line("peak memory", *_series(f.train, "peak_memory_mb"), COLORS[5])]),
    ]


def curves_png(f: F.RunFacts, title: str) -> Optional[bytes]:
    return figure_png(curve_panels(f), title=title)


# ----------------------------------------------------------------------------- sections
def build_run(f: F.RunFacts) -> list:
    """The whole report of one run, as blocks (its images inside)."""
    s = F.summary(f)
    blocks: list = [Heading(1, f"Run report: {f.name}")]
    blocks += _intro(f, s)
    png = curves_png(f, f"{f.name}: training curves")
    if png:
        blocks.append(Image("curves.png", f"training curves of {f.name}", png))
    else:
        blocks.append(Para("Not available: no curve has a logged point yet."))
    for section in (_data, _model, _training, _rl, _dpo, _sft, _benchmarks, _samples, _environment, _config):
        blocks += section(f, s)
    return blocks


def _intro(f: F.RunFacts, s: dict) -> list:
    what = KIND_TITLES.get(f.kind, "Pre-training run")
    out = [Para([what, " ", Code(f.name), f": {s['state']}; started {utc(s['started'])}. "
                 "Written by ", Code("python main.py report"), " from the run's log, folder, "
                 "data and benchmark results."])]
    if f.log.bad_lines:
        shown = ", ".join(map(str, f.log.bad_lines[:10])) + (" ..." if len(f.log.bad_lines) > 10 else "")
        out.append(Para([Bold("Damaged log:"), f" {len(f.log.bad_lines)} line(s) of ",
                         Code(str(f.log.path)), f" are not JSON records and were skipped "
                         f"(line {shown}); the numbers below come from the other "
                         f"{len(f.log.records)} records."]))
    if f.out_of_range:
        out.append(Para([Bold("Values out of range:"), f" {out_of_range(f)} in the log are numbers no "
                         "stage writes (a time outside the years 1-9999, an integer beyond 64 bits, "
                         f"a number beyond ±{F.NUMBER_LIMIT:.0e}) and were left out of the numbers "
                         "and curves below."]))
    of = f" of {count(s['total_steps'])}" if s["total_steps"] else ""
    bpb = num(s["final_bpb"]) + (" (derived)" if s["bpb_derived"] else "")
    params = f.model_numbers["parameters"] if f.model_numbers else None
    rows = [["steps", f"{count(s['step'])}{of}"],
            ["tokens trained", f"{count(s['tokens'])} ({short(s['tokens'])})"],
            ["wall time (training)", duration(s["wall_s"])],
            ["final validation loss", f"{num(s['final_val_loss'])} (step {count(s['final_val_step'])})"],
            ["best validation loss", num(s["best_val_loss"])],
            ["final validation bits per byte", bpb],
            ["parameters", f"{count(params)} ({short(params)})"]]
    if len(f.chain) > 1:
        rows.append(["started from", " → ".join(f.chain)])
    return out + [Table(["", "value"], rows, "lr")]


def _data(f: F.RunFacts, s: dict) -> list:
    out = [Heading(2, "Data")]
    if f.kind == "sft":
        out += _sft_data(f)
    elif f.kind == "rl":
        out += _rl_task(f)
    else:
        out += _shards(f)
    out += _tokenizer(f)
    return out + _missing(f, "data")


def _shards(f: F.RunFacts) -> list:
    m = f.shards
    if m is None:
        return []
    src, tot, st = F.as_dict(m.get("source")), F.as_dict(m.get("totals")), F.as_dict(m.get("stats"))
    inputs = F.as_list(src.get("inputs"))
    names = ", ".join(str(x).rsplit("/", 1)[-1] for x in inputs[:3]) + (" ..." if len(inputs) > 3 else "")
    filters = F.as_dict(src.get("filters"))
    dropped = F.as_dict(st.get("dropped_by_reason"))
    rows = [["source", [Code(str(src.get("kind"))), f" ({len(inputs)} input file(s): {names})"
                        + ("; test mode" if src.get("test") else "")]],
            ["shard set", [Code(str(f.shards_dir)), f", {count(tot.get('shards'))} shard(s), "
                           f"{m.get('dtype')}, built {m.get('created', 'n/a')}"]],
            ["documents", f"{count(tot.get('documents'))} kept of {count(st.get('documents_read'))} read"],
            ["tokens", f"{count(tot.get('tokens'))} ({short(tot.get('tokens'))})"],
            ["characters", count(tot.get("characters"))],
            ["filters", ", ".join(f"{k} = {v}" for k, v in sorted(filters.items())) or "none"],
            ["documents dropped", f"{count(st.get('documents_dropped'))}"
             + (" (" + ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())) + ")" if dropped else "")]]
    if f.cfg is not None:
        d = f.cfg.dataset
        rows.append(["training windows", f"{d.window} tokens, stride {f.cfg.stride}; "
                                         f"{d.val_split:.0%} of the tokens held out for validation"])
    return [Table(["", "value"], rows)]


def _sft_data(f: F.RunFacts) -> list:
    sc = F.as_dict(f.sft_config)
    if not sc:
        return []
    data, m = F.as_dict(sc.get("data")), F.as_dict(f.sft_data)
    src = F.as_dict(data.get("source"))
    rows = [["fine-tuned from", [Code(str(sc.get("base_checkpoint")))]],
            ["data", [Code(str(data.get("dir"))), f" ({src.get('kind')}: {src.get('name')})"]],
            ["examples", f"{count(data.get('train_examples'))} training, "
                         f"{count(data.get('val_examples'))} validation"]]
    if src.get("label"):
        rows.append(["note", str(src["label"])])
    if m:
        c, ln = F.as_dict(m.get("counts")), F.as_dict(m.get("lengths"))
        rows += [["records", f"{count(c.get('kept'))} kept of {count(c.get('considered'))} considered; "
                             f"{count(c.get('too_long'))} too long, {count(c.get('skipped_total'))} malformed"],
                 ["lengths (tokens)", f"mean {ln.get('mean')}, median {ln.get('median')}, max {ln.get('max')}; "
                                      f"{count(ln.get('total_tokens'))} in all, {count(m.get('loss_tokens'))} in the loss"],
                 ["chat template", [Code(str(F.as_dict(m.get("template")).get("name")))]]]
    return [Table(["", "value"], rows)]


def _tokenizer(f: F.RunFacts) -> list:
    tok = F.as_dict(f.tokenizer_copy) or (f.ckpt.tokenizer if f.ckpt else {})
    if not tok:
        return [Para("Not available: the tokenizer (no copy in the run folder, no checkpoint record).")]
    cpt = F.as_dict(F.as_dict(f.shards).get("stats")).get("chars_per_token")
    bpt = F.bytes_per_token(f)
    specials = F.as_dict(tok.get("special_tokens"))
    rows = [["tokenizer", [Code(str(tok.get("name"))), f" ({tok.get('class', 'n/a')})"]],
            ["vocabulary", f"{count(tok.get('vocab_size'))} tokens; BOS {tok.get('bos_id')}, "
                           f"EOS {tok.get('eos_id')}"
                           + (f" ({specials.get('bos')} / {specials.get('eos')})" if specials else "")],
            ["fingerprint", [Code(str(tok.get("fingerprint", ""))[:16])]],
            ["characters per token", (f"{num(cpt, 3)} (the shard set's text)" if finite(cpt) else "n/a")],
            ["UTF-8 bytes per token", (f"{num(bpt, 3)} (measured on the validation windows)"
                                       if bpt else "n/a (not recorded)")]]
    return [Heading(3, "Tokenizer"), Table(["", "value"], rows)]


def _model(f: F.RunFacts, s: dict) -> list:
    out = [Heading(2, "Model")]
    n = f.model_numbers
    if n:
        args = n["args"]
        preset = f.cfg.model.preset if (f.cfg is not None and f.kind == "pretrain") else None
        rows = [["parameters", f"{count(n['parameters'])} ({short(n['parameters'])})"],
                ["non-embedding parameters", f"{count(n['non_embedding'])} ({short(n['non_embedding'])})"],
                ["training FLOPs per token", f"{short(n['flops_per_token'])} (6 x matmul parameters "
                 f"+ 12 x layers x d_model x {n['seq_len']} tokens of context)"]]
        if preset:
            rows.append(["preset", [Code(preset)]])
        out.append(Table(["", "value"], rows))
        out.append(Table(["setting", "value"], [[Code(k), json.dumps(v)] for k, v in sorted(args.items())]))
    if f.checkpoint_files:
        rows = [[Code(name), f"{size / 1e6:,.1f} MB"] for name, size in f.checkpoint_files]
        out += [Heading(3, "Checkpoints"),
                Para(["In ", Code(str(f.run_dir)), ":"]), Table(["file", "size"], rows, "lr")]
        if f.ckpt:
            c = f.ckpt
            out.append(Para([Code(c.path.name), f": step {count(c.step)}, {count(c.tokens_seen)} "
                             f"tokens seen, best validation loss {num(c.best_val_loss)}."]))
    return out + _missing(f, "model")


def _training(f: F.RunFacts, s: dict) -> list:
    out = [Heading(2, "Training")]
    hp = f.hparams
    if not f.segments:
        return out + [Para("Not available: the log records no training start.")] + _missing(f, "training")
    mfu = (f"{s['mfu_median']:.1%} (median of the logged values)" if s["mfu_median"] is not None
           else "n/a: " + _mfu_reason(f))
    eff = hp.get("effective_batch")
    rows = [["state", s["state"]],
            ["steps", f"{count(s['step'])}" + (f" of {count(s['total_steps'])}" if s["total_steps"] else "")],
            ["tokens", f"{count(s['tokens'])}" + (f" (at step {s['tokens_at_step']})"
                                                  if s["tokens_at_step"] != s["step"] else "")],
            ["wall time", f"{duration(s['wall_s'])} training (evaluation and checkpoints included), "
                          f"{duration(s['elapsed_s'])} from first start to last record"],
            ["tokens/s", f"{rate(s['tokens_per_s_median'])} (median of the logged intervals); "
                         f"{rate(s['tokens_per_s_mean'])} over the wall time"],
            ["MFU", mfu],
            ["device", f"{hp.get('device', 'n/a')}, world size {hp.get('world_size', 1)}"],
            ["precision", str(hp.get("dtype", "n/a")).replace("torch.", "")],
            ["peak memory", f"{s['peak_memory_mb']:,.0f} MB" if s["peak_memory_mb"] else "n/a"]]
    if isinstance(hp.get("lora"), dict):
        rows.append(["LoRA", _lora_text(hp["lora"], f.run_dir)])
    if isinstance(eff, int):
        rows.insert(3, ["batch", f"{eff} windows of {hp.get('window')} tokens per step "
                                 f"({hp.get('batch_size')} x {hp.get('grad_accum')} accumulation "
                                 f"x {hp.get('world_size', 1)} process(es))"])
    keys = ("optimizer", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "betas",
            "epochs", "seed", "compile", "activation_checkpointing")
    settings = ", ".join(f"{k} {_plain(hp[k])}" for k in keys if k in hp)
    if isinstance(hp.get("warmup_steps"), int) and isinstance(hp.get("total_steps"), int):
        used = effective_warmup(hp["warmup_steps"], hp["total_steps"])
        if used != hp["warmup_steps"]:
            settings += f" (warm-up used: {used} steps, capped at 20% of the run's {hp['total_steps']})"
    out += [Table(["", "value"], rows), Para(["Settings: ", settings, "."])]
    out += _starts(f)
    return out + _missing(f, "training")


def _lora_text(a: dict, run_dir) -> str:
    """A LoRA run's adapter (the log's hyperparameters): its shape, what trained, where it is."""
    text = (f"r={_plain(a.get('rank'))}, alpha={_plain(a.get('alpha'))}, dropout "
            f"{_plain(a.get('dropout'))}, on {', '.join(map(str, a.get('target_modules') or []))}")
    t, n = a.get("trainable_params"), a.get("total_params")
    if isinstance(t, int) and isinstance(n, int) and n > 0:
        text += f"; {count(t)} trainable of {count(n)} parameters ({100 * t / n:.2f}%), the rest frozen"
    return text + (f"; adapter (PEFT format) in {run_dir}/adapter" if run_dir else "")


def _plain(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _mfu_reason(f: F.RunFacts) -> str:
    for e in f.events:
        if e.get("event") in ("start", "resume") and isinstance(e.get("mfu_unavailable"), str):
            return e["mfu_unavailable"]
    return "not logged"


def _starts(f: F.RunFacts) -> list:
    """Each start and resume: where it began, how it ended; settings changed between them."""
    rows = []
    for i, seg in enumerate(f.segments):
        end = seg.end or "no final event (killed, crashed or still running)"
        rows.append([str(i + 1), seg.kind, utc(seg.t0), count(seg.step0), count(seg.step1),
                     duration(seg.t1 - seg.t0), end])
    interrupted = sum(1 for s in f.segments if s.end == "interrupted")
    resumes = sum(1 for s in f.segments if s.kind == "resume")
    lost = [f"start {i + 2} resumed at step {b.step0} after start {i + 1} had reached step "
            f"{a.step1}: steps {b.step0 + 1}-{a.step1} were trained again"
            for i, (a, b) in enumerate(zip(f.segments, f.segments[1:]))
            if b.kind == "resume" and b.step0 < a.step1]
    out = [Heading(3, "Starts, interruptions and resumes"),
           Para(f"{len(f.segments)} start(s): {interrupted} interrupted (Ctrl-C or SIGTERM, "
                f"state saved), {resumes} resumed."),
           Table(["#", "kind", "began", "from step", "to step", "wall time", "ended"], rows,
                 "lllrrrl")]
    changes = _setting_changes(f)
    if lost or changes:
        out.append(Bullets(lost + changes))
    return out


def _setting_changes(f: F.RunFacts) -> list:
    out = []
    for i, (a, b) in enumerate(zip(f.segments, f.segments[1:])):
        if not (a.config and b.config):
            continue
        ha, hb = a.config["hparams"], b.config["hparams"]
        diff = [f"{k} {json.dumps(ha.get(k))} -> {json.dumps(hb.get(k))}" for k in sorted(set(ha) | set(hb))
                if ha.get(k) != hb.get(k) and k != "run"]
        if diff:
            out.append(f"settings changed at start {i + 2}: " + "; ".join(diff))
    return out


KIND_TITLES = {"pretrain": "Pre-training run", "sft": "Supervised fine-tuning (SFT) run",
               "dpo": "Preference tuning (DPO) run", "rl": "Reinforcement learning (RL) run"}


def _sft(f: F.RunFacts, s: dict) -> list:
    """The post-training runs (SFT, DPO, RL) started from this run, with their curves."""
    out = [Heading(2, "Runs started from this run (SFT, DPO, RL)")]
    if not f.children:
        return out + [Para("None: no post-training run names a checkpoint of this run as its base "
                           "(its sft_config.json, dpo_config.json or rl_config.json).")]
    rows = []
    for c in f.children:
        cs = F.summary(c)
        base = str(F.as_dict(c.sft_config).get("base_checkpoint", "")).rsplit("/", 1)[-1]
        data = F.as_dict(F.as_dict(c.sft_config).get("data"))
        rows.append([Code(c.name), c.kind, Code(base), f"{count(data.get('train_examples'))} / "
                     f"{count(data.get('val_examples'))}", count(cs["step"]), count(cs["tokens"]),
                     num(cs["final_val_loss"]), num(cs["best_val_loss"]), duration(cs["wall_s"]),
                     cs["state"]])
    out.append(Table(["run", "kind", "from", "examples (train / val)", "steps", "tokens",
                      "final val loss", "best val loss", "wall time", "state"], rows, "llllrrrrrl"))
    taken = {"curves.png"}                        # the run's own curves are beside them
    for c in f.children:
        png = curves_png(c, f"{c.name}: {c.kind} curves")
        out.append(Heading(3, c.name))
        if png:
            name = image_file(c.name, taken)      # a folder's name: made safe and unique
            taken.add(name)
            out.append(Image(name, f"fine-tuning curves of {c.name}", png))
        out += [Para(f"Not available ({c.name}): {p}") for ps in c.problems.values() for p in ps]
        if c.log.bad_lines:
            out.append(Para(f"{c.name}: {len(c.log.bad_lines)} damaged log line(s) skipped."))
        if c.out_of_range:
            out.append(Para(f"{c.name}: {out_of_range(c)} out of range left out."))
    return out


def _rl_task(f: F.RunFacts) -> list:
    rc = F.as_dict(f.sft_config)           # the stage config: rl_config.json
    if not rc:
        return [Para("Not available: the run folder has no rl_config.json (its task).")]
    task, hp = F.as_dict(rc.get("task")), F.as_dict(rc.get("hyperparameters"))
    ex = F.as_dict(task.get("example"))
    rows = [["started from", [Code(str(rc.get("base_checkpoint")))]],
            ["task", f"{task.get('name')}: {task.get('source')}"],
            ["verifier", str(task.get("checker"))],
            ["prompts", f"{count(task.get('train_prompts'))} training, {count(task.get('val_prompts'))} held out"],
            ["example", [Code(str(ex.get("prompt"))), " -> ", Code(str(ex.get("answer")))]],
            ["rollouts", f"{hp.get('prompts_per_step')} prompts x {hp.get('group_size')} replies per step, "
                         f"temperature {hp.get('temperature')}, at most {hp.get('max_new_tokens')} tokens"],
            ["objective", f"advantage {hp.get('advantage')} (per group), kl_beta {hp.get('kl_beta')}, "
                          f"lr {hp.get('lr')}"]]
    return [Table(["", "value"], rows)]


def rl_panels(f: F.RunFacts) -> list[Panel]:
    """The reward of each logged step (mean over its replies) and the held-out pass@1."""
    last = max([r["step"] for r in f.train + f.rl_val] or [0])
    xs, ys = _series(f.train, "reward")
    window = max(1, len(ys) // 10)
    smooth = [float(np.mean(ys[max(0, i - window + 1):i + 1])) for i in range(len(ys))]
    return [Panel("Reward (training rollouts)", "step", "mean reward",
                  [Line("logged step", xs, ys, COLORS[0], 1.2, 0.5),
                   Line(f"mean of the last {window} logged steps", xs, smooth, COLORS[0], 2.2)], xlim=(0, last)),
            Panel("Held-out pass@1 (greedy)", "step", "pass@1",
                  [Line("validation", *_series(f.rl_val, "val_pass_at_1"), COLORS[1], 2.0, marker="o")],
                  xlim=(0, last))]


def _rl(f: F.RunFacts, s: dict) -> list:
    if f.kind != "rl":
        return []
    out = [Heading(2, "RL: reward and held-out pass@1")]
    vals, rewards = f.rl_val, _series(f.train, "reward")[1]
    if not vals and not rewards:
        return out + [Para("Not available: the log has no reward or pass@1 yet.")]
    tenth = max(1, len(rewards) // 10)
    rows = [["held-out pass@1, first validation", f"{num(vals[0]['val_pass_at_1'], 3)} (step {vals[0]['step']})"
             if vals else "n/a"],
            ["held-out pass@1, last validation", f"{num(vals[-1]['val_pass_at_1'], 3)} (step {vals[-1]['step']})"
             if vals else "n/a"],
            ["held-out pass@1, best", num(max(r["val_pass_at_1"] for r in vals), 3) if vals else "n/a"],
            [f"reward, first {tenth} logged step(s)", num(float(np.mean(rewards[:tenth])), 3) if rewards else "n/a"],
            [f"reward, last {tenth} logged step(s)", num(float(np.mean(rewards[-tenth:])), 3) if rewards else "n/a"]]
    out.append(Table(["", "value"], rows))
    png = figure_png(rl_panels(f), title=f"{f.name}: reward and pass@1")
    if png:
        out.append(Image("rl.png", f"reward and held-out pass@1 of {f.name}", png))
    return out


DPO_METRICS = (("reward_accuracy", "reward accuracy"), ("reward_margin", "reward margin"),
               ("rewards_chosen", "chosen reward"), ("rewards_rejected", "rejected reward"))


def _dpo(f: F.RunFacts, s: dict) -> list:
    """A DPO run's own section: what it started from, its pairs, and its rewards (first and last
    logged value, training and held-out) with their curves."""
    if f.kind != "dpo":
        return []
    dc = F.as_dict(f.dpo_config)
    data, hp = F.as_dict(dc.get("data")), F.as_dict(dc.get("hyperparameters"))
    src = F.as_dict(data.get("source"))
    out = [Heading(2, "Preference tuning (DPO)"),
           Table(["", "value"], [
               ["started from", [Code(str(dc.get("base_checkpoint")))]],
               ["pairs", [Code(str(data.get("dir"))), f" ({src.get('kind')}: {src.get('name')}); "
                          f"{count(data.get('train_pairs'))} training, {count(data.get('heldout_pairs'))} held out"]],
               ["beta", str(hp.get("beta"))],
               ["reference", f"{F.as_dict(dc.get('reference')).get('how', 'n/a')} "
                             f"({F.as_dict(dc.get('reference')).get('file', 'n/a')})"]])]
    if src.get("label"):
        out.append(Para(["Data: ", str(src["label"])]))
    rows = []
    for key, label in DPO_METRICS:
        _, tr = _series(f.train, key)
        vx, va = _series(f.val, f"val_{key}")
        rows.append([label, num(tr[0]) if tr else "n/a", num(tr[-1]) if tr else "n/a",
                     f"{num(va[0])} (step {count(vx[0])})" if va else "n/a",
                     f"{num(va[-1])} (step {count(vx[-1])})" if va else "n/a"])
    out.append(Table(["", "train, first", "train, last", "held-out, first", "held-out, last"], rows, "lrrrr"))
    panels = [Panel(label, "step", "", [Line("train", *_series(f.train, key), COLORS[0], 1.2),
                                        Line("held-out", *_series(f.val, f"val_{key}"), COLORS[1], 2.0,
                                             marker="o")])
              for key, label in DPO_METRICS]
    png = figure_png(panels, title=f"{f.name}: DPO rewards", cols=2)
    if png:
        out.append(Image("dpo_rewards.png", f"DPO rewards of {f.name}", png))
    return out


def _benchmarks(f: F.RunFacts, s: dict) -> list:
    from utils.bench.report import contamination_line, fmt_value, metric_rows   # 0.25 s: only for a run with benchmark results
    out = [Heading(2, "Benchmarks")]
    for g in f.benchmarks:
        rows = metric_rows(g.models)
        header = ["metric"] + [m["name"] + (" (this run)" if m["ours"] else "") for m in g.models]
        table = [[r["label"]] + [fmt_value(r["metric"], v, e) + (" *" if i in r["best"] else "")
                                 for i, (v, e) in enumerate(zip(r["values"], r["stderrs"]))]
                 for r in rows]
        st = g.settings
        limits = ", ".join(f"{k} {v if v is not None else 'all'}"
                           for k, v in sorted(F.as_dict(st.get("limits")).items()))
        how = [f"preset {st['preset']}" if st.get("preset") else "",
               f"seed {st['seed']}" if st.get("seed") is not None else "",
               f"items per task: {limits}" if limits else ""]
        out.append(Para(["Scored on the same items (", "; ".join([", ".join(g.files)]
                                                                  + [h for h in how if h]), "):"]))
        out.append(Table(header, table, "l" + "r" * len(g.models)) if table else
                   Para("Not available: these result files hold no metric value this report reads."))
        out += [Para(n) for n in dict.fromkeys(m["core_note"] for m in g.models if m.get("core_note"))]
        out += [Para(f"Contamination, {m['name']}: {contamination_line(m['contamination'])}")
                for m in g.models if m.get("contamination")]
    if f.benchmarks:
        out.append(Para("* best value of the row; ↑ higher is better, ↓ lower is better; ± standard "
                        "error. Columns are every model scored on the same items, from any result "
                        "file (docs/report.md)."))
    return out + _missing(f, "benchmarks")


def _samples(f: F.RunFacts, s: dict) -> list:
    out = [Heading(2, "Sample generations")]
    if not f.samples:
        return out + [Para("None logged (training.sample_tokens is 0, or no validation ran).")]
    n = len(f.samples)
    pick = sorted({round(i * (n - 1) / max(1, SAMPLES_SHOWN - 1)) for i in range(min(n, SAMPLES_SHOWN))})
    out.append(Para(f"{len(pick)} of the {n} samples the run logged at its validations "
                    "(seeded, temperature 0.8, top-k 50):"))
    for i in pick:
        r = f.samples[i]
        text = r["text"] if len(r["text"]) <= SAMPLE_CHARS else r["text"][:SAMPLE_CHARS] + " [...]"
        out += [Para([Bold(f"step {r.get('step')}"), " — prompt ", Code(str(r.get("prompt", "")))]),
                CodeBlock(text)]
    return out


def _environment(f: F.RunFacts, s: dict) -> list:
    out = [Heading(2, "Environment")]
    envs = [e for e in map(F.environment, f.segments) if e]
    if not envs:
        return out + [Para("Not recorded: this run's log predates environment recording (git "
                           "commit, packages, machine; runs started since the report stage record "
                           "it once per start in their log).")]
    e = envs[-1]
    git, pk, mc = F.as_dict(e.get("git")), F.as_dict(e.get("packages")), F.as_dict(e.get("machine"))
    commit = git.get("commit")
    code = ([Code(str(commit)[:12]), " (uncommitted changes)" if git.get("dirty") else " (clean tree)"]
            if commit else f"unknown ({git.get('reason', 'not recorded')})")
    gpus = ", ".join(map(str, F.as_list(mc.get("gpus")))) or "none"
    parts = [f"{mc['cpu']}" if mc.get("cpu") else "", f"{mc['cpus']} CPUs" if mc.get("cpus") else "",
             f"{mc['memory_gb']} GB RAM" if mc.get("memory_gb") else "",
             f"GPUs: {gpus}" + (f" (CUDA {mc['cuda']})" if mc.get("cuda") else "")]
    rows = [["code", code],
            ["machine", f"{mc.get('hostname', 'n/a')}: " + ", ".join(p for p in parts if p)],
            ["system", str(mc.get("os", "n/a"))],
            ["packages", ", ".join(f"{k} {v}" for k, v in pk.items() if v) or "n/a"]]
    out.append(Table(["", "value"], rows))
    if len(envs) < len(f.segments):
        out.append(Para(f"{len(f.segments) - len(envs)} of the {len(f.segments)} starts did not "
                        "record it."))
    commits = {str(F.as_dict(x.get("git")).get("commit"))[:12] for x in envs}
    hosts = {str(F.as_dict(x.get("machine")).get("hostname")) for x in envs}
    if len(commits) > 1 or len(hosts) > 1:
        out.append(Para(f"The starts ran on different code or machines (commits "
                        f"{', '.join(sorted(commits))}; hosts {', '.join(sorted(hosts))}); "
                        "the table shows the last start's."))
    return out


def _config(f: F.RunFacts, s: dict) -> list:
    if not f.config:
        return []
    return [Heading(2, "Configuration"),
            Details("The resolved configuration of the last start (from the log)",
                    [CodeBlock(json.dumps(f.config, indent=2, ensure_ascii=False), "json")])]


# ----------------------------------------------------------------------------- comparison
def _tokens_at(f: F.RunFacts, steps: list) -> list:
    """Tokens seen at each step, interpolated from the train records (0 at step 0; NaN past
    the last record)."""
    pts = [(0, 0)] + [(r["step"], r["tokens_seen"]) for r in f.train
                      if r["step"] > 0 and finite(r.get("tokens_seen"))]
    return np.interp(steps, [p[0] for p in pts], [p[1] for p in pts], right=math.nan).tolist()


def build_comparison(runs: list) -> list:
    """Several runs side by side: key numbers and their curves against tokens seen."""
    names = [r.name for r in runs]
    sums = [F.summary(r) for r in runs]
    blocks: list = [Heading(1, "Comparison: " + ", ".join(names)),
                    Para("Each run's own report is in its folder beside this one.")]
    def row(label, fn):
        return [label] + [fn(r, s) for r, s in zip(runs, sums)]
    rows = [row("kind", lambda r, s: r.kind), row("state", lambda r, s: s["state"]),
            row("parameters", lambda r, s: short((r.model_numbers or {}).get("parameters"))),
            row("non-embedding parameters", lambda r, s: short((r.model_numbers or {}).get("non_embedding"))),
            row("steps", lambda r, s: count(s["step"])),
            row("tokens", lambda r, s: f"{count(s['tokens'])}"),
            row("wall time", lambda r, s: duration(s["wall_s"])),
            row("tokens/s (median)", lambda r, s: rate(s["tokens_per_s_median"])),
            row("final validation loss", lambda r, s: num(s["final_val_loss"])),
            row("best validation loss", lambda r, s: num(s["best_val_loss"])),
            row("final bits per byte", lambda r, s: num(s["final_bpb"])),
            row("device", lambda r, s: str(r.hparams.get("device", "n/a"))),
            row("precision", lambda r, s: str(r.hparams.get("dtype", "n/a")).replace("torch.", "")),
            row("data", lambda r, s: str(r.shards_dir.name if r.shards_dir else
                                         F.as_dict(F.as_dict(r.sft_config).get("data")).get("dir", "n/a")))]
    blocks.append(Table(["", *names], rows, "l" + "r" * len(runs)))
    val, train = [], []
    for i, r in enumerate(runs):
        c = COLORS[i % len(COLORS)]
        vx, vy = _series(r.val, "val_loss")
        (fx, fy), (tx, ty) = smoothed_parts(r)
        val.append(Line(r.name, _tokens_at(r, vx), vy, c, 1.8, marker="o"))
        train.append(Line(r.name, _tokens_at(r, tx), ty, c, 1.8))
        if fx:                                   # before its window is full: dashed, said
            train.append(Line(f"{r.name} (mean of all steps so far)", _tokens_at(r, fx), fy, c, 1.4,
                              style="--"))
    windows = {F.smoothing_window(r) for r in runs}
    window = windows.pop() if len(windows) == 1 else None
    png = figure_png([Panel("Validation loss", "tokens seen", "cross-entropy (nats/token)", val),
                      Panel(f"Training loss (mean of last {window} steps)" if window else
                            "Training loss (smoothed)", "tokens seen", "cross-entropy (nats/token)",
                            train)], title="Runs compared", cols=2, panel_size=(5.5, 3.6))
    if png:
        blocks.append(Image("comparison.png", "validation and training loss of the runs", png))
    return blocks
