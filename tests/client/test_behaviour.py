"""One client behaviour suite on every driver: the trio ``Bus``, the blocking ``DirectBus``
and the asyncio ``AioBus`` each drive a real broker process through the same steps and
must show the same behaviour, so a difference between drivers is a failing test.

The tests run on trio (pytest-trio). The blocking driver's methods run in worker threads;
the asyncio driver runs under ``asyncio.run`` in a thread of its own (no trio context
there, as in an asyncio program), and the test submits coroutines to its loop. A driver
that lacks a feature by design is left out of that test's parameter list, with the
reason beside the list.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import re
import signal
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trustme
from driver_harness import HANG, asyncio_bus, run_on_loop

import msgq_trio
import msgq_trio.aio
from msgq_trio import (
    ConnectError,
    ConnectionLost,
    RecipientGone,
    RemoteError,
    RequestTimeout,
    Result,
    UsageError,
)
from msgq_trio.client.message import Message
from msgq_trio.client.reconnect import GAVE_UP
from msgq_trio.client.session import CLOSE_WAIT, IN_HIGH_COUNT, IN_HIGH_WATER
from msgq_trio.core.access import hash_token
from msgq_trio.protocol.codes import ErrorCode
from msgq_trio.protocol.framing import SPEEDUPS, Frame
from msgq_trio.transport.fdpass import RECEIVE_SIZE

DRIVERS = ["trio", "direct", "asyncio"]
#: The direct client sends no attachments, descriptors or notifications and has no
#: call_all (README "The direct client": use the trio client or sync.connect() for those);
#: its handlers are plain functions run in the one thread that uses the connection, so it
#: has no async handlers and cannot be closed while a call or a handler is under way.
ASYNC_DRIVERS = ["trio", "asyncio"]


@attrs.frozen
class Received:
    """What a driver's ``receive`` returned, copied out of the driver's thread."""

    kind: str
    target: str
    event: str | None
    body: Any
    sender: str
    sender_name: str
    attachments: list[bytes]
    #: Descriptors that came with it, taken: the test owns (and closes) them.
    fds: list[int]


def received(msg: msgq_trio.Message) -> Received:
    with msg:
        return Received(
            msg.kind,
            msg.target,
            msg.event,
            msg.body,
            msg.sender,
            msg.sender_name,
            [bytes(a) for a in msg.attachments],
            msg.take_fds(),
        )


class Client:
    """One driver's connection behind the same async methods (run from trio). A driver
    without a method leaves it out: the tests that need it do not run on that driver."""

    lname: str

    async def send(
        self,
        target: str,
        body: Any = None,
        attachments: Sequence[bytes] = (),
        fds: Sequence[int] = (),
    ) -> None:
        raise NotImplementedError

    async def send_many(self, target: str, bodies: list[Any]) -> None:
        raise NotImplementedError

    async def request(self, target: str, command: str, params: Any = None) -> Received:
        raise NotImplementedError

    async def unsubscribe(self, group: str) -> bool:
        raise NotImplementedError

    async def members(self, group: str) -> list[tuple[str, str]]:
        raise NotImplementedError

    async def iterate(self, n: int) -> list[Received]:
        """The next ``n`` messages by ``async for`` (all that come if it ends first)."""
        raise NotImplementedError

    async def wait_lost(self) -> str | None:
        """Wait until the connection ends; the ConnectionLost's code."""
        raise NotImplementedError

    async def setup(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(bus)`` where the driver's bus may be used (its loop's thread)."""
        raise NotImplementedError

    async def call_many(self, requests: list[tuple[Any, ...]]) -> list[Result]:
        raise NotImplementedError

    async def on_notification(
        self, group: str, seen: list[Received], done: threading.Event
    ) -> None:
        """Register a callback for ``group`` that appends each notification to ``seen``
        and sets ``done``."""
        raise NotImplementedError

    async def notify(self, group: str, event: str, params: Any = None) -> None:
        raise NotImplementedError

    async def call(
        self, target: str, command: str, params: Any = None, timeout: float | None = None
    ) -> Any:
        raise NotImplementedError

    async def call_all(self, group: str, command: str, params: Any = None) -> list[Result]:
        raise NotImplementedError

    async def subscribe(self, group: str) -> bool:
        raise NotImplementedError

    async def receive(self, timeout: float) -> Received:
        raise NotImplementedError

    async def add_command(self, name: str, fn: Callable[..., Any]) -> None:
        raise NotImplementedError

    async def wait_connected(self, timeout: float) -> None:
        raise NotImplementedError

    async def state(self) -> tuple[str, int]:
        """(the current lname, reconnects so far)."""
        raise NotImplementedError


class TrioClient(Client):
    def __init__(self, bus: msgq_trio.Bus) -> None:
        self.bus, self.lname = bus, bus.lname

    async def send(
        self,
        target: str,
        body: Any = None,
        attachments: Sequence[bytes] = (),
        fds: Sequence[int] = (),
    ) -> None:
        await self.bus.send(target, body, attachments, fds=fds)

    async def send_many(self, target: str, bodies: list[Any]) -> None:
        await self.bus.send_many(target, bodies)

    async def request(self, target: str, command: str, params: Any = None) -> Received:
        return received(await self.bus.request(target, command, params))

    async def unsubscribe(self, group: str) -> bool:
        return await self.bus.unsubscribe(group)

    async def members(self, group: str) -> list[tuple[str, str]]:
        return [(m.lname, m.name) for m in await self.bus.members(group)]

    async def wait_lost(self) -> str | None:
        return (await self.bus.wait_lost()).code

    async def setup(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.bus)

    async def call_many(self, requests: list[tuple[Any, ...]]) -> list[Result]:
        return await self.bus.call_many(requests)  # type: ignore[arg-type]

    async def iterate(self, n: int) -> list[Received]:
        out: list[Received] = []
        if n:
            async for msg in self.bus:
                out.append(received(msg))
                if len(out) == n:
                    break
        return out

    async def on_notification(
        self, group: str, seen: list[Received], done: threading.Event
    ) -> None:
        def take(msg: msgq_trio.Message) -> None:
            seen.append(received(msg))
            done.set()

        self.bus.on_notification(group, take)

    async def notify(self, group: str, event: str, params: Any = None) -> None:
        await self.bus.notify(group, event, params)

    async def call(
        self, target: str, command: str, params: Any = None, timeout: float | None = None
    ) -> Any:
        return await self.bus.call(target, command, params, timeout=timeout)

    async def call_all(self, group: str, command: str, params: Any = None) -> list[Result]:
        return await self.bus.call_all(group, command, params)

    async def subscribe(self, group: str) -> bool:
        return await self.bus.subscribe(group)

    async def receive(self, timeout: float) -> Received:
        return received(await self.bus.receive(timeout))

    async def add_command(self, name: str, fn: Callable[..., Any]) -> None:
        self.bus.add_command(name, fn)

    async def wait_connected(self, timeout: float) -> None:
        await self.bus.wait_connected(timeout)

    async def state(self) -> tuple[str, int]:
        return self.bus.lname, self.bus.reconnects


class DirectClient(Client):
    """The blocking driver: each method in a worker thread, one at a time (the
    connection is used by one thread at a time, as its contract wants)."""

    def __init__(self, bus: msgq_trio.DirectBus) -> None:
        self.bus, self.lname = bus, bus.lname

    async def send(
        self,
        target: str,
        body: Any = None,
        attachments: Sequence[bytes] = (),
        fds: Sequence[int] = (),
    ) -> None:
        assert not attachments and not fds, "the direct client sends neither"
        await trio.to_thread.run_sync(self.bus.send, target, body)

    async def send_many(self, target: str, bodies: list[Any]) -> None:
        await trio.to_thread.run_sync(self.bus.send_many, target, bodies)

    async def unsubscribe(self, group: str) -> bool:
        return await trio.to_thread.run_sync(self.bus.unsubscribe, group)

    async def members(self, group: str) -> list[tuple[str, str]]:
        rows = await trio.to_thread.run_sync(self.bus.members, group)
        return [(m.lname, m.name) for m in rows]

    async def call(
        self, target: str, command: str, params: Any = None, timeout: float | None = None
    ) -> Any:
        return await trio.to_thread.run_sync(
            functools.partial(self.bus.call, target, command, params, timeout=timeout)
        )

    async def subscribe(self, group: str) -> bool:
        return await trio.to_thread.run_sync(self.bus.subscribe, group)

    async def receive(self, timeout: float) -> Received:
        return received(await trio.to_thread.run_sync(self.bus.receive, timeout))

    async def add_command(self, name: str, fn: Callable[..., Any]) -> None:
        self.bus.command(name)(fn)

    async def wait_connected(self, timeout: float) -> None:
        await trio.to_thread.run_sync(self.bus.wait_connected, timeout)

    async def state(self) -> tuple[str, int]:
        return self.bus.lname, self.bus.reconnects


class AioClient(Client):
    """The asyncio driver on its loop in another thread; each method is a coroutine
    submitted to that loop, its outcome (result or exception) brought back here."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        bus: msgq_trio.aio.AioBus,
        pending: set[asyncio.Task[Any]],
    ) -> None:
        self.loop, self.bus, self.lname, self.pending = loop, bus, bus.lname, pending

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await run_on_loop(self.loop, self.pending, coro)

    async def send(
        self,
        target: str,
        body: Any = None,
        attachments: Sequence[bytes] = (),
        fds: Sequence[int] = (),
    ) -> None:
        await self.run(self.bus.send(target, body, attachments, fds=fds))

    async def send_many(self, target: str, bodies: list[Any]) -> None:
        await self.run(self.bus.send_many(target, bodies))

    async def request(self, target: str, command: str, params: Any = None) -> Received:
        async def ask() -> Received:
            return received(await self.bus.request(target, command, params))

        return await self.run(ask())

    async def unsubscribe(self, group: str) -> bool:
        return await self.run(self.bus.unsubscribe(group))

    async def members(self, group: str) -> list[tuple[str, str]]:
        async def ask() -> list[tuple[str, str]]:
            return [(m.lname, m.name) for m in await self.bus.members(group)]

        return await self.run(ask())

    async def wait_lost(self) -> str | None:
        async def wait() -> str | None:
            return (await self.bus.wait_lost()).code

        return await self.run(wait())

    async def setup(self, fn: Callable[[Any], Any]) -> Any:
        async def on_loop() -> Any:
            return fn(self.bus)

        return await self.run(on_loop())

    async def call_many(self, requests: list[tuple[Any, ...]]) -> list[Result]:
        return await self.run(self.bus.call_many(requests))  # type: ignore[arg-type]

    async def iterate(self, n: int) -> list[Received]:
        async def take() -> list[Received]:
            out: list[Received] = []
            if n:
                async for msg in self.bus:
                    out.append(received(msg))
                    if len(out) == n:
                        break
            return out

        return await self.run(take())

    async def on_notification(
        self, group: str, seen: list[Received], done: threading.Event
    ) -> None:
        async def take(msg: msgq_trio.Message) -> None:  # an async callback, in a task
            seen.append(received(msg))
            done.set()

        async def register() -> None:  # on the loop's thread, like every use of the bus
            self.bus.on_notification(group, take)

        await self.run(register())

    async def notify(self, group: str, event: str, params: Any = None) -> None:
        await self.run(self.bus.notify(group, event, params))

    async def call(
        self, target: str, command: str, params: Any = None, timeout: float | None = None
    ) -> Any:
        return await self.run(self.bus.call(target, command, params, timeout=timeout))

    async def call_all(self, group: str, command: str, params: Any = None) -> list[Result]:
        return await self.run(self.bus.call_all(group, command, params))

    async def subscribe(self, group: str) -> bool:
        return await self.run(self.bus.subscribe(group))

    async def receive(self, timeout: float) -> Received:
        async def take() -> Received:
            return received(await self.bus.receive(timeout))

        return await self.run(take())

    async def add_command(self, name: str, fn: Callable[..., Any]) -> None:
        async def register() -> None:
            self.bus.add_command(name, fn)

        await self.run(register())

    async def wait_connected(self, timeout: float) -> None:
        await self.run(self.bus.wait_connected(timeout))

    async def state(self) -> tuple[str, int]:
        async def read() -> tuple[str, int]:
            return self.bus.lname, self.bus.reconnects

        return await self.run(read())


