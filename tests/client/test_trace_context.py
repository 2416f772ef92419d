"""Trace context propagation (client/tracing.py) on the three drivers, against a real
broker: a handler runs in the trace of the request it answers, and the calls, messages
and notifications it makes carry that trace on without user code; concurrent handlers
keep their own contexts; untraced traffic carries nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio
import trio.lowlevel

import msgq_trio
import msgq_trio.aio
from msgq_trio.client import tracing
from msgq_trio.client.direct import DirectBus
from msgq_trio.client.message import Message


def seen(request: Message) -> dict[str, Any]:
    """What a leaf handler reports: the context it runs in and what its request carried."""
    tc = tracing.CURRENT.get()
    return {
        "traced": request.traced,
        "traceparent": request.header.get("traceparent"),
        "tracecause": request.header.get("tracecause"),
        "trace_id": tc.trace_id if tc else None,
        "cause": tc.cause if tc else None,
        "span_id": tc.span_id if tc else None,
    }


def relay_outcome(root: tracing.TraceContext, hop: dict[str, Any]) -> None:
    """``hop`` is what the leaf C saw of a call root -> B -> C (B relayed it)."""
    assert hop["traced"]
    parsed = tracing.parse_traceparent(hop["traceparent"])
    assert parsed is not None
    assert parsed[0] == root.trace_id == hop["trace_id"]
    # C's context: a new span whose cause is the span B's call carried ...
    assert hop["cause"] == parsed[1] != hop["span_id"]
    # ... and B's call names the hop that made B run: the root's request.
    assert hop["tracecause"] is not None and hop["tracecause"] != parsed[1]


async def leaf(bus: msgq_trio.Bus) -> None:
    @bus.command("leaf")
    def _leaf(_params: Any, request: Message) -> dict[str, Any]:
        return seen(request)


async def test_trio_handler_propagates_into_nested_calls(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await leaf(c)

        @b.command("hop")
        async def hop(_params: Any, request: Message) -> Any:
            await trio.lowlevel.checkpoint()  # a real task: the context lives in it
            return {"leaf": await b.call(c.lname, "leaf"), "me": seen(request)}

        with tracing.start_trace() as root:
            out = await a.call(b.lname, "hop")
        relay_outcome(root, out["leaf"])
        me = out["me"]
        # B's handler ran in the root's trace, caused by the root's request ...
        assert me["trace_id"] == root.trace_id
        assert me["cause"] == tracing.parse_traceparent(me["traceparent"])[1]  # type: ignore[index]
        assert me["tracecause"] is None  # the root's own request has no cause
        # ... and its nested call names that request as its cause.
        assert out["leaf"]["tracecause"] == me["cause"]
        # Outside the block nothing is traced any more.
        untraced = await a.call(c.lname, "leaf")
        assert untraced == {
            "traced": False,
            "traceparent": None,
            "tracecause": None,
            "trace_id": None,
            "cause": None,
            "span_id": None,
        }


async def test_trio_messages_and_notifications_carry_the_trace(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "sub") as sub,
    ):
        await sub.subscribe("events")

        @b.command("fanout")
        async def fanout(_params: Any) -> None:
            await b.send(sub.lname, b"raw bytes")  # the bytes fast path too
            await b.send(sub.lname, {"x": 1})
            await b.send_many(sub.lname, [b"one", b"two"])

        with tracing.start_trace() as root:
            await a.call(b.lname, "fanout")
            await a.notify("events", "changed", {"n": 1})
        got = []
        with trio.fail_after(5):
            for _ in range(5):
                got.append(await sub.receive())
        for m in got:
            assert m.traced, m
            tc = tracing.context_of(m.header)
            assert tc is not None and tc.trace_id == root.trace_id
        assert [m.body for m in got[:4]] == [b"raw bytes", {"x": 1}, b"one", b"two"]
        assert got[4].event == "changed"
        # A receiver continues the trace explicitly (no handler around a receive()).
        with tracing.continued(got[0].header) as tc2:
            assert tc2 is not None and tc2.trace_id == root.trace_id
            assert tracing.CURRENT.get() == tc2
        assert tracing.CURRENT.get() is None


async def test_concurrent_handlers_keep_their_own_contexts(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await leaf(c)
        both = trio.Event()
        waiting = 0

        @b.command("slow")
        async def slow(_params: Any) -> Any:
            nonlocal waiting
            waiting += 1
            if waiting == 2:
                both.set()
            await both.wait()  # both handlers are in flight at once
            return await b.call(c.lname, "leaf")

        results: dict[str, Any] = {}

        async def one(key: str) -> None:
            with tracing.start_trace() as root:
                results[key] = (root, await a.call(b.lname, "slow"))

        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(one, "x")
                n.start_soon(one, "y")
        (rx, hx), (ry, hy) = results["x"], results["y"]
        assert rx.trace_id != ry.trace_id
        relay_outcome(rx, hx)
        relay_outcome(ry, hy)


@contextmanager
def asyncio_b(path: str, c_lname: str) -> Iterator[Callable[[], str]]:
    """An asyncio client "B" in a thread whose ``hop`` handler calls C's ``leaf``."""
    ready = threading.Event()
    stop: list[Callable[[], None]] = []
    lname: list[str] = []
    errors: list[BaseException] = []

    async def main() -> None:
        async with msgq_trio.aio.connect(path, "B-asyncio") as b:

            @b.command("hop")
            async def hop(_params: Any) -> Any:
                await asyncio.sleep(0)
                return {"leaf": await b.call(c_lname, "leaf")}

            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            stop.append(lambda: loop.call_soon_threadsafe(done.set))
            lname.append(b.lname)
            ready.set()
            await done.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)
            ready.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    if errors:
        raise errors[0]
    try:
        yield lambda: lname[0]
    finally:
        stop[0]()
        t.join(10)
    if errors:
        raise errors[0]


