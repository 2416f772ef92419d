"""Pipes across brokers (docs/PIPES.md, "Pipes across brokers"): two and three brokers
on this machine, each on its own Unix socket (no network namespace needed: the brokers
are separate processes joined only by their peer connections), each with the others as
``peers``. Clients in the test process open ends through different brokers."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from peer_helpers import start_brokers, wait_connected
from pipe_helpers import plugin_pid, wait_line

import msgq_trio
from msgq_trio.client.pipe import PipeReader
from msgq_trio.errors import PipeBroken
from plugins.pipe.peers import home_of


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


def name_homed(prefix: str, home: str, nodes: list[str]) -> str:
    """A pipe name whose home (plugins/pipe/peers.py) is node ``home``."""
    for i in range(1000):
        if home_of(f"{prefix}{i}", nodes) == home:
            return f"{prefix}{i}"
    raise AssertionError("no such name")


@pytest.mark.parametrize("n", [2, 3])
async def test_end_of_pipe_and_reader_gone_across_brokers(
    broker_factory: Callable[..., Any], short_tmp: Path, n: int
) -> None:
    """End of pipe reaches a remote reader after the bytes; a reader leaving breaks a
    remote ``fail`` writer; a remote ``wait`` writer waits and its buffered bytes go to
    the next reader, on yet another broker -- the single-broker outcomes."""
    brokers = await start_brokers(broker_factory, short_tmp, n)
    p = [b.path for b in brokers]
    async with (
        msgq_trio.connect(p[0], "w") as w0,
        msgq_trio.connect(p[-1], "r") as r1,
        msgq_trio.connect(p[1], "r2") as r2,
    ):
        r = await r1.pipe("eop").open_reader()
        w = await w0.pipe("eop").open_writer()
        await w.write(b"abc", timeout=5)
        await w.aclose()
        assert await read_all(r) == b"abc"
        await r.aclose()

        r = await r1.pipe("gone").open_reader()
        w = await w0.pipe("gone").open_writer()
        await w.write(b"x", timeout=5)
        await r.aclose()
        with pytest.raises(PipeBroken):
            with trio.fail_after(5):
                while True:
                    await w.write(b"y", timeout=5)
        await w.aclose()

        r = await r1.pipe("wait").open_reader(readahead=0)
        w = await w0.pipe("wait").open_writer(on_reader_gone="wait")
        await w.write(b"buf", timeout=5)  # buffered, unread
        await r.aclose()
        await w.send_all(b"kept")  # no reader: waits
        await trio.sleep(0.3)
        r = await r2.pipe("wait").open_reader()
        await w.write(b"more", timeout=5)
        await w.aclose()
        assert await read_all(r) == b"bufkeptmore"
        await r.aclose()


@pytest.mark.parametrize("mode", ["share", "broadcast"])
@pytest.mark.parametrize("n", [2, 3])
async def test_share_broadcast_and_whole_writes_across_brokers(
    broker_factory: Callable[..., Any], short_tmp: Path, n: int, mode: str
) -> None:
    """N-to-N over brokers: writers on every broker, readers on every broker. Every
    write is contiguous in the stream (records stay whole); ``share``: every byte goes
    to exactly one reader; ``broadcast``: every reader gets every write made after it
    attached, each writer's records in its order."""
    brokers = await start_brokers(broker_factory, short_tmp, n)
    name = f"nn-{mode}"
    async with contextlib.AsyncExitStack() as stack:
        ends = [
            await stack.enter_async_context(msgq_trio.connect(b.path, f"c{i}"))
            for i, b in enumerate(brokers)
        ]
        readers = [await e.pipe(name).open_reader(readers=mode, readahead=0) for e in ends]
        outs = [bytearray() for _ in readers]

        async def read(i: int) -> None:
            outs[i] += await read_all(readers[i])

        async def write(j: int, e: msgq_trio.Bus) -> None:
            w = await e.pipe(name).open_writer()
            for k in range(100):
                rec = f"<{j}:{k:03}:".encode() + bytes([65 + j]) * 3000 + b">"
                await w.write(rec, timeout=10)
            await w.aclose()

        async with trio.open_nursery() as nursery:
            for i in range(len(readers)):
                nursery.start_soon(read, i)
            async with trio.open_nursery() as writers:
                for j, e in enumerate(ends):
                    writers.start_soon(write, j, e)
        expected = {(j, k) for j in range(len(ends)) for k in range(100)}
        if mode == "broadcast":
            for out in outs:
                recs = parse_records(bytes(out))
                assert set(recs) == expected
                for j in range(len(ends)):  # each writer's records in order
                    assert [k for jj, k in recs if jj == j] == list(range(100))
        else:
            # Share: bytes split between readers at read boundaries; joined in the
            # order they left the pipe (readahead=0 reads are served oldest first,
            # so sorting is not possible): the total is every byte exactly once.
            total = sum(len(o) for o in outs)
            assert total == len(expected) * (3000 + 8)
        for r in readers:
            await r.aclose()


