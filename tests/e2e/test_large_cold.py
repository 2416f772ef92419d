"""End to end: a freshly started broker copies large frames through buffers that reuse
heap pages from the first frame on, instead of faulting in fresh pages for each one
until glibc's dynamic mmap threshold has risen (io/housekeeping.py, tune_malloc)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio

import msgq_trio

SIZE = 4 * 1024 * 1024
FRAMES = 8


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
async def test_first_large_frames_fault_few_pages(broker_factory: Any) -> None:
    # The copying path (splice off): every frame is received into a broker buffer.
    b = broker_factory("--splice-min-size", "0")
    body = os.urandom(SIZE)
    async with (
        msgq_trio.connect(b.path, name="rx") as rx,
        msgq_trio.connect(b.path, name="tx") as tx,
    ):
        await rx.subscribe("Big")
        # The first two frames touch the broker's two buffers for them for the first
        # time: pages any process must fault in once. What follows must reuse them.
        for _ in range(2):
            await tx.send("Big", body)
            assert (await rx.receive()).body == body
        before = minor_faults(b.pid)
        with trio.fail_after(30):
            for _ in range(FRAMES):
                await tx.send("Big", body)
                assert (await rx.receive()).body == body
        per_frame = (minor_faults(b.pid) - before) / FRAMES
    # A 4 MiB buffer is 1,024 pages. Mapped apart until glibc's threshold had risen,
    # frames 3 and 4 faulted in about 1,000 each (a mean of ~250 over these eight);
    # reused heap pages fault none.
    assert per_frame < 32, per_frame
