"""Transparent insertion, row by row (docs/QUEUE.md, "Transparent insertion"): what a
group promises without a queue still holds with a queue bound to it, or is refused loudly.

Every end-to-end test runs twice against real broker and plugin processes: ``bound=False``
(the queue ``sql`` exists but binds nothing) and ``bound=True`` (``sql`` binds ``SQL``),
with the same two members ``m0`` and ``m1`` of ``SQL`` (joined in that order, so ``SQL[0]``
is m0) and the same producer, and asserts the same observable result, or the documented
refusal. Absence is never proven by waiting: a later marker message must be the first
thing a member receives.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import cbor2
import pytest
import trio
from msgq_trio.plugins.queue.model import KIND_BODY
from msgq_trio.plugins.queue.service import Stored, decode_bound, encode_bound, encode_bound_raw
from plugin_helpers import eventually, ready_plugin_pid, ready_plugin_pids

import msgq_trio
from msgq_trio.errors import ConnectionLost, MalformedMessage, RemoteError, RpcError
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_frame

Start = Callable[..., Any]

#: Larger than any socket buffer: attachments that cross several reads and writes.
BIG = bytes(range(256)) * 1024


@dataclass
class Member:
    """One member of ``SQL``: records every ``x`` request it handles and answers with its
    name, what it got, and writes its name into each descriptor that came along."""

    name: str
    bus: msgq_trio.Bus
    requests: list[tuple[Any, list[bytes]]] = field(default_factory=list)
    #: (sender, sender_name, via_name) of each request, as the member saw them
    senders: list[tuple[str, str, str | None]] = field(default_factory=list)

    def handle(self, params: Any, request: msgq_trio.Message) -> dict[str, Any]:
        self.requests.append((params, [bytes(a) for a in request.attachments]))
        self.senders.append((request.sender, request.sender_name, request.via_name))
        for fd in request.fds:
            os.write(fd, self.name.encode())
        return {"by": self.name, "params": params, "attachments": len(request.attachments)}


@dataclass
class Setup:
    bound: bool
    m0: Member
    m1: Member
    producer: msgq_trio.Bus
    broker: Any  # the BrokerProcess: .path, .log()

    @property
    def members(self) -> list[Member]:
        return [self.m0, self.m1]


@contextlib.asynccontextmanager
async def sql_group(queue_broker: Start, bound: bool, **options: Any) -> AsyncIterator[Setup]:
    """A broker running the queue plugin with queue ``sql`` (bound to ``SQL`` or not,
    with queue ``options``), members m0 then m1 of ``SQL`` serving ``x``, and a
    producer."""
    b = queue_broker({"sql": {"bind": "SQL", **options} if bound else {}})
    async with (
        msgq_trio.connect(b.path, "m0") as b0,
        msgq_trio.connect(b.path, "m1") as b1,
        msgq_trio.connect(b.path, "producer") as producer,
    ):
        m0, m1 = Member("m0", b0), Member("m1", b1)
        for m in (m0, m1):
            m.bus.add_command("x", m.handle)
            await m.bus.subscribe("SQL")  # in turn: join order makes m0 SQL[0]
        yield Setup(bound, m0, m1, producer, b)


def pipe() -> tuple[int, int]:
    """A pipe whose read end does not block: reading it shows whether some copy of the
    write end is still open somewhere (BlockingIOError) or all are closed (EOF)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w


async def drain(r: int) -> bytes:
    """Everything written to the pipe, once every copy of its write end is closed. The
    broker closes a duplicate just after it wrote it (the receiver may see it first), so
    this waits for EOF; a copy leaked anywhere fails it."""
    out = b""

    def eof() -> bool:
        nonlocal out
        try:
            while chunk := os.read(r, 65536):
                out += chunk
        except BlockingIOError:
            return False
        return True

    await eventually(eof)
    return out


BOUND = pytest.mark.parametrize("bound", [False, True], ids=["direct", "bound"])


