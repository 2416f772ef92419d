"""A receiving client reuses the memory of the large bodies it handed out once the
application has dropped them (``framing.SPARE_BODIES``), so after its first messages a
stream of 4 MiB messages faults in next to no fresh pages, on every driver, without
touching the process's allocator settings.

Minor page faults are counted by the kernel for the receiving process alone (a fresh
interpreter per driver, the publisher in a process of its own): a count, not a time, so
the machine's load does not move it. Before, a fresh trio client faulted in 1,024 pages
(the whole body) for most messages of a burst: glibc maps each body apart until its mmap
threshold has risen, and trims its heap when several bodies were freed together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from msgq_trio.protocol import framing

SIZE = 4 * 1024 * 1024
PAGES = SIZE // 4096
ROUNDS = 6
BURST = 4

PUBLISHER = r"""
import sys, trio, msgq_trio
async def main():
    body = bytes(range(256)) * (4 * 1024 * 1024 // 256)
    async with msgq_trio.connect(sys.argv[1], name="pub") as bus:
        await bus.subscribe("Ack")
        print("READY", flush=True)
        async for msg in bus:
            if msg.body == 0:
                break
            for _ in range(msg.body):
                await bus.send("Big", body)
trio.run(main)
"""

# Each round: ask for BURST messages, receive them all (up to BURST bodies alive at
# once in the client), drop each after a look; the faults of the round.
RECEIVER = r"""
import json, resource, sys
driver, sock, rounds, burst, size = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
if driver == "direct":
    import msgq_trio
    rx = msgq_trio.connect_direct(sock, name="rx")
    rx.subscribe("Big")
    for _ in range(rounds):
        f0 = faults()
        rx.send("Ack", burst)
        for _ in range(burst):
            msg = rx.receive(timeout=30)
            assert len(msg.body) == size and msg.body[-1] == 255
            del msg
        out.append(faults() - f0)
    rx.send("Ack", 0)
    rx.close()
else:
    if driver == "trio":
        import trio as loop, msgq_trio
        connect = msgq_trio.connect
    else:
        import asyncio as loop, msgq_trio.aio
        connect = msgq_trio.aio.connect
    async def main():
        async with connect(sock, name="rx") as rx:
            await rx.subscribe("Big")
            for _ in range(rounds):
                f0 = faults()
                await rx.send("Ack", burst)
                for _ in range(burst):
                    msg = await rx.receive()
                    assert len(msg.body) == size and msg.body[-1] == 255
                    del msg
                out.append(faults() - f0)
            await rx.send("Ack", 0)
    loop.run(main) if driver == "trio" else loop.run(main())
print(json.dumps(out))
"""


@pytest.mark.skipif(not framing.SPEEDUPS, reason="the pure build copies each body")
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux's counts")
@pytest.mark.parametrize("driver", ["trio", "asyncio", "direct"])
def test_large_bodies_fault_few_pages_after_the_first(broker_factory: Any, driver: str) -> None:
    b = broker_factory()
    pub = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(b.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert pub.stdout is not None
        assert pub.stdout.readline().strip() == "READY"
        done = subprocess.run(
            [sys.executable, "-c", RECEIVER, driver, str(b.path), *map(str, (ROUNDS, BURST, SIZE))],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        rounds = json.loads(done.stdout)
        pub.wait(timeout=30)
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.wait()
        if pub.stdout is not None:
            pub.stdout.close()
    # A body is received into fresh pages until a spare of its size is free when it
    # arrives: how many the spares grow to depends on how many bodies the application
    # still held then (at most BURST here, within SPARE_BODIES). Every other message
    # faults in a few pages at most (the receive path's own buffers). Before, most
    # messages faulted in their whole body (1,024 pages).
    fresh = BURST + 1
    assert sum(rounds) < fresh * PAGES + ROUNDS * BURST * PAGES / 16, rounds