@asynccontextmanager
async def open_client(
    driver: str,
    path: Path | str,
    name: str,
    handlers: dict[str, Callable[..., Any]] | None = None,
    group: str | None = None,
    **connect_kw: Any,
) -> AsyncIterator[Client]:
    """A connection named ``name`` on ``driver``; with ``handlers`` it answers those
    commands (the direct one then serves in a thread of its own and is used for nothing
    else), and joins ``group`` if given. Leaving the block closes it; what the driver's
    thread raised fails the test."""
    handlers = handlers or {}
    if driver == "trio":
        async with msgq_trio.connect(path, name, **connect_kw) as bus:
            for cmd, fn in handlers.items():
                bus.add_command(cmd, fn)
            if group:
                await bus.subscribe(group)
            yield TrioClient(bus)
        return
    errors: list[BaseException] = []
    if driver == "direct":
        assert set(connect_kw) <= {"reconnect"}, "the direct client speaks to Unix sockets only"
        direct = msgq_trio.connect_direct(path, name, **connect_kw)
        for cmd, fn in handlers.items():
            direct.command(cmd)(fn)
        if group:
            direct.subscribe(group)
        stop = threading.Event()

        def serve() -> None:
            try:
                while not stop.is_set():
                    direct.serve(0.02)
            except BaseException as exc:
                errors.append(exc)

        server = threading.Thread(target=serve, daemon=True) if handlers else None
        if server is not None:
            server.start()
        try:
            yield DirectClient(direct)
        finally:
            if server is not None:
                stop.set()
                await trio.to_thread.run_sync(server.join, HANG)
            direct.close()
        assert server is None or not server.is_alive()
        assert errors == []
        return
    assert driver == "asyncio"

    async def setup(bus: msgq_trio.aio.AioBus) -> None:
        for cmd, fn in handlers.items():
            bus.add_command(cmd, fn)
        if group:
            await bus.subscribe(group)

    async with asyncio_bus(path, name, setup, **connect_kw) as (loop, bus, pending):
        yield AioClient(loop, bus, pending)


async def wait_thread_event(event: threading.Event) -> None:
    """Wait (from trio) for ``event``, set by a handler in any driver's thread."""
    assert await trio.to_thread.run_sync(event.wait, HANG), "the handler never ran"


def forever(driver: str) -> Callable[[], Coroutine[Any, Any, Any]]:
    """An awaitable that never finishes, for ``driver``'s event loop."""
    if driver == "trio":
        return trio.sleep_forever

    async def wait() -> None:
        await asyncio.get_running_loop().create_future()

    return wait


# -- messages --------------------------------------------------------------------------
@pytest.mark.parametrize("driver", DRIVERS)
async def test_send_and_receive_between_two_clients(driver: str, broker: Any) -> None:
    """A message to a group and one to an lname arrive at the other client, in order,
    stamped with the sender's name."""
    async with (
        open_client(driver, broker.path, "alice") as alice,
        open_client(driver, broker.path, "bob") as bob,
    ):
        assert await bob.subscribe("Chat") is True
        await alice.send("Chat", {"n": 1})
        await alice.send(bob.lname, "to bob")
        first, second = await bob.receive(HANG), await bob.receive(HANG)
    assert (first.kind, first.target, first.body) == ("message", "Chat", {"n": 1})
    assert (second.kind, second.target, second.body) == ("message", bob.lname, "to bob")
    assert first.sender == second.sender == alice.lname
    assert first.sender_name == second.sender_name == "alice"


@pytest.mark.parametrize("driver", DRIVERS)
async def test_receive_with_timeout(driver: str, broker: Any) -> None:
    """With nothing sent, receive(timeout) raises the driver's timeout error (trio's
    TooSlowError, the builtin TimeoutError for the others); the connection is fine after
    it and a message sent then is received."""
    expected = trio.TooSlowError if driver == "trio" else TimeoutError
    async with (
        open_client(driver, broker.path, "waiter") as waiter,
        msgq_trio.connect(broker.path, "sender") as sender,
    ):
        with pytest.raises(expected):
            await waiter.receive(0.2)
        await sender.send(waiter.lname, "late")
        got = await waiter.receive(HANG)
    assert (got.body, got.sender_name) == ("late", "sender")


@pytest.mark.parametrize("receiver", DRIVERS)
@pytest.mark.parametrize("sender", ASYNC_DRIVERS)  # the direct client sends no attachments
async def test_attachments_round_trip(sender: str, receiver: str, broker: Any) -> None:
    """Binary attachments (an empty one, all byte values, a large one) arrive as sent,
    beside the CBOR body."""
    blobs = [b"", bytes(range(256)), os.urandom(300_000)]
    async with (
        open_client(sender, broker.path, "tx") as tx,
        open_client(receiver, broker.path, "rx") as rx,
    ):
        await tx.send(rx.lname, {"parts": len(blobs)}, blobs)
        got = await rx.receive(HANG)
    assert got.body == {"parts": 3}
    assert got.attachments == blobs


