"""Curves as PNG bytes, with matplotlib's object API on the Agg canvas: no pyplot, no backend
switch, no rcParams change (nothing global is touched, at import or at call time).

Deterministic: the same series give the same bytes (fixed size, DPI and fonts, matplotlib's
own DejaVu Sans; the PNG carries no creation time and no software version, ``Software``
metadata removed). A panel is a title, axis labels and lines ``(label, xs, ys, style)``;
panels without a finite point are left out, and the grid shrinks to what is left.
Every text (titles, axis labels, legend entries, marks) is shown literally (:func:`literal`):
a run name such as ``m$^$m`` is neither parsed as mathtext nor, starting with ``_``, hidden
from the legend.
Cost: matplotlib's drawing and PNG encoding of each figure.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from utils.training.logging_utils import finite

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DPI = 100
SPARSE_POINTS = 25


@dataclass
class Line:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str = COLORS[0]
    width: float = 1.6
    alpha: float = 1.0
    marker: str = ""
    style: str = "-"              # matplotlib linestyle: "-" solid, "--" dashed


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: list = field(default_factory=list)
    log_y: bool = False
    marks: list = field(default_factory=list)     # (x, label): dotted vertical lines (resumes)
    xlim: Optional[tuple] = None                  # (lo, hi): the same x range in every panel

    def points(self) -> int:
        return sum(1 for ln in self.lines for y in ln.ys if _ok(y))


def _ok(v) -> bool:
    return finite(v)


def literal(text) -> str:
    """``text`` as matplotlib must be given it to show it as written: every ``$`` escaped, so
    no part is parsed as mathtext (an even number of unescaped ``$`` turns on math mode, and
    a name such as ``m$^$m`` would not even parse). The one helper for every string this
    module hands to matplotlib. (A legend label that starts with ``_`` is hidden by legend()
    when it collects labels itself; :func:`_draw` passes its handles and labels explicitly.)"""
    return str(text).replace("$", r"\$")


def figure_png(panels: Sequence[Panel], title: Optional[str] = None, cols: int = 3,
               panel_size: tuple[float, float] = (4.2, 3.1)) -> Optional[bytes]:
    """The panels that have data, in a grid ``cols`` wide, as PNG bytes (None: no data)."""
    # matplotlib (0.9 s, and its font cache built on first use): only when a figure is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    panels = [p for p in panels if p.points()]
    if not panels:
        return None
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(panel_size[0] * cols, panel_size[1] * rows + (0.45 if title else 0)),
                 dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    if title:
        fig.suptitle(literal(title), fontsize=15, fontweight="bold")
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.set_visible(False)
            continue
        _draw(ax, panels[i])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _draw(ax, p: Panel) -> None:
    handles, labels = [], []
    for ln in p.lines:
        pts = [(x, y) for x, y in zip(ln.xs, ln.ys) if _ok(x) and _ok(y)]
        if not pts:
            continue
        xs, ys = zip(*pts)
        sparse = len(pts) <= SPARSE_POINTS           # few points: show where they are
        handles += ax.plot(xs, ys, color=ln.color, linewidth=ln.width, alpha=ln.alpha,
                           linestyle=ln.style, marker=ln.marker or ("o" if sparse else ""),
                           markersize=4 if sparse else 3.5)
        labels.append(literal(ln.label))
    for x, label in p.marks:
        ax.axvline(x, color="#555555", linestyle=":", linewidth=1.2)
        ax.annotate(literal(label), xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=10, color="#555555")
    if p.log_y and all(y > 0 for ln in p.lines for y in ln.ys if _ok(y)):
        ax.set_yscale("log")
    if max((abs(x) for ln in p.lines for x in ln.xs if _ok(x)), default=0) >= 1e4:
        from matplotlib.ticker import EngFormatter     # matplotlib: as in figure_png
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))     # 20k, 1.5M: labels that fit
    if p.xlim and p.xlim[1] > p.xlim[0]:
        pad = 0.03 * (p.xlim[1] - p.xlim[0])
        ax.set_xlim(p.xlim[0] - pad, p.xlim[1] + pad)
    ax.set_title(literal(p.title), fontsize=13)
    ax.set_xlabel(literal(p.xlabel), fontsize=12)
    ax.set_ylabel(literal(p.ylabel), fontsize=12)
    ax.tick_params(labelsize=10.5)
    ax.grid(True, color="#e5e5e5", linewidth=0.8)
    if ax.get_yscale() == "linear":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    if len(handles) > 1:          # explicit labels: one starting with "_" is shown, not dropped
        ax.legend(handles, labels, fontsize=9.5, framealpha=0.85, edgecolor="#dddddd")
