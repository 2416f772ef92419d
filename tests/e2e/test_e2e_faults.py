"""End to end: a misbehaving client (absurd length prefixes, garbage, stalled frames,
oversized frames) is dropped alone while the others keep working."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

import msgq_trio
from msgq_trio import Bus, ConnectionLost
from msgq_trio.errors import UsageError
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame


def raw_frame(ftype: int, **kw: Any) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(ftype, **kw))


@asynccontextmanager
async def bystanders(path: Any) -> AsyncIterator[tuple[Bus, Bus, Bus]]:
    """Two clients that exchange messages and calls, plus a membership watcher."""
    async with (
        msgq_trio.connect(path, name="left") as left,
        msgq_trio.connect(path, name="right") as right,
        msgq_trio.connect(path, name="watcher") as watcher,
    ):
        await watcher.subscribe("msgq.membership")

        @right.command("echo")
        def echo(params: object) -> object:
            return params

        await right.subscribe("Right")
        yield left, right, watcher


async def still_exchanging(left: Bus, right: Bus, rounds: int = 20) -> None:
    """The two bystanders can still message each other and call each other."""
    with trio.fail_after(10):
        for i in range(rounds):
            await left.send(right.lname, i)
            assert (await right.receive()).body == i
            await right.send(left.lname, -i)
            assert (await left.receive()).body == -i
        assert await left.call("Right", "echo", {"still": "alive"}) == {"still": "alive"}


async def disconnect_reason(watcher: Bus, lname: str) -> str:
    """Wait for the 'disconnected' membership event of ``lname``; return its reason."""
    with trio.fail_after(10):
        while True:
            msg = await watcher.receive()
            if msg.event == "disconnected" and msg.body["lname"] == lname:
                return str(msg.body["reason"])


@pytest.mark.parametrize("handshake_first", [False, True], ids=["before-hello", "after-hello"])
async def test_absurd_length_prefix_drops_only_that_client(
    broker, raw_peer, handshake_first: bool
) -> None:
    """A raw client that sends a 4 GiB length prefix gets one ERROR frame (request id 0,
    code frame-too-large) and then EOF; its disconnection reason is frame-too-large; two
    other clients keep exchanging messages."""
    async with bystanders(broker.path) as (left, right, watcher):
        await still_exchanging(left, right, rounds=3)
        async with raw_peer(broker.path) as raw:
            if handshake_first:
                assert (await raw.hello("bomber")).type == FrameType.WELCOME
            await raw.send_bytes(struct.pack(">I", 0xFFFFFFF0) + b"\x03\x00" + b"\x00" * 26)
            frames = await raw.frames_until_eof(timeout=5)
            assert [(f.type, f.request_id, f.header().get("code")) for f in frames] == [
                (FrameType.ERROR, 0, "frame-too-large")
            ]
        if handshake_first:
            assert await disconnect_reason(watcher, raw.lname) == "frame-too-large"
        await still_exchanging(left, right)


@pytest.mark.parametrize("same_write", [False, True], ids=["separate-write", "same-write"])
async def test_garbage_after_handshake_drops_only_that_client(
    broker, raw_peer, same_write: bool
) -> None:
    """A client that sends a valid message and then garbage (an unknown frame type) has its
    valid message delivered, then gets ERROR protocol-error and EOF, whether the garbage
    came in the same write or a later one; the others keep working."""
    async with bystanders(broker.path) as (left, right, watcher):
        async with raw_peer(broker.path) as raw:
            assert (await raw.hello("garbler")).type == FrameType.WELCOME
            good = raw_frame(FrameType.MESSAGE, target="Right", body=encode_cbor("valid"))
            garbage = b"\x00\x00\x00\x1c" + b"\xee" * 28
            if same_write:
                await raw.send_bytes(good + garbage)
            else:
                await raw.send_bytes(good)
                msg = await right.receive(timeout=5)
                assert msg.body == "valid"
                await raw.send_bytes(garbage)
            frames = await raw.frames_until_eof(timeout=5)
            assert [(f.type, f.request_id, f.header().get("code")) for f in frames] == [
                (FrameType.ERROR, 0, "protocol-error")
            ]
        if same_write:
            msg = await right.receive(timeout=5)
            assert (msg.body, msg.sender) == ("valid", raw.lname)
        assert await disconnect_reason(watcher, raw.lname) == "protocol-error"
        await still_exchanging(left, right)


async def test_random_garbage_stream(broker, raw_peer) -> None:
    """Pure noise after a valid handshake ends that connection (ERROR or EOF, never a
    hang) and leaves the broker serving the others."""
    noise = bytes((i * 151 + 7) % 256 for i in range(5000))
    async with bystanders(broker.path) as (left, right, _watcher):
        async with raw_peer(broker.path) as raw:
            assert (await raw.hello("noise")).type == FrameType.WELCOME
            await raw.send_bytes(noise)
            frames = await raw.frames_until_eof(timeout=5)
            assert [f.type for f in frames] in ([FrameType.ERROR], [])
        await still_exchanging(left, right)


async def test_stalled_frame_is_dropped(broker_factory, raw_peer) -> None:
    """With --idle-in-frame-timeout 0.5 a client that sends half a frame and stalls gets
    ERROR protocol-error and EOF; others are unaffected."""
    b = broker_factory("--idle-in-frame-timeout", "0.5")
    async with bystanders(b.path) as (left, right, watcher):
        async with raw_peer(b.path) as raw:
            assert (await raw.hello("staller")).type == FrameType.WELCOME
            frame = raw_frame(FrameType.MESSAGE, target="Right", body=encode_cbor("x" * 100))
            await raw.send_bytes(frame[:50])
            t0 = trio.current_time()
            frames = await raw.frames_until_eof(timeout=20)
            assert 0.4 <= trio.current_time() - t0 < 20.0  # not the 30 s default
            assert [f.header().get("code") for f in frames] == ["protocol-error"]
        assert await disconnect_reason(watcher, raw.lname) == "protocol-error"
        await still_exchanging(left, right)


async def test_a_large_frame_sent_slowly_passes_and_one_that_stalls_is_dropped(
    broker_factory, raw_peer
) -> None:
    """--idle-in-frame-timeout bounds the gap between a frame's pieces, not the frame: a
    1 MiB frame sent in 16 pieces 0.25 s apart (4 s in all, twice the 2 s limit) reaches
    its receiver whole; the next large frame, stalled after two pieces, gets its sender
    ERROR protocol-error and EOF; others are unaffected."""
    b = broker_factory("--idle-in-frame-timeout", "2")
    body = bytes(range(256)) * 4096
    async with bystanders(b.path) as (left, right, watcher):
        async with raw_peer(b.path) as raw:
            assert (await raw.hello("slow-sender")).type == FrameType.WELCOME
            frame = raw_frame(FrameType.MESSAGE, target="Right", body=encode_cbor(body))
            piece = -(-len(frame) // 16)
            for i in range(0, len(frame), piece):
                await raw.send_bytes(frame[i : i + piece])
                await trio.sleep(0.25)
            msg = await right.receive(timeout=10)
            assert msg.body == body
            await raw.send_bytes(frame[: 2 * piece])
            t0 = trio.current_time()
            frames = await raw.frames_until_eof(timeout=30)
            assert 1.5 <= trio.current_time() - t0 < 30.0  # the limit, not the 30 s default
            assert [f.header().get("code") for f in frames] == ["protocol-error"]
        assert await disconnect_reason(watcher, raw.lname) == "protocol-error"
        await still_exchanging(left, right)


async def test_max_frame_size_flag(broker_factory) -> None:
    """With --max-frame-size 1048576 a 900 KiB attachment passes; a client sending a 2 MiB
    one is dropped (ConnectionLost; the broker's reason is frame-too-large) and only it."""
    b = broker_factory(
        "--max-frame-size", "1048576", "--out-hard-limit", "4194304", "--out-soft-limit", "1048576"
    )
    async with bystanders(b.path) as (left, right, watcher):
        async with msgq_trio.connect(b.path, name="big-sender") as big:
            assert (await big.call("msgq", "version"))["protocol"] == 1
            await big.send(right.lname, "fits", attachments=[b"a" * (900 * 1024)])
            msg = await right.receive(timeout=5)
            assert bytes(msg.attachments[0]) == b"a" * (900 * 1024)
            try:
                await big.send(right.lname, "too big", attachments=[b"b" * (2 * 1024 * 1024)])
                await big.receive(timeout=5)
            except UsageError:
                pass  # refusing it locally is fine too
            except ConnectionLost:
                # The code the client reports is checked by
                # test_dropped_client_learns_the_reason_when_busy; here: the broker's side.
                assert await disconnect_reason(watcher, big.lname) == "frame-too-large"
            else:
                pytest.fail("a 2 MiB frame went through a 1 MiB broker")
        await still_exchanging(left, right)


def stall_this_process(seconds: float) -> None:
    """Block the whole event loop, like a client process that is descheduled for a while."""
    time.sleep(seconds)


async def test_dropped_client_learns_the_reason_when_busy(broker_factory) -> None:
    """A client dropped for an oversized frame reports ConnectionLost with code
    frame-too-large even if its process was descheduled while the broker answered, so that
    it notices the broker's ERROR frame and the failed write together (8 rounds)."""
    b = broker_factory(
        "--max-frame-size", "1048576", "--out-hard-limit", "4194304", "--out-soft-limit", "1048576"
    )
    codes: list[str | None] = []
    for _ in range(8):
        async with msgq_trio.connect(b.path, name="busy") as bus:

            async def send_big(bus: Bus = bus) -> None:
                try:
                    await bus.send(bus.lname, "too big", attachments=[bytes(2 * 1024 * 1024)])
                    await bus.receive(timeout=5)
                except ConnectionLost as exc:
                    codes.append(exc.code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_big)
                # The writer has started the frame and waits for the socket to drain.
                await trio.testing.wait_all_tasks_blocked()
                stall_this_process(0.2)  # meanwhile the broker sends ERROR and closes
    assert codes == ["frame-too-large"] * 8


async def test_bus_lost_tells_a_sender_that_never_reads(broker_factory) -> None:
    """A client that only sends learns that the broker dropped it for its last frame from
    ``bus.lost`` (code frame-too-large), without a receive or a further call; ``lost`` is
    None while the connection is up."""
    # 512 KiB: over the broker's limit, under the client's OUT_HIGH_WATER (1 MiB), so
    # send() returns at once and nothing else would tell the client.
    b = broker_factory("--max-frame-size", "262144")
    async with msgq_trio.connect(b.path, name="sender") as bus:
        assert bus.lost is None
        await bus.send("Nobody", "small")
        await bus.flush()
        assert bus.lost is None
        await bus.send("Nobody", "too big", attachments=[bytes(512 * 1024)])
        with trio.fail_after(5):
            while bus.lost is None:  # what a sender checks now and then  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert bus.lost.code == "frame-too-large"
        with pytest.raises(ConnectionLost):
            await bus.send("Nobody", "after")


async def test_sigkilled_client_is_cleaned_up(broker, spawn_client) -> None:
    """A client process killed with SIGKILL leaves its groups, its lname stops resolving,
    and the broker reports it disconnected with reason connection-lost."""
    async with msgq_trio.connect(broker.path, name="observer") as obs:
        await obs.subscribe("msgq.membership")
        helper = spawn_client(
            broker.path, name="doomed", groups=["Doomed"], commands={"pid": "pid"}
        )
        assert await obs.call("Doomed", "pid") == helper.pid
        helper.sigkill()
        assert await disconnect_reason(obs, helper.lname) == "connection-lost"
        assert await obs.members("Doomed") == []
        with pytest.raises(msgq_trio.NoRecipient):
            await obs.call(helper.lname, "pid")


async def test_stopped_consumer_is_dropped_and_senders_resume(broker_factory, spawn_client) -> None:
    """A subscriber process stopped with SIGSTOP stops draining: the broker pauses the
    sender feeding it (backpressure) while unrelated clients keep working, then after
    --slow-consumer-timeout (1 s) without progress drops it (slow-consumer) and the sender
    carries on."""
    b = broker_factory("--out-soft-limit", "1048576", "--slow-consumer-timeout", "1")
    async with (
        bystanders(b.path) as (left, right, watcher),
        msgq_trio.connect(b.path, name="pusher") as pusher,
    ):
        sink = spawn_client(b.path, name="sink", groups=["Sink"])
        os.kill(sink.pid, signal.SIGSTOP)
        pushed = trio.Event()

        async def push() -> None:
            for _ in range(256):  # 16 MiB, far beyond the socket buffer and the soft limit
                await pusher.send("Sink", None, attachments=[bytes(65536)])
            await pusher.flush()
            pushed.set()

        t0 = trio.current_time()
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(push)
                await trio.sleep(0.3)
                assert not pushed.is_set()
                await still_exchanging(left, right, rounds=5)  # not stalled by the sink
                assert await disconnect_reason(watcher, sink.lname) == "slow-consumer"
                dropped_after = trio.current_time() - t0
                await pushed.wait()
        assert 0.9 <= dropped_after < 8.0
        assert await pusher.call("msgq", "ping") == "pong"
        await still_exchanging(left, right)


async def test_sender_killed_while_paused_is_dropped_and_its_callers_fail_fast(
    broker_factory, spawn_client, call_paused_then_kill
) -> None:
    """A client whose reads the broker has paused (it floods a stopped subscriber) is
    SIGKILLed while a call to it is pending. Its EOF sits behind data the broker is not
    reading, yet the broker sees the hang-up: the caller gets recipient-gone, not the
    call's timeout, and the client's disconnection is announced long before
    --slow-consumer-timeout (60 s) would drop the stopped subscriber. The frames it sent
    that were never delivered are counted in the log and in the broker's counters."""
    b = broker_factory("--out-soft-limit", "1048576", "--slow-consumer-timeout", "60")
    async with bystanders(b.path) as (left, right, watcher):
        sink = spawn_client(b.path, name="sink", groups=["Sink"])
        os.kill(sink.pid, signal.SIGSTOP)
        flooder = spawn_client(
            b.path,
            name="flooder",
            commands={"work": "hang"},
            flood={"target": "Sink", "size": 65536},
        )
        outcome = await call_paused_then_kill(left, flooder, timeout=20)
        assert await disconnect_reason(watcher, flooder.lname) == "connection-lost"
        assert [type(e) for e in outcome] == [msgq_trio.RecipientGone]
        stats = await left.call("msgq", "stats")
        assert stats["paused_readers"] == 0
        found = re.search(
            r"client l\.\d+ \(name='flooder'.*\) closed the connection.* "
            r"while its reads were paused by backpressure: discarding (\d+) "
            r"frames \((\d+) bytes\)",
            # Written by the broker's log thread: it may land after the client saw it.
            b.log_with("while its reads were paused by backpressure"),
        )
        assert found, b.log()
        assert int(found[1]) >= 1 and int(found[2]) >= 65536 * int(found[1])
        assert stats["counters"]["discarded_frames"] == int(found[1])
        await still_exchanging(left, right)
        os.kill(sink.pid, signal.SIGCONT)


@pytest.mark.parametrize("client", ["trio", "direct"])
async def test_publisher_closing_while_paused_loses_nothing(
    broker_factory, raw_peer, client: str
) -> None:
    """A publisher sends to a receiver that does not read for 4 s (twice the client's
    2 s GOODBYE wait) until the broker pauses its reads, sends two more messages (they
    stay unread in its socket) and closes. Its close waits while the broker has its bytes
    unread (up to the broker's slow_consumer_timeout without progress, told in WELCOME):
    every message arrives once the receiver reads again, and none is discarded."""
    b = broker_factory("--out-soft-limit", "1048576", "--slow-consumer-timeout", "8")
    size = 65536
    async with raw_peer(b.path) as sink, msgq_trio.connect(b.path, name="obs") as obs:
        assert (await sink.hello("sink")).type == FrameType.WELCOME
        await sink.subscribe("Sink")
        sent, closed = trio.Event(), trio.Event()
        count = 0

        async def paused() -> bool:
            await trio.sleep(0.01)  # let the broker read what was just written
            return bool((await obs.call("msgq", "stats"))["paused_readers"])

        async def publish_trio() -> None:
            nonlocal count
            async with msgq_trio.connect(b.path, name="pub") as pub:
                extra = 2
                while extra:
                    await pub.send("Sink", [count, bytes(size)])
                    await pub.flush()
                    count += 1
                    if extra < 2 or await paused():
                        extra -= 1
                sent.set()
            closed.set()

        def publish_direct() -> None:
            nonlocal count
            with msgq_trio.connect_direct(b.path, name="pub") as pub:
                extra = 2
                while extra:
                    pub.send("Sink", [count, bytes(size)])
                    count += 1
                    if extra < 2 or trio.from_thread.run(paused):
                        extra -= 1
                trio.from_thread.run_sync(sent.set)

        async def publish() -> None:
            if client == "trio":
                await publish_trio()
            else:
                await trio.to_thread.run_sync(publish_direct)
                closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            with trio.fail_after(10):
                await sent.wait()
            await trio.sleep(4.0)
            assert not closed.is_set()  # still waiting for the broker's GOODBYE
            assert (await obs.call("msgq", "stats"))["paused_readers"] == 1
            got = []
            with trio.fail_after(30):
                while len(got) < count:
                    frame = await sink.receive_frame()
                    assert frame is not None
                    if frame.type == FrameType.MESSAGE:
                        body = frame.body()
                        assert isinstance(body, list) and len(body[1]) == size
                        got.append(body[0])
        assert closed.is_set() and got == list(range(count))
        stats = await obs.call("msgq", "stats")
        assert stats["counters"]["discarded_frames"] == 0
    assert "while its reads were paused" not in b.log()


SUBSCRIBER = """
import sys, trio, msgq_trio
async def main():
    async with msgq_trio.connect(sys.argv[1], name="bulk-sub",
                                 max_frame_size=65 << 20) as bus:
        await bus.subscribe("Bulk")
        print("ready", flush=True)
        n = 0
        async for msg in bus:
            with msg:
                assert len(msg.attachments[0]) == 64 << 20
            n += 1
            if n == int(sys.argv[2]):
                break
        print("received", n, flush=True)
trio.run(main)
"""


def start_subscriber(path: Any, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, str(path), str(count)], stdout=subprocess.PIPE, text=True
    )


