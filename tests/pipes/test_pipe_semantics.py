"""Pipe semantics against a real broker and pipe plugin (clients in the test process,
talking through real Unix sockets). Each test names the seed-002 bug it answers."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import sync
from msgq_trio.client.pipe import PipeReader, PipeWriter
from msgq_trio.errors import PipeBroken, PipeTimeout, RemoteError


async def stats(bus: msgq_trio.Bus, name: str) -> dict[str, Any]:
    return dict(await bus.call("msgq-pipe", "pipe.stats", {"pipe": name}))


async def read_all(r: PipeReader, n: int | None = None, timeout: float = 10) -> bytes:
    out = bytearray()
    with trio.fail_after(timeout):
        while data := await r.read(n):
            out += data
    return bytes(out)


async def test_rapid_open_close_sequences(pipe_broker: Callable[..., Any]) -> None:
    """ZPIPES bug "rapid writer opens asserts" / "zpipes_client_new asserts on rapid open":
    writer on A, reader on B, a second writer on B, write through it, close, over and
    over, interleaved with opens that close at once: every byte arrives, nothing
    asserts (the broker log is checked for tracebacks at teardown), no pipe is left."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "A") as a, msgq_trio.connect(b.path, "B") as bb:
        for i in range(60):
            name = f"rapid{i % 3}"
            w1 = await a.pipe(name).open_writer()
            r = await bb.pipe(name).open_reader()
            w2 = await bb.pipe(name).open_writer()
            await (await a.pipe(name).open_reader()).aclose()  # open/close at once
            msg = f"#{i}".encode()
            await w2.write(msg, timeout=5)
            await w2.aclose()
            await w1.aclose()
            assert await read_all(r) == msg
            await r.aclose()
        assert (await a.call("msgq-pipe", "pipe.stats", {}))["pipes"] == 0


async def test_reader_attaching_after_the_writer(pipe_broker: Callable[..., Any]) -> None:
    """ZPIPES bug "readers and writers that never connect" / "writer blocked forever": a
    writer that opened first waits while no reader is attached (or times out with
    PipeTimeout, nothing written), and resumes as soon as a reader attaches."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        w = await wb.pipe("late").open_writer()
        with pytest.raises(PipeTimeout) as info:
            await w.write(b"too early", timeout=0.3)
        assert info.value.written == 0
        done = trio.Event()

        async def writer() -> None:
            await w.write(b"x" * 700_000)  # several chunks, waits for the reader
            await w.aclose()
            done.set()

        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await trio.sleep(0.5)
            assert not done.is_set()
            r = await rb.pipe("late").open_reader()
            assert await read_all(r) == b"x" * 700_000  # "too early" was never written
            await r.aclose()


async def test_small_read_buffers_lose_nothing(pipe_broker: Callable[..., Any]) -> None:
    """ZPIPES bug "data discarded when the reader's buffer is smaller than a chunk": writes
    of random sizes (up to 600 KiB, several chunks), reads of random sizes down to one
    byte, with and without read-ahead: the reader gets exactly the bytes written."""
    b = pipe_broker()
    rnd = random.Random(2)
    blob = os.urandom(3 << 20)
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        for readahead in (65536, 0):
            name = f"small{readahead}"
            r = await rb.pipe(name).open_reader(readahead=readahead)
            w = await wb.pipe(name).open_writer()
            got = bytearray()

            async def writer(w: PipeWriter = w) -> None:
                off = 0
                while off < len(blob):
                    n = rnd.choice([1, 7, 1000, 65536, 300_000, 600_000])
                    await w.send_all(blob[off : off + n])
                    off += n
                await w.aclose()

            async with trio.open_nursery() as n:
                n.start_soon(writer)
                with trio.fail_after(60):
                    while data := await r.read(rnd.choice([1, 3, 100, 4096, 100_000])):
                        got += data
            assert bytes(got) == blob
            await r.aclose()


async def test_close_while_reader_waits_for_more(pipe_broker: Callable[..., Any]) -> None:
    """ZPIPES bug "reads that cannot tell a timeout from a closed pipe": a reader waiting
    for 1 MB while 10 bytes are buffered gets the 10 bytes, then b"" once the writer
    closed; a read with nothing to get raises PipeTimeout (the pipe stays usable),
    distinct from end of pipe (b"") and from errors (PipeBroken)."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        r = await rb.pipe("wait").open_reader()
        w = await wb.pipe("wait").open_writer()
        with pytest.raises(PipeTimeout):
            await r.read(1_000_000, timeout=0.2)
        await w.write(b"0123456789")
        assert await r.read(1_000_000, timeout=5) == b"0123456789"
        async with trio.open_nursery() as n:
            n.start_soon(w.aclose)
            assert await r.read(1_000_000, timeout=5) == b""
        assert await r.read(10, timeout=5) == b""  # stays at end of pipe
        # A new writer: the same reader gets its bytes (like a fifo reopened).
        w = await wb.pipe("wait").open_writer()
        await w.write(b"more")
        assert await r.read(10, timeout=5) == b"more"
        await w.aclose()
        await r.aclose()