async def test_asyncio_handler_propagates(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await leaf(c)
        with asyncio_b(str(broker.path), c.lname) as b_lname:
            with tracing.start_trace() as root:
                out = await a.call(b_lname(), "hop")
            relay_outcome(root, out["leaf"])
            assert not (await a.call(b_lname(), "hop"))["leaf"]["traced"]


async def test_blocking_handler_propagates(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await leaf(c)
        b = msgq_trio.connect_direct(broker.path, "B-direct")
        try:
            assert isinstance(b, DirectBus)

            @b.command("hop")
            def hop(_params: Any) -> Any:
                return {"leaf": b.call(c.lname, "leaf")}

            stop = threading.Event()

            def serve() -> None:
                while not stop.is_set():
                    b.serve(0.02)

            t = threading.Thread(target=serve, daemon=True)
            t.start()
            try:
                with tracing.start_trace() as root:
                    out = await a.call(b.lname, "hop")
                relay_outcome(root, out["leaf"])
            finally:
                stop.set()
                await trio.to_thread.run_sync(t.join, 10)

            # And the blocking client's own root: its call carries the trace.
            def own_root() -> tuple[tracing.TraceContext, Any]:
                with tracing.start_trace() as root2:
                    return root2, b.call(c.lname, "leaf")

            root2, hop2 = await trio.to_thread.run_sync(own_root)
            assert hop2["trace_id"] == root2.trace_id and hop2["tracecause"] is None
        finally:
            b.close()


def test_traceparent_parsing() -> None:
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.parse_traceparent(good) == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
        1,
    )
    for bad in [
        None,
        42,
        good.upper(),
        good.replace("-01", "-1"),
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
        "ff" + good[2:],
        good + "-extra",
    ]:
        assert tracing.parse_traceparent(bad) is None, bad
    # A later version may add fields; its first four are read.
    assert tracing.parse_traceparent("01" + good[2:] + "-what") is not None
    assert tracing.context_of({"traceparent": good, "tracestate": "x" * 600}) == (
        tracing.TraceContext("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", 1, None)
    )