@pytest.mark.parametrize("subscriber", DRIVERS)
@pytest.mark.parametrize("notifier", ASYNC_DRIVERS)  # the direct client has no notify()
async def test_notification_reaches_a_subscriber(
    notifier: str, subscriber: str, broker: Any
) -> None:
    """A notification to a group reaches its subscriber as kind ``notification`` with
    its event and params; a client outside the group gets nothing."""
    async with (
        open_client(subscriber, broker.path, "sub") as sub,
        open_client(notifier, broker.path, "pub") as pub,
        msgq_trio.connect(broker.path, "outsider") as outsider,
    ):
        await sub.subscribe("Zones")
        await pub.notify("Zones", "zone-added", {"zone": "example."})
        got = await sub.receive(HANG)
        # The outsider's inbox stays empty: a message sent to it afterwards comes first.
        await pub.send(outsider.lname, "only this")
        assert (await outsider.receive(HANG)).body == "only this"
    assert (got.kind, got.target, got.event) == ("notification", "Zones", "zone-added")
    assert got.body == {"zone": "example."}
    assert got.sender_name == "pub"


# -- calls -----------------------------------------------------------------------------
@pytest.mark.parametrize("driver", DRIVERS)
async def test_call_and_its_answer(driver: str, broker: Any) -> None:
    """A call to a group with one member is answered by its handler, ``fn(params)`` or
    ``fn(params, request)``; None and nested values round-trip."""
    handlers = {
        "add": lambda p: p[0] + p[1],
        "who": lambda _p, request: [request.sender_name, request.command],
        "nothing": lambda _p: None,
    }
    async with (
        open_client(driver, broker.path, "svc", handlers, group="Svc"),
        open_client(driver, broker.path, "caller") as caller,
    ):
        assert await caller.call("Svc", "add", [2, 3]) == 5
        assert await caller.call("Svc", "who") == ["caller", "who"]
        assert await caller.call("Svc", "nothing") is None


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_call_timeout_is_the_brokers_answer(driver: str, broker: Any) -> None:
    """A handler that never answers: with ``timeout`` the broker answers ``timeout``
    after it (RequestTimeout naming the callee), and the caller goes on."""
    started = threading.Event()

    async def black_hole(_params: object) -> None:
        started.set()
        await trio.sleep_forever()

    async with (
        open_client("trio", broker.path, "svc", {"hole": black_hole, "ping": lambda _p: 1}, "Svc"),
        open_client(driver, broker.path, "caller") as caller,
    ):
        with pytest.raises(RequestTimeout) as info:
            await caller.call("Svc", "hole", timeout=0.5)
        assert started.is_set()
        assert await caller.call("Svc", "ping") == 1
    assert info.value.code == ErrorCode.TIMEOUT


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_silent_broker_times_the_call_out_locally(driver: str, broker: Any) -> None:
    """With the broker stopped (SIGSTOP), a call with ``timeout`` gives up by itself
    (LOCAL_GRACE after the timeout) with RequestTimeout saying the broker was silent;
    after SIGCONT the connection works again."""
    async with open_client(driver, broker.path, "caller") as caller:
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RequestTimeout, match="none from the broker"):
                await caller.call("msgq", "version", timeout=0.2)
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        assert await caller.subscribe("After") is True


@pytest.mark.parametrize("driver", DRIVERS)
async def test_many_messages_arrive_in_order(driver: str, broker: Any) -> None:
    """A burst of messages (many per receive, frames split across receives) arrives
    complete and in order."""
    count = 2000
    async with (
        open_client(driver, broker.path, "rx") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
    ):
        for i in range(count):
            await tx.send(rx.lname, [i, "x" * (i % 700)])
        got = [(await rx.receive(HANG)).body for _ in range(count)]
    assert got == [[i, "x" * (i % 700)] for i in range(count)]


@pytest.mark.parametrize("receiver", DRIVERS)
@pytest.mark.parametrize("sender", DRIVERS)
async def test_send_many_is_each_message_in_order(sender: str, receiver: str, broker: Any) -> None:
    """``send_many`` delivers what ``send`` would one by one, in order (small bodies of
    any type, a large binary one among them); a batch with a body that cannot be encoded
    sends none of them."""
    big = os.urandom(2 * 1024 * 1024)
    bodies: list[Any] = [*range(3000), big, *(b"x" * i for i in range(100)), "end"]
    async with (
        open_client(sender, broker.path, "tx") as tx,
        open_client(receiver, broker.path, "rx") as rx,
    ):
        with pytest.raises(UsageError, match="body 1 of the batch"):
            await tx.send_many(rx.lname, ["never sent", object()])
        await tx.send_many(rx.lname, bodies)
        got = [(await rx.receive(HANG)).body for _ in range(len(bodies))]
    assert got == bodies


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_bytes_body_to_a_bad_target_is_refused_and_nothing_else_lost(
    driver: str, broker: Any
) -> None:
    """``send`` of a bytes body (each driver's shortest way) to a target too long for a
    frame is the caller's error (UsageError naming the target), queues nothing, and the
    bus goes on: the messages before and after it arrive, in order."""
    async with (
        open_client(driver, broker.path, "tx") as tx,
        open_client("trio", broker.path, "rx") as rx,
    ):
        await tx.send(rx.lname, b"before")
        with pytest.raises(UsageError, match="cannot send to 'GGG"):
            await tx.send("G" * 70_000, b"x")
        await tx.send(rx.lname, b"after")
        got = [(await rx.receive(HANG)).body for _ in range(2)]
    assert got == [b"before", b"after"]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client reads on demand
