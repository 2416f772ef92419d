"""The pipe client on every asynchronous driver: the same client code (one pipe core
under the trio face and the asyncio face) runs on the trio ``Bus`` and on the asyncio
``AioBus`` against a real broker running the pipe plugin, and must behave the same
(tests/driver_harness.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import trio
from driver_harness import ASYNC_DRIVERS, open_driver

from msgq_trio.errors import PipeBroken, PipeTimeout, UsageError


async def read_to_end(r: Any) -> bytes:
    """Everything the reader gets until end of pipe."""
    out = bytearray()
    while data := await r.read():
        out += data
    return bytes(out)


def outcome_of(fn: Callable[[], Any]) -> Callable[[Any], Any]:
    """``fn()``'s outcome as a value: what it returned, or the class of the pipe error
    it raised (compared across drivers, which raise in other threads)."""

    async def run(_bus: Any) -> Any:
        try:
            return await fn()
        except (PipeBroken, PipeTimeout) as exc:
            return type(exc)

    return run


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_round_trip_with_backpressure(driver: str, pipe_broker: Callable[..., Any]) -> None:
    """A write larger than the pipe holds, with a reader attached that does not read,
    is held back by the pipe's bound: it times out having written a whole-chunk prefix
    and nothing more. Written on after the reader starts, every byte arrives once and
    in order, and the writer's close ends the pipe for the reader."""
    b = pipe_broker(max_buffer=600_000, max_chunk=100_000)
    blob = os.urandom(2_000_000)
    async with open_driver(driver, b.path, "w") as wd, open_driver(driver, b.path, "r") as rd:
        r = await rd.run(lambda bus: bus.pipe("bp").open_reader())
        w = await wd.run(lambda bus: bus.pipe("bp").open_writer())

        async def write_too_much(_bus: Any) -> int | None:
            try:
                await w.write(blob, timeout=0.5)
            except PipeTimeout as exc:
                return exc.written
            return None

        written = await wd.run(write_too_much)
        assert written is not None and 0 < written < len(blob)
        assert written % 100_000 == 0

        async def write_rest(_bus: Any) -> None:
            await w.write(blob[written:])
            await w.aclose()

        async with trio.open_nursery() as n:
            n.start_soon(wd.run, write_rest)
            data = await rd.run(lambda _bus: read_to_end(r))
        await rd.run(lambda _bus: r.aclose())
    assert data == blob


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_pipe_errors_are_the_same_on_both(
    driver: str, pipe_broker: Callable[..., Any]
) -> None:
    """The pipe's errors come out the same way on both drivers: a read with nothing
    written times out with PipeTimeout (the pipe stays usable); once the only reader
    left, a writer opened with on_reader_gone="fail" gets PipeBroken, and stays broken."""
    b = pipe_broker()
    async with open_driver(driver, b.path, "w") as wd, open_driver(driver, b.path, "r") as rd:
        r = await rd.run(lambda bus: bus.pipe("e").open_reader())
        w = await wd.run(lambda bus: bus.pipe("e").open_writer(on_reader_gone="fail"))
        assert await rd.run(outcome_of(lambda: r.read(10, timeout=0.2))) is PipeTimeout
        assert await wd.run(outcome_of(lambda: w.write(b"a"))) == 1
        assert await rd.run(outcome_of(lambda: r.read(10))) == b"a"
        await rd.run(lambda _bus: r.aclose())
        assert await wd.run(outcome_of(lambda: w.write(b"after"))) is PipeBroken
        assert await wd.run(outcome_of(lambda: w.send_all(b"again"))) is PipeBroken
        await wd.run(lambda _bus: w.aclose())


@pytest.mark.parametrize(
    "driver,closed_error",
    [("trio", trio.ClosedResourceError), ("asyncio", UsageError)],
)
async def test_using_a_closed_end(
    driver: str, closed_error: type[Exception], pipe_broker: Callable[..., Any]
) -> None:
    """A closed end refuses reads and writes with its face's closed error (trio's
    ClosedResourceError on trio, UsageError on asyncio), the caller's mistake; closing
    again is a no-op."""
    b = pipe_broker()
    async with open_driver(driver, b.path, "c") as d:

        async def misuse(bus: Any) -> list[type[Exception] | None]:
            r = await bus.pipe("c").open_reader()
            w = await bus.pipe("c").open_writer()
            await r.aclose()
            await w.aclose()
            out: list[type[Exception] | None] = []
            for attempt in (lambda: r.read(1), lambda: w.write(b"x")):
                try:
                    await attempt()
                except Exception as exc:
                    out.append(type(exc))
                else:
                    out.append(None)
            await r.aclose()
            await w.aclose()
            return out

        assert await d.run(misuse) == [closed_error, closed_error]
