"""Wildcard subscriptions on every driver (the behaviour suite's drivers, from
test_behaviour.py): the trio ``Bus``, the blocking ``DirectBus`` and the asyncio
``AioBus`` subscribe to patterns, receive through them once per message, are refused a
pattern as a target by the client library itself, and get ``no-recipient`` for a call
to a group reached only through a pattern."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from driver_harness import HANG
from test_behaviour import ASYNC_DRIVERS, DRIVERS, Received, open_client, wait_thread_event

import msgq_trio
from msgq_trio import NoRecipient, UsageError


@pytest.mark.parametrize("driver", DRIVERS)
async def test_patterns_deliver_once_per_message(driver: str, broker: Any) -> None:
    """Subscribed to ``Zone.a``, ``Zone.*`` and ``Zone.>``, a client gets each message
    to a matching group once, a notification through ``Zone.*`` too, and nothing for a
    group no pattern matches (a marker sent last to its lname arrives right after)."""
    async with (
        open_client(driver, broker.path, "rx") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
    ):
        for group in ("Zone.a", "Zone.*", "Zone.>"):
            assert await rx.subscribe(group) is True
        assert await rx.subscribe("Zone.*") is False
        assert sorted(await rx.members("Zone.*")) == [(rx.lname, "rx")]
        await tx.send("Zone.a", 1)
        await tx.send("Zone.b.c", 2)
        await tx.send("Other.a", 3)
        await tx.send_many("Zone.a", [4, 5])  # one run to a group: once each too
        await tx.notify("Zone.b", "changed", {"n": 6})
        await tx.send(rx.lname, "marker")
        got = [await rx.receive(HANG) for _ in range(6)]
        assert await rx.unsubscribe("Zone.>") is True
        assert await rx.unsubscribe("Zone.>") is False
    assert [(g.kind, g.target, g.body) for g in got] == [
        ("message", "Zone.a", 1),
        ("message", "Zone.b.c", 2),
        ("message", "Zone.a", 4),
        ("message", "Zone.a", 5),
        ("notification", "Zone.b", {"n": 6}),
        ("message", rx.lname, "marker"),
    ]
    assert got[-2].event == "changed"


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_pattern_is_no_target(driver: str, broker: Any) -> None:
    """Sending or calling to a pattern (also as ``G[N]``) is the caller's error, raised
    by the client library before anything is sent: the connection goes on."""
    async with (
        open_client(driver, broker.path, "tx") as tx,
        open_client("trio", broker.path, "rx") as rx,
    ):
        for target in ("Zone.*", "Zone.>", "Zone.*[0]"):
            with pytest.raises(UsageError, match="wildcards"):
                await tx.send(target, 1)
            with pytest.raises(UsageError, match="wildcards"):
                await tx.call(target, "ping")
        await tx.send(rx.lname, "still here")
        assert (await rx.receive(HANG)).body == "still here"


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_call_never_goes_to_a_wildcard_subscriber(driver: str, broker: Any) -> None:
    """A group whose only subscriber is a pattern's has no recipient for a call, nor for
    ``G[0]`` or ``G[?]``: a wildcard subscriber observes, it does not serve."""
    async with (
        open_client(
            driver, broker.path, "watcher", {"do": lambda _p: "served"}, group="Svc.*"
        ) as watcher,
        open_client(driver, broker.path, "caller") as caller,
    ):
        for target in ("Svc.x", "Svc.x[0]", "Svc.x[?]"):
            with pytest.raises(NoRecipient):
                await caller.call(target, "do")
        # Sent to its lname, the command is served: the refusal was the routing's.
        assert await caller.call(watcher.lname, "do") == "served"


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client has no callbacks
async def test_a_notification_callback_for_a_pattern(driver: str, broker: Any) -> None:
    """``on_notification("Zone.*", cb)`` runs ``cb`` for a notification to ``Zone.a``
    that came through the subscription ``Zone.*``."""
    seen: list[Received] = []
    done = threading.Event()
    async with (
        open_client(driver, broker.path, "rx", group="Zone.*") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
    ):
        await rx.on_notification("Zone.*", seen, done)
        await tx.notify("Zone.a", "changed", 1)
        await wait_thread_event(done)
    assert [(r.kind, r.target, r.event, r.body) for r in seen] == [
        ("notification", "Zone.a", "changed", 1)
    ]
