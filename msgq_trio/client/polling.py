"""When a caller polls its socket for the answer instead of sleeping: the client's
``busy_poll`` rule, sans-I/O (times are arguments; the trio driver does the polling).

Why poll at all: a trio program waits for its socket in ``epoll_wait``, and waking a
process asleep there costs the sender's write and the wakee's run loop a trip through
the kernel's scheduler, once per round trip on the caller's side, a large part of a
local round trip (BENCHMARKS.md records the figures). A caller that keeps receiving
without sleeping for the little time the answer takes saves that, at the price of a CPU
while it polls; the rule below spends that only where it buys latency.
"""

from __future__ import annotations

import enum
import os

__all__ = ["BUSY_POLL", "CallPoller", "Poll", "check_busy_poll"]

#: The longest a caller polls for its answer (seconds), as the broker's
#: ``limits.busy_poll``: twice a local round trip through the broker (the figure
#: BENCHMARKS.md records for the round trip), so it covers one with room; a call
#: answered later than that stops the polling (see :class:`CallPoller`).
BUSY_POLL = 0.0002
#: Answers within the limit that open the window after it has been closed by a late
#: one; doubled by every poll that missed, up to _MAX_NEED (so a caller whose answers
#: cannot come while it polls, e.g. from a handler in its own program, wastes one window
#: per _MAX_NEED calls at most), and back to this once a poll catches its answer.
_NEED = 2
_MAX_NEED = 64


class Poll(enum.Enum):
    """How a call's wait went, for :meth:`CallPoller.answered`."""

    #: The call did not poll (the window was closed, or polling was not possible).
    SLEPT = "slept"
    #: It polled and took its answer meanwhile.
    CAUGHT = "caught"
    #: It polled and stopped before the answer came (the window ended, or something
    #: else in the program needed the thread), then slept.
    MISSED = "missed"


def check_busy_poll(value: float) -> float:
    """``value`` if it is a valid ``busy_poll`` (seconds, 0 to 1), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"busy_poll must be a number of seconds, got {value!r}")
    if not 0 <= value <= 1:
        raise ValueError(f"busy_poll must be between 0 and 1 s, got {value!r}")
    return float(value)


class CallPoller:
    """Whether the next lone call polls for its answer, and for how long (``window``).

    The window opens (to ``limit``) once enough answers in a row came within twice
    ``limit`` of their request while the caller slept (two at first: polling would
    likely have caught them, as the sleeping caller's own wake-up is part of the
    delay). A poll that catches its answer keeps it open; one that misses closes it, and
    doubles the number of such answers needed to open it again (up to 64; back to two
    after a catch). So a client polls while its calls are answered back to back within
    the limit, and one whose answers come later, or cannot come while it polls (the
    answering handler runs in the same program), wastes a window rarely.

    ``limit`` 0 turns polling off; so does a process that may run on one CPU only
    (``cpus`` < 2): there a polling caller would only delay the process that answers.
    """

    __slots__ = ("_need", "_short", "caught", "limit", "missed", "window")

    def __init__(self, limit: float, cpus: int | None = None) -> None:
        if cpus is None:
            cpus = len(os.sched_getaffinity(0))
        #: The limit in force (0: off).
        self.limit = check_busy_poll(limit) if cpus >= 2 else 0.0
        #: How long the next lone call polls (0: it sleeps at once).
        self.window = 0.0
        #: Answers caught while polling, and polls that missed (stats and tests).
        self.caught = 0
        self.missed = 0
        self._need = _NEED
        self._short = 0

    def answered(self, delay: float, how: Poll) -> None:
        """A call's answer came ``delay`` seconds after its request went out."""
        if how is Poll.CAUGHT:
            self.caught += 1
            self._need = _NEED
        elif how is Poll.MISSED:
            self.missed += 1
            self.window = 0.0
            self._need = min(2 * self._need, _MAX_NEED)
            self._short = 0
        elif delay > 2 * self.limit:
            # Later than polling could have caught: a slept call's delay includes its
            # own wake-up from the event loop's wait (on a busy host about as long as
            # the limit), so up to twice the limit still counts as short. Judged by
            # the limit alone, a caller whose answers came just over it because it
            # slept would never poll again: stuck at the slower sleeping round trip for
            # good. A window opened for answers truly later than the limit misses and
            # closes at its first poll (see MISSED).
            self.window = 0.0
            self._short = 0
        elif not self.window:
            self._short += 1
            if self._short >= self._need:
                self.window = self.limit
                self._short = 0
