"""End to end: addressing and delivery through a real broker process (groups, lnames, G[N],
G[?], sender stamping, per-pair ordering, members(), attachments, notifications)."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from contextlib import AsyncExitStack

import pytest
import trio

import msgq_trio
from msgq_trio import Bus, NoRecipient
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor


async def assert_next_is_marker(bus: Bus, marker: str) -> None:
    """The next message on ``bus`` is ``marker``: proves nothing else was queued before it
    (the marker is sent after the message under test, over the same ordered path)."""
    msg = await bus.receive(timeout=5)
    assert msg.body == marker, f"unexpected message before the marker: {msg!r} {msg.body!r}"


async def test_group_message_reaches_all_members_but_sender(broker) -> None:
    """A message to a group reaches every member except the sender, with body, header,
    sender lname and name; a non-member's message reaches all members."""
    async with (
        msgq_trio.connect(broker.path, name="A") as a,
        msgq_trio.connect(broker.path, name="B") as b,
        msgq_trio.connect(broker.path, name="C") as c,
        msgq_trio.connect(broker.path, name="Outsider") as out,
    ):
        for bus in (a, b, c):
            await bus.subscribe("Zone")
        await a.send("Zone", {"zone": "example.org"}, header={"prio": 1})
        for bus in (b, c):
            msg = await bus.receive(timeout=5)
            assert (msg.kind, msg.target, msg.body, msg.header) == (
                "message",
                "Zone",
                {"zone": "example.org"},
                {"prio": 1},
            )
            assert (msg.sender, msg.sender_name) == (a.lname, "A")
        await a.send(a.lname, "marker")
        await assert_next_is_marker(a, "marker")
        await out.send("Zone", "from outside")
        for bus in (a, b, c):
            msg = await bus.receive(timeout=5)
            assert (msg.body, msg.sender) == ("from outside", out.lname)


async def test_direct_message_to_lname(broker) -> None:
    """A message to an lname reaches only that connection."""
    async with (
        msgq_trio.connect(broker.path, name="A") as a,
        msgq_trio.connect(broker.path, name="B") as b,
        msgq_trio.connect(broker.path, name="C") as c,
    ):
        await b.subscribe("G")
        await c.subscribe("G")
        await a.send(b.lname, "just for b")
        msg = await b.receive(timeout=5)
        assert (msg.body, msg.target, msg.sender) == ("just for b", b.lname, a.lname)
        await a.send(c.lname, "marker")
        await assert_next_is_marker(c, "marker")


async def test_instances_by_join_order(broker) -> None:
    """G[N] reaches the N-th member by join order; G[0] becomes the next member when the
    first leaves (by unsubscribing, then by disconnecting); past the end is nobody."""
    async with AsyncExitStack() as stack, msgq_trio.connect(broker.path, name="sender") as s:
        ws = []
        for i in range(4):
            w = await stack.enter_async_context(msgq_trio.connect(broker.path, name=f"w{i}"))
            await w.subscribe("W")
            ws.append(w)
        for i in range(4):
            await s.send(f"W[{i}]", i)
        for i, w in enumerate(ws):
            msg = await w.receive(timeout=5)
            assert (msg.body, msg.target) == (i, f"W[{i}]")
        with pytest.raises(NoRecipient):
            await s.call("W[4]", "anything")
        await ws[0].unsubscribe("W")
        await s.send("W[0]", "now w1")
        assert (await ws[1].receive(timeout=5)).body == "now w1"
        async with msgq_trio.connect(broker.path, name="w4") as late:
            await late.subscribe("W")
            await s.send("W[3]", "late is last")
            assert (await late.receive(timeout=5)).body == "late is last"
        # After w4 disconnected, W[3] is past the end again.
        with pytest.raises(NoRecipient):
            await s.call("W[3]", "anything")
        assert [m.name for m in await s.members("W")] == ["w1", "w2", "w3"]
        await stack.aclose()
        assert await s.members("W") == []


