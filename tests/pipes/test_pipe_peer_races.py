"""Opens racing on different brokers (docs/PIPES.md, "Pipes across brokers"): a seeded
randomized test over many interleavings of opens and closes on both sides, and the
ZPIPES tracker's three multi-broker reproductions as named regression tests. Two
brokers on this machine, each on its own Unix socket. The brokers' logs are checked for
tracebacks and internal errors at teardown (the conftest broker fixture)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from peer_helpers import start_brokers

import msgq_trio

#: Interleavings tried (each a fresh pipe name and a fresh random schedule); a few
#: seconds in all, so it runs in every test run.
ROUNDS = 40


async def stats(path: Path) -> dict[str, Any]:
    async with msgq_trio.connect(path, "stats") as bus:
        return dict(await bus.call("msgq-pipe", "pipe.stats", {}))


async def one_round(buses: list[Any], rnd: random.Random, name: str) -> None:
    """One interleaving (see the test below)."""
    msg = rnd.randbytes(rnd.choice([1, 1000, 300_000]))
    got = trio.Event()
    result: list[bytes] = []

    async def reader(bus: Any, d: float) -> None:
        await trio.sleep(d)
        r = await bus.pipe(name).open_reader()
        out = bytearray()
        with trio.fail_after(20):
            while len(out) < len(msg):
                out += await r.read()  # b"": an end of pipe of a churning writer
        await r.aclose()
        result.append(bytes(out))
        got.set()

    async def writer(bus: Any, d: float) -> None:
        await trio.sleep(d)
        w = await bus.pipe(name).open_writer(on_reader_gone="wait")
        await w.write(msg, timeout=20)
        await got.wait()
        await w.aclose()

    async def churn(bus: Any, role: str, d: float) -> None:
        await trio.sleep(d)
        p = bus.pipe(name)
        for _ in range(3):
            if role == "w":
                e: Any = await p.open_writer(on_reader_gone="wait")
            else:
                e = await p.open_reader(readahead=0)
            await trio.sleep(rnd.random() * 0.003)
            await e.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, rnd.choice(buses), rnd.random() * 0.01)
        nursery.start_soon(writer, rnd.choice(buses), rnd.random() * 0.01)
        for _ in range(rnd.randint(0, 4)):
            nursery.start_soon(churn, rnd.choice(buses), rnd.choice("rw"), rnd.random() * 0.01)
    assert result == [msg], (name, [len(x) for x in result], len(msg))


async def test_random_open_close_interleavings_agree_on_one_outcome(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """Each round: a reader and a writer of one name open on random brokers at random
    moments, while other writers and readers of the same name open and close on both
    brokers; the writer writes a message and stays until the reader has it. Whatever the
    interleaving, the reader gets exactly that message (end-of-pipe answers from the
    churning writers aside, which are the single-broker outcome), no call fails, and
    once everyone left no broker holds a pipe or an end."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    rnd = random.Random(0x44)
    async with contextlib.AsyncExitStack() as stack:
        buses = [
            await stack.enter_async_context(msgq_trio.connect(b.path, f"c{i}"))
            for i, b in enumerate(brokers)
            for _ in range(2)
        ]
        for i in range(ROUNDS):
            await one_round(buses, rnd, f"race{i}")
    for b in brokers:
        s = await stats(b.path)
        assert s["pipes"] == 0 and s["ends"] == 0, s
        assert s["federation"]["remote_ends"] == 0 and s["federation"]["ends_from_peers"] == 0


async def test_rapid_writer_opens_asserts(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """ZPIPES "rapid writer opens asserts": a reader on broker B asserted when a new
    writer opened on B while A's writer was still attached. Here A's writer streams
    while writers open, write one record and close on B, over and over: the reader gets
    A's stream and every record whole, nothing asserts."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    a_path, b_path = brokers[0].path, brokers[1].path
    async with (
        msgq_trio.connect(a_path, "A") as a,
        msgq_trio.connect(b_path, "B") as b,
        msgq_trio.connect(b_path, "Br") as br,
    ):
        r = await br.pipe("rapid").open_reader()
        wa = await a.pipe("rapid").open_writer()
        out = bytearray()

        async def read() -> None:
            with trio.fail_after(30):
                while data := await r.read():
                    out.extend(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for i in range(50):
                await wa.write(b"[A%03d]" % i, timeout=10)
                wb = await b.pipe("rapid").open_writer()
                await wb.write(b"[B%03d]" % i, timeout=10)
                await wb.aclose()
            await wa.aclose()
        recs = bytes(out).split(b"]")[:-1]
        assert sorted(recs) == sorted(
            [b"[A%03d" % i for i in range(50)] + [b"[B%03d" % i for i in range(50)]
        )
        assert [x for x in recs if x.startswith(b"[A")] == [b"[A%03d" % i for i in range(50)]


async def test_client_new_asserts_on_rapid_open(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """ZPIPES "zpipes_client_new asserts on rapid open": many writers of one name open
    at the same moment on both brokers; each writes one record and closes. The reader
    gets every record once, whole."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    async with contextlib.AsyncExitStack() as stack:
        buses = [
            await stack.enter_async_context(msgq_trio.connect(b.path, f"c{i}"))
            for i, b in enumerate(brokers)
        ]
        r = await buses[1].pipe("burst").open_reader()

        async def writer(i: int) -> None:
            w = await buses[i % 2].pipe("burst").open_writer()
            await w.write(b"(%02d)" % i + b"x" * 5000, timeout=10)
            await w.aclose()

        out = bytearray()
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(writer, i)
        # Every writer left: the reader gets everything, then end of pipe.
        with trio.fail_after(20):
            while data := await r.read():
                out.extend(data)
        await r.aclose()
        recs = [x for x in bytes(out).split(b"(") if x]
        assert sorted(recs) == sorted(b"%02d)" % i + b"x" * 5000 for i in range(40))


async def meet(wbus: Any, rbus: Any, name: str, first: int) -> None:
    """A reader and a writer of ``name``: ``first`` 0 reader first, 1 writer first,
    2 together."""
    got: list[bytes] = []

    async def read() -> None:
        if first == 1:
            await trio.sleep(0.002)
        r = await rbus.pipe(name).open_reader()
        got.append(await r.read(timeout=10))
        await r.aclose()

    async def write() -> None:
        if first == 0:
            await trio.sleep(0.002)
        w = await wbus.pipe(name).open_writer()
        await w.write(name.encode(), timeout=10)
        await w.aclose()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(write)
    assert got == [name.encode()]


async def test_readers_and_writers_that_never_connect(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """ZPIPES "readers and writers sometimes never connect": a reader and a writer of a
    fresh name open at the same moment on different brokers (either one first, or
    together), 60 times: every time the write goes through and the reader gets it."""
    brokers = await start_brokers(broker_factory, short_tmp, 2)
    async with (
        msgq_trio.connect(brokers[0].path, "a") as a,
        msgq_trio.connect(brokers[1].path, "b") as b,
    ):
        for i in range(60):
            wbus, rbus = (a, b) if i % 2 else (b, a)
            await meet(wbus, rbus, f"meet{i}", i % 3)