def parse_records(data: bytes) -> list[tuple[int, int]]:
    """Records ``<J:KKK:` + 3000 x letter J + ``>``; asserts each is whole."""
    out = []
    i = 0
    while i < len(data):
        assert data[i : i + 1] == b"<", (i, data[i : i + 20])
        j, k = int(data[i + 1 : i + 2]), int(data[i + 3 : i + 6])
        body = data[i + 7 : i + 7 + 3000]
        assert body == bytes([65 + j]) * 3000 and data[i + 3007 : i + 3008] == b">"
        out.append((j, k))
        i += 3008
    return out


@pytest.mark.parametrize("n", [2, 3])
async def test_flushed_when_both_ends_left_across_brokers(
    broker_factory: Callable[..., Any], short_tmp: Path, n: int
) -> None:
    """Both ends left (on different brokers) with bytes unread: reopening the name,
    again on different brokers, starts empty; nothing is left on any broker."""
    brokers = await start_brokers(broker_factory, short_tmp, n)
    p = [b.path for b in brokers]
    async with msgq_trio.connect(p[0], "a") as a, msgq_trio.connect(p[-1], "b") as b:
        for name in ("f0", "f1", "f2", "f3"):
            r = await b.pipe(name).open_reader()
            w = await a.pipe(name).open_writer()
            await w.write(b"old", timeout=5)
            await w.aclose()
            await r.aclose()
            r = await a.pipe(name).open_reader()
            w = await b.pipe(name).open_writer()
            await w.write(b"new", timeout=5)
            await w.aclose()
            assert await read_all(r) == b"new"
            await r.aclose()
    for path in p:
        s = await all_stats(path)
        assert s["pipes"] == 0 and s["federation"]["ends_from_peers"] == 0, s


