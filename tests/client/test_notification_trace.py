"""Notification callbacks run in the trace their notification carries, on the trio and
asyncio clients: what a callback sends (here a call) continues the sender's trace, as a
command handler's does, without user code; untraced notifications run untraced."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import trio

import msgq_trio
import msgq_trio.aio
from msgq_trio.client import tracing
from msgq_trio.client.message import Message


def leaf_view(request: Message) -> dict[str, Any]:
    """What the leaf saw: the trace its request carried and the cause named in it."""
    tc = tracing.context_of(request.header)
    return {
        "trace_id": tc.trace_id if tc else None,
        "tracecause": request.header.get("tracecause"),
    }


def check(root: tracing.TraceContext, note: Message, seen: dict[str, Any]) -> None:
    """``seen`` is what a callback of ``note`` reported (its own context, and what its
    call to the leaf carried)."""
    sent = tracing.context_of(note.header)
    assert sent is not None and sent.trace_id == root.trace_id
    # The callback ran in the notification's trace, caused by the notification's span ...
    assert seen["cb_trace"] == root.trace_id and seen["cb_cause"] == sent.span_id
    # ... and its call carried the trace on, naming the notification as its cause.
    assert seen["leaf"]["trace_id"] == root.trace_id
    assert seen["leaf"]["tracecause"] == sent.span_id


def callback_view(tc: tracing.TraceContext | None) -> dict[str, Any]:
    return {
        "cb_trace": tc.trace_id if tc else None,
        "cb_cause": tc.cause if tc else None,
        "cb_span": tc.span_id if tc else None,
    }


async def test_trio_notification_callbacks_continue_the_trace(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
        msgq_trio.connect(broker.path, "copy") as copy,
    ):
        c.add_command("leaf", lambda _p, request: leaf_view(request))
        send, got = trio.open_memory_channel[dict[str, Any]](10)

        async def on_zone(note: Message) -> None:
            view = callback_view(tracing.CURRENT.get())
            view["leaf"] = await b.call(c.lname, "leaf")
            view["event"] = note.event
            await send.send(view)

        inline_seen: list[dict[str, Any]] = []
        inline_done = trio.Event()

        def on_inline(_note: Message) -> None:
            inline_seen.append(callback_view(tracing.CURRENT.get()))
            inline_done.set()

        b.on_notification("Zone", on_zone)
        b.on_notification_inline("Inline", on_inline)
        await b.subscribe("Zone")
        await b.subscribe("Inline")
        await copy.subscribe("Zone")  # the notification as sent, for its span id

        with tracing.start_trace() as root:
            await a.notify("Zone", "changed", {"n": 1})
            await a.notify("Inline", "changed")
        await a.notify("Zone", "untraced")
        with trio.fail_after(10):
            # Each callback runs in a task of its own: they may end in either order.
            views = {v["event"]: v for v in [await got.receive(), await got.receive()]}
            note = await copy.receive()
        traced, untraced = views["changed"], views["untraced"]
        check(root, note, traced)
        assert untraced["cb_trace"] is None and untraced["leaf"]["trace_id"] is None
        with trio.fail_after(10):
            await inline_done.wait()
        assert inline_seen[0]["cb_trace"] == root.trace_id
        assert tracing.CURRENT.get() is None  # nothing leaked into this task


async def test_asyncio_notification_callbacks_continue_the_trace(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "C") as c,
        msgq_trio.connect(broker.path, "copy") as copy,
    ):
        c.add_command("leaf", lambda _p, request: leaf_view(request))
        await copy.subscribe("Zone")
        views: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
        ready = threading.Event()
        stop: list[Any] = []

        async def main() -> None:
            async with msgq_trio.aio.connect(str(broker.path), "B-asyncio") as b:

                async def on_zone(note: Message) -> None:
                    view = callback_view(tracing.CURRENT.get())
                    view["leaf"] = await b.call(c.lname, "leaf")
                    view["event"] = note.event
                    views.put(view)

                b.on_notification("Zone", on_zone)
                await b.subscribe("Zone")
                done = asyncio.Event()
                loop = asyncio.get_running_loop()
                stop.append(lambda: loop.call_soon_threadsafe(done.set))
                ready.set()
                await done.wait()

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:
                views.put(exc)
                ready.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert await trio.to_thread.run_sync(ready.wait, 10)
        try:
            with tracing.start_trace() as root:
                await a.notify("Zone", "changed")
            await a.notify("Zone", "untraced")
            first = await trio.to_thread.run_sync(views.get, True, 10)
            second = await trio.to_thread.run_sync(views.get, True, 10)
        finally:
            if stop:
                stop[0]()
            await trio.to_thread.run_sync(t.join, 10)
        assert isinstance(first, dict) and isinstance(second, dict), (first, second)
        # Each callback runs in a task of its own: they may end in either order.
        by_event = {v["event"]: v for v in (first, second)}
        traced, untraced = by_event["changed"], by_event["untraced"]
        with trio.fail_after(10):
            note = await copy.receive()
        check(root, note, traced)
        assert untraced["cb_trace"] is None and untraced["leaf"]["trace_id"] is None