@BOUND
async def test_notify_reaches_every_member_unqueued(queue_broker: Start, bound: bool) -> None:
    """``notify("SQL")`` is a broadcast to the subscribers of now, with or without a queue:
    each member's first arrival is the notification, before a later message."""
    async with sql_group(queue_broker, bound) as s:
        await s.producer.notify("SQL", "changed", {"n": 1})
        await s.producer.send("SQL", "marker")
        for m in s.members:
            first = await m.bus.receive(timeout=10)
            assert (first.kind, first.event, first.body) == ("notification", "changed", {"n": 1})
            assert first.sender_name == "producer"
            assert (await m.bus.receive(timeout=10)).body == "marker"


@BOUND
async def test_instance_addressing_reaches_that_instance(queue_broker: Start, bound: bool) -> None:
    """``SQL[N]`` is the N-th member by join order, straight from the producer: a message
    reaches that member only (the other's first arrival is a later marker) and a call is
    answered by it."""
    async with sql_group(queue_broker, bound) as s:
        await s.producer.send("SQL[1]", "for-1")
        await s.producer.send("SQL", "marker")
        first = await s.m1.bus.receive(timeout=10)
        assert (first.body, first.target, first.sender_name) == ("for-1", "SQL[1]", "producer")
        assert (await s.m1.bus.receive(timeout=10)).body == "marker"
        assert (await s.m0.bus.receive(timeout=10)).body == "marker"

        assert (await s.producer.call("SQL[1]", "x", {"n": 1}))["by"] == "m1"
        assert (await s.producer.call("SQL[0]", "x", {"n": 0}))["by"] == "m0"
        assert s.m0.requests == [({"n": 0}, [])]
        assert s.m1.requests == [({"n": 1}, [])]


@BOUND
async def test_anycast_message_reaches_one_member(queue_broker: Start, bound: bool) -> None:
    """``send("SQL[?]")`` reaches exactly one member (queued, with a queue, as the group's
    traffic is): one member's first arrival is it, the other's a later marker."""
    async with sql_group(queue_broker, bound) as s:
        await s.producer.send("SQL[?]", "anyone")
        await s.producer.send("SQL", "marker")
        firsts = [(await m.bus.receive(timeout=10)).body for m in s.members]
        assert sorted(firsts) == ["anyone", "marker"]
        [got_it] = [m for m, body in zip(s.members, firsts, strict=True) if body == "anyone"]
        assert (await got_it.bus.receive(timeout=10)).body == "marker"


@BOUND
async def test_members_see_a_producers_messages_in_order(queue_broker: Start, bound: bool) -> None:
    """Every member gets a producer's one-way messages to the group in the order sent
    (the queue hands them to its members in batches per member, and must not let those
    batches reorder them)."""
    n = 300
    async with sql_group(queue_broker, bound) as s:
        for i in range(n):
            await s.producer.send("SQL", i)
        for m in s.members:
            assert [(await m.bus.receive(timeout=10)).body for _ in range(n)] == list(range(n))


@BOUND
async def test_call_all_answers_once_per_member(queue_broker: Start, bound: bool) -> None:
    """``call_all("SQL")`` reaches every member directly and returns one result each, in
    join order; the queue does not answer it."""
    async with sql_group(queue_broker, bound) as s:
        results = await s.producer.call_all("SQL", "x", {"n": 7})
        assert [(r.ok, r.sender, r.value["by"]) for r in results] == [
            (True, s.m0.bus.lname, "m0"),
            (True, s.m1.bus.lname, "m1"),
        ]
        assert s.m0.requests == s.m1.requests == [({"n": 7}, [])]