async def test_instance_zero_after_first_member_disconnects(broker) -> None:
    """When the first member of a group disconnects, G[0] is the member that joined second."""
    async with (
        msgq_trio.connect(broker.path, name="sender") as s,
        msgq_trio.connect(broker.path, name="second") as second,
    ):
        async with msgq_trio.connect(broker.path, name="first") as first:
            await first.subscribe("Svc")
            await second.subscribe("Svc")
            await s.send("Svc[0]", "to first")
            assert (await first.receive(timeout=5)).body == "to first"
        await s.send("Svc[0]", "to second")
        msg = await second.receive(timeout=5)
        assert (msg.body, msg.target) == ("to second", "Svc[0]")
        assert [m.name for m in await s.members("Svc")] == ["second"]


async def test_anycast_spreads_roughly_uniformly(broker) -> None:
    """600 messages to G[?] with 3 members: each member gets between 120 and 280 and none
    is lost or duplicated."""
    async with AsyncExitStack() as stack:
        s = await stack.enter_async_context(msgq_trio.connect(broker.path, name="s"))
        ms = [
            await stack.enter_async_context(msgq_trio.connect(broker.path, name=f"m{i}"))
            for i in range(3)
        ]
        for m in ms:
            await m.subscribe("Any")
        for i in range(600):
            await s.send("Any[?]", i)
        for m in ms:
            await s.send(m.lname, "done")
        got: dict[str, list[int]] = {}
        with trio.fail_after(20):
            for m in ms:
                bodies = []
                while (msg := await m.receive()).body != "done":
                    assert msg.target == "Any[?]"
                    bodies.append(msg.body)
                got[m.lname] = bodies
        counts = Counter({k: len(v) for k, v in got.items()})
        assert sorted(b for v in got.values() for b in v) == list(range(600))
        assert all(120 <= n <= 280 for n in counts.values()), counts


async def test_sender_stamping_defeats_forged_source(broker, raw_peer) -> None:
    """A raw client that writes a forged source section (claiming to be l.1 'admin' or the
    broker) is seen by receivers with its true lname and name, for messages and requests."""
    async with msgq_trio.connect(broker.path, name="victim") as victim:
        await victim.subscribe("Victims")

        @victim.command("whoami")
        def whoami(_params: object, request: msgq_trio.Message) -> list[str]:
            return [request.sender, request.sender_name]

        async with raw_peer(broker.path) as raw:
            welcome = await raw.hello("forger")
            assert welcome.type == FrameType.WELCOME
            await raw.send_frame(
                FrameType.MESSAGE,
                target="Victims",
                body=encode_cbor("trust me"),
                source=b"l.1\0admin",
            )
            msg = await victim.receive(timeout=5)
            assert msg.body == "trust me"
            assert (msg.sender, msg.sender_name) == (raw.lname, "forger")
            await raw.send_frame(
                FrameType.REQUEST,
                target="Victims",
                request_id=7,
                header=encode_cbor({"cmd": "whoami"}),
                source=b"l.0\0msgq",
            )
            reply = await raw.receive_frame()
            assert reply is not None
            assert (reply.type, reply.request_id) == (FrameType.REPLY, 7)
            assert reply.body() == [raw.lname, "forger"]
            assert reply.source == f"{victim.lname}\0victim".encode()


async def test_per_pair_ordering_many_senders(broker) -> None:
    """8 sender connections each send 2,000 numbered messages to one receiver concurrently:
    every sender's sequence arrives complete and strictly in order."""
    n_senders, n_msgs = 8, 2000
    async with AsyncExitStack() as stack:
        rx = await stack.enter_async_context(msgq_trio.connect(broker.path, name="rx"))
        senders = [
            await stack.enter_async_context(msgq_trio.connect(broker.path, name=f"tx{i}"))
            for i in range(n_senders)
        ]

        async def pump(i: int, bus: Bus) -> None:
            for seq in range(n_msgs):
                await bus.send(rx.lname, [i, seq])
            await bus.flush()

        expected = dict.fromkeys(range(n_senders), 0)
        by_lname = {s.lname: i for i, s in enumerate(senders)}
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i, s in enumerate(senders):
                    nursery.start_soon(pump, i, s)
                for _ in range(n_senders * n_msgs):
                    msg = await rx.receive()
                    i, seq = msg.body
                    assert by_lname[msg.sender] == i
                    assert seq == expected[i], f"sender {i}: got {seq}, expected {expected[i]}"
                    expected[i] += 1
        assert expected == dict.fromkeys(range(n_senders), n_msgs)


