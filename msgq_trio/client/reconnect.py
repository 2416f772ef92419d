"""The reconnect policy of the client drivers and its backoff schedule, without I/O.

``connect(..., reconnect=True)`` (or a :class:`Reconnect`) makes a driver reconnect
after the connection is lost; the driver sleeps for what :meth:`Backoff.next_delay`
says and stops when it says None. Time is an argument (the driver's monotonic clock), and
so is the randomness of the jitter, so the schedule is unit-tested without sockets or
clocks.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import ConnectionLost, UsageError

__all__ = [
    "GAVE_UP",
    "Backoff",
    "Reconnect",
    "gave_up_error",
    "log_lost",
    "log_reconnected",
    "reconnect_policy",
    "reconnecting_error",
]

log = logging.getLogger("msgq_trio.client")


def _positive(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise UsageError(f"Reconnect.{attr.name} must be positive, not {value!r}")


def _optional_positive(_inst: object, attr: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise UsageError(f"Reconnect.{attr.name} must be positive or None, not {value!r}")


@attrs.frozen
class Reconnect:
    """How a client reconnects after losing the broker (a value; pass it to ``connect``).

    The n-th attempt (n = 1, 2, ...) waits ``initial_delay * factor ** (n - 1)`` s, at
    most ``max_delay``, each wait spread by up to ``jitter`` of itself either way, counted
    from the end of the previous attempt. The client gives up once ``give_up_after`` s
    passed since the loss without a new connection (None: never).

    Attributes:
        initial_delay: the first wait (0.1 s: a broker restarted by its supervisor, e.g.
            systemd's default ``RestartSec=100ms``, is back about then).
        factor: growth of the wait per failed attempt (2: the usual doubling).
        max_delay: the longest wait (2 s: nats-py's ``reconnect_time_wait``; a restarted
            broker is found within 2 s of coming back).
        jitter: the fraction by which each wait is varied at random (0.1), so that many
            clients of a restarted broker do not all knock at the same instant.
        give_up_after: seconds without a connection after which the loss is final (120 s:
            nats-py's 60 attempts x 2 s). Long enough to ride out a broker restart or
            upgrade; short enough that a client whose broker is gone for good says so
            (its iteration ends with ConnectionLost, ERROR logged) instead of waiting in
            silence. None: try forever.
        attempt_timeout: the longest one attempt may take to connect and get WELCOME
            (30 s: the asyncio and direct clients' ``timeout`` for WELCOME), so a broker
            that accepts but never answers (stopped) does not hold the reconnect.
    """

    initial_delay: float = attrs.field(default=0.1, validator=_positive)
    factor: float = attrs.field(default=2.0, validator=_positive)
    max_delay: float = attrs.field(default=2.0, validator=_positive)
    jitter: float = 0.1
    give_up_after: float | None = attrs.field(default=120.0, validator=_optional_positive)
    attempt_timeout: float = attrs.field(default=30.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.jitter < 1:
            raise UsageError(f"Reconnect.jitter must be in [0, 1), not {self.jitter!r}")
        if self.factor < 1:
            raise UsageError(f"Reconnect.factor must be >= 1, not {self.factor!r}")

    def delay(self, attempt: int, rand: float) -> float:
        """The wait before attempt number ``attempt`` (1 first), ``rand`` in [0, 1)
        choosing the jitter (0.5: none)."""
        base = min(self.max_delay, self.initial_delay * self.factor ** min(attempt - 1, 64))
        return base * (1 + self.jitter * (2 * rand - 1))


def reconnect_policy(reconnect: bool | Reconnect | None) -> Reconnect | None:
    """The policy for ``connect``'s ``reconnect`` argument: None/False off, True the
    defaults, a :class:`Reconnect` itself.

    Raises:
        UsageError: anything else (the caller's bug).
    """
    if reconnect is None or reconnect is False:
        return None
    if reconnect is True:
        return Reconnect()
    if isinstance(reconnect, Reconnect):
        return reconnect
    raise UsageError(f"reconnect must be a bool or a Reconnect, not {type(reconnect).__name__}")


class Backoff:
    """The schedule of one outage: from the loss at ``lost_at`` until a connection is made
    again (then the driver starts a new Backoff at the next loss) or it gives up.

    Args:
        policy: the delays and the bound.
        lost_at: when the connection was lost, on the driver's clock.
        rand: the jitter's source of numbers in [0, 1).
    """

    def __init__(
        self, policy: Reconnect, lost_at: float, rand: Callable[[], float] = random.random
    ) -> None:
        self.policy = policy
        self.lost_at = lost_at
        #: Attempts scheduled so far (the driver reports the count when one succeeds).
        self.attempts = 0
        self._rand = rand

    def next_delay(self, now: float) -> float | None:
        """How long to wait before the next attempt, or None: give up (``give_up_after``
        passed since the loss). A wait never runs past the bound, so the last attempt is
        made at it."""
        bound = self.policy.give_up_after
        if bound is not None and now - self.lost_at >= bound:
            return None
        self.attempts += 1
        delay = self.policy.delay(self.attempts, self._rand())
        if bound is not None:
            delay = min(delay, self.lost_at + bound - now)
        return max(0.0, delay)

    def out_of_time(self, now: float) -> bool:
        """Whether the bound has passed (after a failed attempt: give up now)."""
        bound = self.policy.give_up_after
        return bound is not None and now - self.lost_at >= bound


#: ``ConnectionLost.code`` once a client gave up reconnecting (local: never on the wire).
GAVE_UP = "reconnect-gave-up"


def reconnecting_error(lost: ConnectionLost) -> ConnectionLost:
    """What sends and calls raise while the client reconnects after ``lost``: the loss's
    reason and code, saying that the client is reconnecting (nothing is queued)."""
    return ConnectionLost(
        f"{lost}; the client is reconnecting (nothing is queued meanwhile: "
        "wait_connected() waits for the new connection)",
        code=lost.code,
    )


def gave_up_error(
    target: str, backoff: Backoff, now: float, last: BaseException | None
) -> ConnectionLost:
    """The final ConnectionLost (code :data:`GAVE_UP`) once ``backoff`` ran out; logged
    as an ERROR."""
    msg = (
        f"gave up reconnecting to the broker at {target}: no connection within "
        f"{now - backoff.lost_at:.1f} s ({backoff.attempts} attempts, "
        f"Reconnect.give_up_after={backoff.policy.give_up_after})"
        + (f"; last attempt: {last}" if last is not None else "")
    )
    log.error("%s", msg)
    return ConnectionLost(msg, code=GAVE_UP)


def log_lost(target: str, lost: ConnectionLost) -> None:
    """The WARNING at a loss the client will reconnect after."""
    log.warning("connection to the broker at %s lost: %s; reconnecting", target, lost)


def log_reconnected(target: str, attempts: int, lname: str) -> None:
    """The INFO once a reconnect succeeded."""
    log.info(
        "reconnected to the broker at %s after %d attempt%s: this client is now %s",
        target,
        attempts,
        "" if attempts == 1 else "s",
        lname,
    )