@BOUND
async def test_attachments_reach_the_members(queue_broker: Start, bound: bool) -> None:
    """Attachments of a one-way message reach every member, those of a request the member
    that handles it, byte for byte (a large one included)."""
    async with sql_group(queue_broker, bound) as s:
        await s.producer.send("SQL", {"n": 1}, [b"small", BIG])
        for m in s.members:
            msg = await m.bus.receive(timeout=10)
            assert msg.body == {"n": 1}
            assert [bytes(a) for a in msg.attachments] == [b"small", BIG]

        answer = await s.producer.call("SQL[?]", "x", {"n": 2}, attachments=[BIG, b"", b"z"])
        await eventually(lambda: len(s.m0.requests) + len(s.m1.requests) >= 1)
        [(params, attachments)] = s.m0.requests + s.m1.requests
        assert (params, attachments) == ({"n": 2}, [BIG, b"", b"z"])
        # The member's own answer (with members online, never the queue's ack).
        assert answer in (
            {"by": "m0", "params": {"n": 2}, "attachments": 3},
            {"by": "m1", "params": {"n": 2}, "attachments": 3},
        )


async def test_attachments_stored_while_no_member_is_there(queue_broker: Start) -> None:
    """With the queue, what comes while the group is empty is stored with its attachments
    and reaches the first member to join, attachments included (without a queue it would
    be no-recipient: that is what the queue is for)."""
    b = queue_broker({"sql": {"bind": "SQL"}})
    async with msgq_trio.connect(b.path, "producer") as producer:
        assert await producer.call("SQL", "x", {"n": 1}, attachments=[b"r1", BIG]) == {
            "queued": "sql"
        }
        await producer.send("SQL[?]", {"n": 2}, [BIG, b"m2"])
        await producer.send("SQL", {"n": 3}, [b"m3"])
        async with msgq_trio.connect(b.path, "m0") as bus:
            m0 = Member("m0", bus)
            bus.add_command("x", m0.handle)
            await bus.subscribe("SQL")
            for n, attachments in ((2, [BIG, b"m2"]), (3, [b"m3"])):
                msg = await bus.receive(timeout=10)
                assert msg.body == {"n": n}
                assert [bytes(a) for a in msg.attachments] == attachments
            await eventually(lambda: len(m0.requests) >= 1)
            assert m0.requests == [({"n": 1}, [b"r1", BIG])]


@BOUND
async def test_request_with_fds(queue_broker: Start, bound: bool) -> None:
    """A request carrying a descriptor: without a queue the member gets it; to a bound
    group it is refused with ``bad-request`` naming the binding (a descriptor cannot be
    stored), nobody gets it, and every copy but the producer's own is closed."""
    async with sql_group(queue_broker, bound) as s:
        r, w = pipe()
        try:
            if bound:
                with pytest.raises(RemoteError) as info:
                    await s.producer.call("SQL[?]", "x", {"n": 1}, fds=[w])
                err = info.value
                assert err.code == "bad-request"
                assert "'SQL[?]' is bound to" in str(err) and "msgq-queue-binder" in str(err)
                assert "file descriptors cannot be stored" in str(err)
                expected, handled = b"", []
            else:
                answer = await s.producer.call("SQL[?]", "x", {"n": 1}, fds=[w])
                assert answer["by"] in ("m0", "m1")
                expected, handled = answer["by"].encode(), [{"n": 1}]
            os.close(w)
            w = -1
            assert await drain(r) == expected  # every copy is closed: nothing leaked
            # Nothing is left on its way: a later call to each is handled after it.
            assert [(await s.producer.call(f"SQL[{i}]", "x", "later"))["by"] for i in (0, 1)] == [
                "m0",
                "m1",
            ]
            assert [p for m in s.members for p, _ in m.requests if p != "later"] == handled
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)


