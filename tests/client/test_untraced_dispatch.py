"""A request that carries no trace runs untraced, even when the task or thread that
dispatches it works for a trace: a blocking client waiting inside a trace for its own
answer serves the requests that arrive meanwhile, and their handlers must not inherit
(and propagate) the waiting caller's trace."""

from __future__ import annotations

from typing import Any

import trio

import msgq_trio
from msgq_trio.client import tracing


async def test_a_waiting_blocking_caller_serves_untraced_requests_untraced(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "C") as c,
        msgq_trio.connect(broker.path, "B") as b,
    ):
        seen: list[Any] = []
        direct = msgq_trio.connect_direct(broker.path, "A")

        @direct.command("who")
        def who(_params: Any) -> Any:
            tc = tracing.CURRENT.get()
            seen.append(tc)
            return tc is None

        go, done = trio.Event(), trio.Event()

        @c.command("slow")
        async def slow(_params: Any) -> Any:
            go.set()  # A now waits for this answer, inside its trace
            await done.wait()
            return "ok"

        async def untraced_caller() -> None:
            await go.wait()
            try:
                assert await b.call(direct.lname, "who") is True  # served by A's waiting call
            finally:
                done.set()

        root: list[tracing.TraceContext] = []

        def traced_call() -> Any:
            with tracing.start_trace() as tc:
                root.append(tc)
                return direct.call(c.lname, "slow", timeout=5)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(untraced_caller)
                with trio.fail_after(10):
                    assert await trio.to_thread.run_sync(traced_call) == "ok"
        finally:
            await trio.to_thread.run_sync(direct.close)
        assert root and seen == [None]
