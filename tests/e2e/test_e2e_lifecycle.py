"""End to end: broker process lifecycle (clean shutdown on signals, stale socket files,
a second broker on a live path, a path that is not a socket)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess

import pytest
import trio

import msgq_trio
from msgq_trio import ConnectionLost
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor


def exists(path: object) -> bool:
    """Whether anything (a socket file included) is at ``path``."""
    return os.path.lexists(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_clean_shutdown_on_signal(broker, sig: signal.Signals) -> None:
    """On SIGTERM/SIGINT the broker says GOODBYE: a client's iteration ends after the
    messages already sent, later calls raise ConnectionLost (code broker-shutdown), the
    socket file is removed and the broker exits with status 0."""
    async with (
        msgq_trio.connect(broker.path, name="listener") as listener,
        msgq_trio.connect(broker.path, name="talker") as talker,
    ):
        await listener.subscribe("News")
        await talker.send("News", "before")
        iterated: list[object] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def iterate() -> None:
                    async for msg in listener:
                        iterated.append(msg.body)
                        broker.send_signal(sig)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(iterate)
                await trio.sleep_forever()
        assert iterated == ["before"]
        for bus in (listener, talker):
            # receive() waits for the broker's GOODBYE; calls after it fail at once.
            with pytest.raises(ConnectionLost) as ei:
                await bus.receive(timeout=5)
            assert ei.value.code == "broker-shutdown"
            with pytest.raises(ConnectionLost) as ei:
                await bus.call("msgq", "ping")
            assert ei.value.code == "broker-shutdown"
    status = await trio.to_thread.run_sync(broker.wait, 10)
    assert status == 0, broker.log()
    assert not exists(broker.path)


async def test_pending_call_at_shutdown_raises_connection_lost(broker) -> None:
    """A call pending when the broker shuts down raises ConnectionLost (as documented for
    call() and connect()), not a generic RpcError; the broker still exits 0."""
    async with (
        msgq_trio.connect(broker.path, name="caller") as caller,
        msgq_trio.connect(broker.path, name="callee") as callee,
    ):
        await callee.subscribe("Slow")
        started = trio.Event()

        @callee.command("hang")
        async def hang(_params: object) -> None:
            started.set()
            await trio.sleep_forever()

        errors: list[BaseException] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def pending_call() -> None:
                    try:
                        await caller.call("Slow", "hang")
                    except Exception as exc:
                        errors.append(exc)

                nursery.start_soon(pending_call)
                await started.wait()
                broker.send_signal(signal.SIGTERM)
    status = await trio.to_thread.run_sync(broker.wait, 10)
    assert status == 0
    assert len(errors) == 1
    assert isinstance(errors[0], ConnectionLost), repr(errors[0])


async def test_goodbye_is_the_last_frame_at_shutdown(broker, raw_peer) -> None:
    """Rule 3: the broker's GOODBYE is the last frame it sends on a connection. A client
    with a call pending on another client, whose queue is still full of messages when the
    broker shuts down, receives those messages, then GOODBYE, then nothing (in particular
    not the recipient-gone answer produced when the callee leaves after the GOODBYE)."""
    async with raw_peer(broker.path) as caller:
        async with (
            msgq_trio.connect(broker.path, name="callee") as callee,
            msgq_trio.connect(broker.path, name="flooder") as flooder,
        ):
            assert (await caller.hello("caller")).type == FrameType.WELCOME
            await caller.subscribe("Flood")
            started = trio.Event()

            @callee.command("hang")
            async def hang(_params: object) -> None:
                started.set()
                await trio.sleep_forever()

            await callee.subscribe("Hang")
            await caller.send_frame(
                FrameType.REQUEST, target="Hang", request_id=2, header=encode_cbor({"cmd": "hang"})
            )
            with trio.fail_after(5):
                await started.wait()
            # Fill the caller's queue in the broker (the raw caller is not reading now).
            for _ in range(32):
                await flooder.send("Flood", None, attachments=[bytes(65536)])
            assert await flooder.call("msgq", "ping") == "pong"
            broker.send_signal(signal.SIGTERM)
            with pytest.raises(ConnectionLost):
                await callee.receive(timeout=5)
        # The callee has left (after the broker's GOODBYE); now the caller reads it all.
        frames = await caller.frames_until_eof(timeout=10)
    types = [f.type for f in frames]
    assert types.count(FrameType.MESSAGE) == 32
    assert FrameType.GOODBYE in types
    after = [(f.type, f.header()) for f in frames[types.index(FrameType.GOODBYE) + 1 :]]
    assert after == [], f"frames after the broker's GOODBYE: {after}"
    status = await trio.to_thread.run_sync(broker.wait, 10)
    assert status == 0


async def test_idle_client_sees_shutdown(broker) -> None:
    """An idle client waiting in receive() gets ConnectionLost (code broker-shutdown), not
    a hang, when the broker is stopped; the broker then exits 0 promptly."""
    t0 = trio.current_time()
    async with msgq_trio.connect(broker.path, name="idle") as idle:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, broker.send_signal, signal.SIGTERM)
            with pytest.raises(ConnectionLost) as ei:
                await idle.receive(timeout=5)
        assert ei.value.code == "broker-shutdown"
    status = await trio.to_thread.run_sync(broker.wait, 10)
    assert status == 0
    assert trio.current_time() - t0 < 10.0  # promptly: no client or grace period waited for
    assert not exists(broker.path)


async def test_stale_socket_file_is_replaced(broker_factory, short_tmp) -> None:
    """A socket file left by a dead broker (bound, closed, never unlinked) is replaced by a
    new broker, which then serves clients."""
    path = short_tmp / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    b = broker_factory(path=path)
    async with msgq_trio.connect(path) as bus:
        assert await bus.call("msgq", "ping") == "pong"
    b.log_with("stale")


async def test_second_broker_on_live_path_is_refused(broker, broker_argv) -> None:
    """A second broker on the path of a live one exits non-zero with a clear message on
    stderr (no traceback); the first keeps its socket and keeps working."""
    result = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            broker_argv(broker.path),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    )
    assert result.returncode != 0
    assert "already running" in result.stderr
    assert exists(broker.path)
    async with msgq_trio.connect(broker.path, name="after") as bus:
        assert await bus.call("msgq", "ping") == "pong"
    assert broker.proc.poll() is None
    assert "msgq-trio serve: a broker is already running" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


async def test_path_that_is_not_a_socket_is_left_alone(short_tmp, broker_argv) -> None:
    """A broker refuses to replace a regular file at its socket path: non-zero exit, a
    message on stderr, the file untouched."""
    path = short_tmp / "precious.txt"
    path.write_text("do not delete")
    result = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            broker_argv(path),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    )
    assert result.returncode != 0
    assert "not a socket" in result.stderr
    assert path.read_text() == "do not delete"


async def test_invalid_configuration_is_refused(short_tmp, broker_argv) -> None:
    """Inconsistent limits (hard limit below twice the frame size) exit with status 2 and a
    message, without creating the socket."""
    path = short_tmp / "bad.sock"
    result = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            broker_argv(path, "--max-frame-size", "1048576", "--out-hard-limit", "1048576"),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    )
    assert result.returncode == 2
    assert "invalid configuration" in result.stderr
    assert not exists(path)


async def test_iteration_raises_when_dropped(broker) -> None:
    """A consumer iterating with ``async for`` is told when the broker drops it: it gets
    every message received before the drop, then ConnectionLost with the reason's code
    (here an operator's ``drop``), never a silent end of the loop."""
    async with (
        msgq_trio.connect(broker.path, name="victim") as victim,
        msgq_trio.connect(broker.path, name="operator") as operator,
    ):
        await victim.subscribe("News")
        for i in range(3):
            await operator.send("News", i)
        await operator.flush()
        got: list[object] = []
        with trio.fail_after(10):
            while len(got) < 3:
                got.append((await victim.receive()).body)
            await operator.call("msgq", "drop", {"lname": victim.lname})
            with pytest.raises(ConnectionLost) as ei:
                async for msg in victim:
                    got.append(msg.body)
        assert got == [0, 1, 2]
        assert ei.value.code == "dropped"


async def test_iteration_raises_when_broker_is_killed(broker) -> None:
    """SIGKILL of the broker (no GOODBYE) ends a consumer's ``async for`` with
    ConnectionLost after the messages already received, not with a normal end."""
    async with (
        msgq_trio.connect(broker.path, name="listener") as listener,
        msgq_trio.connect(broker.path, name="talker") as talker,
    ):
        await listener.subscribe("News")
        await talker.send("News", "before")
        await talker.flush()
        got: list[object] = []
        with trio.fail_after(10):
            with pytest.raises(ConnectionLost) as ei:
                async for msg in listener:
                    got.append(msg.body)
                    broker.send_signal(signal.SIGKILL)
        assert got == ["before"]
        assert ei.value.code is None
