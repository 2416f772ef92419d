"""The self-contained HTML reports (matplotlib charts inlined as SVG, no scripts, no
external files) and the terminal summaries, rendered from the small collected figures of
an analysis.

No Spark: the figures are dicts of plain values. Every table has an ``id`` and a header
row; numbers are written by :func:`fmt` (ints as they are, floats with 3 decimals) so a
reader, or a test, finds exactly the figures of ``summary.json``.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

from . import charts

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }
th { background: #f0f0f0; }
td.t, th.t { text-align: left; }
figure { margin: 0.5em 0 1.5em; }
.note { color: #555; font-size: 0.9em; }
"""


def fmt(v: Any) -> str:
    """A table cell: '' for None, ints as they are, floats with 3 decimals."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.3f}"
    return str(v)


def e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def table(
    tid: str, columns: Sequence[str], rows: Iterable[dict[str, Any]], caption: str | None = None
) -> str:
    """An HTML table with ``id=tid``, header ``columns`` and one row per dict."""
    out = [f'<table id="{e(tid)}">']
    if caption:
        out.append(f"<caption>{e(caption)}</caption>")
    out.append(
        "<thead><tr>"
        + "".join(f'<th class="t">{e(c)}</th>' for c in columns)
        + "</tr></thead><tbody>"
    )
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cls = ' class="t"' if isinstance(v, str) or v is None else ""
            cells.append(f"<td{cls}>{e(fmt(v))}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _short(v: float) -> str:
    if v >= 1e9:
        return f"{v / 1e9:.3g}G"
    if v >= 1e6:
        return f"{v / 1e6:.3g}M"
    if v >= 1e3:
        return f"{v / 1e3:.3g}k"
    return f"{v:.3g}"


def page(title: str, body: Sequence[str]) -> str:
    """A complete HTML5 document."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{e(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def utc(ts: float | None) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM:SS.mmm UTC``; ``n/a`` for None."""
    if ts is None:
        return "n/a"
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def histogram_label(b: int) -> str:
    """Label of latency bin ``b`` (10 per decade, lower edge in ms)."""
    return _short(10 ** (b / 10))


# -- capture ---------------------------------------------------------------------------------
#: Columns of the broker table that are Unix times: shown as UTC dates (summary.json keeps
#: the numbers).
TIMES = ("broker_started", "first_ts", "last_ts")
REQUEST_COLUMNS = ("total", "answered", "callee-error", "broker-error", "never-answered")


