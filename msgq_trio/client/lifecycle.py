"""The client connection's whole life as one state table, without I/O: the one
reconnect supervisor of every driver (trio, asyncio, blocking).

The drivers dial, read, write and sleep; this table decides. Each driver's loop is the
same: while :meth:`Lifecycle.wait` gives a delay, sleep that long (0: none) and dial,
the attempt bounded by :attr:`~Lifecycle.attempt_deadline` (the trio and asyncio
drivers in a task, ``_supervise``; the blocking driver from whichever call waits for
the connection, as it has no task of its own), and report what happened
(:meth:`~Lifecycle.welcomed`, :meth:`~Lifecycle.lost`, :meth:`~Lifecycle.attempt_failed`,
:meth:`~Lifecycle.restored`, :meth:`~Lifecycle.close`). Time is an argument (the
driver's monotonic clock); the jitter's randomness is injected, so the schedule is
unit-tested without sockets or clocks.

States and the events that move between them (``TRANSITIONS`` is the table)::

    CONNECTING --welcomed--> READY          the first connection; its failure is
    CONNECTING --failed----> ERROR          connect()'s error (no reconnect)
    READY --lost (policy)--> RECONNECTING   waiting for the next attempt, or dialing
    READY --lost-----------> ERROR          reconnect off: the loss is final
    READY --close----------> DRAINING       our GOODBYE said, the broker's awaited
    DRAINING --lost--------> CLOSED         the connection ended after our close
    RECONNECTING --welcomed-> RESTORING     a new connection: groups joined again
    RECONNECTING --failed--> RECONNECTING   (the next attempt is scheduled) or ERROR
                                            (the policy gave up)
    RESTORING --restored---> READY          the reconnect is complete
    RESTORING --lost/failed-> RECONNECTING  the same outage goes on
    any but CLOSED --close-> CLOSED         (from READY: DRAINING first)

Rules:

1. ERROR and CLOSED are final: every later send or call raises (the session's ``lost``
   says why: the loss, ``reconnect-gave-up``, or "the bus was closed").
2. An outage runs from the loss until a reconnect is restored; its :class:`Backoff`
   spans every attempt of it, so ``give_up_after`` counts from the loss.
3. While RECONNECTING or RESTORING nothing is queued for the broker: sends and calls
   fail at once with the loss's reason, saying that the client is reconnecting. The
   restore's own calls go out once WELCOME is taken (the session is up again).
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections.abc import Callable

from ..errors import ConnectError, ConnectionLost, UsageError
from ..protocol.codes import ErrorCode
from .reconnect import (
    Backoff,
    Reconnect,
    gave_up_error,
    log_lost,
    log_reconnected,
    reconnecting_error,
)

__all__ = [
    "CONNECT_TIMEOUT",
    "TRANSITIONS",
    "HeartbeatMonitor",
    "Lifecycle",
    "State",
    "connect_timeout",
]

log = logging.getLogger("msgq_trio.client")


#: How long ``connect()`` (every driver) waits for the first connection: the dial and
#: the broker's WELCOME together, unless it says otherwise (its ``timeout``). 30 s, as
#: :attr:`Reconnect.attempt_timeout <msgq_trio.client.reconnect.Reconnect.attempt_timeout>`
#: bounds each reconnect attempt: three times the broker's own handshake timeout (10 s),
#: so only a path that carries nothing (a black hole, a broker that accepts and never
#: answers) reaches it.
CONNECT_TIMEOUT = 30.0


def connect_timeout(timeout: float) -> float:
    """``connect()``'s ``timeout``, checked: a positive number of seconds.

    Raises:
        UsageError: anything else (named).
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf
    ):
        raise UsageError(f"connect timeout must be a positive number of seconds: {timeout!r}")
    return float(timeout)


class State(enum.Enum):
    """Where a client connection is in its life (see the module's table)."""

    CONNECTING = "connecting"
    READY = "ready"
    RECONNECTING = "reconnecting"
    RESTORING = "restoring"
    DRAINING = "draining"
    CLOSED = "closed"
    ERROR = "error"


