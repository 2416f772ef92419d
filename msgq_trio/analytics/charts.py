"""The reports' charts, drawn by matplotlib (the benchmark's plotting stack,
``benchmarks/report.py``'s ``plot``) and inlined in the HTML as SVG, so a report stays one
self-contained file.

Each chart is an ``<svg id=...>`` element; every plotted series is a group with id
``<chart id>-series-<name>`` and every bar ``<chart id>-bar-<i>``, so a reader (or a
test) can find what was drawn. Ids inside a chart are salted with the chart's id: two
charts on one page never share an id. Output is deterministic (no dates, fixed salt).
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Sequence
from typing import Any

#: The benchmark's qualitative colours (matplotlib's default cycle, "tab:" names).
COLOURS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
#: Inches at 100 dpi: about the width of the report's tables.
FIGSIZE = (7.6, 2.8)

_PROLOGUE = re.compile(r"^.*?(?=<svg)", re.S)
_METADATA = re.compile(r"<metadata>.*?</metadata>", re.S)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only (as the benchmark)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any, sid: str) -> str:
    """``fig`` as an inline ``<svg id=sid>`` (no XML prologue, no metadata)."""
    plt = _pyplot()
    buf = io.StringIO()
    with plt.rc_context({"svg.hashsalt": sid, "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    text = _METADATA.sub("", _PROLOGUE.sub("", buf.getvalue(), count=1), count=1)
    return text.replace("<svg ", f'<svg id="{sid}" role="img" ', 1).strip()


def _gid(sid: str, kind: str, name: str | int) -> str:
    return f"{sid}-{kind}-{re.sub(r'[^A-Za-z0-9_.-]', '_', str(name))}"


def lines(
    sid: str,
    title: str,
    series: dict[str, list[tuple[float, float]]],
    ylabel: str,
    xlabel: str,
    *,
    log_y: bool = False,
) -> str:
    """A line chart: one line per series (x ascending), legend outside on the right; a
    one-point series is drawn as a dot."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for i, (name, pts) in enumerate(sorted(series.items())):
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        (line,) = ax.plot(
            xs,
            ys,
            color=COLOURS[i % len(COLOURS)],
            label=name,
            marker="o" if len(pts) == 1 else None,
            linewidth=1.5,
        )
        line.set_gid(_gid(sid, "series", name))
    if log_y and any(y > 0 for pts in series.values() for _, y in pts):
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return _svg(fig, sid)


def bars(sid: str, title: str, values: Sequence[tuple[str, float]], ylabel: str) -> str:
    """A bar chart (a histogram): one bar per (label, value), labels thinned to 20."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    xs = list(range(len(values)))
    drawn = ax.bar(xs, [v for _, v in values], color=COLOURS[0])
    for i, patch in enumerate(drawn.patches):
        patch.set_gid(_gid(sid, "bar", i))
    every = max(1, len(values) // 20)
    ax.set_xticks(xs[::every], [lab for lab, _ in values][::every], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return _svg(fig, sid)


def boxes(
    sid: str, title: str, data: Sequence[tuple[str, Sequence[float | None]]], ylabel: str
) -> str:
    """Box plots from precomputed quantiles: per label (min, p25, p50, p75, max), whiskers
    at min and max; a label with a missing quantile is skipped."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    stats: list[dict[str, Any]] = [
        {
            "label": lab[:24],
            "whislo": q[0],
            "q1": q[1],
            "med": q[2],
            "q3": q[3],
            "whishi": q[4],
            "fliers": [],
        }
        for lab, q in data
        if all(v is not None for v in q)
    ]
    if stats:
        drawn = ax.bxp(stats, showfliers=False, patch_artist=True)
        for i, box in enumerate(drawn["boxes"]):
            box.set_facecolor(COLOURS[0])
            box.set_gid(_gid(sid, "series", i))
        ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return _svg(fig, sid)