def capture_html(fig: dict[str, Any], sources: Sequence[str], tables_dir: str) -> str:
    """The capture report (figures from :func:`msgq_trio.analytics.capture.analyze_capture`)."""
    b: list[str] = []
    b.append(
        f'<p class="note">{fig["records"]} records from {fig["files"]} file(s): '
        f"{e(', '.join(sources[:5]))}{' ...' if len(sources) > 5 else ''}; "
        f"{e(utc(fig['first_ts']))} to {e(utc(fig['last_ts']))}. "
        f"Tables: <code>{e(tables_dir)}</code>. Records the capture lost "
        f"(capture-dropped): {fig['capture_dropped']}.</p>"
    )
    b.append("<h2>Broker lifetimes</h2>")
    b.append(
        f'<p class="note">{fig["broker_instances"]} broker instance(s) wrote this '
        "capture; requests and connections are keyed by instance (lnames and request "
        f"ids restart with each broker). First {fig['top']} shown.</p>"
    )
    b.append(
        table(
            "brokers",
            ("broker_instance", "broker_started", "records", "first_ts", "last_ts"),
            [{**r, **{k: utc(r[k]) for k in TIMES}} for r in fig["brokers"]],
        )
    )
    b.append("<h2>Requests</h2>")
    b.append(
        '<p class="note">answered: the callee replied; callee-error: it replied with '
        "an error; broker-error: the broker refused the request (never delivered); "
        "never-answered: delivered, and the callee never replied (reason: the broker's "
        "answer on its behalf, or no-reply-in-capture).</p>"
    )
    b.append(table("requests-summary", REQUEST_COLUMNS, [fig["requests"]]))
    b.append(table("request-status", ("status", "reason", "requests"), fig["request_status"]))
    b.append(
        table(
            "never-answered",
            ("target", "command", "reason", "requests"),
            fig["never_answered_by_target"],
            caption="Requests never answered by their callee",
        )
    )
    b.append("<h2>Latency per (target, command)</h2>")
    b.append('<p class="note">Replies by the callee only, reply ts - request ts, ms.</p>')
    b.append(
        table(
            "latency",
            ("target", "command", "replies", "p50_ms", "p95_ms", "p99_ms", "max_ms"),
            fig["latency"],
        )
    )
    b.append(
        table(
            "latency-overall",
            ("replies", "p50_ms", "p95_ms", "p99_ms", "max_ms"),
            [fig["latency_overall"]] if fig["latency_overall"] else [],
            caption="Every callee reply",
        )
    )
    hist = [(histogram_label(r["bin"]), r["n"]) for r in fig["latency_histogram"]]
    b.append(
        "<figure>"
        + charts.bars("latency-histogram", "Latency distribution (ms, log bins)", hist, "replies")
        + "</figure>"
    )
    b.append("<h2>Errors</h2>")
    b.append(
        table(
            "errors-by-code",
            ("code", "errors", "from_callees", "from_broker"),
            fig["errors_by_code"],
        )
    )
    b.append(
        table(
            "errors-by-party",
            ("code", "party", "broker_instance", "sender", "sender_name", "on_behalf_of", "errors"),
            fig["errors_by_party"],
        )
    )
    b.append("<h2>Traffic</h2>")
    b.append(table("per-kind", ("kind", "frames", "bytes"), fig["per_kind"]))
    width = fig["plot_bucket_s"]
    t0 = min((r["bucket"] for r in fig["traffic_series"]), default=0)
    frames: dict[str, list[tuple[float, float]]] = {}
    nbytes: dict[str, list[tuple[float, float]]] = {}
    for r in fig["traffic_series"]:
        frames.setdefault(r["kind"], []).append((r["bucket"] - t0, r["frames"] / width))
        nbytes.setdefault(r["kind"], []).append((r["bucket"] - t0, r["bytes"] / width))
    b.append(
        "<figure>"
        + charts.lines(
            "traffic-frames",
            f"Frames per second by kind ({width} s buckets)",
            frames,
            "frames/s",
            f"seconds from {utc(t0)}",
        )
        + "</figure>"
    )
    b.append(
        "<figure>"
        + charts.lines(
            "traffic-bytes",
            f"Bytes per second by kind ({width} s buckets)",
            nbytes,
            "bytes/s",
            f"seconds from {utc(t0)}",
        )
        + "</figure>"
    )
    b.append("<h2>Top talkers</h2>")
    b.append(
        f'<p class="note">The first {fig["top"]} of each; the full tables are '
        "<code>senders</code> and <code>targets</code>.</p>"
    )
    b.append(
        table(
            "top-senders",
            ("broker_instance", "sender", "sender_name", "frames", "bytes", "targets"),
            fig["top_senders"],
        )
    )
    b.append(
        table(
            "top-targets",
            ("broker_instance", "target", "frames", "bytes", "senders"),
            fig["top_targets"],
        )
    )
    b.append("<h2>Slow consumers</h2>")
    b.append(
        '<p class="note">What the capture shows: requests refused receiver-full, '
        "slow-consumer drops, answers discarded, records the capture lost. Queued bytes "
        "are not captured (see <code>msgq-trio ctl stats</code>).</p>"
    )
    b.append(
        table("slow-consumer-signals", ("signal", "count", "clients"), fig["slow_consumer_signals"])
    )
    b.append(
        table(
            "slow-consumers",
            ("signal", "broker_instance", "client", "count", "first_second", "last_second"),
            fig["slow_consumers"],
        )
    )
    return page("msgq-trio capture report", b)