async def test_pipelined_and_cancelled_reads_keep_their_bytes(
    pipe_broker: Callable[..., Any],
) -> None:
    """ZPIPES bug "pipelined reads that break": reads cancelled while their request is in
    flight keep what the request brings; the next read returns it in order."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        r = await rb.pipe("cancel").open_reader()
        w = await wb.pipe("cancel").open_writer()
        got = bytearray()
        for i in range(20):
            with trio.move_on_after(0.01):
                got += await r.read(5)  # usually cancelled while waiting
            await w.write(f"{i:04d}".encode())
        await w.aclose()
        got += await read_all(r)
        assert bytes(got) == b"".join(f"{i:04d}".encode() for i in range(20))
        await r.aclose()


async def test_both_ends_gone_then_reopened_has_no_old_data(
    pipe_broker: Callable[..., Any],
) -> None:
    """ZPIPES bug "zpipes retains data for disconnected pipes": bytes nobody read are
    flushed once both ends left (closed or disconnected); the reopened pipe starts
    empty."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "watch") as watch:
        for how in ("close", "disconnect"):
            async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
                r = await rb.pipe("stale").open_reader()
                w = await wb.pipe("stale").open_writer(on_reader_gone="wait")
                await w.write(b"OLD" * 1000)
                assert (await stats(watch, "stale"))["buffered"] == 3000
                if how == "close":
                    await r.aclose()
                    await w.aclose()
            with trio.fail_after(5):
                while True:  # the disconnect is processed asynchronously
                    if not (await stats(watch, "stale"))["exists"]:
                        break
                    await trio.sleep(0.02)
            async with msgq_trio.connect(b.path, "w2") as wb, msgq_trio.connect(b.path, "r2") as rb:
                r = await rb.pipe("stale").open_reader()
                w = await wb.pipe("stale").open_writer()
                await w.write(b"NEW")
                await w.aclose()
                assert await read_all(r) == b"NEW"
                await r.aclose()


