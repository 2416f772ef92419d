"""RPC tracking: every request that wants an answer, until it is answered or fails.

The life of one pending call (one slot per (caller, request id)):

    PENDING --answer from each callee--> REPLIED     (slot freed when no callee is left)
    PENDING --callee disconnects-------> PEER_GONE   (caller gets recipient-gone at once)
    PENDING --deadline passes----------> TIMED_OUT   (caller gets timeout; logged at ERROR)
    PENDING --caller disconnects-------> CANCELLED   (slot dropped; late answers discarded)

Each slot also holds its (group, command) counters (core/cmdstats.py), bumped here as the
call ends, so the statistics cost the answer path no lookup of their own.

Pure data structure: time is an argument, deadlines are data (``next_deadline()``), and
the outcomes are returned to the broker, which turns them into frames. Each slot is linked
from the registry and from both parties' ``Peer.pending_*`` sets, so a disconnect frees its
slots in O(its slots) (dbus-broker's reply registry has the same two-way ownership).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left as _bisect
from typing import NamedTuple

from .cmdstats import LATENCY_BUCKETS, CommandStat, CommandStats
from .peers import Peer


class Pending:
    __slots__ = (
        "callees",
        "caller",
        "command",
        "deadline",
        "request_id",
        "started",
        "stat",
        "target",
    )

    def __init__(
        self,
        caller: Peer,
        request_id: int,
        callees: dict[int, Peer],
        deadline: float,
        target: str,
        command: str,
        stat: CommandStat,
        started: float,
    ) -> None:
        self.caller = caller
        self.request_id = request_id
        self.callees = callees
        self.deadline = deadline
        self.target = target
        self.command = command
        self.stat = stat
        self.started = started


class Failure(NamedTuple):
    """A callee that will never answer: the broker answers the caller in its name."""

    caller: Peer
    request_id: int
    callee: Peer
    reason: str  # "recipient-gone" | "timeout"
    command: str


class PendingReplies:
    """Registry of pending calls keyed by (caller id, request id)."""

    def __init__(self, command_stats: CommandStats | None = None) -> None:
        self.slots: dict[tuple[int, int], Pending] = {}
        self._deadlines: list[tuple[float, int, int]] = []
        #: Per (group, command) counters of every call (core/cmdstats.py).
        self.stats = command_stats if command_stats is not None else CommandStats()

    def __len__(self) -> int:
        return len(self.slots)

    def is_pending(self, caller: Peer, request_id: int) -> bool:
        return (caller.id, request_id) in self.slots

    def add(
        self,
        caller: Peer,
        request_id: int,
        callees: list[Peer],
        deadline: float,
        target: str,
        command: str,
        stat: CommandStat | None = None,
        now: float = 0.0,
    ) -> None:
        """Register a call delivered to ``callees``; the caller's quota is checked by the broker.

        ``stat`` is the pair's counters, its request already counted (the dispatcher's
        :meth:`CommandStats.entry`; taken here if None); ``now`` starts its latency."""
        key = (caller.id, request_id)
        assert key not in self.slots, "duplicate request id must be refused before add()"
        if stat is None:
            stat = self.stats.entry(target, command)
        self.slots[key] = Pending(
            caller, request_id, {c.id: c for c in callees}, deadline, target, command, stat, now
        )
        caller.pending_out.add(key)
        for c in callees:
            c.pending_in.add(key)
        heapq.heappush(self._deadlines, (deadline, caller.id, request_id))

    def answer(
        self,
        callee: Peer,
        caller_id: int,
        request_id: int,
        now: float = 0.0,
        error: str | None = None,
    ) -> Peer | None:
        """Record ``callee``'s answer. Returns the caller to forward it to, or None to drop it.

        None means: the caller is gone, the call timed out, or ``callee`` was never asked
        (a forged or duplicate answer). Late answers are discarded quietly (and not
        counted). ``error`` is the code of an ERROR answer, None for a REPLY; ``now`` ends
        the call's latency.
        """
        key = (caller_id, request_id)
        slot = self.slots.get(key)
        if slot is None or slot.callees.pop(callee.id, None) is None:
            return None
        if error is None:
            # CommandStats.answered_ok, without its call (one per round trip).
            stat = slot.stat
            latency = now - slot.started
            stat.ok += 1
            stat.buckets[_bisect(LATENCY_BUCKETS, latency)] += 1
            stat.latency_sum += latency
        else:
            self.stats.answered_error(slot.stat, now - slot.started, error)
        callee.pending_in.discard(key)
        if not slot.callees:
            self._free(key, slot)
        return slot.caller

    def peer_gone(self, peer: Peer) -> list[Failure]:
        """Free everything ``peer`` took part in; returns the failures to report to callers."""
        failures: list[Failure] = []
        for key in peer.pending_in:
            slot = self.slots.get(key)
            if slot is None:
                continue
            if slot.callees.pop(peer.id, None) is not None:
                slot.stat.recipient_gone += 1
            if slot.caller.alive and slot.caller is not peer:
                failures.append(
                    Failure(slot.caller, slot.request_id, peer, "recipient-gone", slot.command)
                )
            if not slot.callees:
                self._free(key, slot)
        peer.pending_in.clear()
        for key in list(peer.pending_out):
            slot = self.slots.pop(key, None)
            if slot is None:
                continue
            slot.stat.cancelled += len(slot.callees)
            for c in slot.callees.values():
                c.pending_in.discard(key)
        peer.pending_out.clear()
        return failures

    def next_deadline(self) -> float | None:
        """Earliest deadline among pending calls (stale heap entries are skipped lazily)."""
        h = self._deadlines
        while h:
            deadline, cid, rid = h[0]
            slot = self.slots.get((cid, rid))
            if slot is not None and slot.deadline == deadline:
                return deadline
            heapq.heappop(h)
        return None

    def expire(self, now: float) -> list[Failure]:
        """Time out every call whose deadline is <= now."""
        out: list[Failure] = []
        h = self._deadlines
        while h and h[0][0] <= now:
            deadline, cid, rid = heapq.heappop(h)
            key = (cid, rid)
            slot = self.slots.get(key)
            if slot is None or slot.deadline != deadline:
                continue
            slot.stat.timeout += len(slot.callees)
            for callee in slot.callees.values():
                callee.pending_in.discard(key)
                out.append(Failure(slot.caller, rid, callee, "timeout", slot.command))
            slot.callees.clear()
            self._free(key, slot)
        return out

    def _free(self, key: tuple[int, int], slot: Pending) -> None:
        del self.slots[key]
        slot.caller.pending_out.discard(key)

    def check_empty(self) -> None:
        """Assert nothing is left (called at shutdown by tests to catch leaks)."""
        assert not self.slots, f"leaked RPC slots: {list(self.slots)[:10]}"