async def test_a_reader_ahead_of_the_application_holds_a_bounded_count(
    driver: str, broker: Any
) -> None:
    """Small messages that the application does not take: the driver holds at most
    ``IN_HIGH_COUNT`` of them plus one receive's worth (far under ``IN_HIGH_WATER``
    bytes) and reads no more; the rest wait in the broker and the socket. A call it
    makes meanwhile still gets its answer; then every message arrives, in order:
    backpressure, never loss."""
    count = 20_000  # ~2.6 MB: the broker's queue and the socket buffers take the rest
    most = IN_HIGH_COUNT + RECEIVE_SIZE // 32  # 32 bytes: the smallest frame
    async with (
        open_client("trio", broker.path, "svc", {"echo": lambda p: p}, group="Svc"),
        open_client(driver, broker.path, "rx") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
    ):
        for i in range(count):
            await tx.send(rx.lname, i)
        await tx.flush()
        held = 0
        with trio.fail_after(HANG):
            while held < IN_HIGH_COUNT:  # it reads ahead up to the bound...
                held = await rx.setup(lambda bus: len(bus._in))
                assert held <= most
                await trio.sleep(0.05)
        for _ in range(20):  # ...and no further (without the bound it reads all 20,000)
            assert await rx.setup(lambda bus: len(bus._in)) <= most
            await trio.sleep(0.05)
        # A call's answer is read past the bound: the caller gets it before it takes
        # its messages.
        assert await rx.call("Svc", "echo", "past the messages", timeout=HANG) == (
            "past the messages"
        )
        # Taken by receive() and then by iteration: each way wakes the paused reader.
        got = [(await rx.receive(HANG)).body for _ in range(count // 2)]
        with trio.fail_after(HANG):
            got += [r.body for r in await rx.iterate(count - count // 2)]
    assert got == list(range(count))


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client reads on demand
async def test_a_reader_ahead_of_the_application_holds_bounded_bytes(
    driver: str, broker: Any
) -> None:
    """Large messages that the application does not take: the driver reads until the
    bytes waiting pass ``IN_HIGH_WATER``, and no further (the receive that passed it is
    the most over it: one message here); the rest wait in the broker and the sender.
    Taking them (by receive() and by iteration) resumes reading, every byte arrives in
    order, and nothing is held once all are taken."""
    size = 1 << 20
    count = IN_HIGH_WATER // size + 8
    bodies = [bytes([i]) * size for i in range(count)]

    def waiting(bus: Any) -> tuple[int, int]:
        return bus._in_held(), len(bus._in)

    async with (
        open_client(driver, broker.path, "rx") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
        trio.open_nursery() as nursery,
    ):

        async def send_all() -> None:
            for body in bodies:
                await tx.send(rx.lname, body)
            await tx.flush()

        nursery.start_soon(send_all)
        held, n = 0, 0
        with trio.fail_after(HANG):
            while held <= IN_HIGH_WATER:  # it reads ahead up to the bound...
                held, n = await rx.setup(waiting)
                await trio.sleep(0.02)
        for _ in range(10):  # ...and no further
            held, n = await rx.setup(waiting)
            assert IN_HIGH_WATER < held <= IN_HIGH_WATER + size + 4096
            assert n < count
            await trio.sleep(0.05)
        got = [(await rx.receive(HANG)).body for _ in range(count // 2)]
        with trio.fail_after(HANG):
            got += [m.body for m in await rx.iterate(count - count // 2)]
        assert await rx.setup(waiting) == (0, 0)
    assert got == bodies


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client reads on demand
async def test_messages_waiting_for_the_application_are_no_work_for_the_collector(
    driver: str, broker: Any
) -> None:
    """A burst the application has not taken yet waits as frames, not as Message
    objects, and (compiled scanner) as frames the cyclic garbage collector does not
    track: thousands waiting add nothing to each collection. Taken, each is a Message
    like any other, in order, its sender stamped."""
    count = IN_HIGH_COUNT // 2  # all of them read ahead, far from the reader's bound
    async with (
        open_client(driver, broker.path, "rx") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
    ):
        await tx.send_many(rx.lname, [[i, "x" * (i % 50)] for i in range(count)])
        await tx.flush()
        held = 0
        with trio.fail_after(HANG):
            for _ in range(100_000):  # polled: the messages wait in rx's driver
                held = await rx.setup(lambda bus: len(bus._in))
                if held >= count:
                    break
                await trio.sleep(0.02)
        assert held == count

        def waiting(bus: Any) -> tuple[int, int, int, int]:
            entries = list(bus._in)
            made = sum(isinstance(e, Message) for e in entries)
            size = sum(len(e.raw) for e in entries if isinstance(e, Frame))
            return made, sum(gc.is_tracked(e) for e in entries), size, bus._in_held()

        made, tracked, size, counted = await rx.setup(waiting)
        assert made == 0
        if SPEEDUPS:
            assert tracked == 0
        assert counted == size  # the bytes that count against IN_HIGH_WATER
        got = [await rx.receive(HANG) for _ in range(count)]
        assert await rx.setup(lambda bus: bus._in_held()) == 0
    assert [m.body for m in got] == [[i, "x" * (i % 50)] for i in range(count)]
    assert {(m.sender, m.sender_name) for m in got} == {(tx.lname, "tx")}


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client reads on demand
async def test_large_bodies_waiting_for_the_application_count_in_full(
    driver: str, broker: Any
) -> None:
    """Large binary bodies are received straight into bytes of their own
    (``Frame.large_body``); while they wait for the application each still counts all
    its bytes against ``IN_HIGH_WATER``, and taking them gives those bytes back."""
    bodies = [os.urandom(1 << 20) + bytes([i]) for i in range(3)]
    async with (
        open_client(driver, broker.path, "rx") as rx,
        msgq_trio.connect(broker.path, "tx") as tx,
    ):
        for body in bodies:
            await tx.send(rx.lname, body)
        await tx.flush()
        held = 0
        with trio.fail_after(HANG):
            for _ in range(100_000):  # polled: the messages wait in rx's driver
                held = await rx.setup(lambda bus: len(bus._in))
                if held >= len(bodies):
                    break
                await trio.sleep(0.02)
        assert held == len(bodies)

        def waiting(bus: Any) -> tuple[list[int], int, int]:
            frames = [e if isinstance(e, Frame) else e._frame for e in bus._in]
            own = [len(f.large_body) for f in frames]
            return own, sum(len(f.raw) + len(f.large_body) for f in frames), bus._in_held()

        own, size, counted = await rx.setup(waiting)
        assert own == [len(b) for b in bodies]  # received apart, not copied out later
        assert counted == size > sum(len(b) for b in bodies)
        # Taken by receive() and by iteration: both give the bytes back.
        got = [(await rx.receive(HANG)).body]
        with trio.fail_after(HANG):
            got += [m.body for m in await rx.iterate(len(bodies) - 1)]
        assert await rx.setup(lambda bus: bus._in_held()) == 0
    assert got == bodies


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client runs plain functions
async def test_an_async_handler_answers(driver: str, broker: Any) -> None:
    """An ``async def`` handler's awaited result is the answer, and its exception maps
    like a plain function's; several are under way at once."""
    gate = threading.Event()
    waiting = threading.Event()
    pause = trio.sleep if driver == "trio" else asyncio.sleep

    async def slow(_params: object) -> str:
        waiting.set()
        while not gate.is_set():  # the other request gets answered meanwhile
            await pause(0.01)
        return "slow"

    async def double(params: int) -> int:
        return params * 2

    async def broken(_params: object) -> None:
        raise KeyError("zone")

    handlers = {"slow": slow, "double": double, "broken": broken}
    async with (
        open_client(driver, broker.path, "svc", handlers, group="Svc"),
        open_client(driver, broker.path, "caller") as caller,
        trio.open_nursery() as nursery,
    ):
        slow_answer: list[Any] = []

        async def call_slow() -> None:
            slow_answer.append(await caller.call("Svc", "slow"))

        nursery.start_soon(call_slow)
        await wait_thread_event(waiting)
        assert await caller.call("Svc", "double", 21) == 42
        with pytest.raises(RemoteError) as info:
            await caller.call("Svc", "broken")
        assert info.value.code == ErrorCode.BAD_REQUEST
        gate.set()
    assert slow_answer == ["slow"]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_an_async_handler_without_await_is_answered_in_the_reader(
    driver: str, broker: Any
) -> None:
    """An ``async def`` handler whose code has no ``await`` cannot suspend: it runs to
    its end in the reader, as a plain function does, without a task of its own; one
    that awaits gets its task. The answer and the error mapping are the same."""
    pause = trio.sleep if driver == "trio" else asyncio.sleep

    def where() -> str:
        if driver == "trio":
            name = trio.lowlevel.current_task().name
            return "task" if "_await_request" in name else "reader"
        return "task" if asyncio.current_task() is not None else "reader"

    async def quick(_params: object) -> str:
        return where()

    async def awaiting(_params: object) -> str:
        await pause(0)
        return where()

    async def broken(_params: object) -> None:
        raise KeyError("zone")

    handlers = {"quick": quick, "awaiting": awaiting, "broken": broken}
    async with (
        open_client(driver, broker.path, "svc", handlers, group="Svc"),
        open_client(driver, broker.path, "caller") as caller,
    ):
        assert await caller.call("Svc", "quick") == "reader"
        assert await caller.call("Svc", "awaiting") == "task"
        with pytest.raises(RemoteError) as info:
            await caller.call("Svc", "broken")
        assert info.value.code == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_handler_raising_a_documented_error(driver: str, broker: Any) -> None:
    """The handler contract (``Session.answer_for``) on every driver: CommandFailed's
    code, message and data reach the caller; ValueError answers ``bad-request`` naming
    it; any other exception ``internal-error`` naming its type. The callee goes on."""

    def missing(params: str) -> None:
        raise msgq_trio.CommandFailed("zone-unknown", f"no zone {params}", {"zone": params})

    def bad(_params: object) -> None:
        raise ValueError("class must be IN")

    def buggy(_params: object) -> None:
        raise RuntimeError("oops")

    handlers = {"missing": missing, "bad": bad, "buggy": buggy, "ping": lambda _p: "pong"}
    async with (
        open_client(driver, broker.path, "svc", handlers, group="Svc"),
        open_client(driver, broker.path, "caller") as caller,
    ):
        with pytest.raises(RemoteError) as failed:
            await caller.call("Svc", "missing", "example.")
        with pytest.raises(RemoteError) as bad_request:
            await caller.call("Svc", "bad")
        with pytest.raises(RemoteError) as internal:
            await caller.call("Svc", "buggy")
        assert await caller.call("Svc", "ping") == "pong"
    assert failed.value.code == "zone-unknown"
    assert failed.value.message == "no zone example."
    assert failed.value.data == {"zone": "example."}
    assert bad_request.value.code == ErrorCode.BAD_REQUEST
    assert "ValueError: class must be IN" in bad_request.value.message
    assert internal.value.code == ErrorCode.INTERNAL_ERROR
    assert internal.value.data == {"type": "RuntimeError"}


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client: one call at a time
async def test_call_many_and_call_callbacks(driver: str, broker: Any) -> None:
    """call_many answers every request in request order, each its value or its error;
    call_cb and call_many_cb run their callbacks with the same outcomes."""

    def refuse(_params: object) -> None:
        raise msgq_trio.CommandFailed("busy", "try later")

    requests = [("Svc", "echo", 1), ("Svc", "refuse"), ("Nobody", "x"), ("Svc", "echo", 3)]
    outcomes: list[Any] = []
    done = threading.Event()

    def record(*args: Any) -> None:
        outcomes.append(args)
        if len(outcomes) == 3:
            done.set()

    async with (
        open_client(driver, broker.path, "svc", {"echo": lambda p: p, "refuse": refuse}, "Svc"),
        open_client(driver, broker.path, "caller") as caller,
    ):
        results = await caller.call_many(requests)

        def start(bus: Any) -> None:
            bus.call_cb("Svc", "echo", "cb", record)
            bus.call_cb("Svc", "refuse", None, record)
            bus.call_many_cb(requests[:2], record)

        await caller.setup(start)
        await wait_thread_event(done)
    assert [(r.target, r.ok, r.value) for r in results] == [
        ("Svc", True, 1),
        ("Svc", False, None),
        ("Nobody", False, None),
        ("Svc", True, 3),
    ]
    assert isinstance(results[1].error, RemoteError) and results[1].error.code == "busy"
    assert isinstance(results[2].error, msgq_trio.NoRecipient)
    assert (True, "cb") in outcomes
    (refused,) = [o for o in outcomes if o[0] is False]
    assert isinstance(refused[1], RemoteError) and refused[1].code == "busy"
    (many,) = [o[0] for o in outcomes if len(o) == 1]
    assert [(r.ok, r.value) for r in many] == [(True, 1), (False, None)]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client has no inline API
async def test_inline_handlers_see_arrival_order(driver: str, broker: Any) -> None:
    """Inline message and notification callbacks and inline commands run as frames
    arrive, in the order they were sent; an inline command answers with answer() or
    answer_error(), and a default handler takes commands without a handler."""
    seen: list[str] = []

    def install(bus: Any) -> None:
        bus.on_message_inline(lambda m: seen.append(f"message {m.body}"))
        bus.on_notification_inline("Zones", lambda m: seen.append(f"event {m.event}"))

        def get(request: msgq_trio.Message) -> None:
            seen.append(f"get {request.body}")
            if request.body == "missing":
                bus.answer_error(request, "zone-unknown", "no such zone")
            else:
                bus.answer(request, {"zone": request.body}, attachments=[b"soa"])

        bus.add_inline_command("get", get)
        bus.set_default_handler(lambda params, request: [request.command, params])

    async with (
        open_client(driver, broker.path, "svc") as svc,
        msgq_trio.connect(broker.path, "peer") as peer,
    ):
        await svc.setup(install)
        await svc.subscribe("Zones")
        await peer.send(svc.lname, 1)
        await peer.notify("Zones", "zone-added")
        answer = await peer.request(svc.lname, "get", "example.")
        with pytest.raises(RemoteError) as info:
            await peer.call(svc.lname, "get", "missing")
        assert await peer.call(svc.lname, "anything", 7) == ["anything", 7]
        await peer.send(svc.lname, 2)
        await peer.call(svc.lname, "get", "last")  # the message before it was seen
    assert seen == [
        "message 1",
        "event zone-added",
        "get example.",
        "get missing",
        "message 2",
        "get last",
    ]
    assert answer.body == {"zone": "example."}
    assert [bytes(a) for a in answer.attachments] == [b"soa"]
    assert info.value.code == "zone-unknown"


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client has no call_all
async def test_call_all_with_two_members(driver: str, broker: Any) -> None:
    """Every member of the group answers: one Result per member in join order, a
    member's CommandFailed as its error Result."""

    def refuse(_params: object) -> None:
        raise msgq_trio.CommandFailed("busy", "try later")

    async with (
        open_client(driver, broker.path, "a", {"name": lambda p: f"a{p}"}, group="Svc") as a,
        open_client(driver, broker.path, "b", {"name": refuse}, group="Svc") as b,
        open_client(driver, broker.path, "caller") as caller,
    ):
        results = await caller.call_all("Svc", "name", 1)
    assert [r.sender for r in results] == [a.lname, b.lname]
    assert (results[0].ok, results[0].value) == (True, "a1")
    assert results[1].ok is False
    assert isinstance(results[1].error, RemoteError) and results[1].error.code == "busy"


@pytest.mark.parametrize("caller_driver", DRIVERS)
@pytest.mark.parametrize(
    "callee_driver",
    # The direct client cannot be closed while its handler runs (one thread uses it).
    ASYNC_DRIVERS,
)
async def test_a_callee_disconnecting_mid_call_is_recipient_gone(
    callee_driver: str, caller_driver: str, broker: Any
) -> None:
    """The callee closes while its async handler is under way: the caller's call fails
    at once with ``recipient-gone`` (no timeout involved), and the caller goes on."""
    started = threading.Event()
    hang = forever(callee_driver)

    async def stuck(_params: object) -> None:
        started.set()
        await hang()

    outcome: list[BaseException] = []
    async with open_client(caller_driver, broker.path, "caller") as caller:
        # Leaving this block closes the callee first, then waits for the call's end.
        async with (
            trio.open_nursery() as nursery,
            open_client(callee_driver, broker.path, "svc", {"stuck": stuck}, "Svc"),
        ):

            async def call() -> None:
                try:
                    await caller.call("Svc", "stuck")
                except Exception as exc:
                    outcome.append(exc)

            nursery.start_soon(call)
            await wait_thread_event(started)
        async with open_client("trio", broker.path, "svc2", {"ping": lambda _p: 1}, "Svc2"):
            assert await caller.call("Svc2", "ping") == 1
    assert len(outcome) == 1 and isinstance(outcome[0], RecipientGone), outcome
    assert outcome[0].code == ErrorCode.RECIPIENT_GONE


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # a DirectBus is closed by its one thread
async def test_closing_fails_pending_calls_with_connection_lost(driver: str, broker: Any) -> None:
    """Closing a client while one of its calls waits for an answer fails that call with
    ConnectionLost (not a hang, not a timeout)."""
    started = threading.Event()

    async def stuck(_params: object) -> None:
        started.set()
        await trio.sleep_forever()

    outcome: list[BaseException] = []
    # Leaving this block closes the caller first, then waits for its call's end.
    async with (
        open_client("trio", broker.path, "svc", {"stuck": stuck}, "Svc"),
        trio.open_nursery() as nursery,
        open_client(driver, broker.path, "caller") as caller,
    ):

        async def call() -> None:
            try:
                await caller.call("Svc", "stuck")
            except Exception as exc:
                outcome.append(exc)

        nursery.start_soon(call)
        await wait_thread_event(started)
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectionLost), outcome


# -- groups ----------------------------------------------------------------------------
@pytest.mark.parametrize("driver", DRIVERS)
async def test_subscribe_members_unsubscribe(driver: str, broker: Any) -> None:
    """subscribe and unsubscribe say whether they changed anything; members lists the
    group in join order."""
    async with (
        open_client(driver, broker.path, "a") as a,
        open_client(driver, broker.path, "b") as b,
    ):
        assert await a.subscribe("Grp") is True
        assert await a.subscribe("Grp") is False
        assert await b.subscribe("Grp") is True
        assert await b.members("Grp") == [(a.lname, "a"), (b.lname, "b")]
        assert await a.unsubscribe("Grp") is True
        assert await a.unsubscribe("Grp") is False
        assert await a.members("Grp") == [(b.lname, "b")]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client has no callbacks
async def test_a_notification_callback_takes_the_group(driver: str, broker: Any) -> None:
    """With on_notification for a group, its notifications go to the callback and not to
    iteration; other messages still go to iteration."""
    seen: list[Received] = []
    done = threading.Event()
    async with (
        open_client(driver, broker.path, "sub") as sub,
        msgq_trio.connect(broker.path, "pub") as pub,
    ):
        await sub.on_notification("Zones", seen, done)
        await sub.subscribe("Zones")
        await pub.notify("Zones", "zone-added", {"zone": "example."})
        await wait_thread_event(done)
        await pub.send(sub.lname, "plain")
        got = await sub.receive(HANG)
    assert [(n.kind, n.event, n.body) for n in seen] == [
        ("notification", "zone-added", {"zone": "example."})
    ]
    assert (got.kind, got.body) == ("message", "plain")


# -- iteration and the end of the connection --------------------------------------------
@pytest.mark.parametrize("how", ["shutdown", "killed"])
@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client has receive() only
async def test_iteration_and_how_it_ends(driver: str, how: str, broker: Any) -> None:
    """``async for`` yields messages in order; it ends quietly when the broker shuts down
    (its GOODBYE), and raises ConnectionLost when the broker dies: a consumer never
    mistakes a crash for the end of the stream."""
    async with open_client(driver, broker.path, "rx") as rx:
        async with msgq_trio.connect(broker.path, "tx") as tx:
            for i in range(3):
                await tx.send(rx.lname, i)
        assert [m.body for m in await rx.iterate(3)] == [0, 1, 2]
        if how == "shutdown":
            assert await trio.to_thread.run_sync(broker.stop) == 0
            assert await rx.iterate(5) == []
        else:
            await trio.to_thread.run_sync(broker.kill)
            with pytest.raises(ConnectionLost):
                await rx.iterate(5)


async def test_a_cancelled_block_closes_its_bus_at_once_with_a_goodbye(broker: Any) -> None:
    """Cancelling the block around ``connect`` (a plugin's SIGTERM, a timeout) cancels
    the bus's reader and writer too: the close sends the queued GOODBYE itself and does
    not wait for the broker's, which nobody would read. The broker sees a clean close,
    not a lost connection."""
    with trio.move_on_after(HANG) as outer:
        with trio.CancelScope() as scope:
            async with msgq_trio.connect(broker.path, "cancelled"):
                cancelled_at = trio.current_time()
                scope.cancel()
                await trio.sleep_forever()
        closing = trio.current_time() - cancelled_at
    assert not outer.cancelled_caught
    # The close takes milliseconds; waiting for a GOODBYE nobody reads took CLOSE_WAIT
    # at least (12 s in a plugin whose writer had not sent ours).
    assert closing < CLOSE_WAIT
    await _closed_cleanly(broker)


async def _closed_cleanly(broker: Any) -> None:
    """The broker counted one clean close and no lost connection."""
    async with msgq_trio.connect(broker.path, "observer") as obs:
        st: dict[str, Any] = {}
        with trio.fail_after(HANG):
            for _ in range(100_000):  # polled: the broker counts it when it cleaned up
                st = await obs.call("msgq", "stats")
                if st["disconnects"].get("closed", 0):
                    break
                await trio.sleep(0.02)
    assert st["disconnects"].get("closed", 0) == 1
    assert st["disconnects"].get("connection-lost", 0) == 0


async def test_a_cancelled_asyncio_block_closes_its_bus_with_a_goodbye(broker: Any) -> None:
    """The asyncio client's side of the test above: a task cancelled inside ``async with
    msgq_trio.aio.connect(...)`` (asyncio delivers the cancellation once, and the
    driver reads in loop callbacks, not in a task of the block) closes its bus within
    ``CLOSE_WAIT``, with the GOODBYE exchange: the broker sees a clean close."""

    async def main() -> float:
        loop = asyncio.get_running_loop()
        entered = asyncio.Event()

        async def block() -> None:
            async with msgq_trio.aio.connect(broker.path, "cancelled"):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(block())
        await asyncio.wait_for(entered.wait(), HANG)
        cancelled_at = loop.time()
        task.cancel()
        try:
            await asyncio.wait_for(task, HANG)
        except asyncio.CancelledError:
            pass
        assert task.cancelled()
        return loop.time() - cancelled_at

    closing = await trio.to_thread.run_sync(asyncio.run, main())
    assert closing < CLOSE_WAIT
    await _closed_cleanly(broker)


# -- descriptors -------------------------------------------------------------------------
@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client reads on demand
async def test_descriptors_of_messages_nobody_took_are_closed_with_the_bus(
    driver: str, broker: Any
) -> None:
    """A message carrying a descriptor that the application never took: closing the
    bus closes the receiver's duplicate, so a pipe's read end sees EOF once the sender
    closed its own write end too (a leaked duplicate would keep the pipe open)."""
    r, w = os.pipe()
    try:
        async with (
            msgq_trio.connect(broker.path, "tx") as tx,
            open_client(driver, broker.path, "rx") as rx,
        ):
            await tx.send(rx.lname, "with a descriptor", fds=[w])
            with trio.fail_after(HANG):
                for _ in range(100_000):  # polled: the message waits in rx's driver
                    if await rx.setup(lambda bus: len(bus._in)):
                        break
                    await trio.sleep(0.01)
        os.close(w)
        w = -1
        os.set_blocking(r, False)
        assert os.read(r, 1) == b""
    finally:
        os.close(r)
        if w != -1:
            os.close(w)


@pytest.mark.parametrize("receiver", DRIVERS)
@pytest.mark.parametrize("sender", ASYNC_DRIVERS)  # the direct client sends no descriptors
async def test_a_descriptor_travels_with_a_message(sender: str, receiver: str, broker: Any) -> None:
    """A pipe's write end sent with a message arrives as the receiver's own duplicate:
    what is written to it comes out of the sender's read end; the sender's descriptor
    stays its own."""
    r, w = os.pipe()
    try:
        async with (
            open_client(sender, broker.path, "tx") as tx,
            open_client(receiver, broker.path, "rx") as rx,
        ):
            await tx.send(rx.lname, "a pipe", fds=[w])
            got = await rx.receive(HANG)
        assert got.body == "a pipe" and len(got.fds) == 1
        with os.fdopen(got.fds[0], "wb") as theirs:
            theirs.write(b"through the bus")
        os.write(w, b"!")  # ours is still open
        os.close(w)
        w = -1
        with os.fdopen(r, "rb") as ours:
            r = -1
            assert ours.read() == b"through the bus!"
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client passes no descriptors
async def test_a_handler_answers_with_a_descriptor(driver: str, broker: Any) -> None:
    """A handler's Reply with descriptors reaches the caller's request(): the caller owns
    a working duplicate, the handler could close its own at once."""
    r, w = os.pipe()

    def give(_params: object) -> msgq_trio.Reply:
        return msgq_trio.Reply({"what": "pipe"}, attachments=[b"meta"], fds=[w])

    try:
        async with (
            open_client(driver, broker.path, "svc", {"give": give}, "Svc"),
            open_client(driver, broker.path, "caller") as caller,
        ):
            answer = await caller.request("Svc", "give")
        os.close(w)
        w = -1
        assert (answer.kind, answer.body, answer.attachments) == (
            "answer",
            {"what": "pipe"},
            [b"meta"],
        )
        assert len(answer.fds) == 1
        with os.fdopen(answer.fds[0], "wb") as theirs:
            theirs.write(b"handed over")
        with os.fdopen(r, "rb") as ours:
            r = -1
            assert ours.read() == b"handed over"
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


# -- TCP and TLS ---------------------------------------------------------------------------
TOKEN = "behaviour-token-5e3a"


@pytest.fixture
def pki(short_tmp: Path) -> dict[str, Any]:
    """A CA and the broker's certificate for 127.0.0.1, as files."""
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(short_tmp / "server.pem")
    )
    return {"ca": ca, "certfile": str(short_tmp / "server.pem")}


def start_tcp_broker(
    broker_factory: Any, short_tmp: Path, pki: dict[str, Any], scheme: str
) -> tuple[Any, str, dict[str, Any]]:
    """A broker listening on ``scheme``://127.0.0.1 (a token for ``remote``, allowed to
    send to lnames, call Svc and join Grp; heartbeat 0.5 s x 3): (broker, URL, connect
    kwargs)."""
    tls = f'certfile = "{pki["certfile"]}"\nkeyfile = "{pki["certfile"]}"\n'
    config = short_tmp / f"{scheme}.toml"
    config.write_text(
        '[tcp]\nlisten = ["127.0.0.1:0"]\nheartbeat_interval = 0.5\nheartbeat_misses = 3\n'
        + (tls if scheme == "tls" else "insecure = true\n")
        + f'tokens = {{ remote = "{hash_token(TOKEN)}" }}\n'
        + '[[access.rule]]\nwho = ["tcp:remote"]\nsend = ["l.*"]\ncall = ["Svc"]\n'
        + 'subscribe = ["Grp"]\n'
    )
    b = broker_factory("--config", str(config))
    url = re.findall(rf"listening on ({scheme}://\S+)", b.log_with(f"listening on {scheme}://"))[0]
    kw: dict[str, Any] = {"token": TOKEN}
    if scheme == "tls":
        kw["ssl_context"] = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        pki["ca"].configure_trust(kw["ssl_context"])
    return b, url, kw


@pytest.mark.parametrize("scheme", ["tcp", "tls"])
@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client: Unix sockets only
async def test_over_tcp_and_tls(
    driver: str, scheme: str, broker_factory: Any, short_tmp: Path, pki: dict[str, Any]
) -> None:
    """Over ``tcp://`` (token) and ``tls://`` (token, the broker's certificate trusted):
    calls, attachments and messages work as on a Unix socket; descriptors are refused
    before anything is sent (no SCM_RIGHTS over TCP)."""
    b, url, kw = start_tcp_broker(broker_factory, short_tmp, pki, scheme)
    handlers = {"who": lambda _p, request: request.sender_name}
    with pytest.raises(ConnectError) as refused:
        async with open_client(driver, url, "intruder", **{**kw, "token": "wrong-token"}):
            pass
    assert refused.value.code == ErrorCode.UNAUTHENTICATED
    async with (
        open_client("trio", b.path, "svc", handlers, "Svc") as svc,
        open_client(driver, url, "remote", **kw) as remote,
    ):
        assert await remote.call("Svc", "who") == "remote"
        await remote.send(svc.lname, {"over": scheme}, [b"\x00" * 100_000])
        got = await svc.receive(HANG)
        with pytest.raises(UsageError, match="descriptors"):
            await remote.send(svc.lname, "fd", fds=[0])
        await svc.send(remote.lname, "back")
        assert (await remote.receive(HANG)).body == "back"
    assert (got.body, got.sender_name, got.attachments) == (
        {"over": scheme},
        "remote",
        [b"\x00" * 100_000],
    )


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_refusal_sent_before_our_hello_arrived_is_what_connect_raises(
    driver: str, broker_factory: Any
) -> None:
    """A broker that refuses a connection writes its ERROR, reads what HELLO it can for a
    bounded moment (io/connection.py ``linger``) and closes; a client whose HELLO was not
    all written by then gets EPIPE on its write. Its connect raises the broker's reason
    (``limit-exceeded``) all the same, read from the receive buffer, not the broken pipe.
    A HELLO far larger than the linger reads and the socket buffers hold makes that write
    fail every time; a loaded client that writes a small HELLO late meets the same."""
    b = broker_factory("--max-connections", "1")
    name = "n" * (16 * 1024 * 1024)
    async with open_client("trio", b.path, "first"):
        with pytest.raises(ConnectError) as refused:
            async with open_client(driver, b.path, name):
                pytest.fail("a second connection was admitted")
    assert refused.value.code == ErrorCode.LIMIT_EXCEEDED, refused.value
    assert "max_connections=1" in str(refused.value)


# -- backpressure ------------------------------------------------------------------------
async def test_a_paused_asyncio_sender_waits_instead_of_buffering(
    broker_factory: Any, raw_peer: Callable[[Path], Any]
) -> None:
    """The broker stops reading a sender whose receiver does not read: the asyncio
    driver's ``send`` then waits with at most OUT_HIGH_WATER (plus the frame that crossed
    it) queued, instead of buffering without bound; once the receiver reads, the waiting
    send completes and every message arrives, in order. (The trio driver's bound is
    tests/e2e/test_e2e_faults.py's; the direct driver's send returns only once the
    kernel took the frame.)"""
    b = broker_factory("--out-soft-limit", "65536", "--slow-consumer-timeout", "3600")
    body = b"x" * 65536
    #: Far more than the broker, both sockets' kernel buffers and OUT_HIGH_WATER hold.
    most = 400
    async with raw_peer(b.path) as sink, open_client("asyncio", b.path, "src") as src:
        await sink.hello("sink")
        assert isinstance(src, AioClient)
        bus = src.bus
        waiting: list[asyncio.Task[None]] = []

        async def flood() -> tuple[int, int]:
            """Send until a send waits (it is kept in ``waiting``); (its index, the bytes
            queued then). A send that does not wait finishes at the first yield."""
            for i in range(most):
                task = asyncio.ensure_future(bus.send(sink.lname, body))
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                if not task.done():
                    waiting.append(task)
                    return i, bus._out_bytes
                task.result()
            return most, bus._out_bytes

        sent, queued = await src.run(flood())
        assert sent < most, f"{most} sends of 64 KiB never waited ({queued} bytes queued)"
        assert queued <= msgq_trio.aio.OUT_HIGH_WATER + len(body) + 1024
        bodies = []
        while len(bodies) < sent + 1:
            frame = await sink.receive_frame(HANG)
            assert frame is not None
            bodies.append(frame.body())
        assert bodies == [body] * (sent + 1)
        await src.run(waiting[0])


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client: Unix sockets only
async def test_a_silent_broker_is_detected_over_tcp(
    driver: str, broker_factory: Any, short_tmp: Path, pki: dict[str, Any]
) -> None:
    """Over TCP a stopped broker sends no FIN: the heartbeat (WELCOME's 0.5 s x 3)
    declares the connection lost with code ``heartbeat-timeout``; an idle connection to
    a live broker is kept (the client answers the broker's heartbeats)."""
    b, url, kw = start_tcp_broker(broker_factory, short_tmp, pki, "tcp")
    async with open_client(driver, url, "remote", **kw) as remote:
        # Idle for several heartbeat intervals (the broker's own check): still connected.
        await trio.sleep(2.0)
        assert await remote.call("msgq", "version")
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            # Bounded far above 3 x 0.5 s: a heartbeat that never fires fails, not hangs.
            with trio.fail_after(60):
                code = await remote.wait_lost()
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
    assert code == ErrorCode.HEARTBEAT_TIMEOUT


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client: Unix sockets only
async def test_tls_trust_from_the_environment(
    driver: str,
    broker_factory: Any,
    short_tmp: Path,
    pki: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``ssl_context``, ``tls://`` trusts ``$MSGQ_TRIO_TLS_CA`` (as the command
    line does); a CA file that cannot be loaded is a UsageError naming the variable,
    raised before connecting."""
    _broker, url, kw = start_tcp_broker(broker_factory, short_tmp, pki, "tls")
    del kw["ssl_context"]
    ca = short_tmp / "ca.pem"
    pki["ca"].cert_pem.write_to_path(str(ca))
    monkeypatch.setenv("MSGQ_TRIO_TLS_CA", str(ca))
    async with open_client(driver, url, "remote", **kw) as remote:
        assert await remote.call("msgq", "version")
    monkeypatch.setenv("MSGQ_TRIO_TLS_CA", str(short_tmp / "missing.pem"))
    with pytest.raises(UsageError, match=r"\$MSGQ_TRIO_TLS_CA"):
        async with open_client(driver, url, "remote", **kw):
            pass


# -- reconnect (connect(..., reconnect=...)) ---------------------------------------------
class Messages(logging.Handler):
    """Collects the messages logged to it, from any thread (the asyncio driver logs from
    its loop's thread)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


#: Quick attempts, and a bound only a broken reconnect reaches.
FAST = msgq_trio.Reconnect(initial_delay=0.05, max_delay=0.5, give_up_after=2 * HANG)


async def next_message(client: Client, driver: str) -> Received:
    """The next message: by ``async for`` where the driver has it, else receive()
    (bounded by HANG either way)."""
    if driver == "direct":
        return await client.receive(HANG)
    with trio.fail_after(HANG):
        got = await client.iterate(1)
    assert len(got) == 1
    return got[0]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_reconnecting_client_survives_a_broker_restart(
    driver: str, broker_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker is SIGKILLed under a client with reconnect on that joined a group,
    has a command handler and has a call in flight to a handler that never answers: the
    call fails with ConnectionLost; while the broker is down a send fails at once saying
    the client is reconnecting; once the broker is back on the same socket, without user
    code, a call to the handler (through the group) is answered and a notification to
    the group reaches the client, on its new connection (members shows the new lname)."""
    caplog.set_level(logging.INFO, logger="msgq_trio.client")
    b = broker_factory()
    started = threading.Event()

    async def stuck(_params: object) -> None:
        started.set()
        await trio.sleep_forever()

    async with open_client(driver, b.path, "x", reconnect=FAST) as x:
        await x.add_command("echo", lambda params: {"echo": params})
        assert await x.subscribe("Grp") is True
        outcome: list[BaseException] = []
        async with msgq_trio.connect(b.path, "hanger") as hanger:
            hanger.add_command("hang", stuck)
            await hanger.subscribe("Hang")
            # Bounded: a call the loss does not fail would hang here.
            with trio.fail_after(HANG):
                async with trio.open_nursery() as nursery:

                    async def call() -> None:
                        try:
                            await x.call("Hang", "hang")
                        except Exception as exc:
                            outcome.append(exc)

                    nursery.start_soon(call)
                    await wait_thread_event(started)
                    await trio.to_thread.run_sync(b.kill)
        assert len(outcome) == 1 and isinstance(outcome[0], ConnectionLost), outcome
        with pytest.raises(ConnectionLost, match="reconnecting"):
            await x.send("Grp", "while down")
        b2 = broker_factory(path=b.path)
        await x.wait_connected(HANG)
        new_lname, reconnects = await x.state()
        assert reconnects == 1
        logged = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert [m for lvl, m in logged if lvl == "WARNING" and str(b.path) in m and "lost" in m]
        assert [m for lvl, m in logged if lvl == "INFO" and f"now {new_lname}" in m]
        answers: list[Any] = []
        async with msgq_trio.connect(b2.path, "peer") as peer, trio.open_nursery() as nursery:
            # Joined again as the new connection (a restarted broker numbers lnames
            # afresh, so the new one may even equal the old).
            assert [(m.lname, m.name) for m in await peer.members("Grp")] == [(new_lname, "x")]

            async def ask_then_notify() -> None:
                # The direct client answers while it waits in receive() below.
                answers.append(await peer.call("Grp", "echo", 7))
                await peer.notify("Grp", "after-restart", {"n": 1})

            nursery.start_soon(ask_then_notify)
            got = await next_message(x, driver)
    assert answers == [{"echo": 7}]
    assert (got.kind, got.target, got.event, got.body) == (
        "notification",
        "Grp",
        "after-restart",
        {"n": 1},
    )


@pytest.mark.parametrize("driver", DRIVERS)
async def test_without_reconnect_a_restart_leaves_the_bus_lost(
    driver: str, broker_factory: Any
) -> None:
    """Reconnect is off by default: after the broker is killed and started again on the
    same socket, the bus stays lost (calls raise ConnectionLost without "reconnecting",
    wait_connected raises it, no reconnect is counted)."""
    b = broker_factory()
    async with open_client(driver, b.path, "x") as x:
        await x.subscribe("Grp")
        await trio.to_thread.run_sync(b.kill)
        with pytest.raises(ConnectionLost) as first:
            await x.call("msgq", "version")
        broker_factory(path=b.path)
        with pytest.raises(ConnectionLost) as later:
            await x.call("msgq", "version")
        with pytest.raises(ConnectionLost):
            await x.wait_connected(HANG)
        _, reconnects = await x.state()
    assert reconnects == 0
    assert "reconnecting" not in str(first.value) and "reconnecting" not in str(later.value)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_reconnect_gives_up_after_its_bound(
    driver: str, broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker never comes back: once ``give_up_after`` passed, the loss is final:
    receiving ends with ConnectionLost (code ``reconnect-gave-up``) and an ERROR is
    logged."""
    policy = msgq_trio.Reconnect(initial_delay=0.05, max_delay=0.2, give_up_after=1.0)
    async with open_client(driver, broker.path, "x", reconnect=policy) as x:
        await trio.to_thread.run_sync(broker.kill)
        with pytest.raises(ConnectionLost) as lost:
            await next_message(x, driver)
        with pytest.raises(ConnectionLost):
            await x.wait_connected(HANG)
    assert lost.value.code == GAVE_UP, lost.value
    assert [r for r in caplog.records if r.levelname == "ERROR" and "gave up" in r.getMessage()]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_receiving_goes_on_across_a_reconnect(driver: str, broker_factory: Any) -> None:
    """A receive (``async for``; the direct client's receive()) under way when the broker
    is killed does not end: it waits across the reconnect and returns the message sent
    to the group after the broker was restarted."""
    b = broker_factory()
    got: list[Received] = []
    async with open_client(driver, b.path, "rx", reconnect=FAST) as rx:
        await rx.subscribe("Grp")
        with trio.fail_after(2 * HANG):
            async with trio.open_nursery() as nursery:

                async def take() -> None:
                    got.append(await next_message(rx, driver))

                nursery.start_soon(take)
                await trio.to_thread.run_sync(b.kill)
                b2 = broker_factory(path=b.path)
                async with msgq_trio.connect(b2.path, "tx") as tx:
                    # rx joins again by itself; the broker is another process, so poll.
                    while True:
                        if await tx.members("Grp"):
                            break
                        await trio.sleep(0.02)
                    await tx.send("Grp", "after the restart")
    assert [(m.kind, m.body) for m in got] == [("message", "after the restart")]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client: Unix sockets only
async def test_reconnect_over_tcp_after_a_broker_restart(
    driver: str, broker_factory: Any, short_tmp: Path, pki: dict[str, Any]
) -> None:
    """Over ``tcp://`` with a token: the broker is SIGKILLed and started again on the
    same port; the client reconnects with the same token, joins its group again, and a
    message to the group reaches it."""
    b, url, kw = start_tcp_broker(broker_factory, short_tmp, pki, "tcp")
    config = short_tmp / "tcp.toml"
    port = url.rsplit(":", 1)[1]
    config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
    async with open_client(driver, url, "remote", reconnect=FAST, **kw) as remote:
        await remote.subscribe("Grp")
        await trio.to_thread.run_sync(b.kill)
        b2 = broker_factory("--config", str(config), path=b.path)
        await remote.wait_connected(HANG)
        async with msgq_trio.connect(b2.path, "local") as local:
            assert [m.name for m in await local.members("Grp")] == ["remote"]
            await local.send("Grp", "over tcp again")
            got = await next_message(remote, driver)
        _, reconnects = await remote.state()
    assert (got.body, reconnects) == ("over tcp again", 1)


async def test_the_sync_client_passes_reconnect_to_its_bus(broker_factory: Any) -> None:
    """``msgq_trio.sync.connect(..., reconnect=...)`` is the trio Bus's reconnect: after
    the broker is killed and restarted, wait_connected returns, the group is joined
    again and calls work."""
    import msgq_trio.sync

    b = broker_factory()

    def run() -> tuple[int, list[Any]]:
        with msgq_trio.sync.connect(b.path, "s", reconnect=FAST) as bus:
            bus.subscribe("Grp")
            b.kill()
            broker_factory(path=b.path)
            bus.wait_connected(HANG)
            return bus.reconnects, [m.name for m in bus.members("Grp")]

    assert await trio.to_thread.run_sync(run) == (1, ["s"])


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)  # the direct client: Unix sockets only
async def test_reconnect_after_heartbeat_silence_over_tcp(
    driver: str,
    broker_factory: Any,
    short_tmp: Path,
    pki: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over TCP a stopped broker is found silent by the heartbeat (WELCOME's 0.5 s x 3):
    the client's call in flight fails with ConnectionLost (``heartbeat-timeout``) and it
    reconnects; attempts that reach the stopped broker get no WELCOME and end after
    ``attempt_timeout``. Once the broker runs again, the client is back in its group."""
    caplog.set_level(logging.DEBUG, logger="msgq_trio.client")
    seen = Messages()
    logging.getLogger("msgq_trio.client").addHandler(seen)
    b, url, kw = start_tcp_broker(broker_factory, short_tmp, pki, "tcp")
    policy = msgq_trio.Reconnect(
        initial_delay=0.05, max_delay=0.5, give_up_after=2 * HANG, attempt_timeout=1.0
    )
    async with open_client(driver, url, "remote", reconnect=policy, **kw) as remote:
        await remote.subscribe("Grp")
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ConnectionLost) as lost, trio.fail_after(HANG):
                await remote.call("msgq", "version")
            # The kernel accepts for the stopped broker: wait until an attempt has
            # timed out waiting for WELCOME (logged at DEBUG).
            with trio.fail_after(HANG):
                while True:
                    if any("WELCOME within" in m for m in seen.messages):
                        break
                    await trio.sleep(0.05)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        await remote.wait_connected(HANG)
        async with msgq_trio.connect(b.path, "local") as local:
            await local.send("Grp", "after the silence")
            got = await next_message(remote, driver)
        _, reconnects = await remote.state()
        logging.getLogger("msgq_trio.client").removeHandler(seen)
    assert lost.value.code == ErrorCode.HEARTBEAT_TIMEOUT
    assert (got.body, reconnects) == ("after the silence", 1)


async def test_the_sync_client_sends_many(broker: Any) -> None:
    """``msgq_trio.sync`` has ``send_many``: every body arrives, in order, once it
    returns."""
    import msgq_trio.sync

    def run() -> list[Any]:
        with (
            msgq_trio.sync.connect(broker.path, "tx") as tx,
            msgq_trio.sync.connect(broker.path, "rx") as rx,
        ):
            tx.send_many(rx.lname, [*range(500), "end"])
            return [rx.receive(HANG).body for _ in range(501)]

    assert await trio.to_thread.run_sync(run) == [*range(500), "end"]
