"""Per-command statistics: for each (target group, command), how many requests, how each
ended, and how long the answered ones took.

Always on, so the per-request work is one dict lookup and a few integer increments: the
dispatcher takes the pair's :class:`CommandStat` once per REQUEST (:meth:`CommandStats.entry`;
for a pair already tracked it does the same inline: ``pairs.get`` and ``requests += 1``)
and the pending call (core/rpc.py) keeps it until the call ends, so the answer path finds
it with the slot it already looks up (and counts a REPLY inline, as
:meth:`CommandStats.answered_ok` would: a Python call less per round trip each). The
command name is the one the dispatcher reads from the request's header anyway; the body
is never decoded for it.

Outcomes, one per recipient that was asked (one per request, except for a request to
every member of a group, which has one per member):

* ``ok`` — answered with REPLY; ``error`` — answered with ERROR by the callee, counted per
  error code too (``errors``);
* ``no-recipient`` — nobody to ask; ``refused`` — the broker refused the request (access
  policy, several members for a plain request, a receiver's queue full, a leaving or
  remote recipient that cannot take it);
* ``recipient-gone`` — the callee disconnected (or was killed) before answering;
  ``timeout`` — the deadline passed first;
* ``cancelled`` — the caller disconnected before the answer.

So a plain request's outcomes add up to its ``requests`` once it has ended.

Bounds: at most ``max_pairs`` (group, command) pairs are tracked (``limits.max_command_stats``);
the requests of any further pair are counted under the one pair (``"other"``, ``"other"``)
and in ``overflow``, so a client inventing command names costs a counter, not memory. The
codes one pair counts errors under are bounded the same way (``max_codes``, past it code
``"other"``): an error code is the callee's choice.

Requests to the broker itself (target ``msgq``) are not counted here, nor requests refused
before their command is read (a request id already pending, ``max_pending_requests``
reached: the caller's own bookkeeping, whatever it calls). A request to one
connection by its lname (``l.N``) is counted under the group ``"l.*"``: lnames are never
reused, so they would fill the table with pairs that will never be seen again.

Pure data: time is an argument.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["DIRECT_GROUP", "LATENCY_BUCKETS", "OTHER", "CommandStat", "CommandStats"]

#: Upper bounds (seconds) of the latency buckets, roughly logarithmic (1-2.5-5 per decade):
#: a local round trip takes tens of microseconds, a handler doing I/O milliseconds, one
#: in trouble seconds; past a minute only the deadline (``request_timeout``) is left.
LATENCY_BUCKETS = (
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: The group and command (and error code) under which what is past a bound is counted.
OTHER = "other"
#: The group a request addressed to one connection (``l.N``) is counted under.
DIRECT_GROUP = "l.*"

_bisect = bisect.bisect_left


class CommandStat:
    """The counters of one (group, command) pair. ``buckets[i]`` counts answers (ok or
    error) that took at most ``LATENCY_BUCKETS[i]`` seconds and more than the bound
    before; the last entry, longer ones."""

    __slots__ = (
        "buckets",
        "cancelled",
        "command",
        "error",
        "errors",
        "group",
        "latency_sum",
        "no_recipient",
        "ok",
        "recipient_gone",
        "refused",
        "requests",
        "timeout",
    )

    def __init__(self, group: str, command: str) -> None:
        self.group = group
        self.command = command
        self.requests = 0
        self.ok = 0
        self.error = 0
        self.errors: dict[str, int] = {}
        self.no_recipient = 0
        self.refused = 0
        self.recipient_gone = 0
        self.timeout = 0
        self.cancelled = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def outcomes(self) -> dict[str, int]:
        """Every outcome's count, by its name (docs: the module)."""
        return {
            "ok": self.ok,
            "error": self.error,
            "no-recipient": self.no_recipient,
            "refused": self.refused,
            "recipient-gone": self.recipient_gone,
            "timeout": self.timeout,
            "cancelled": self.cancelled,
        }

    def as_dict(self) -> dict[str, Any]:
        """The pair as plain data (the ``command-stats`` control command's row)."""
        answered = self.ok + self.error
        return {
            "group": self.group,
            "command": self.command,
            "requests": self.requests,
            "outcomes": self.outcomes(),
            "errors": dict(self.errors),
            "latency": {
                "count": answered,
                "sum": self.latency_sum,
                "mean": self.latency_sum / answered if answered else None,
                "p50": self.quantile(0.5),
                "p99": self.quantile(0.99),
                "buckets": list(self.buckets),
            },
        }

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile of the answers'
        latencies (``inf`` past the last bound), or None with no answer yet."""
        total = self.ok + self.error
        if not total:
            return None
        rank = q * total
        seen = 0
        for i, n in enumerate(self.buckets):
            seen += n
            if seen >= rank and n:
                return LATENCY_BUCKETS[i] if i < len(LATENCY_BUCKETS) else float("inf")
        return float("inf")


class CommandStats:
    """The table of :class:`CommandStat` by (group, command), bounded (see the module)."""

    def __init__(self, max_pairs: int = 1024, max_codes: int = 16) -> None:
        self.max_pairs = max_pairs
        self.max_codes = max_codes
        self.pairs: dict[tuple[str, str], CommandStat] = {}
        #: Where requests past ``max_pairs`` are counted (not in ``pairs`` until used).
        self.other = CommandStat(OTHER, OTHER)
        #: Requests counted under ``other`` because the table was full.
        self.overflow = 0

    def entry(self, group: str, command: str) -> CommandStat:
        """The pair's counters, its ``requests`` already counted: created on first use,
        or ``other`` once ``max_pairs`` pairs are tracked."""
        s = self.pairs.get((group, command))
        if s is None:
            if len(self.pairs) < self.max_pairs:
                s = self.pairs[(group, command)] = CommandStat(group, command)
            else:
                s = self.other
                self.overflow += 1
        s.requests += 1
        return s

    @staticmethod
    def answered_ok(s: CommandStat, latency: float) -> None:
        s.ok += 1
        s.buckets[_bisect(LATENCY_BUCKETS, latency)] += 1
        s.latency_sum += latency

    def answered_error(self, s: CommandStat, latency: float, code: str) -> None:
        s.error += 1
        errors = s.errors
        if code not in errors and len(errors) >= self.max_codes:
            code = OTHER
        errors[code] = errors.get(code, 0) + 1
        s.buckets[_bisect(LATENCY_BUCKETS, latency)] += 1
        s.latency_sum += latency

    def rows(self) -> list[CommandStat]:
        """Every tracked pair, and ``other`` once used, most requests first (then by name)."""
        out = list(self.pairs.values())
        if self.other.requests:
            out.append(self.other)
        out.sort(key=lambda s: (-s.requests, s.group, s.command))
        return out

    def snapshot(self, top: int | None = None) -> dict[str, Any]:
        """The table as plain data: the ``top`` pairs by requests (all if None), the
        bounds, and how many requests overflowed."""
        rows = self.rows()
        return {
            "pairs": len(self.pairs),
            "max_pairs": self.max_pairs,
            "overflow": self.overflow,
            "latency_buckets": list(LATENCY_BUCKETS),
            "commands": [s.as_dict() for s in (rows if top is None else rows[:top])],
        }
