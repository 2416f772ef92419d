"""The broker's Prometheus metrics: its lifetime traffic totals and process figures.

The families are rendered and served by :mod:`msgq_trio.exposition` (shared with the
plugins' endpoints); this module keeps what only the broker counts.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..core.cmdstats import LATENCY_BUCKETS, CommandStats
from ..core.peers import Peer

if TYPE_CHECKING:  # only ops/control.py's render_metrics imports it (prometheus_client)
    from ..exposition import Exposition


class TrafficTotals:
    """Lifetime message and byte counters: live peers' counters plus those of every peer
    that has left (folded in by the broker's ``on_disconnect`` hook), and disconnects by
    reason. Bytes a leaving client is still owed and receives after its GOODBYE are not
    counted."""

    def __init__(self) -> None:
        self.msgs_in = self.msgs_out = self.bytes_in = self.bytes_out = 0
        self.disconnects: Counter[str] = Counter()

    def peer_gone(self, peer: Peer, reason: str) -> None:
        self.msgs_in += peer.msgs_in
        self.msgs_out += peer.msgs_out
        self.bytes_in += peer.bytes_in
        self.bytes_out += peer.bytes_out
        self.disconnects[reason] += 1

    def totals(self, live: Iterable[Peer]) -> dict[str, int]:
        out = {
            "messages_in": self.msgs_in,
            "messages_out": self.msgs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }
        for p in live:
            out["messages_in"] += p.msgs_in
            out["messages_out"] += p.msgs_out
            out["bytes_in"] += p.bytes_in
            out["bytes_out"] += p.bytes_out
        return out


def process_figures() -> dict[str, Any]:
    """Open fds and resident memory of this process (-1 where /proc is unavailable)."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = -1
    return {"fds": fds, "rss": rss}


def command_families(e: Exposition, table: CommandStats) -> None:
    """The per-command statistics (core/cmdstats.py) as metric families. Labels only for
    the tracked pairs and ``other``, so at most ``max_pairs + 1`` series per family (times
    the outcomes, or the bounded error codes)."""
    rows = table.rows()
    e.family(
        "msgq_command_requests",
        "counter",
        "Requests per (target group, command); a call to one connection is under group "
        "'l.*', pairs past limits.max_command_stats under 'other'.",
        [({"group": s.group, "command": s.command}, s.requests) for s in rows],
    )
    e.family(
        "msgq_command_outcomes",
        "counter",
        "How the requests ended, one per recipient asked: ok, error (by the callee), "
        "no-recipient, refused (by the broker), recipient-gone, timeout, cancelled.",
        [
            ({"group": s.group, "command": s.command, "outcome": outcome}, n)
            for s in rows
            for outcome, n in s.outcomes().items()
        ],
    )
    e.family(
        "msgq_command_errors",
        "counter",
        "The callees' ERROR answers by code (limits.max_command_codes per pair, then 'other').",
        [
            ({"group": s.group, "command": s.command, "code": code}, n)
            for s in rows
            for code, n in sorted(s.errors.items())
        ],
    )
    e.histograms(
        "msgq_command_latency_seconds",
        "Time from request to answer (ok or error) as the broker sees it.",
        ("group", "command"),
        LATENCY_BUCKETS,
        (((s.group, s.command), s.buckets, s.latency_sum) for s in rows),
    )
    e.family(
        "msgq_command_stats_pairs",
        "gauge",
        "(group, command) pairs tracked (limits.max_command_stats).",
        len(table.pairs),
    )
    e.family(
        "msgq_command_stats_overflow",
        "counter",
        "Requests counted under 'other' because limits.max_command_stats pairs were tracked.",
        table.overflow,
    )


#: Users with a series of their own in the per-user metrics (the rest sum up as "other"):
#: bounds the label set whatever the number of users.
USER_SERIES_TOP = 10


def user_series(e: Exposition, rows: list[dict[str, Any]], top: int) -> None:
    """Per-user quota figures (``Users.rows()``, most memory first): the ``top`` users by
    name, the rest summed as ``user="other"``; their limits and refusals too."""
    shown, rest = rows[:top], rows[top:]
    use: list[tuple[dict[str, str], int]] = []
    limit: list[tuple[dict[str, str], int]] = []
    refused: list[tuple[dict[str, str], int]] = []
    for r in shown:
        for q, v in r["use"].items():
            use.append(({"user": r["user"], "quota": q}, v))
            limit.append(({"user": r["user"], "quota": q}, r["limits"][q]))
        for q, v in r["refused"].items():
            refused.append(({"user": r["user"], "quota": q}, v))
    if rest:
        other: Counter[str] = Counter()
        other_refused: Counter[str] = Counter()
        for r in rest:
            other.update(r["use"])
            other_refused.update(r["refused"])
        use += [({"user": "other", "quota": q}, v) for q, v in sorted(other.items())]
        refused += [({"user": "other", "quota": q}, v) for q, v in sorted(other_refused.items())]
    e.family(
        "msgq_user_use",
        "gauge",
        f'Per-user use of each quota (the {top} users using most memory; the rest as "other").',
        use,
    )
    e.family("msgq_user_limit", "gauge", "Per-user limit of each quota (same users).", limit)
    e.family(
        "msgq_user_refusals",
        "counter",
        "Operations refused for a quota, by the user whose quota it is (connected users).",
        refused,
    )
