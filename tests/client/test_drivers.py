"""One handler contract on both client drivers: the same request to a callee on the trio
``Bus`` and on the blocking ``DirectBus`` gets the same answer (the session's mapping),
against a real broker process; malformed requests come from a raw-socket peer."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import ConnectionLost, RemoteError, UsageError
from msgq_trio.client.bus import OUT_HIGH_WATER
from msgq_trio.protocol.codes import ErrorCode, FrameType
from msgq_trio.protocol.framing import Frame, encode_cbor

DRIVERS = ["trio", "direct"]


@asynccontextmanager
async def callee(
    driver: str, path: Path, handlers: dict[str, Callable[..., Any]]
) -> AsyncIterator[str]:
    """A client named ``svc`` in group ``Svc`` on ``driver``, answering with
    ``handlers``; yields its lname. The direct one serves in a thread of its own; what
    that thread raised fails the test."""
    if driver == "trio":
        async with msgq_trio.connect(path, "svc") as bus:
            for name, fn in handlers.items():
                bus.add_command(name, fn)
            await bus.subscribe("Svc")
            yield bus.lname
        return
    direct = msgq_trio.connect_direct(path, "svc")
    for name, fn in handlers.items():
        direct.command(name)(fn)
    direct.subscribe("Svc")
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                direct.serve(0.02)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield direct.lname
    finally:
        stop.set()
        await trio.to_thread.run_sync(thread.join, 10)
        direct.close()
    assert not thread.is_alive() and errors == []


async def raw_request(peer: Any, rid: int, command: str, body: bytes) -> Frame:
    """Send a REQUEST with ``body`` as it is to ``Svc``; return its answer."""
    await peer.send_frame(
        FrameType.REQUEST,
        target="Svc",
        request_id=rid,
        header=encode_cbor({"cmd": command}),
        body=body,
    )
    while True:
        frame = await peer.receive_frame()
        assert isinstance(frame, Frame), "the broker closed the raw peer's connection"
        if frame.request_id == rid and frame.type in (FrameType.REPLY, FrameType.ERROR):
            return frame


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_malformed_request_body_is_bad_request_naming_the_caller(
    driver: str, broker: Any, raw_peer: Callable[[Path], Any]
) -> None:
    """A request whose body is not CBOR never reaches the handler: the answer is
    ``bad-request`` with the message that names the caller, the same on both drivers;
    the callee goes on serving."""
    seen: list[object] = []
    async with (
        callee(driver, broker.path, {"get": seen.append}),
        raw_peer(broker.path) as peer,
    ):
        await peer.hello("caller")
        answer = await raw_request(peer, 7, "get", b"\x9f")  # an unterminated array
        assert answer.type == FrameType.ERROR
        header = answer.header()
        assert header["code"] == ErrorCode.BAD_REQUEST
        assert str(header["message"]).startswith(f"request from {peer.lname} ('caller')")
        assert "malformed body" in str(header["message"])
        ok = await raw_request(peer, 8, "get", encode_cbor(1))
        assert ok.type == FrameType.REPLY
    assert seen == [1]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_handler_may_take_the_request_too(driver: str, broker: Any) -> None:
    """``fn(params, request)`` works on both drivers: the handler sees who called."""
    async with (
        callee(driver, broker.path, {"who": lambda p, r: [p, r.sender_name]}),
        msgq_trio.connect(broker.path, "caller") as caller,
    ):
        assert await caller.call("Svc", "who", 5) == [5, "caller"]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_connection_lost_from_another_connection_answers_internal_error(
    driver: str, broker: Any
) -> None:
    """A handler that fails with ConnectionLost of some other connection (its own is
    fine) answers ``internal-error`` naming it, and its client goes on serving."""

    def relay(_params: object) -> None:
        raise ConnectionLost("the upstream bus is gone")

    async with (
        callee(driver, broker.path, {"relay": relay, "ping": lambda p: "pong"}),
        msgq_trio.connect(broker.path, "caller") as caller,
    ):
        with pytest.raises(RemoteError, match="upstream bus is gone") as info:
            # A bound only for the broken case (no answer at all), never reached here.
            await caller.call("Svc", "relay", timeout=20)
        assert info.value.code == ErrorCode.INTERNAL_ERROR
        assert info.value.data == {"type": "ConnectionLost"}
        assert await caller.call("Svc", "ping") == "pong"


async def test_the_direct_client_refuses_descriptors_and_async_handlers(broker: Any) -> None:
    """The blocking driver passes no descriptors: a Reply carrying some answers
    ``internal-error`` and its duplicates are closed. An async handler is refused when
    it is registered (nothing could await it)."""
    r, w = os.pipe()
    try:
        dups: list[int] = []

        def give(_params: object) -> msgq_trio.Reply:
            reply = msgq_trio.Reply("ok", fds=[r])
            dups.extend(reply.fds)
            return reply

        async with (
            callee("direct", broker.path, {"give": give}),
            msgq_trio.connect(broker.path, "caller") as caller,
        ):
            with pytest.raises(RemoteError, match="cannot pass descriptors") as info:
                await caller.call("Svc", "give")
            assert info.value.code == ErrorCode.INTERNAL_ERROR
        assert len(dups) == 1
        with pytest.raises(OSError):
            os.fstat(dups[0])
    finally:
        os.close(r)
        os.close(w)

    with msgq_trio.connect_direct(broker.path, "svc") as direct:

        async def handler(_params: object) -> None:
            return None

        with pytest.raises(UsageError, match="plain-function handlers"):
            direct.command("a")(handler)


async def test_send_is_awaited_like_a_coroutine_method(broker: Any) -> None:
    """``Bus.send`` is a plain method returning an awaitable (no coroutine per message),
    and that awaitable passes wherever a coroutine does: awaited, handed to
    ``nursery.start_soon``, or awaited past the 256th call (its cancellation check)
    and past ``OUT_HIGH_WATER`` (its wait for the writer). Every message arrives, in
    order."""
    big = b"x" * (OUT_HIGH_WATER + 1)
    async with (
        msgq_trio.connect(broker.path, "sub") as sub,
        msgq_trio.connect(broker.path, "pub") as pub,
    ):
        await sub.subscribe("G")
        for i in range(300):
            await pub.send("G", i)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pub.send, "G", "from a task")
        await pub.send("G", big)
        await pub.flush()
        got = []
        with trio.fail_after(30):  # only a broken client gets near this
            while len(got) < 302:
                got.append((await sub.receive()).body)
    assert got == [*range(300), "from a task", big]


async def test_a_cancelled_publisher_loop_stops_and_loses_nothing_it_queued(
    broker: Any,
) -> None:
    """``Bus.send`` checks for cancellation every 256 calls (and whenever it waits), not
    at every call: a publisher loop in a cancelled scope stops within 256 messages, and
    every message it queued before that reaches the subscriber."""
    async with (
        msgq_trio.connect(broker.path, "sub") as sub,
        msgq_trio.connect(broker.path, "pub") as pub,
    ):
        await sub.subscribe("G")
        queued = 0
        with trio.CancelScope() as scope:
            scope.cancel()
            for i in range(10_000):
                await pub.send("G", i)
                queued += 1
        assert 0 < queued < 256
        await pub.flush()
        got = []
        with trio.fail_after(30):  # only a broken client gets near this
            while len(got) < queued:
                got.append((await sub.receive()).body)
        assert got == list(range(queued))
