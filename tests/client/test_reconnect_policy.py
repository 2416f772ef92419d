"""The reconnect policy and its backoff schedule (client/reconnect.py): pure code, time
and randomness passed in, so the schedule is checked without sockets or clocks."""

from __future__ import annotations

import pytest

from msgq_trio import Reconnect, UsageError
from msgq_trio.client.reconnect import Backoff, reconnect_policy


def schedule(policy: Reconnect, times: list[float], rand: float = 0.5) -> list[float | None]:
    """The delays a Backoff (lost at 0) gives when asked at each of ``times``."""
    backoff = Backoff(policy, 0.0, rand=lambda: rand)
    return [backoff.next_delay(t) for t in times]


def test_the_delays_grow_by_the_factor_up_to_the_maximum() -> None:
    """Without jitter (rand 0.5) the n-th wait is initial * factor ** (n - 1), capped."""
    policy = Reconnect(initial_delay=0.1, factor=2.0, max_delay=1.0, give_up_after=None)
    assert schedule(policy, [0.0] * 6) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_jitter_spreads_each_delay_by_its_fraction() -> None:
    """rand 0 and rand 1 are the two ends of the spread: -jitter and +jitter of the
    delay."""
    policy = Reconnect(initial_delay=1.0, factor=1.0, max_delay=1.0, jitter=0.25)
    assert schedule(policy, [0.0], rand=0.0) == pytest.approx([0.75])
    assert schedule(policy, [0.0], rand=0.999999) == pytest.approx([1.25], rel=1e-5)


def test_it_gives_up_once_the_bound_passed_and_never_waits_past_it() -> None:
    """With give_up_after 1 s: a wait that would run past the bound is cut to end at it
    (the last attempt is made then); asked at or after the bound, it gives up (None)."""
    policy = Reconnect(initial_delay=0.4, factor=2.0, max_delay=10.0, give_up_after=1.0)
    backoff = Backoff(policy, 0.0, rand=lambda: 0.5)
    assert backoff.next_delay(0.0) == pytest.approx(0.4)
    assert backoff.next_delay(0.4) == pytest.approx(0.6)  # 0.8 cut to the bound
    assert backoff.next_delay(1.0) is None
    assert backoff.out_of_time(1.0) and not backoff.out_of_time(0.99)
    assert backoff.attempts == 2


def test_never_gives_up_without_a_bound() -> None:
    policy = Reconnect(give_up_after=None)
    backoff = Backoff(policy, 0.0, rand=lambda: 0.5)
    assert backoff.next_delay(1e9) == pytest.approx(policy.delay(1, 0.5))


def test_the_defaults_and_the_connect_argument() -> None:
    """``reconnect=True`` is the documented defaults; False/None is off; anything else,
    or a policy that makes no sense, is the caller's error."""
    policy = reconnect_policy(True)
    assert policy == Reconnect(
        initial_delay=0.1, factor=2.0, max_delay=2.0, jitter=0.1, give_up_after=120.0
    )
    assert reconnect_policy(False) is None and reconnect_policy(None) is None
    custom = Reconnect(give_up_after=5.0)
    assert reconnect_policy(custom) is custom
    with pytest.raises(UsageError):
        reconnect_policy(3)  # type: ignore[arg-type]
    for bad in (
        {"initial_delay": 0},
        {"factor": 0.5},
        {"max_delay": -1},
        {"jitter": 1.0},
        {"give_up_after": 0},
    ):
        with pytest.raises(UsageError):
            Reconnect(**bad)  # type: ignore[arg-type]