@pytest.mark.parametrize("home", ["writer", "reader"])
async def test_writer_process_sigkilled_gives_remote_reader_end_of_pipe(
    broker_factory: Callable[..., Any],
    short_tmp: Path,
    spawn_peer: Callable[..., Any],
    home: str,
) -> None:
    """A writer process on broker 0 is SIGKILLed mid-transfer (the pipe homed on the
    writer's or the reader's broker): the reader on broker 1 gets every byte accepted,
    in pattern, then end of pipe -- as on one broker."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    name = name_homed("k", "n0" if home == "writer" else "n1", ["n0", "n1"])
    reader = spawn_peer(brokers[1].path, "read", name, "--chunk", str(256 * 1024))
    await trio.to_thread.run_sync(wait_line, reader, "open", 20)
    writer = spawn_peer(brokers[0].path, "write", name)
    await trio.to_thread.run_sync(wait_line, reader, "progress", 30)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    line = await trio.to_thread.run_sync(wait_line, reader, "read", 10)
    assert line.endswith(" ok"), line
    assert reader.wait(10) == 0


@pytest.mark.parametrize("home", ["writer", "reader"])
async def test_broker_sigkilled_breaks_the_remote_reader(
    broker_factory: Callable[..., Any],
    short_tmp: Path,
    spawn_peer: Callable[..., Any],
    home: str,
) -> None:
    """Broker 0 (the writer's) is SIGKILLed mid-transfer: the reader on broker 1 fails
    PipeBroken (exit 1) within moments -- Unix sockets: the peer connection's end is
    seen at once -- after bytes that are all in pattern (nothing after the gap)."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    name = name_homed("s", "n0" if home == "writer" else "n1", ["n0", "n1"])
    reader = spawn_peer(brokers[1].path, "read", name, "--chunk", str(256 * 1024))
    await trio.to_thread.run_sync(wait_line, reader, "open", 20)
    spawn_peer(brokers[0].path, "write", name)
    await trio.to_thread.run_sync(wait_line, reader, "progress", 30)
    brokers[0].expect_exit = True
    brokers[0].proc.send_signal(signal.SIGKILL)
    brokers[0].proc.wait(10)
    t0 = time.monotonic()
    line = await trio.to_thread.run_sync(wait_line, reader, "error", 10)
    assert "PipeBroken" in line, line
    assert time.monotonic() - t0 < 5
    assert reader.wait(10) == 1
    s = await all_stats(brokers[1].path)
    assert s["pipes"] == 0, s


@pytest.mark.parametrize("home", ["writer", "reader"])
async def test_max_buffer_holds_across_the_hop(
    broker_factory: Callable[..., Any], short_tmp: Path, home: str
) -> None:
    """``max_buffer`` (256 KiB here) bounds the pipe across brokers: with the reader on
    the other broker stalled, the writer's writes wait (PipeTimeout, with the exact
    prefix accepted) once the home holds the bound; the home never holds more, the
    other broker holds no pipe at all; the reader then gets every byte, in order."""
    bound = 256 * 1024
    brokers = await start_brokers(broker_factory, short_tmp, 2, max_buffer=bound, max_chunk=65536)
    name = name_homed("bound", "n0" if home == "writer" else "n1", ["n0", "n1"])
    homes = brokers[0 if home == "writer" else 1].path, brokers[1 if home == "writer" else 0].path
    payload = random.Random(7).randbytes(4 << 20)
    async with (
        msgq_trio.connect(brokers[0].path, "w") as wb,
        msgq_trio.connect(brokers[1].path, "r") as rb,
        msgq_trio.connect(homes[0], "s") as home_bus,
        msgq_trio.connect(homes[1], "s") as other_bus,
    ):
        r = await rb.pipe(name).open_reader(readahead=0)
        w = await wb.pipe(name).open_writer()
        accepted = 0
        with pytest.raises(msgq_trio.PipeTimeout) as info:
            while True:
                await w.write(payload[accepted : accepted + 65536], timeout=1.0)
                accepted += 65536
        accepted += info.value.written
        s = await home_bus.call("msgq-pipe", "pipe.stats", {"pipe": name})
        assert s["buffered"] <= bound and accepted <= bound + 65536, (s, accepted)
        assert (await other_bus.call("msgq-pipe", "pipe.stats", {}))["pipes"] == 0
        got = bytearray()

        async def read() -> None:
            got.extend(await read_all(r))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await w.write(payload[accepted:], timeout=30)
            await w.aclose()
        assert bytes(got) == payload
        await r.aclose()


async def test_home_plugin_killed_breaks_remote_ends_and_the_set_recovers(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """The pipe plugin of the pipe's home broker is SIGKILLed (the supervisor restarts
    it, without its pipes): the remote writer fails PipeBroken, not a hang; the
    forwarding broker says hello to the new pipe service, and a new pipe across the two
    brokers works again."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    name = name_homed("pk", "n1", ["n0", "n1"])
    async with (
        msgq_trio.connect(brokers[0].path, "w") as wb,
        msgq_trio.connect(brokers[1].path, "r") as rb,
    ):
        r = await rb.pipe(name).open_reader()
        w = await wb.pipe(name).open_writer()
        await w.write(b"x", timeout=5)
        os.kill(plugin_pid(brokers[1].pid), signal.SIGKILL)
        with pytest.raises(PipeBroken):
            with trio.fail_after(10):
                while True:
                    await w.write(b"y" * 1000, timeout=10)
        await w.aclose()
        await r.aclose()
        await wait_connected([b.path for b in brokers])
        with trio.fail_after(20):
            while True:
                try:
                    r = await rb.pipe(name + "again").open_reader()
                    break
                except msgq_trio.NoRecipient:
                    await trio.sleep(0.1)
            w = await wb.pipe(name + "again").open_writer()
            await w.write(b"back", timeout=10)
            await w.aclose()
            assert await read_all(r) == b"back"
            await r.aclose()
