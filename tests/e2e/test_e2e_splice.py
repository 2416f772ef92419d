"""Large frames spliced through the broker (``limits.splice_min_size``,
``transport/splice.py``): what arrives is exactly what was sent, on each path a spliced
frame can take (one receiver, several, no free pipe), and the broker holds no pipe and no
extra descriptor afterwards, whatever became of the sender or the receiver."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import Bus
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame

MiB = 1 << 20


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def raw_frame(ftype: int, **kw: Any) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(ftype, **kw))


async def stats(bus: Bus) -> dict[str, Any]:
    return await bus.call("msgq", "stats")  # type: ignore[no-any-return]


async def settled(bus: Bus, fds: int, timeout: float = 10.0) -> dict[str, Any]:
    """The broker's stats once it holds no pipe and is back to ``fds`` descriptors."""
    with trio.fail_after(timeout):
        while True:
            st = await stats(bus)
            if st["splice_pipes"] == 0 and st["fds"] == fds:
                return st
            await trio.sleep(0.02)


async def stats_when(
    bus: Bus, ready: Callable[[dict[str, Any]], bool], timeout: float = 10.0
) -> dict[str, Any]:
    """The broker's stats once ``ready`` holds for them (polled: another process)."""
    with trio.fail_after(timeout):
        while True:
            st = await stats(bus)
            if ready(st):
                return st
            await trio.sleep(0.01)


async def wait_for_pipes(bus: Bus) -> None:
    """Until the broker holds at least one pipe (a frame is being spliced or is queued)."""
    await stats_when(bus, lambda st: st["splice_pipes"] > 0)


@asynccontextmanager
async def big_subscriber_and_raw_sender(
    path: Path, raw_peer: Callable[[Path], Any], name: str
) -> AsyncIterator[tuple[Bus, Bus, Any, int]]:
    """A subscriber of ``Big``, a second client for stats, a raw sender past its handshake
    as ``name``, and the broker's descriptor count before the raw sender connected."""
    async with (
        msgq_trio.connect(path, name="sub") as sub,
        msgq_trio.connect(path, name="ops") as ops,
    ):
        fds = (await stats(ops))["fds"]
        await sub.subscribe("Big")
        async with raw_peer(path) as raw:
            assert (await raw.hello(name)).type == FrameType.WELCOME
            yield sub, ops, raw, fds


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
async def test_large_messages_arrive_whole_and_in_order(broker_factory, splice: bool) -> None:
    """4 MiB messages between small ones, one receiver: every body intact and in order;
    each large one was spliced (counted), or none with ``--splice-min-size 0``."""
    b = broker_factory(*(() if splice else ("--splice-min-size", "0")))
    sent: list[bytes] = []
    async with (
        msgq_trio.connect(b.path, name="sub") as sub,
        msgq_trio.connect(b.path, name="pub") as pub,
        msgq_trio.connect(b.path, name="ops") as ops,
    ):
        fds = (await stats(ops))["fds"]
        await sub.subscribe("Big")
        for i in range(5):
            for body in (f"small {i}".encode(), payload(4 * MiB + i, i)):
                sent.append(body)
                await pub.send("Big", body)
        await pub.flush()
        with trio.fail_after(30):
            for i, body in enumerate(sent):
                msg = await sub.receive()
                assert msg.body == body, f"message {i} differs"
        st = await settled(ops, fds)
    assert st["spliced_frames"] == (5 if splice else 0)
    assert st["splice_fallbacks"] == 0


async def test_a_spliced_message_for_several_receivers_reaches_each_whole(broker) -> None:
    """Pipes go to one socket only: for a group of three the broker reads the rest back
    once and all three get the same bytes."""
    bodies = [payload(4 * MiB, 10 + i) for i in range(3)]
    async with (
        msgq_trio.connect(broker.path, name="a") as a,
        msgq_trio.connect(broker.path, name="b") as b,
        msgq_trio.connect(broker.path, name="c") as c,
        msgq_trio.connect(broker.path, name="pub") as pub,
    ):
        fds = (await stats(pub))["fds"]
        for s in (a, b, c):
            await s.subscribe("Fan")
        for body in bodies:
            await pub.send("Fan", body)
        await pub.flush()
        with trio.fail_after(30):
            for s in (a, b, c):
                assert [(await s.receive()).body for _ in bodies] == bodies
        st = await settled(pub, fds)
    assert st["spliced_frames"] == 3