@BOUND
async def test_message_with_fds(queue_broker: Start, bound: bool) -> None:
    """A one-way message carrying a descriptor: without a queue every member gets it;
    to a bound group the broker refuses it as it refuses any one-way message it cannot
    take: the sender is dropped with ERROR ``forbidden`` naming the binding. Nobody
    gets it (a later marker is each member's first arrival) and its copies are closed."""
    async with sql_group(queue_broker, bound) as s:
        r, w = pipe()
        try:
            await s.producer.send("SQL", "with-fd", fds=[w])
            if bound:
                with pytest.raises(ConnectionLost) as info:
                    await s.producer.receive(timeout=10)
                assert info.value.code == "forbidden"
                assert "'SQL' is bound to" in str(info.value)
                assert "file descriptors cannot be stored" in str(info.value)
            else:
                for m in s.members:
                    with await m.bus.receive(timeout=10) as msg:
                        assert msg.body == "with-fd" and len(msg.fds) == 1
            os.close(w)
            w = -1
            assert await drain(r) == b""  # every copy is closed: nothing leaked
            async with msgq_trio.connect(s.broker.path, "producer2") as p2:
                await p2.send("SQL", "marker")
                for m in s.members:
                    assert (await m.bus.receive(timeout=10)).body == "marker"
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)


@BOUND
async def test_malformed_body(queue_broker: Start, bound: bool) -> None:
    """A one-way message whose body is not CBOR (the sender's bug; the broker does not
    decode bodies): without a queue the members' ``body`` raises MalformedMessage naming
    the sender; the queue cannot store what it cannot decode, so it drops it with a
    WARNING naming the sender, and keeps serving (it used to crash the plugin)."""
    async with sql_group(queue_broker, bound) as s:
        p = s.producer
        p._queue(
            encode_frame(FrameType.MESSAGE, target="SQL", body=b"\x9f", source=p.session.stamp)
        )
        await p.send("SQL", "after")
        for m in s.members:
            first = await m.bus.receive(timeout=10)
            if not bound:
                with pytest.raises(MalformedMessage, match="producer"):
                    _ = first.body
                first = await m.bus.receive(timeout=10)
            assert first.body == "after"
        if bound:
            await eventually(
                lambda: f"dropping a message from {p.lname} (producer) to 'SQL'" in s.broker.log()
            )


@BOUND
async def test_members_see_the_producer_as_the_sender(queue_broker: Start, bound: bool) -> None:
    """Members see the producer (its lname and name) as the sender of its messages and
    requests, with or without the queue; with it, ``via`` names the queue's binder, and
    a member's answer to ``sender`` reaches the producer directly."""
    async with sql_group(queue_broker, bound) as s:
        p = s.producer
        await p.send("SQL", "hello")
        for m in s.members:
            msg = await m.bus.receive(timeout=10)
            assert (msg.body, msg.sender, msg.sender_name) == ("hello", p.lname, "producer")
            if bound:
                assert msg.via_name == "msgq-queue-binder"
                assert msg.via is not None and msg.via.startswith("l.")
                assert msg.via not in (p.lname, s.m0.bus.lname, s.m1.bus.lname)
            else:
                assert (msg.via, msg.via_name) == (None, None)
            await m.bus.send(msg.sender, f"reply from {m.name}")
        assert sorted([(await p.receive(timeout=10)).body for _ in s.members]) == [
            "reply from m0",
            "reply from m1",
        ]
        answer = await p.call("SQL[?]", "x", {"n": 1})
        [seen] = s.m0.senders + s.m1.senders
        assert seen == (p.lname, "producer", "msgq-queue-binder" if bound else None)
        assert answer["by"] in ("m0", "m1")


@BOUND
async def test_an_answer_after_the_commit_reaches_the_caller(
    queue_broker: Start, bound: bool
) -> None:
    """A member that answers only after the queue made the request durable (it held it
    past ``ack_grace``) still answers the caller, as without a queue: the queue waits
    for that answer while the caller waits. (Before, the caller got ``{"queued"}`` and
    the member's answer was lost.)"""
    async with sql_group(queue_broker, bound) as s:
        release = trio.Event()
        arrived = trio.Event()

        async def slow(params: Any) -> str:
            arrived.set()
            await release.wait()
            return f"done {params}"

        s.m0.bus.add_command("slow", slow)
        async with trio.open_nursery() as n:
            result: list[Any] = []

            async def call() -> None:
                # Bound: m1 has no "slow" and answers unknown-command, a nack: the queue
                # redelivers until m0 has it.
                result.append(await s.producer.call("SQL[?]" if bound else "SQL[0]", "slow", 1))

            n.start_soon(call)
            await arrived.wait()
            if bound:
                q = s.producer.queue("sql")
                await eventually(lambda: _stored(q))
            release.set()
        assert result == ["done 1"]


