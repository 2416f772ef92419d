"""The client connection's state table (client/lifecycle.py): the one reconnect
supervisor of every driver, checked without sockets or clocks (time is an argument,
the jitter's randomness injected)."""

from __future__ import annotations

import pytest

from msgq_trio import ConnectError, ConnectionLost, Reconnect
from msgq_trio.client.lifecycle import CONNECT_TIMEOUT, Lifecycle, State
from msgq_trio.client.reconnect import GAVE_UP

POLICY = Reconnect(initial_delay=1.0, factor=2.0, max_delay=4.0, jitter=0.0, give_up_after=10.0)


def ready(policy: Reconnect | None = POLICY) -> Lifecycle:
    life = Lifecycle(policy, "/tmp/broker.sock", rand=lambda: 0.5)
    life.dialing(0.0)
    assert life.welcomed() is State.READY
    return life


def test_the_first_connection_failing_is_final() -> None:
    """connect() raises the first connection's error: no reconnect follows."""
    life = Lifecycle(POLICY, "x")
    life.dialing(0.0)
    assert life.wait(0.0) is None  # no reconnect schedule for the first connection
    assert life.attempt_deadline == pytest.approx(CONNECT_TIMEOUT)  # connect()'s bound
    life.attempt_failed(ConnectError("refused"), 0.0)
    assert life.state is State.ERROR and life.final and life.wait(0.0) is None


def test_a_loss_without_a_policy_is_final() -> None:
    """Reconnect off: the loss itself is what every later call raises."""
    life = ready(None)
    lost = ConnectionLost("gone", code="dropped")
    assert life.lost(lost, 5.0) is lost
    assert life.state is State.ERROR and life.wait(5.0) is None


def test_a_loss_schedules_attempts_until_one_is_restored() -> None:
    """The first attempt waits the first delay; a failed one the next; WELCOME on a
    reconnect is RESTORING (not yet connected) until the restore completes."""
    life = ready()
    err = life.lost(ConnectionLost("gone", code="dropped"), 100.0)
    assert err.code == "dropped" and "reconnecting" in str(err)
    assert life.state is State.RECONNECTING and not life.connected
    assert life.due == pytest.approx(101.0)
    assert life.wait(100.5) == pytest.approx(0.5)
    assert life.wait(101.5) == 0.0  # due: dial now
    life.dialing(101.0)
    assert life.wait(101.0) is None  # the attempt under way: nothing to schedule
    assert life.attempt_deadline == pytest.approx(101.0 + POLICY.attempt_timeout)
    assert life.attempt_failed(ConnectError("refused"), 101.0) is None
    assert life.wait(101.0) == pytest.approx(2.0)  # the second delay: 2 s
    life.dialing(103.0)
    assert life.welcomed() is State.RESTORING and life.reconnecting and not life.connected
    life.restored("l.9")
    assert life.connected and life.reconnects == 1 and life.backoff is None


def test_a_loss_while_restoring_continues_the_same_outage() -> None:
    """give_up_after counts from the first loss: a broker that accepts and drops the
    client again and again makes the policy give up, with the final error."""
    life = ready()
    life.lost(ConnectionLost("gone"), 0.0)
    for t in (1.0, 3.0, 7.0):
        assert life.state is State.RECONNECTING
        life.dialing(t)
        assert life.welcomed() is State.RESTORING
        life.lost(ConnectionLost("dropped again"), t)
    life.dialing(life.due or 0.0)
    gave_up = life.attempt_failed(ConnectError("refused"), 10.0)
    assert gave_up is not None and gave_up.code == GAVE_UP
    assert life.state is State.ERROR and life.final and life.reconnects == 0


def test_closing_drains_then_closes_and_cancels_a_reconnect() -> None:
    """close() while connected waits for the broker's GOODBYE (DRAINING); while
    reconnecting it ends the outage at once: no attempt is due any more."""
    life = ready()
    life.close()
    assert life.state is State.DRAINING
    lost = ConnectionLost("the bus was closed")
    assert life.lost(lost, 1.0) is lost and life.state is State.CLOSED
    life = ready()
    life.lost(ConnectionLost("gone"), 0.0)
    life.close()
    assert life.state is State.CLOSED and life.wait(0.0) is None and life.due is None
    assert life.attempt_failed(ConnectError("late"), 5.0) is None and life.state is State.CLOSED