def capture_text(fig: dict[str, Any]) -> str:
    """The terminal summary of a capture analysis."""
    req = fig["requests"]
    lines = [
        f"records {fig['records']}  files {fig['files']}  bytes {fig['bytes']}  "
        f"capture-dropped {fig['capture_dropped']}  broker instances "
        f"{fig['broker_instances']}",
        f"{utc(fig['first_ts'])} .. {utc(fig['last_ts'])}",
        "",
        _text_table(REQUEST_COLUMNS, [req]),
        "",
        _text_table(
            ("target", "command", "replies", "p50_ms", "p95_ms", "p99_ms", "max_ms"),
            fig["latency"][:10],
        ),
        "",
        _text_table(("code", "errors", "from_callees", "from_broker"), fig["errors_by_code"]),
        "",
        _text_table(("sender", "sender_name", "frames", "bytes"), fig["top_senders"][:5]),
    ]
    return "\n".join(lines)


def _text_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    out = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    if not rows:
        out.append("(none)")
    return "\n".join(out)


# -- scenarios -------------------------------------------------------------------------------
SCENARIO_COLUMNS = (
    "result_set",
    "scenario",
    "runs",
    "passed",
    "pass_rate",
    "versions",
    "rss_peak_mib_p50",
    "rss_peak_mib_max",
    "latency_p99_ms_p50",
    "latency_p99_ms_max",
    "duration_s_p50",
)
REGRESSION_COLUMNS = (
    "scenario",
    "runs_baseline",
    "runs_current",
    "pass_rate_baseline",
    "pass_rate_current",
    "rss_peak_mib_p50_baseline",
    "rss_peak_mib_p50_current",
    "latency_p99_ms_p50_baseline",
    "latency_p99_ms_p50_current",
    "regression",
)


def scenarios_html(fig: dict[str, Any], sources: Sequence[str], tables_dir: str) -> str:
    """The scenario results report (figures from ``analyze_scenarios``)."""
    b: list[str] = []
    b.append(
        f'<p class="note">Result files: {e(", ".join(sources[:5]))}'
        f"{' ...' if len(sources) > 5 else ''}. Tables: <code>{e(tables_dir)}</code>.</p>"
    )
    b.append(
        table(
            "totals",
            ("result_set", "runs", "passed", "scenarios", "versions", "first_run", "last_run"),
            fig["totals"],
        )
    )
    if "regressions" in fig:
        b.append("<h2>Regressions (current against baseline)</h2>")
        b.append(table("regressions", REGRESSION_COLUMNS, fig["regressions"]))
    b.append("<h2>Per scenario</h2>")
    b.append(table("per-scenario", SCENARIO_COLUMNS, fig["per_scenario"]))
    for key, title, unit in (
        ("rss_peak_mib", "Broker RSS peak per scenario", "MiB"),
        ("latency_p99_ms", "p99 latency of the healthy clients", "ms"),
    ):
        boxes = [
            (
                f"{r['scenario']} ({r['result_set']})" if "regressions" in fig else r["scenario"],
                [r[f"{key}_{q}"] for q in ("min", "p25", "p50", "p75", "max")],
            )
            for r in fig["per_scenario"]
        ]
        b.append(
            "<figure>"
            + charts.boxes(f"box-{key}", f"{title} across runs ({unit})", boxes, unit)
            + "</figure>"
        )
    b.append("<h2>Per version</h2>")
    b.append(
        table(
            "per-version",
            (
                "result_set",
                "scenario",
                "version",
                "runs",
                "passed",
                "pass_rate",
                "rss_peak_mib_p50",
                "latency_p99_ms_p50",
            ),
            fig["per_version"],
        )
    )
    b.append("<h2>Failed checks</h2>")
    b.append(
        table(
            "failed-checks", ("result_set", "scenario", "check", "failures"), fig["failed_checks"]
        )
    )
    return page("msgq-trio scenario results report", b)


def scenarios_text(fig: dict[str, Any]) -> str:
    """The terminal summary of a scenario results analysis."""
    parts = [
        _text_table(("result_set", "runs", "passed", "scenarios", "versions"), fig["totals"]),
        "",
        _text_table(
            (
                "result_set",
                "scenario",
                "runs",
                "pass_rate",
                "rss_peak_mib_p50",
                "latency_p99_ms_p50",
            ),
            fig["per_scenario"],
        ),
    ]
    if "regressions" in fig:
        regs = [r for r in fig["regressions"] if r["regression"]]
        parts += [
            "",
            f"regressions: {len(regs)}",
            _text_table(
                ("scenario", "regression", "pass_rate_baseline", "pass_rate_current"), regs
            ),
        ]
    return "\n".join(parts)
