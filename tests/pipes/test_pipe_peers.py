"""Pipes across brokers (docs/PIPES.md, "Pipes across brokers"): two and three brokers
on this machine, each on its own Unix socket (no network namespace needed: the brokers
are separate processes joined only by their peer connections), each with the others as
``peers``. Clients in the test process open ends through different brokers."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from peer_helpers import start_brokers

import msgq_trio
from msgq_trio.client.pipe import PipeReader


async def read_all(r: PipeReader, timeout: float = 20) -> bytes:
    out = bytearray()
    with trio.fail_after(timeout):
        while data := await r.read():
            out += data
    return bytes(out)


async def all_stats(path: Path) -> dict[str, Any]:
    async with msgq_trio.connect(path, "stats") as bus:
        return dict(await bus.call("msgq-pipe", "pipe.stats", {}))


@pytest.mark.parametrize("n", [2, 3])
async def test_bytes_cross_brokers_exactly_in_order(
    broker_factory: Callable[..., Any], short_tmp: Path, n: int
) -> None:
    """A writer on one broker, a reader on another (every pair, several names so both
    a local and a remote home are used): the reader gets exactly the bytes written,
    in order, for random write and read sizes; end of pipe after the writer closed."""
    brokers = await start_brokers(broker_factory, short_tmp, n)
    rnd = random.Random(44)
    payload = rnd.randbytes(3 << 20)
    for i, wb in enumerate(brokers):
        for j, rb in enumerate(brokers):
            if i == j:
                continue
            name = f"x{i}{j}"
            async with (
                msgq_trio.connect(wb.path, "w") as wbus,
                msgq_trio.connect(rb.path, "r") as rbus,
            ):
                got = bytearray()

                async def reader(
                    name: str = name, rbus: msgq_trio.Bus = rbus, got: bytearray = got
                ) -> None:
                    r = await rbus.pipe(name).open_reader()
                    with trio.fail_after(30):
                        while data := await r.read(rnd.choice([1, 100, 4096, 1 << 20])):
                            got.extend(data)
                    await r.aclose()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reader)
                    w = await wbus.pipe(name).open_writer()
                    pos = 0
                    while pos < len(payload):
                        k = rnd.choice([1, 1000, 65536, 300_000])
                        await w.send_all(payload[pos : pos + k])
                        pos += k
                    await w.aclose()
                assert bytes(got) == payload
    forwarded = moved = 0
    for b in brokers:
        s = await all_stats(b.path)
        assert s["pipes"] == 0 and s["federation"]["remote_ends"] == 0, s
        forwarded += s["federation"]["forwarded_opens"]
        moved += s["federation"]["bytes_to_peers"] + s["federation"]["bytes_from_peers"]
    assert forwarded >= n * (n - 1)  # each pair: at least one end is remote
    assert moved >= n * (n - 1) * len(payload)
