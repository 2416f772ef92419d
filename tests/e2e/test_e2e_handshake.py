"""End to end: the handshake against a real broker process (lnames, version mismatch,
first-frame rules, handshake timeout)."""

from __future__ import annotations

import re
from contextlib import AsyncExitStack

import pytest
import trio

import msgq_trio
from msgq_trio import ConnectError
from msgq_trio.protocol import connection as connection_module
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame


def raw_frame(ftype: int, **kw: object) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(ftype, **kw))  # type: ignore[arg-type]


async def test_connect_assigns_lname(broker) -> None:
    """connect() completes the handshake: the bus has an lname l.N, the broker's version,
    and the broker answers its own commands."""
    async with msgq_trio.connect(broker.path, name="alpha") as bus:
        assert re.fullmatch(r"l\.[1-9][0-9]*", bus.lname)
        assert bus.broker_version == msgq_trio.__version__
        assert await bus.version() == {"broker": msgq_trio.__version__, "protocol": 1}
        assert await bus.call("msgq", "ping") == "pong"
        assert await bus.call("l.0", "ping") == "pong"


async def test_version_mismatch_raw(broker, raw_peer) -> None:
    """A HELLO with protocol version 99 is answered with one ERROR frame (request id 0, code
    version-mismatch, body listing the supported versions), then the connection closes;
    the broker keeps serving others."""
    async with raw_peer(broker.path) as raw:
        answer = await raw.hello("time-traveller", version=99)
        assert answer.type == FrameType.ERROR
        assert answer.request_id == 0
        assert answer.header()["code"] == "version-mismatch"
        assert answer.body() == {"supported": [1]}
        assert await raw.frames_until_eof(timeout=5) == []
    async with msgq_trio.connect(broker.path) as bus:
        assert await bus.call("msgq", "ping") == "pong"


async def test_version_mismatch_connect_error(broker, monkeypatch) -> None:
    """msgq_trio.connect() from a client speaking another protocol version raises
    ConnectError with code version-mismatch."""
    monkeypatch.setattr(connection_module, "PROTOCOL_VERSION", 99)
    with pytest.raises(ConnectError) as ei:
        async with msgq_trio.connect(broker.path, name="future-client"):
            pytest.fail("the handshake should have been refused")
    assert ei.value.code == "version-mismatch"


async def test_connect_without_broker(short_tmp) -> None:
    """connect() to a path where no broker listens raises ConnectError at once."""
    with pytest.raises(ConnectError):
        async with msgq_trio.connect(short_tmp / "nobody.sock"):
            pytest.fail("connected to nothing")


@pytest.mark.parametrize(
    "first", [FrameType.MESSAGE, FrameType.REQUEST, FrameType.WELCOME, FrameType.GOODBYE]
)
async def test_first_frame_must_be_hello(broker, raw_peer, first: FrameType) -> None:
    """A connection whose first frame is not HELLO gets an ERROR protocol-error and EOF."""
    async with raw_peer(broker.path) as raw:
        await raw.send_bytes(
            raw_frame(first, target="G", request_id=1, header=encode_cbor({"cmd": "x"}))
        )
        frames = await raw.frames_until_eof(timeout=5)
        assert [(f.type, f.header()["code"]) for f in frames] == [
            (FrameType.ERROR, "protocol-error")
        ]


async def test_garbage_before_hello(broker, raw_peer) -> None:
    """Garbage with a plausible length but an unknown frame type, sent before HELLO, gets an
    ERROR protocol-error and EOF."""
    async with raw_peer(broker.path) as raw:
        await raw.send_bytes(b"\x00\x00\x00\x1c" + b"\xee" * 28)
        frames = await raw.frames_until_eof(timeout=5)
        assert [f.header()["code"] for f in frames] == ["protocol-error"]


@pytest.mark.parametrize("name", ["x" * 256, "nul\0name", 42])
async def test_invalid_hello_name(broker, raw_peer, name: object) -> None:
    """A HELLO whose name is too long, contains NUL or is not a string is refused with
    protocol-error and the connection closed."""
    async with raw_peer(broker.path) as raw:
        answer = await raw.hello(name)  # type: ignore[arg-type]
        assert answer.type == FrameType.ERROR
        assert answer.header()["code"] == "protocol-error"
        assert await raw.frames_until_eof(timeout=5) == []


async def test_handshake_timeout(broker_factory, raw_peer) -> None:
    """With --handshake-timeout 0.5 a connection that never sends HELLO is closed after
    about half a second."""
    b = broker_factory("--handshake-timeout", "0.5")
    async with raw_peer(b.path) as raw:
        t0 = trio.current_time()
        await raw.frames_until_eof(timeout=9)
        assert 0.4 <= trio.current_time() - t0 < 9.0  # not the 10 s default


async def test_frames_pipelined_after_hello(broker, raw_peer) -> None:
    """Frames a client sends right behind its HELLO, before WELCOME arrived, are routed
    like any other (nothing more needs to be sent to flush them)."""
    async with msgq_trio.connect(broker.path, name="member") as member:
        await member.subscribe("Pipe")
        async with raw_peer(broker.path) as raw:
            await raw.send_bytes(
                raw_frame(FrameType.HELLO, header=encode_cbor({"version": 1, "name": "eager"}))
                + raw_frame(FrameType.MESSAGE, target="Pipe", body=encode_cbor("early"))
            )
            welcome = await raw.receive_frame()
            assert welcome is not None and welcome.type == FrameType.WELCOME
            msg = await member.receive(timeout=5)
            assert (msg.body, msg.sender_name) == ("early", "eager")


async def test_lnames_unique_across_1000_connections(broker) -> None:
    """1,000 connections (10 batches of 100 open at once, each batch closed before the next)
    all get distinct lnames, and lnames are never reused after disconnects."""
    seen: list[int] = []
    for batch in range(10):
        async with AsyncExitStack() as stack:
            buses = [
                await stack.enter_async_context(
                    msgq_trio.connect(broker.path, name=f"b{batch}-{i}")
                )
                for i in range(100)
            ]
            numbers = [int(b.lname.removeprefix("l.")) for b in buses]
            if seen:
                assert min(numbers) > max(seen), "an lname was reused after a disconnect"
            seen.extend(numbers)
    assert len(seen) == 1000
    assert len(set(seen)) == 1000
    async with msgq_trio.connect(broker.path) as last:
        assert int(last.lname.removeprefix("l.")) > max(seen)


async def test_max_connections(broker_factory) -> None:
    """With --max-connections 2 a third client is refused: ConnectError with code
    limit-exceeded; once one leaves, a new client gets in."""
    b = broker_factory("--max-connections", "2")
    async with msgq_trio.connect(b.path, name="one"):
        async with msgq_trio.connect(b.path, name="two"):
            with pytest.raises(ConnectError) as ei:
                async with msgq_trio.connect(b.path, name="three"):
                    pytest.fail("a third connection was admitted")
            assert ei.value.code == "limit-exceeded"
        # The broker frees the slot just after its GOODBYE to "two": allow it a moment.
        for _ in range(40):
            try:
                async with msgq_trio.connect(b.path, name="four") as four:
                    assert await four.call("msgq", "ping") == "pong"
                    break
            except ConnectError as exc:
                assert exc.code == "limit-exceeded"
                await trio.sleep(0.05)
        else:
            pytest.fail("the slot of a departed client was never freed")
