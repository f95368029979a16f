"""Benchmark reports: the comparison table, best-per-metric highlighting, ranking, result files.

The table has one row per metric and one column per model, each cell ``value ± stderr``.
With several models the best value of each row is marked ``*`` (and, on a terminal that
allows colour, bold green; never with ``NO_COLOR`` set or when output is not a TTY). The
ranking orders models by their mean rank over the metrics every model has (ties share the
better rank); the number of rows each model wins is shown next to it.

Files (all written atomically): ``benchmark_<time>.json`` (results, settings, versions),
``benchmark_<time>.txt`` (the same table, no colour codes), and with ``--per-item``
``benchmark_<time>_items.jsonl`` (one JSON object per scored item and model). The passkey
task adds its grid to both and a heat map per model, ``benchmark_<time>_passkey_<model>.png``.
"""
from __future__ import annotations

import json
import math
import os
import textwrap
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from utils.atomic import atomic_open, write_json_atomic
from utils.bench import core as CORE
from utils.bench.runner import METRICS, base_task
from utils.environment import package_versions as versions

PERCENT = {"acc", "acc_norm", "top1", "top5", "top10"}
BOLD_GREEN, RESET = "\033[1;32m", "\033[0m"


def use_color(stream) -> bool:
    """Colour only on a TTY, never with NO_COLOR set (https://no-color.org) or TERM=dumb."""
    if "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb":
        return False
    return bool(getattr(stream, "isatty", lambda: False)())