async def _stored(q: Any) -> bool:
    return bool((await q.stats())["stored"] >= 1)


@BOUND
async def test_order_between_a_producers_messages_and_requests(
    queue_broker: Start, bound: bool
) -> None:
    """A member gets a producer's one-way messages and requests in the order sent:
    each request finds exactly the messages sent before it already received (before,
    with a queue, requests went out as soon as dispatched and overtook messages)."""
    b = queue_broker({"sql": {"bind": "SQL"} if bound else {}})
    async with (
        msgq_trio.connect(b.path, "m0") as member,
        msgq_trio.connect(b.path, "producer") as producer,
    ):
        seen: list[tuple[int, int]] = []

        def handle(params: Any) -> None:
            # Handlers run in the reader as frames arrive; messages wait in its inbox.
            seen.append((params, len(member._in)))

        member.add_command("x", handle)
        await member.subscribe("SQL")
        waits = []
        for i in range(40):
            if i % 2:
                waits.append(producer.start_call("SQL", "x", i))
            else:
                await producer.send("SQL", i)
        answers = [await w() for w in waits]
        # A request still behind the member's window (16) when the queue made it durable
        # (after ack_grace: a loaded machine) is answered {"queued"} and reaches the
        # member later, still in queue order (docs/QUEUE.md); the others the member
        # answered itself (its handler returns None).
        assert all(a is None or a == {"queued": "sql"} for a in answers), answers
        if not bound:
            assert answers == [None] * 20
        await eventually(lambda: len(seen) == 20)
        assert seen == [(i, (i + 1) // 2) for i in range(1, 40, 2)]
        assert [(await member.receive(timeout=10)).body for _ in range(20)] == list(range(0, 40, 2))


@BOUND
async def test_queue_send_is_acked_and_deduplicated_across_plugin_restarts(
    queue_broker: Start, bound: bool
) -> None:
    """``bus.queue(q).send(body)`` is the producer ack for a one-way message: it returns
    once the message is durable, and a resend with the same producer and seq after the
    plugin was SIGKILLed and restarted is answered ``duplicate``: the first member to
    join gets each message once, with its attachments, from the producer via the
    queue. Without a binding it is refused loudly (a plain ``send`` has no ack)."""
    b = queue_broker({"sql": {"bind": "SQL"} if bound else {}})
    async with msgq_trio.connect(b.path, "producer") as p:
        q = p.queue("sql", producer="radius-1")
        if not bound:
            with pytest.raises(RemoteError, match="not bound to a group") as info:
                await q.send("x")
            assert info.value.code == "bad-request"
            return
        assert await q.send({"n": 1}, [b"att"], seq=1) == "stored"
        assert await q.send({"n": 2}, seq=2) == "stored"
        os.kill(ready_plugin_pid(b), signal.SIGKILL)
        await eventually(lambda: len(ready_plugin_pids(b.log())) == 2)
        q2 = p.queue("sql", producer="radius-1")  # a producer that restarted too
        for seq in (1, 2):
            assert await resend(q2, {"n": seq}, seq) == "duplicate"
        assert await q2.send({"n": 3}) == "stored"  # the next seq after the stored ones
        async with msgq_trio.connect(b.path, "m0") as m0:
            await m0.subscribe("SQL")
            for n, attachments in ((1, [b"att"]), (2, []), (3, [])):
                msg = await m0.receive(timeout=10)
                assert (msg.body, [bytes(a) for a in msg.attachments]) == ({"n": n}, attachments)
                assert (msg.sender, msg.via_name) == (p.lname, "msgq-queue-binder")
            await p.send("SQL", "marker")
            assert (await m0.receive(timeout=10)).body == "marker"  # no duplicate before


async def resend(q: Any, body: Any, seq: int) -> str:
    """Send with a fixed seq, again after a failure (the plugin may still be binding)."""
    with trio.fail_after(30):
        while True:
            try:
                return str(await q.send(body, seq=seq))
            except RpcError:
                await trio.sleep(0.05)


async def test_a_put_into_a_bound_queue_reaches_the_members(queue_broker: Start) -> None:
    """A ``put`` into a bound queue (a link forwarding into it, say) reaches the group's
    members as a one-way message whatever its body looks like (a body shaped like a
    request included), instead of crashing the forwarder."""
    b = queue_broker({"sql": {"bind": "SQL"}})
    async with msgq_trio.connect(b.path, "producer") as p, msgq_trio.connect(b.path, "m0") as m0:
        await m0.subscribe("SQL")
        q = p.queue("sql")
        assert await q.put(["x", {"looks": "like a request"}]) in ("stored", "consumed")
        assert await q.put("plain") in ("stored", "consumed")
        assert [(await m0.receive(timeout=10)).body for _ in range(2)] == [
            ["x", {"looks": "like a request"}],
            "plain",
        ]


# -- the stored value (sans I/O) -----------------------------------------------------------
@pytest.mark.parametrize(
    "kind, value",
    [
        (b"R", ["write", {"acct": 1}]),
        (b"M", {"n": 1}),
        (b"M", [{"n": 1}, [b"not", b"attachments"]]),  # a body shaped like [body, attachments]
        (b"M", None),
    ],
)
def test_stored_values_round_trip_and_old_ones_decode(kind: bytes, value: Any) -> None:
    """Values stored before attachments existed (kind + one CBOR item) decode with none;
    new ones keep attachments, ``G[?]`` and the producer whatever the body looks like; a
    value without extensions is written exactly as before (older plugins read it too)."""
    old = kind + cbor2.dumps(value)
    assert decode_bound(old) == Stored(kind[0], value, [], False, None)
    assert encode_bound(kind, value) == old
    new = encode_bound(
        kind, value, [b"a", memoryview(BIG)], anycast=kind == b"M", origin=("l.7", "radius")
    )
    assert decode_bound(new) == Stored(kind[0], value, [b"a", BIG], kind == b"M", ("l.7", "radius"))
    assert cbor2.loads(new[1:]) == value  # what `peek` and an older plugin read
    raw = encode_bound_raw(kind, cbor2.dumps(value), [], False, ("l.7", "radius"))
    assert decode_bound(raw) == Stored(kind[0], value, [], False, ("l.7", "radius"))


def test_put_bodies_and_malformed_values() -> None:
    """A put's body (kind ``B``, a put into a bound queue: a link's, say) is its value,
    never read as extensions; what cannot be forwarded is a ValueError, never a crash of
    the forwarder: malformed CBOR, a request that is not ``[cmd, params]``, a ``send``
    body with bytes after its item."""
    body = cbor2.dumps([{"n": 1}]) + cbor2.dumps({"from": ["l.1", "x"]})
    assert decode_bound(b"B" + cbor2.dumps("x")) == Stored(KIND_BODY, "x", [], False, None)
    assert decode_bound(b"B" + body).value == [{"n": 1}]
    for bad in (b"M\x9f", b"R" + cbor2.dumps({"cmd": "x"}), b"R" + cbor2.dumps([1, 2]), b"B"):
        with pytest.raises(ValueError):
            decode_bound(bad)
    with pytest.raises(ValueError, match="after its CBOR item"):
        encode_bound_raw(b"M", body, [], False, None)
    with pytest.raises(ValueError, match="not well-formed"):
        encode_bound_raw(b"M", b"\x9f", [], False, None)