async def test_paused_sender_resumes_as_its_receiver_drains(broker_factory) -> None:
    """A publisher sends 12 x 64 MiB to a subscriber process that reads as fast as it
    can: the broker pauses the publisher while each message drains (longer than the
    20 ms between its hang-up checks) and resumes it on the receiver's progress. A lost
    wake-up (seen in the attachment benchmark: the paused reader woke for its hang-up
    check, missed the writer's wake-up meanwhile and waited on) stalled it until
    --slow-consumer-timeout, here 60 s. The race depends on timing: against the faulty
    code this test failed in 1 of 4 runs, the benchmark in about half of its runs."""
    b = broker_factory("--slow-consumer-timeout", "60", "--max-frame-size", str(65 << 20))
    count = 12
    sub = start_subscriber(b.path, count)
    try:
        assert sub.stdout is not None
        assert await trio.to_thread.run_sync(sub.stdout.readline) == "ready\n"
        with trio.fail_after(40):
            async with msgq_trio.connect(b.path, name="bulk-pub") as pub:
                blob = memoryview(bytearray(64 << 20))
                for _ in range(count):
                    await pub.send("Bulk", None, attachments=[blob])
                await pub.flush()
            line = await trio.to_thread.run_sync(sub.stdout.readline)
        assert line == f"received {count}\n"
    finally:
        sub.kill()
        sub.wait()
        if sub.stdout is not None:
            sub.stdout.close()