_S = State
#: (state, event) -> the next state; an event absent for a state leaves it unchanged
#: (e.g. a second loss report of the same connection). ``failed`` with an outage whose
#: policy gave up goes to ERROR instead (decided by the Backoff, not the table).
TRANSITIONS: dict[tuple[State, str], State] = {
    (_S.CONNECTING, "welcomed"): _S.READY,
    (_S.CONNECTING, "failed"): _S.ERROR,
    (_S.CONNECTING, "close"): _S.CLOSED,
    (_S.READY, "lost"): _S.RECONNECTING,  # ERROR without a policy (rule 1)
    (_S.READY, "close"): _S.DRAINING,
    (_S.DRAINING, "lost"): _S.CLOSED,
    (_S.DRAINING, "close"): _S.DRAINING,
    (_S.RECONNECTING, "welcomed"): _S.RESTORING,
    (_S.RECONNECTING, "failed"): _S.RECONNECTING,
    (_S.RECONNECTING, "close"): _S.CLOSED,
    (_S.RESTORING, "restored"): _S.READY,
    (_S.RESTORING, "lost"): _S.RECONNECTING,
    (_S.RESTORING, "failed"): _S.RECONNECTING,
    (_S.RESTORING, "close"): _S.CLOSED,
    (_S.ERROR, "close"): _S.CLOSED,
}