async def test_without_a_free_pipe_a_large_message_is_copied(broker_factory) -> None:
    """``--splice-max-pipes 1``: a 4 MiB rest needs more than one pipe, so the broker reads
    back what it spliced and receives the rest the ordinary way: bodies intact, the
    fallback counted, no pipe left."""
    b = broker_factory("--splice-max-pipes", "1")
    bodies = [payload(4 * MiB, 20 + i) for i in range(3)]
    async with (
        msgq_trio.connect(b.path, name="sub") as sub,
        msgq_trio.connect(b.path, name="pub") as pub,
    ):
        fds = (await stats(pub))["fds"]
        await sub.subscribe("Big")
        for body in bodies:
            await pub.send("Big", body)
        await pub.flush()
        with trio.fail_after(30):
            assert [(await sub.receive()).body for _ in bodies] == bodies
        st = await settled(pub, fds)
    assert st["splice_fallbacks"] == 3
    assert st["spliced_frames"] == 0


async def test_a_sender_gone_in_the_middle_of_a_spliced_frame_leaves_nothing(
    broker, raw_peer
) -> None:
    """A raw sender writes 3 of a 4 MiB message's MiB and closes: the receiver gets none
    of it (the next message from another sender comes first), the broker logs who died
    mid-frame, and its pipes and descriptors are all released."""
    frame = raw_frame(FrameType.MESSAGE, target="Big", body=encode_cbor(payload(4 * MiB, 30)))
    async with big_subscriber_and_raw_sender(broker.path, raw_peer, "dies-mid-frame") as (
        sub,
        ops,
        raw,
        fds,
    ):
        await raw.send_bytes(frame[: 3 * MiB])
        await wait_for_pipes(ops)
        await raw.aclose()
        await ops.send("Big", b"after")
        with trio.fail_after(10):
            assert (await sub.receive()).body == b"after"
        await settled(ops, fds)
    broker.log_with("closed the connection in the middle of a frame")


async def test_a_receiver_gone_with_spliced_messages_queued_leaves_nothing(
    broker_factory, raw_peer
) -> None:
    """A raw subscriber that never reads, then closes, while three 4 MiB messages for it
    wait in the broker as pipes (a 32 MiB soft limit lets them queue rather than pause
    their sender): its queue is dropped with the pipes, the sender is not stuck and the
    broker is back to its descriptors."""
    broker = broker_factory("--out-soft-limit", str(32 * MiB))
    async with (
        msgq_trio.connect(broker.path, name="pub") as pub,
        msgq_trio.connect(broker.path, name="other") as other,
        msgq_trio.connect(broker.path, name="ops") as ops,
    ):
        fds = (await stats(ops))["fds"]
        await other.subscribe("Other")

        async def send_three() -> None:
            # (its sends wait while the broker pauses it for the full receiver)
            for i in range(3):
                await pub.send("Big", payload(4 * MiB, 40 + i))
            await pub.flush()

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery, raw_peer(broker.path) as raw:
                assert (await raw.hello("never-reads")).type == FrameType.WELCOME
                await raw.subscribe("Big")
                nursery.start_soon(send_three)
                st = await stats_when(ops, lambda st: st["spliced_frames"] == 3)
                assert st["splice_pipes"] > 0
        await pub.send("Other", b"still flowing")
        with trio.fail_after(10):
            assert (await other.receive()).body == b"still flowing"
        await settled(ops, fds)


async def test_a_spliced_frame_may_come_slowly_but_not_stall(broker_factory, raw_peer) -> None:
    """``--idle-in-frame-timeout 2`` bounds each wait for a spliced frame's next piece: a
    4 MiB frame sent in 16 pieces 0.25 s apart (4 s) arrives whole; one that stops after
    two pieces gets its sender ERROR protocol-error and EOF; no pipe is left."""
    b = broker_factory("--idle-in-frame-timeout", "2")
    body = payload(4 * MiB, 50)
    frame = raw_frame(FrameType.MESSAGE, target="Big", body=encode_cbor(body))
    piece = -(-len(frame) // 16)
    async with big_subscriber_and_raw_sender(b.path, raw_peer, "slow-sender") as (
        sub,
        ops,
        raw,
        fds,
    ):
        for i in range(0, len(frame), piece):
            await raw.send_bytes(frame[i : i + piece])
            await trio.sleep(0.25)
        with trio.fail_after(10):
            assert (await sub.receive()).body == body
        assert (await stats(ops))["spliced_frames"] == 1
        await raw.send_bytes(frame[: 2 * piece])
        frames = await raw.frames_until_eof(timeout=30)
        assert [f.header().get("code") for f in frames] == ["protocol-error"]
        await raw.aclose()
        await settled(ops, fds)


async def test_a_spliced_message_for_nobody_leaves_nothing(broker) -> None:
    """A 4 MiB message to a group without members is spliced in, counted as having no
    recipient, and its pipes are released at once."""
    async with msgq_trio.connect(broker.path, name="pub") as pub:
        fds = (await stats(pub))["fds"]
        for i in range(3):
            await pub.send("Nobody", payload(4 * MiB, 60 + i))
        await pub.flush()
        st = await stats_when(pub, lambda st: st["spliced_frames"] == 3)
        assert st["counters"]["no_recipient"] == 3
        await settled(pub, fds)
