"""Histories of what a scenario's processes did, and the invariants checked on them.

A role records every operation it performs as JSON lines (one object per line): an
``invoke`` when it starts one, then exactly one completion with the same ``process``
and ``id``: ``ok`` (it happened: a put acked, a call answered), ``fail`` (it did not
happen, with the documented ``error`` code) or ``info`` (unknown: the connection broke
before the answer). Deliveries a consumer sees are single ``ok`` records of ``f =
"deliver"``. Counters say *how many*; a history says *which*, so a failed check names
the operations that break it.

This module is pure (no trio, no processes, no clock): :class:`Recorder` builds the
lines a role writes, :func:`parse` reads them back, the ``check_*`` functions and
:func:`check` find violations. Times are whatever clock the recorder was given
(``time.monotonic()`` in the roles: one clock for every process of the machine).

Operations and their fields:

* ``send`` (a producer hands message ``key`` to the bus or a queue; ``ok`` is ack 1):
  ``key`` (unique per message, the same on a resend), ``producer`` and ``seq`` for
  order checks.
* ``deliver`` (a consumer got message ``key``; ``ok`` only): ``key``, ``producer``,
  ``seq``.
* ``call`` (an RPC; ``ok`` with its answer, ``fail`` with ``error``): any fields.

Any other ``f`` is recorded and kept for the silence check only.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

__all__ = [
    "TYPES",
    "HistoryError",
    "Op",
    "Recorder",
    "Violation",
    "check",
    "check_answered_once",
    "check_lost",
    "check_no_duplicates",
    "check_order",
    "check_reaches_each",
    "check_silence",
    "merge",
    "parse",
]

TYPES = ("invoke", "ok", "fail", "info")
#: How many operations a violation lists at most (the rest are counted).
MAX_NAMED = 10


class HistoryError(ValueError):
    """A history line is malformed; the message names the source and the line."""


@attrs.frozen
class Op:
    """One recorded operation. ``index`` is its position in the merged history."""

    index: int
    process: str
    type: str
    f: str
    id: int
    time: float
    key: str | None = None
    producer: str | None = None
    seq: int | None = None
    error: str | None = None
    value: Any = None

    def describe(self) -> str:
        """``#12 producer-0 ok send p0:7 at 1.250`` (what a violation prints)."""
        what = f" {self.key}" if self.key is not None else ""
        err = f" ({self.error})" if self.error else ""
        return f"#{self.index} {self.process} {self.type} {self.f}{what}{err} at {self.time:.3f}"


@attrs.frozen
class Violation:
    """A broken invariant: which check, what is wrong, and the operations involved
    (indices into the history)."""

    check: str
    message: str
    ops: tuple[int, ...]


class Recorder:
    """Builds one process's history lines (sans I/O: the caller writes them).

    ``invoke`` returns the operation id to complete it with; each method returns the
    JSON line (no newline). Raises ``ValueError`` for a completion of an id that was
    never invoked or is already complete (a role's bug, caught where it happens)."""

    def __init__(self, process: str) -> None:
        self.process = process
        self._next = 0
        self._open: set[int] = set()

    def invoke(self, f: str, time: float, **fields: Any) -> tuple[int, str]:
        self._next += 1
        self._open.add(self._next)
        return self._next, self._line("invoke", f, self._next, time, fields)

    def complete(self, op_id: int, type_: str, f: str, time: float, **fields: Any) -> str:
        if type_ not in ("ok", "fail", "info"):
            raise ValueError(f"a completion is ok, fail or info, not {type_!r}")
        if op_id not in self._open:
            raise ValueError(f"operation {op_id} of {self.process} is not open")
        self._open.discard(op_id)
        return self._line(type_, f, op_id, time, fields)

    def event(self, f: str, time: float, **fields: Any) -> str:
        """A single ``ok`` record (a delivery): no invoke before it."""
        self._next += 1
        return self._line("ok", f, self._next, time, fields)

    def _line(self, type_: str, f: str, op_id: int, time: float, fields: dict[str, Any]) -> str:
        rec = {"process": self.process, "type": type_, "f": f, "id": op_id, "time": time, **fields}
        return json.dumps(rec, separators=(",", ":"), sort_keys=True)


def parse(lines: Iterable[str], source: str = "history") -> list[Op]:
    """Parse history lines (empty lines skipped) into :class:`Op` s, in the given order,
    indexed from 0. Merge several processes' files by concatenating and sorting by
    ``time`` first (:func:`merge`).

    Raises:
        HistoryError: a line is not a JSON object with ``process`` (str), ``type`` (one
            of :data:`TYPES`), ``f`` (str), ``id`` (int) and ``time`` (number); names
            ``source`` and the line number.
    """
    ops: list[Op] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HistoryError(f"{source}:{n}: not JSON: {exc}") from None
        if not isinstance(rec, dict):
            raise HistoryError(f"{source}:{n}: not a JSON object")
        ops.append(_op(rec, len(ops), f"{source}:{n}"))
    return ops


