"""End to end: what one pass of the broker's scheduler queues for one peer leaves in one
write (``msgq_trio/io/batching.py``), and nothing is lost or reordered by it.

The broker is stopped (SIGSTOP) while a hundred senders each send to one receiver, so
that when it continues one poll returns every sender's socket and their readers run in
one pass. The broker's write system calls are counted from ``/proc/PID/io`` (``syscw``):
the direct writes of small queues are ``write(2)`` calls.
"""

from __future__ import annotations

import os
import signal
from contextlib import AsyncExitStack
from pathlib import Path

import trio

import msgq_trio
from msgq_trio import Bus

SENDERS = 100
#: Seconds for every message to arrive: they take milliseconds; a loaded machine is slow.
ARRIVAL = 60


def write_calls(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["syscw"])


async def receive(rx: Bus, n: int) -> list[bytes]:
    got: list[bytes] = []
    with trio.fail_after(ARRIVAL):
        async for msg in rx:
            got.append(bytes(msg.body))
            if len(got) == n:
                return got
    raise AssertionError(f"the receiver's stream ended after {len(got)} of {n}")


async def receiver_and_senders(stack: AsyncExitStack, path: Path, n: int) -> tuple[Bus, list[Bus]]:
    """A receiver subscribed to "Sink" and ``n`` senders, connected."""
    rx = await stack.enter_async_context(msgq_trio.connect(path, name="rx"))
    await rx.subscribe("Sink")
    senders = [
        await stack.enter_async_context(msgq_trio.connect(path, name=f"s{i}")) for i in range(n)
    ]
    return rx, senders


async def test_a_pass_of_messages_for_one_peer_leaves_in_few_writes(broker) -> None:
    """A hundred messages for one receiver that the broker reads in one pass reach it in
    a few writes (the pass's first at once, the rest together at its end), not one
    write each; every message arrives."""
    async with AsyncExitStack() as stack:
        rx, senders = await receiver_and_senders(stack, broker.path, SENDERS)
        for s in senders:  # every connection set up and idle before the burst
            await s.send("Sink", b"warm")
        assert len(await receive(rx, SENDERS)) == SENDERS

        os.kill(broker.pid, signal.SIGSTOP)
        try:
            for i, s in enumerate(senders):
                await s.send("Sink", b"%d" % i)
            for s in senders:
                await s.flush()  # in the broker's socket buffers
            before = write_calls(broker.pid)
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        got = await receive(rx, SENDERS)
        writes = write_calls(broker.pid) - before
    assert sorted(got) == sorted(b"%d" % i for i in range(SENDERS))
    # One write per message would be SENDERS; batched, 2 (a reader or two may still run
    # in a later pass on a loaded machine).
    assert writes <= SENDERS // 10, writes


async def test_order_from_each_sender_is_kept_through_batched_writes(broker) -> None:
    """Twenty senders each send 200 numbered messages as fast as they can to one
    receiver: every message arrives once, and each sender's in the order it sent them."""
    n, per = 20, 200
    async with AsyncExitStack() as stack:
        rx, senders = await receiver_and_senders(stack, broker.path, n)

        async def send_all(i: int, s: Bus) -> None:
            for k in range(per):
                await s.send("Sink", b"%d:%d" % (i, k))

        async with trio.open_nursery() as nursery:
            for i, s in enumerate(senders):
                nursery.start_soon(send_all, i, s)
            got = await receive(rx, n * per)
    seen: dict[int, list[int]] = {}
    for body in got:
        i, k = map(int, body.split(b":"))
        seen.setdefault(i, []).append(k)
    assert seen == {i: list(range(per)) for i in range(n)}