async def test_reader_gone_fail_or_wait(pipe_broker: Callable[..., Any]) -> None:
    """Reader gone: a writer opened with on_reader_gone="fail" gets PipeBroken on its
    next write (and stays broken); one opened with "wait" waits for the next reader,
    which gets the bytes."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "w") as wb:
        async with msgq_trio.connect(b.path, "r") as rb:
            r = await rb.pipe("f").open_reader()
            wf = await wb.pipe("f").open_writer()
            await wf.write(b"a")
            r2 = await rb.pipe("g").open_reader()
            ww = await wb.pipe("g").open_writer(on_reader_gone="wait")
            await ww.write(b"b")
            assert await r2.read(1) == b"b"
        with pytest.raises(PipeBroken):  # the reader's connection ended
            with trio.fail_after(5):
                await wf.write(b"after")
        with pytest.raises(PipeBroken):
            await wf.send_all(b"again")
        await wf.aclose()
        async with trio.open_nursery() as n:
            n.start_soon(ww.write, b"for the next reader")
            await trio.sleep(0.3)
            async with msgq_trio.connect(b.path, "r2") as rb:
                r = await rb.pipe("g").open_reader()
                assert await r.read(100, timeout=5) == b"for the next reader"
        await ww.aclose()


async def test_share_mode_each_byte_to_one_reader(pipe_broker: Callable[..., Any]) -> None:
    """N-to-N, share: three readers together get every byte exactly once (records
    numbered 0..N-1, read one byte-exact record at a time)."""
    b = pipe_broker()
    n_rec, size = 1000, 16
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        readers = [
            await rb.pipe("share").open_reader(readers="share", readahead=0) for _ in range(3)
        ]
        w = await wb.pipe("share").open_writer()
        seen: list[int] = []

        async def reader(r: PipeReader) -> None:
            buf = b""
            while True:
                data = await r.read(size - len(buf) if buf else size)
                if not data:
                    break
                buf += data
                if len(buf) == size:
                    seen.append(int(buf))
                    buf = b""
            assert buf == b""

        async with trio.open_nursery() as n:
            for r in readers:
                n.start_soon(reader, r)
            for i in range(n_rec):
                await w.send_all(b"%016d" % i)
            await w.aclose()
        assert sorted(seen) == list(range(n_rec))


async def test_broadcast_and_whole_writes(pipe_broker: Callable[..., Any]) -> None:
    """N-to-N, broadcast: every reader gets every byte; two writers each writing 600 KiB
    records (3 chunks each) never interleave inside a record."""
    b = pipe_broker()
    rec = 600_000
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        r1 = await rb.pipe("bc").open_reader(readers="broadcast")
        r2 = await rb.pipe("bc").open_reader(readers="broadcast")
        with pytest.raises(RemoteError) as info:
            await rb.pipe("bc").open_reader(readers="share")
        assert info.value.code == "bad-request"
        writers = [await wb.pipe("bc").open_writer() for _ in range(2)]
        results: list[bytes] = []

        async def write(w: PipeWriter, tag: bytes) -> None:
            for _ in range(4):
                await w.write(tag * rec)
            await w.aclose()

        async def read(r: PipeReader) -> None:
            results.append(await read_all(r, timeout=60))

        async with trio.open_nursery() as n:
            n.start_soon(read, r1)
            n.start_soon(read, r2)
            n.start_soon(write, writers[0], b"A")
            n.start_soon(write, writers[1], b"B")
        assert results[0] == results[1] and len(results[0]) == 8 * rec
        records = [results[0][i : i + rec] for i in range(0, 8 * rec, rec)]
        assert sorted(r[:1] for r in records) == [b"A"] * 4 + [b"B"] * 4
        assert all(r == r[:1] * rec for r in records)


def test_sync_file_objects(pipe_broker: Callable[..., Any]) -> None:
    """The synchronous client's pipes are binary file objects: readline and iteration
    on the reader, write on the writer, b"" at end of pipe."""
    b = pipe_broker()
    lines = [f"line {i}\n".encode() for i in range(1000)]
    with sync.connect(b.path, "w") as wb, sync.connect(b.path, "r") as rb:
        raw = rb.pipe("lines").open_reader(timeout=10)
        import io

        reader = io.BufferedReader(raw)

        def write() -> None:
            with wb.pipe("lines").open_writer() as w:
                for ln in lines:
                    w.write(ln)

        t = threading.Thread(target=write)
        t.start()
        assert list(reader) == lines
        assert reader.read() == b""
        reader.close()
        t.join(10)


async def test_trace_logs_name_client_and_sizes(pipe_broker: Callable[..., Any]) -> None:
    """ZPIPES bug "no log details of read/write requests": with ``trace = true`` the
    broker's log names the pipe, the client (lname and name) and each read/write size."""
    b = pipe_broker(trace=True)
    async with (
        msgq_trio.connect(b.path, "tracer-w") as wb,
        msgq_trio.connect(b.path, "tracer-r") as rb,
    ):
        r = await rb.pipe("traced").open_reader()
        w = await wb.pipe("traced").open_writer()
        await w.write(b"12345")
        assert await r.read(5) == b"12345"
        await w.aclose()
        await r.aclose()
        wl = wb.lname
    with trio.fail_after(5):
        while True:  # the plugin logs to the broker's stderr asynchronously
            if b.log().count("closed handle") >= 2:
                break
            await trio.sleep(0.05)
    log = b.log()
    assert f"pipe 'traced': {wl} (tracer-w) opened handle" in log
    assert f"pipe 'traced': {wl} write handle" in log and ": 5 bytes" in log
    assert "read handle" in log and "closed handle" in log