def fmt_value(metric: str, value: Optional[float], stderr: Optional[float] = None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if metric in PERCENT:
        s = f"{100 * value:.2f}"
        return s + (f" ± {100 * stderr:.2f}" if stderr is not None else "")
    digits = 3 if metric in ("bits_per_byte",) else 4 if metric == "core" else 2
    s = f"{value:.{digits}f}"
    return s + (f" ± {stderr:.{digits}f}" if stderr is not None else "")


def task_keys(models: Sequence[dict]) -> list[tuple[str, str]]:
    """(result key, label) of every task any model has, in METRICS' order; a key with shots
    (``hellaswag:10``) follows its task's and reads ``hellaswag 10-shot``."""
    seen: dict[str, None] = {}
    for m in models:
        for key in m.get("results", {}):
            seen.setdefault(key, None)
    out = []
    for task in METRICS:
        keys = [k for k in seen if base_task(k) == task]
        keys.sort(key=lambda k: int(k.partition(":")[2] or 0))
        out += [(k, k.replace(":", " ") + "-shot" if ":" in k else k) for k in keys]
    return out


def metric_rows(models: Sequence[dict]) -> list[dict]:
    """One row per (task, metric) that any model has: label, values, best model indices."""
    rows = []
    for task, shown in task_keys(models):
        for metric, higher in METRICS[base_task(task)]:
            vals, errs = [], []
            for m in models:
                r = m["results"].get(task, {}).get("metrics", {}).get(metric)
                vals.append(None if r is None else r["value"])
                errs.append(None if r is None else r["stderr"])
            if all(v is None for v in vals):
                continue
            have = [(v, i) for i, v in enumerate(vals) if v is not None and math.isfinite(v)]
            best: list[int] = []
            if len(models) > 1 and have:
                target = max(v for v, _ in have) if higher else min(v for v, _ in have)
                best = [i for v, i in have if v == target]
            unit = " (%)" if metric in PERCENT else ""
            rows.append({"task": task, "metric": metric, "higher_is_better": higher,
                         "label": ("CORE-style centered mean ↑" if task == "core" else
                                   f"{shown} {metric}{unit} {'↑' if higher else '↓'}"),
                         "values": vals, "stderrs": errs, "best": best})
    return rows


def ranking(models: Sequence[dict], rows: Optional[list] = None) -> list[dict]:
    """Models by mean rank (1 = best) over the rows every model has a value for."""
    rows = metric_rows(models) if rows is None else rows
    full = [r for r in rows if all(v is not None for v in r["values"])]
    ranks = [[] for _ in models]
    wins = [0] * len(models)
    for r in full:
        vals = r["values"]
        for i, v in enumerate(vals):
            better = sum(1 for w in vals if (w > v if r["higher_is_better"] else w < v))
            ranks[i].append(1 + better)
        for i in r["best"]:
            wins[i] += 1
    out = [{"model": m["name"], "mean_rank": (sum(rk) / len(rk)) if rk else None,
            "metrics_won": wins[i], "metrics_compared": len(full)}
           for i, (m, rk) in enumerate(zip(models, ranks))]
    out.sort(key=lambda d: (d["mean_rank"] is None, d["mean_rank"] or 0, -d["metrics_won"]))
    for pos, d in enumerate(out, 1):
        d["position"] = pos
    return out


def render_table(models: Sequence[dict], color: bool = False) -> str:
    rows = metric_rows(models)
    names = [m["name"] for m in models]
    cells = []
    for r in rows:
        line = []
        for i, (v, e) in enumerate(zip(r["values"], r["stderrs"])):
            text = fmt_value(r["metric"], v, e) + (" *" if i in r["best"] else "  ")
            line.append(text)
        cells.append(line)
    w0 = max([len("metric")] + [len(r["label"]) for r in rows])
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    out = [f"{'metric':<{w0}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths))]
    out.append("-" * len(out[0]))
    for r, line in zip(rows, cells):
        parts = []
        for i, (c, w) in enumerate(zip(line, widths)):
            s = f"{c:>{w}}"
            parts.append(f"{BOLD_GREEN}{s}{RESET}" if color and i in r["best"] else s)
        out.append(f"{r['label']:<{w0}}  " + "  ".join(parts))
    if len(models) > 1:
        out.append("")
        out.append("* best value of the row;  ↑ higher is better, ↓ lower is better;  ± standard error")
        out.append("")
        out.append("Ranking (mean rank over the metrics every model has):")
        for d in ranking(models, rows):
            mr = "n/a" if d["mean_rank"] is None else f"{d['mean_rank']:.2f}"
            out.append(f"  {d['position']}. {d['model']}  mean rank {mr}, best on "
                       f"{d['metrics_won']} of {d['metrics_compared']} metrics")
    else:
        out.append("")
        out.append("↑ higher is better, ↓ lower is better;  ± standard error")
    return "\n".join(out)


def render_counts(models: Sequence[dict]) -> str:
    """Per model and task: items scored / selected, skipped reasons, data source notes."""
    out = ["Items (scored/selected; skipped by reason; rows the data loader skipped in the file):"]
    notes: dict[str, str] = {}
    for m in models:
        out.append(f"  {m['name']}:")
        for task, r in m["results"].items():
            if "items" not in r:
                continue                   # an aggregate (core), not a task
            it = r.get("items", {})
            sk = ", ".join(f"{k} {v}" for k, v in it.get("skipped", {}).items()) or "none"
            dsk = ", ".join(f"{k} {v}" for k, v in it.get("skipped_in_data", {}).items()) or "none"
            out.append(f"    {task:<14} {it.get('scored')}/{it.get('selected')}  skipped: {sk};  "
                       f"in data: {dsk}")
            if r.get("note"):
                notes[task] = f"{r['note']} [{r.get('source')}]"
            elif r.get("source"):
                notes.setdefault(task, str(r.get("source")))
    out.append("Sources:")
    out += [f"  {t}: {n}" for t, n in notes.items()]
    return "\n".join(out)


def render_core(models: Sequence[dict]) -> str:
    """Each model's CORE-style aggregate: per CORE task its accuracy, random baseline and
    centered accuracy, then the mean, and what it covers (utils/bench/core.py)."""
    out = []
    for m in models:
        r = m["results"].get("core")
        if not r:
            continue
        agg = r["metrics"]["core"]
        se = "" if agg.get("stderr") is None else f" ± {agg['stderr']:.4f}"
        out.append(f"CORE-style score, {m['name']}: {agg['value']:.4f}{se}")
        out.append(f"  {'CORE task':<22} {'ours':<27} {'shots':>5} {'accuracy':>9} {'random':>7} {'centered':>9}")
        for t in r["tasks"]:
            out.append(f"  {t['core_task']:<22} {t['key'] + ' ' + t['metric']:<27} {t['shots']:>5} "
                       f"{100 * t['accuracy']:>8.2f}% {100 * t['random_baseline']:>6.0f}% "
                       f"{t['centered']:>9.4f}")
        out.append("  " + r["note"])
        out.append("")
    return "\n".join(out).rstrip()


def contamination_line(c: Optional[dict]) -> Optional[str]:
    """One line: each task's contaminated share, or why nothing was checked."""
    if not c:
        return None
    if not c.get("checked"):
        return f"not checked: {c.get('why')}"
    parts = []
    for key, r in c["tasks"].items():
        share = "n/a" if r["share"] is None else f"{100 * r['share']:.1f}%"
        parts.append(f"{key} {share} ({r['contaminated']}/{r['judged']})")
    return (f"{'; '.join(parts)} of the items scored, against {c['tokens']:,} training tokens "
            f"({c['shards']}); rule: {c['rule']}")


def render_contamination(models: Sequence[dict]) -> str:
    out = [f"Contamination, {m['name']}: {contamination_line(m.get('contamination'))}"
           for m in models if m.get("contamination")]
    return "\n".join(out)


def render_passkey(models: Sequence[dict]) -> str:
    """Each model's passkey grid: accuracy (%) per needle depth (rows) and context length
    (columns); lengths not run say why (beyond the model's context, too short)."""
    out = []
    for m in models:
        r = m["results"].get("passkey")
        if r is None:
            continue
        g = r["grid"]
        head = [str(L) for L in g["lengths"]]
        rows = [[f"{d}%"] + [("n/a" if a is None else f"{100 * a:.0f}") for a in acc]
                for d, acc in zip(g["depths"], g["acc"])]
        w = [max(len(x) for x in col) for col in zip(["depth \\ length", *head], *rows)]
        line = lambda cells: "  ".join(f"{c:>{k}}" for c, k in zip(cells, w))   # noqa: E731
        out += [f"Passkey retrieval, {m['name']}: accuracy (%) by needle depth and context length "
                f"in tokens ({r['samples_per_cell']} samples per cell, {r['digits']}-digit keys)",
                line(["depth \\ length", *head])]
        out += [line(row) for row in rows]
        why = {"beyond_context": f"beyond the model's context ({r['context']} tokens): not run, "
                                 "never truncated",
               "too_short": "too short for the instructions, needle and question"}
        out += [f"  {L}: {why[st]}" for L, st in g["status"].items() if st in why]
        if r.get("heatmap"):
            out.append(f"  heat map: {r['heatmap']}")
        out.append("")
    return "\n".join(out).rstrip()


def passkey_heatmap(result: dict, title: str, path: Path) -> Path:
    """The grid as a PNG heat map (x: context length, y: needle depth; grey: not run, labelled
    why; each cell's accuracy written in it), written atomically. matplotlib's object API (no
    pyplot: no global figure state)."""
    # matplotlib (~0.9 s, and its font cache built on first use): only for a passkey heat map
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    g = result["grid"]
    acc = np.array([[np.nan if a is None else 100 * a for a in row] for row in g["acc"]], dtype=float)
    fig = Figure(figsize=(max(4.8, 1.8 + 0.9 * len(g["lengths"])), 1.6 + 0.38 * len(g["depths"])),
                 dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_facecolor("#d9d9d9")                                    # cells not run
    im = ax.imshow(np.ma.masked_invalid(acc), cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(g["lengths"])), [str(L) for L in g["lengths"]])
    ax.set_yticks(range(len(g["depths"])), [f"{d}%" for d in g["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    gone = {"beyond_context": "beyond\ncontext", "too_short": "too\nshort"}
    for r in range(acc.shape[0]):
        for c, L in enumerate(g["lengths"]):
            a = acc[r, c]
            text = gone.get(g["status"].get(str(L)), "n/a") if np.isnan(a) else f"{a:.0f}"
            dark = not np.isnan(a) and (a < 20 or a > 80)               # the colour map's dark ends
            ax.text(c, r, text, ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    samples = result.get("samples_per_cell")
    lines = textwrap.wrap(title, 48) + ([f"{samples} samples per cell"] if samples else [])
    ax.set_title("\n".join(lines), fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    with atomic_open(Path(path)) as f:
        fig.savefig(f, format="png")
    return Path(path)


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d_%H%M%S")


def output_paths(out_dir: Path, stamp: Optional[str] = None) -> dict[str, Path]:
    """benchmark_<time>.{json,txt} and _items.jsonl; never overwrites an earlier run's files."""
    stamp = stamp or timestamp()
    base, n = f"benchmark_{stamp}", 1
    while (out_dir / f"{base}.json").exists() or (out_dir / f"{base}.txt").exists():
        n += 1
        base = f"benchmark_{stamp}_{n}"
    return {"json": out_dir / f"{base}.json", "txt": out_dir / f"{base}.txt",
            "items": out_dir / f"{base}_items.jsonl"}


def write_results(paths: dict[str, Path], payload: dict, text: str,
                  records: Optional[list] = None) -> list[Path]:
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    written = []
    if records is not None:
        with atomic_open(paths["items"]) as f:
            for rec in records:
                f.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
        written.append(paths["items"])
    with atomic_open(paths["txt"]) as f:
        f.write((text + "\n").encode("utf-8"))
    written.append(paths["txt"])
    write_json_atomic(paths["json"], payload)       # last: its presence means the run completed
    written.append(paths["json"])
    return written


def scored_results(bench_dir: Path, weights_fp: str) -> tuple[list[tuple[str, str, str]], Optional[str]]:
    """(task, metric, value as the table shows it) of the newest result file in ``bench_dir``
    that scored exactly these weights (``weights_fp``: the fingerprint its models' identity
    records; int8-quantized scores are of other weights), and that file's name; ([], None) when
    none did. Damaged or malformed files are passed over."""
    files = sorted(bench_dir.glob("benchmark_*.json"), key=lambda p: p.stat().st_mtime,
                   reverse=True) if bench_dir.is_dir() else []
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue                       # a damaged result file: the next one may do
        models = data.get("models") if isinstance(data, dict) else None
        for m in models if isinstance(models, list) else []:
            ident = (m.get("identity") if isinstance(m, dict) else None) or {}
            if not isinstance(ident, dict) or ident.get("fingerprint") != weights_fp or ident.get("quantize"):
                continue                   # other weights (int8 too), or a malformed record
            rows = []
            results = m.get("results") if isinstance(m.get("results"), dict) else {}
            for task, res in sorted(results.items()):
                metrics = res.get("metrics") if isinstance(res, dict) else None
                for metric, v in (metrics if isinstance(metrics, dict) else {}).items():
                    if isinstance(v, dict) and v.get("value") is not None:
                        rows.append((task, metric, fmt_value(metric, v["value"], v.get("stderr"))))
            line = contamination_line(m.get("contamination")) if isinstance(m.get("contamination"), dict) else None
            if line:
                rows.append(("contamination", f"{m['contamination'].get('ngram', 13)}-gram overlap", line))
            return rows, f.name
    return [], None


def package_versions() -> dict:
    return versions(("torch", "transformers", "tokenizers", "datasets", "numpy", "sacrebleu",
                     "rouge-score", "tqdm"))