async def test_members_in_join_order_with_names(broker) -> None:
    """members() lists lname, name and pid in join order; a member that leaves drops out
    and the others keep their order."""
    async with (
        msgq_trio.connect(broker.path, name="first") as first,
        msgq_trio.connect(broker.path, name="third") as third,
        msgq_trio.connect(broker.path, name="asker") as asker,
    ):
        await first.subscribe("Team")
        async with msgq_trio.connect(broker.path, name="second") as second:
            await second.subscribe("Team")
            await third.subscribe("Team")
            members = await asker.members("Team")
            assert [(m.lname, m.name) for m in members] == [
                (first.lname, "first"),
                (second.lname, "second"),
                (third.lname, "third"),
            ]
            assert {m.pid for m in members} == {os.getpid()}
        assert [m.name for m in await asker.members("Team")] == ["first", "third"]
        assert await asker.members("NoSuchGroup") == []


async def test_subscribe_idempotent_and_reserved_names(broker) -> None:
    """subscribe() is True then False; reserved names are refused with bad-request."""
    async with msgq_trio.connect(broker.path) as bus:
        assert await bus.subscribe("G") is True
        assert await bus.subscribe("G") is False
        assert await bus.unsubscribe("G") is True
        assert await bus.unsubscribe("G") is False
        for bad in ("l.3", "msgq", "G[1]", ""):
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await bus.subscribe(bad)
            assert ei.value.code == "bad-request"


async def test_attachments_round_trip_including_16_mib(broker) -> None:
    """Binary attachments (empty, small, 16 MiB) arrive byte for byte with the body, both
    in a message and in a request."""
    big = hashlib.shake_256(b"seed").digest(16 * 1024 * 1024)
    async with (
        msgq_trio.connect(broker.path, name="tx") as tx,
        msgq_trio.connect(broker.path, name="rx") as rx,
    ):
        await rx.subscribe("Blobs")

        @rx.command("digest")
        def digest(params: object, request: msgq_trio.Message) -> list[object]:
            return [params, [hashlib.sha256(bytes(a)).hexdigest() for a in request.attachments]]

        with trio.fail_after(30):
            await tx.send("Blobs", {"n": 3}, attachments=[b"", b"\x00small\xff", big])
            msg = await rx.receive()
            assert msg.body == {"n": 3}
            atts = [bytes(a) for a in msg.attachments]
            assert atts[:2] == [b"", b"\x00small\xff"]
            assert len(atts[2]) == len(big)
            assert atts[2] == big
            result = await tx.call("Blobs", "digest", "p", attachments=[big, b"x"])
        assert result == ["p", [hashlib.sha256(big).hexdigest(), hashlib.sha256(b"x").hexdigest()]]


async def test_notifications(broker) -> None:
    """notify() arrives as kind 'notification' with .event and params at every subscriber
    but the publisher; on_notification callbacks get them instead of iteration."""
    async with (
        msgq_trio.connect(broker.path, name="pub") as pub,
        msgq_trio.connect(broker.path, name="iter") as it,
        msgq_trio.connect(broker.path, name="cb") as cb,
    ):
        got: list[tuple[str, str | None, object, str]] = []
        arrived = trio.Event()

        def on_event(msg: msgq_trio.Message) -> None:
            got.append((msg.kind, msg.event, msg.body, msg.sender))
            arrived.set()

        cb.on_notification("Events", on_event)
        for bus in (pub, it, cb):
            await bus.subscribe("Events")
        await pub.notify("Events", "zone-added", {"zone": "example.org"})
        msg = await it.receive(timeout=5)
        assert (msg.kind, msg.event, msg.body, msg.sender, msg.target) == (
            "notification",
            "zone-added",
            {"zone": "example.org"},
            pub.lname,
            "Events",
        )
        with trio.fail_after(5):
            await arrived.wait()
        assert got == [("notification", "zone-added", {"zone": "example.org"}, pub.lname)]
        await cb.send(cb.lname, "marker")
        await assert_next_is_marker(cb, "marker")
        await pub.send(pub.lname, "marker")
        await assert_next_is_marker(pub, "marker")