class Lifecycle:
    """One client's connection state and its reconnect policy.

    Args:
        policy: the reconnect policy, or None (a loss is final).
        target: the address dialled (for the log lines and errors).
        rand: the jitter's source of numbers in [0, 1).
        connect_timeout: the bound of the first connection (dial and WELCOME).
    """

    def __init__(
        self,
        policy: Reconnect | None,
        target: str = "",
        rand: Callable[[], float] = random.random,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.policy = policy
        self.target = target
        self.connect_timeout = connect_timeout
        self.state = State.CONNECTING
        #: The outage under way (RECONNECTING, RESTORING), else None.
        self.backoff: Backoff | None = None
        #: Why the last attempt of the outage failed (for the give-up message).
        self.last_error: BaseException | None = None
        #: When the next attempt is due (RECONNECTING and waiting), else None.
        self.due: float | None = None
        #: When the attempt under way must have its WELCOME (None: no bound).
        self.attempt_deadline: float | None = None
        #: How many times the client reconnected.
        self.reconnects = 0
        self._rand = rand

    def _go(self, event: str) -> State:
        new = TRANSITIONS.get((self.state, event), self.state)
        self.state = new
        return new

    # -- queries ---------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """READY: connected, and after a reconnect the groups joined again."""
        return self.state is State.READY

    @property
    def reconnecting(self) -> bool:
        """Between a loss and a restored new connection."""
        return self.state is State.RECONNECTING or self.state is State.RESTORING

    @property
    def final(self) -> bool:
        """The connection ended for good (ERROR, CLOSED): no reconnect follows."""
        return self.state is State.ERROR or self.state is State.CLOSED

    def wait(self, now: float) -> float | None:
        """How long to sleep before dialing again (0: now), or None: no attempt comes
        (connected, or the end is final)."""
        if self.state is not State.RECONNECTING or self.due is None:
            return None
        return max(0.0, self.due - now)

    # -- events ----------------------------------------------------------------------
    def dialing(self, now: float) -> None:
        """The driver dials now: the first connection, bounded by ``connect_timeout``,
        or a reconnect attempt, bounded by the policy's ``attempt_timeout``, so that a
        path that carries nothing or a broker that accepts but never answers holds
        neither ``connect()`` nor the reconnect (:attr:`attempt_deadline`)."""
        self.due = None
        if self.state is State.RECONNECTING and self.policy is not None:
            self.attempt_deadline = now + self.policy.attempt_timeout
        elif self.state is State.CONNECTING:
            self.attempt_deadline = now + self.connect_timeout
        else:
            self.attempt_deadline = None

    def welcomed(self) -> State:
        """WELCOME taken: READY (the first connection) or RESTORING (a reconnect's)."""
        self.attempt_deadline = None
        return self._go("welcomed")

    def restored(self, lname: str) -> None:
        """A reconnect's restore is complete (logged as INFO): READY again."""
        if self.state is not State.RESTORING:
            return
        backoff = self.backoff
        self.backoff = self.last_error = None
        self.reconnects += 1
        self._go("restored")
        log_reconnected(self.target, backoff.attempts if backoff else 0, lname)

    def lost(self, lost: ConnectionLost, now: float, *, closing: bool = False) -> ConnectionLost:
        """The connection ended with ``lost`` (``closing``: after our GOODBYE). Returns
        what sends and calls raise from now on: ``lost`` itself when the end is final,
        else the reconnecting error (logged as a WARNING), the first attempt scheduled
        by the policy's first delay."""
        if closing and self.state is State.READY:
            self._go("close")
        state = self.state
        if state is State.DRAINING:
            self._go("lost")
            return lost
        if state is State.READY and self.policy is None:
            self.state = State.ERROR
            return lost
        if state is State.RESTORING:
            self._go("lost")
            self.last_error = lost
            gave_up = self._schedule(now)
            return gave_up if gave_up is not None else reconnecting_error(lost)
        if state is not State.READY:
            return lost  # already down (a second report of the same loss), or final
        assert self.policy is not None
        self._go("lost")
        log_lost(self.target, lost)
        self.backoff = Backoff(self.policy, now, self._rand)
        self.last_error = None
        self._schedule(now)
        return reconnecting_error(lost)

    def attempt_failed(self, exc: BaseException, now: float) -> ConnectionLost | None:
        """The attempt under way failed with ``exc`` (a dial, handshake or restore
        error, or its ``attempt_deadline`` passed). Returns None when the next attempt
        is scheduled, or the final ConnectionLost (code ``reconnect-gave-up``, logged as
        an ERROR) once the policy gave up: the state is then ERROR.
        The first connection's failure is connect()'s error: ERROR, returns None."""
        self.attempt_deadline = None
        if self.state is State.CONNECTING:
            self._go("failed")
            return None
        if not self.reconnecting:
            return None
        self._go("failed")
        self.last_error = exc
        return self._schedule(now)

    def timed_out(self) -> ConnectError:
        """The error of an attempt that passed its ``attempt_deadline``."""
        if self.state is State.CONNECTING:
            return ConnectError(
                f"no connection to the broker at {self.target} and WELCOME within "
                f"{self.connect_timeout:g} s (connect's timeout)"
            )
        timeout = self.policy.attempt_timeout if self.policy else None
        return ConnectError(
            f"no connection and WELCOME within {timeout} s (Reconnect.attempt_timeout)"
        )

    def close(self) -> None:
        """The application closes the client: DRAINING while connected (the driver says
        GOODBYE and waits for the broker's), else CLOSED at once (an attempt under way
        or scheduled is given up)."""
        self.due = self.attempt_deadline = None
        self.backoff = None
        self._go("close")

    def _schedule(self, now: float) -> ConnectionLost | None:
        backoff = self.backoff
        assert backoff is not None
        delay = backoff.next_delay(now)
        if delay is None:
            self.state = State.ERROR
            self.due = None
            self.backoff = None
            return gave_up_error(self.target, backoff, now, self.last_error)
        self.due = now + delay
        return None


class HeartbeatMonitor:
    """The heartbeat decision of a TCP connection, one call per interval: a silent
    broker (a dead host or path sends no FIN or RST) is declared lost after ``misses``
    intervals in which nothing arrived. Intervals in which the driver's reader is paused
    (the application is not consuming, so nothing can arrive) do not count."""

    def __init__(self, interval: float, misses: int) -> None:
        self.interval = interval
        self.misses = misses
        self._last = -1
        self._missed = 0

    def tick(self, received_bytes: int, paused: bool) -> ConnectionLost | None:
        """One interval passed. Returns None while the broker is alive (the driver then
        pings if :attr:`silent`), or the :class:`ConnectionLost` (code
        ``heartbeat-timeout``) to fail the connection with."""
        if received_bytes != self._last or paused:
            self._last, self._missed = received_bytes, 0
            return None
        self._missed += 1
        if self._missed < self.misses:
            return None
        log.error(
            "the broker sent nothing for %d heartbeat intervals of %s s: connection lost",
            self._missed,
            self.interval,
        )
        return ConnectionLost(
            f"the broker sent nothing for {self._missed * self.interval:g} s (heartbeat)",
            code=str(ErrorCode.HEARTBEAT_TIMEOUT),
        )

    @property
    def silent(self) -> bool:
        """Whether the last interval brought nothing (ask the broker ``ping``: its answer,
        or any traffic, proves it alive)."""
        return self._missed > 0