async def test_closed_ends_leave_no_call_slots(pipe_broker: Callable[..., Any]) -> None:
    """A reader closed with reads in flight and a writer closed after a broken write
    leave nothing registered on the bus (no leak per opened pipe)."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "c") as bus:
        for _ in range(5):
            r = await bus.pipe("slots").open_reader()
            with trio.move_on_after(0.05):
                await r.read(10)  # leaves its reads in flight
            await r.aclose()
        assert bus.session.calls == {}


async def test_write_timeout_reports_the_prefix_written(pipe_broker: Callable[..., Any]) -> None:
    """A multi-chunk write into a full pipe times out: PipeTimeout.written is exactly the
    prefix the reader will get, the rest was not written (no hole, no duplicate), and
    the writer carries on with its next write."""
    b = pipe_broker(max_buffer=600_000, max_chunk=100_000)
    blob = os.urandom(2_000_000)
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        r = await rb.pipe("full").open_reader()
        w = await wb.pipe("full").open_writer()
        with pytest.raises(PipeTimeout) as info:
            await w.write(blob, timeout=0.5)
        written = info.value.written
        assert 0 < written < len(blob) and written % 100_000 == 0
        async with trio.open_nursery() as n:

            async def finish() -> None:
                await w.write(b"END")
                await w.aclose()

            n.start_soon(finish)
            assert await read_all(r) == blob[:written] + b"END"
        await r.aclose()


async def test_cancelled_multi_chunk_write_releases_the_pipe(
    pipe_broker: Callable[..., Any],
) -> None:
    """A writer cancelled in the middle of a multi-chunk write does not keep the pipe
    locked (Rule 4): another writer's bytes follow what was sent of the cut write."""
    b = pipe_broker(max_buffer=300_000, max_chunk=100_000)
    async with msgq_trio.connect(b.path, "w") as wb, msgq_trio.connect(b.path, "r") as rb:
        r = await rb.pipe("cut").open_reader()
        a = await wb.pipe("cut").open_writer()
        other = await wb.pipe("cut").open_writer()
        with trio.move_on_after(0.3):
            await a.write(b"A" * 1_000_000)  # the pipe fills: cancelled mid-write
        async with trio.open_nursery() as n:

            async def finish() -> None:
                await other.write(b"B" * 10)
                await other.aclose()
                await a.aclose()

            n.start_soon(finish)
            data = await read_all(r)
        assert data.endswith(b"B" * 10) and data.rstrip(b"B") == b"A" * (len(data) - 10)
        assert len(data) - 10 >= 300_000
        await r.aclose()


async def test_reader_closed_by_another_task_while_reading(
    pipe_broker: Callable[..., Any],
) -> None:
    """trio's ReceiveStream contract: ``aclose()`` from another task while
    ``receive_some`` is blocked makes that call raise ClosedResourceError (never another
    exception, never data). 40 rounds, as the race is in when the blocked read wakes
    relative to the close, which one round hits only some of the time; every later call
    on the closed reader raises ClosedResourceError too, and no call slot is left."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "r") as rb:
        for i in range(40):
            r = await rb.pipe(f"blocked{i % 4}").open_reader()
            outcome: list[BaseException | bytes] = []

            async def blocked_read(r: PipeReader = r, outcome: list[Any] = outcome) -> None:
                try:
                    outcome.append(await r.receive_some(100))
                except Exception as exc:  # recorded, asserted below
                    outcome.append(exc)

            async with trio.open_nursery() as n:
                n.start_soon(blocked_read)
                # Close only once the read is blocked on the plugin's answer (the plugin
                # holds a read with nothing to return): the case the contract is about.
                await trio.testing.wait_all_tasks_blocked()
                assert r._inflight and not outcome
                await r.aclose()
            assert len(outcome) == 1
            assert isinstance(outcome[0], trio.ClosedResourceError), f"round {i}: {outcome[0]!r}"
            with pytest.raises(trio.ClosedResourceError):
                await r.receive_some(100)
        assert not rb.session.calls