def merge(histories: Iterable[Sequence[Op]]) -> list[Op]:
    """One history from several processes' histories, ordered by time (stable: a
    process's own order is kept for equal times), re-indexed from 0."""
    merged = sorted((op for h in histories for op in h), key=lambda op: op.time)
    return [attrs.evolve(op, index=i) for i, op in enumerate(merged)]


def _op(rec: dict[str, Any], index: int, where: str) -> Op:
    def need(key: str, types: type | tuple[type, ...]) -> Any:
        v = rec.get(key)
        if not isinstance(v, types) or isinstance(v, bool):
            raise HistoryError(f"{where}: {key!r} is missing or not {types}")
        return v

    type_ = need("type", str)
    if type_ not in TYPES:
        raise HistoryError(f"{where}: type {type_!r} is not one of {TYPES}")
    seq = rec.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
        raise HistoryError(f"{where}: 'seq' is not an integer")
    for key in ("key", "producer", "error"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            raise HistoryError(f"{where}: {key!r} is not a string")
    return Op(
        index,
        need("process", str),
        type_,
        need("f", str),
        need("id", int),
        float(need("time", (int, float))),
        rec.get("key"),
        rec.get("producer"),
        seq,
        rec.get("error"),
        rec.get("value"),
    )


# -- checks ---------------------------------------------------------------------------------
def _violation(check: str, message: str, ops: Sequence[Op]) -> Violation:
    named = "; ".join(op.describe() for op in ops[:MAX_NAMED])
    more = f"; and {len(ops) - MAX_NAMED} more" if len(ops) > MAX_NAMED else ""
    return Violation(check, f"{message}: {named}{more}", tuple(op.index for op in ops))


def _completions(history: Sequence[Op]) -> dict[tuple[str, int], list[Op]]:
    done: dict[tuple[str, int], list[Op]] = {}
    for op in history:
        if op.type != "invoke":
            done.setdefault((op.process, op.id), []).append(op)
    return done


def check_lost(history: Sequence[Op]) -> list[Violation]:
    """Every message whose send completed ``ok`` (acked) was delivered at least once."""
    delivered = {op.key for op in history if op.f == "deliver" and op.type == "ok"}
    lost = [op for op in history if op.f == "send" and op.type == "ok" and op.key not in delivered]
    if not lost:
        return []
    return [_violation("lost", f"{len(lost)} acked messages were never delivered", lost)]


def check_reaches_each(
    history: Sequence[Op], prefixes: Iterable[str], *, ended: Iterable[str] = ()
) -> list[Violation]:
    """Every acked message reached every process whose name starts with one of
    ``prefixes`` (a group's members: ``auth-`` for ``auth-0``, ``auth-1``...) that was
    running when the message was sent (its invoke) and to the end: a broadcast the system
    promises to every live member. A process runs from its first recorded operation (a
    member records one once it joined) until the end, unless it is in ``ended``."""
    pre = tuple(prefixes)
    gone = set(ended)
    first: dict[str, float] = {}
    got: dict[str, set[str | None]] = {}
    invoked: dict[tuple[str, int], float] = {}
    for op in history:
        if op.type == "invoke":
            invoked[op.process, op.id] = op.time
        if op.process.startswith(pre):
            first.setdefault(op.process, op.time)
            if op.f == "deliver" and op.type == "ok":
                got.setdefault(op.process, set()).add(op.key)
    members = [p for p in first if p not in gone]
    out = []
    for op in history:
        if op.f != "send" or op.type != "ok":
            continue
        sent = invoked.get((op.process, op.id), op.time)
        missing = [p for p in members if first[p] <= sent and op.key not in got.get(p, ())]
        if missing:
            out.append(
                _violation(
                    "reaches-each",
                    f"{op.key} was acked but never reached {', '.join(sorted(missing))}",
                    [op],
                )
            )
    return out


def check_no_duplicates(history: Sequence[Op], *, per: str = "all") -> list[Violation]:
    """No message is delivered twice: to anyone (``per="all"``: a queue's consumers
    share its messages), to the same process (``"process"``: a group's members each get
    one), or within one consumer session (``"session"``: the ``session`` in a delivery's
    ``value``; a redelivery after a crash is at-least-once, a second copy within one
    session is a duplicate)."""
    if per not in ("all", "process", "session"):
        raise ValueError(f"per must be all, process or session, not {per!r}")
    seen: dict[tuple[str, Any, str | None] | str | None, list[Op]] = {}
    for op in history:
        if op.f == "deliver" and op.type == "ok":
            if per == "all":
                k: tuple[str, Any, str | None] | str | None = op.key
            else:
                session = op.value.get("session") if isinstance(op.value, dict) else None
                k = (op.process, session if per == "session" else None, op.key)
            seen.setdefault(k, []).append(op)
    out = []
    for ops in seen.values():
        if len(ops) > 1:
            out.append(
                _violation("duplicates", f"message {ops[0].key} delivered {len(ops)} times", ops)
            )
    return out


def check_order(history: Sequence[Op]) -> list[Violation]:
    """Each process receives each producer's messages in increasing ``seq`` (gaps are
    fine: another consumer may have taken some)."""
    last: dict[tuple[str, str], Op] = {}
    out = []
    for op in history:
        if op.f != "deliver" or op.type != "ok" or op.producer is None or op.seq is None:
            continue
        k = (op.process, op.producer)
        prev = last.get(k)
        if prev is not None and prev.seq is not None and op.seq <= prev.seq:
            out.append(
                _violation(
                    "order",
                    f"{op.process} got {op.producer}'s seq {op.seq} after seq {prev.seq}",
                    [prev, op],
                )
            )
        if prev is None or prev.seq is None or op.seq > prev.seq:
            last[k] = op
    return out


def check_answered_once(
    history: Sequence[Op], *, allowed_errors: Iterable[str] = (), ended: Iterable[str] = ()
) -> list[Violation]:
    """Every invoked operation completes exactly once, and every ``fail`` carries one of
    ``allowed_errors`` (the documented codes for this system). An operation of a
    process in ``ended`` (killed, or stopped by the scenario) may stay open: its
    outcome is unknown, as with ``info``."""
    allowed = set(allowed_errors)
    gone = set(ended)
    done = _completions(history)
    out = []
    for op in history:
        if op.type != "invoke":
            continue
        comps = done.get((op.process, op.id), [])
        if not comps and op.process not in gone:
            out.append(_violation("answered-once", f"{op.f} never completed", [op]))
        elif len(comps) > 1:
            out.append(
                _violation("answered-once", f"{op.f} completed {len(comps)} times", [op, *comps])
            )
        for c in comps:
            if c.type == "fail" and c.error not in allowed:
                out.append(
                    _violation(
                        "answered-once",
                        f"{op.f} failed with an undocumented error "
                        f"{c.error!r} (documented: {sorted(allowed)})",
                        [op, c],
                    )
                )
    # A single ok record is an event (a delivery); a fail or info always completes
    # something that was invoked.
    invoked = {(op.process, op.id) for op in history if op.type == "invoke"}
    for key, comps in done.items():
        if key not in invoked and any(c.type != "ok" for c in comps):
            out.append(
                _violation("answered-once", f"{comps[0].f} completed without an invoke", comps)
            )
    return out


def check_silence(
    history: Sequence[Op], bound: float, *, until: float | None = None, ended: Iterable[str] = ()
) -> list[Violation]:
    """No process goes longer than ``bound`` seconds between two recorded operations
    (nor from its last one to ``until``, the end of the run, unless it is in
    ``ended``): a client stuck without an error is a failure, not a slow success."""
    gone = set(ended)
    by_process: dict[str, list[Op]] = {}
    for op in history:
        by_process.setdefault(op.process, []).append(op)
    out = []
    for process, ops in by_process.items():
        for a, b in itertools.pairwise(ops):
            if b.time - a.time > bound:
                out.append(
                    _violation(
                        "silence",
                        f"{process} was silent for {b.time - a.time:.3f} s (bound {bound} s)",
                        [a, b],
                    )
                )
        if until is not None and process not in gone and until - ops[-1].time > bound:
            out.append(
                _violation(
                    "silence",
                    f"{process} was silent for the last "
                    f"{until - ops[-1].time:.3f} s (bound {bound} s)",
                    [ops[-1]],
                )
            )
    return out


def check(
    history: Sequence[Op],
    *,
    lost: bool = True,
    duplicates: bool = True,
    duplicates_per: str = "all",
    order: bool = False,
    answered_once: bool = True,
    allowed_errors: Iterable[str] = (),
    silence: float | None = None,
    until: float | None = None,
    ended: Iterable[str] = (),
    reaches_each: Iterable[str] = (),
) -> list[Violation]:
    """The checks a scenario asks for, in this order; an empty list means the history
    keeps every invariant checked."""
    ended = list(ended)
    out: list[Violation] = []
    if lost:
        out += check_lost(history)
    prefixes = list(reaches_each)
    if prefixes:
        out += check_reaches_each(history, prefixes, ended=ended)
    if duplicates:
        out += check_no_duplicates(history, per=duplicates_per)
    if order:
        out += check_order(history)
    if answered_once:
        out += check_answered_once(history, allowed_errors=allowed_errors, ended=ended)
    if silence is not None:
        out += check_silence(history, silence, until=until, ended=ended)
    return out
