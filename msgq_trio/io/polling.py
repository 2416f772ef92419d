"""Busy polling (``limits.busy_poll``): keep the trio loop polling for a while after a
read, so the next frame is taken without a sleeping process's wake-up."""

from __future__ import annotations

import math
import os

import trio

from .wakeup import Wakeup


class BusyPoller:
    """``limits.busy_poll``: keeps the trio loop polling for a while after a read.

    The reader of each connection, on every read: ``if not poller.polling and
    poller.limit: poller.adapt(now)``, then ``poller.last_read = now`` (inline: it runs
    per receive). :meth:`run` is the polling task.
    """

    __slots__ = (
        "_last_gap_short",
        "_wake",
        "cpus",
        "last_read",
        "limit",
        "passes",
        "polling",
        "window",
    )

    def __init__(self, limit: float) -> None:
        #: When the last read came (trio clock).
        self.last_read = -math.inf
        self._wake = Wakeup()
        #: True while the task polls (reads then are within the window: no adapting).
        self.polling = False
        #: Loop passes made polling (stats: its CPU is visible).
        self.passes = 0
        #: The limit in force (0: off, always so on one CPU); see :meth:`set_limit`.
        self.limit = 0.0
        #: How long after a read the task polls now (adaptive, see :meth:`adapt`).
        self.window = 0.0
        self._last_gap_short = False
        self.cpus = len(os.sched_getaffinity(0))
        self.set_limit(limit)

    def set_limit(self, limit: float) -> None:
        """Put ``limits.busy_poll`` in force: off where this process may run on one CPU
        only (a spinning broker would only delay the clients it waits for)."""
        if self.cpus < 2:
            limit = 0.0
        self.limit = limit
        self.window = min(self.window, limit)

    def adapt(self, now: float) -> None:
        """A read came while the loop was asleep: adapt the polling window, then poll.

        After KVM's halt polling: a read that came within ``limits.busy_poll`` of the
        previous one would have been caught by polling that long. Two such reads in a row
        grow the window (to a quarter of the limit, then doubling, up to the limit); one
        that came later closes it. Reads caught while polling change nothing (they are
        within the window). So the broker polls while frames come back to back (request,
        answer, next request: every gap short) and not for traffic spaced wider than the
        limit, nor for calls paced apart (an answer's short gap, then the next request's
        long one): CPU is spent only where it buys latency.
        """
        limit = self.limit
        short = now - self.last_read <= limit
        if not short:
            self.window = 0.0
        elif self._last_gap_short:
            self.window = min(limit, max(2 * self.window, limit / 4))
            self._wake.set()
        self._last_gap_short = short

    async def run(self) -> None:
        """``limits.busy_poll``: for ``window`` after the last read, keep this
        trio loop running (every pass polls the sockets without sleeping, then yields the
        CPU to any other runnable process), so the next frame is taken without the
        wake-up of a sleeping process (a scheduler round trip, long next to handling a
        small frame). Parked, costing nothing, while the window is 0 or
        once no read came for that long."""
        clock = trio.current_time
        checkpoint = trio.lowlevel.checkpoint
        yield_cpu = os.sched_yield
        while True:
            await self._wake.wait()
            self.polling = True
            try:
                while clock() - self.last_read < self.window:
                    self.passes += 1
                    await checkpoint()
                    # Polite spinning: a process runnable on this CPU (a client of ours,
                    # on a small machine) runs now rather than at the end of our time
                    # slice; what it gains and costs: BENCHMARKS.md, "Busy polling".
                    yield_cpu()
            finally:
                self.polling = False
