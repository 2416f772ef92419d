"""Helpers of the analytics tests (imported as ``analytics_helpers``): strict HTML parsing of the
reports, what their charts drew, and the nearest-rank percentile the report's figures are
checked against."""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import html5lib
import trio

SVG = "{http://www.w3.org/2000/svg}"
#: JVM options for every Spark JVM of the analytics tests (tests/analytics/conftest.py
#: says why): the client JIT only and the serial collector.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def parse_report(path: Path) -> Any:
    """The report parsed by html5lib in strict mode: any HTML parse error raises."""
    parser = html5lib.HTMLParser(strict=True, namespaceHTMLElements=False)
    with open(path, "rb") as f:
        return parser.parse(f)


def _text(el: Any) -> str:
    return "".join(el.itertext()).strip()


def table_rows(doc: Any, tid: str) -> list[dict[str, str]]:
    """The rows of ``<table id=tid>`` as {header: cell text}; fails if it is missing."""
    tables = [t for t in doc.iter("table") if t.get("id") == tid]
    assert len(tables) == 1, f"expected one table #{tid}, found {len(tables)}"
    header = [_text(th) for th in tables[0].find("thead").iter("th")]
    rows = []
    for tr in tables[0].find("tbody").iter("tr"):
        cells = [_text(td) for td in tr.iter("td")]
        assert len(cells) == len(header), (tid, header, cells)
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def svg(doc: Any, sid: str) -> Any:
    """The inline ``<svg id=sid>`` element (a matplotlib chart); fails if it is missing."""
    found = [s for s in doc.iter(f"{SVG}svg") if s.get("id") == sid]
    assert len(found) == 1, f"expected one svg #{sid}, found {len(found)}"
    return found[0]


def drawn(doc: Any, sid: str, kind: str) -> list[str]:
    """The names of the ``kind`` ("series" or "bar") elements drawn in chart ``sid``
    (msgq_trio.analytics.charts gives each the id ``<sid>-<kind>-<name>``)."""
    prefix = f"{sid}-{kind}-"
    return sorted(
        g.get("id")[len(prefix) :]
        for g in svg(doc, sid).iter(f"{SVG}g")
        if (g.get("id") or "").startswith(prefix)
    )


def nearest_rank(values: list[float], p: float) -> float:
    """The smallest value with at least ``p`` of the values at or below it."""
    s = sorted(values)
    return s[max(0, math.ceil(p * len(s)) - 1)]


def cell(v: Any) -> str:
    """How the report writes a number (msgq_trio.analytics.report.fmt)."""
    from msgq_trio.analytics.report import fmt

    return fmt(v)


async def poll(
    check: Callable[[], bool | Awaitable[bool]], timeout: float, interval: float = 0.05
) -> None:
    """Wait until ``check()`` is true, asking every ``interval`` s, for things that give no
    event to wait on (a broker's status, a file another process writes); TooSlowError
    after ``timeout`` s."""
    with trio.fail_after(timeout):
        for _ in range(1 << 62):
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await trio.sleep(interval)
