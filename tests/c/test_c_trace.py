"""Trace context through the C client (docs/PROTOCOL.md "Trace context"): a traced
request's handler in C runs in a span of the request's trace, and the calls it makes
from inside its callback carry it on (same trace id, a new span, ``tracecause`` the
request's span), as the Python clients do; untraced requests stay untraced. The C
component is clients/c/tests/introspect_check.c (its ``relay`` calls Python's
``Py.ping``). Every test runs with the plain and the sanitized build."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from libmsgq_build import CBuild, CProcess, check_clean

import msgq_trio
from msgq_trio.client import tracing


@pytest.fixture
def component(cbuild: CBuild, broker: Any, short_tmp: Path) -> Iterator[CProcess]:
    proc = CProcess(
        [str(cbuild.dir / "introspect-check"), "serve", str(broker.path), "Zones"],
        cbuild.env,
        short_tmp / "trace.err",
    )
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.stderr()
        check_clean(proc.stderr())
    finally:
        proc.kill()


def parts(traceparent: str) -> tuple[str, str, str]:
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id, flags


async def test_c_handler_passes_the_trace_on(broker: Any, component: CProcess) -> None:
    """Python A (start_trace) calls the C relay, whose handler notifies PyEvents and
    calls Python's ping: the ping handler runs in the same trace, caused by the C call's
    span, and the notification carries the trace too; the C handler saw A's span as the
    incoming traceparent and ran in a new span of its own; the broker's ``trace`` lists
    the five hops with that causality. An untraced call stays untraced all the way."""
    seen: list[tracing.TraceContext | None] = []
    async with (
        msgq_trio.connect(str(broker.path), name="py") as bus,
        msgq_trio.connect(str(broker.path), name="events") as events,
    ):
        await bus.subscribe("Py")
        await events.subscribe("PyEvents")

        @bus.command("ping")
        def ping(params: Any) -> Any:
            seen.append(tracing.CURRENT.get())
            return {"got": params}

        untraced = await bus.call("Zones", "relay", {"text": "plain"})
        assert untraced == {"pong": {"got": {"text": "plain"}}, "incoming": None, "current": None}
        assert seen == [None]
        with trio.fail_after(10):
            plain_event = await events.receive()
        assert "traceparent" not in plain_event.header

        with tracing.start_trace() as root:
            answer = await bus.call("Zones", "relay", {"text": "traced"})
        assert answer["pong"] == {"got": {"text": "traced"}}
        in_trace, in_span, in_flags = parts(answer["incoming"])
        cur_trace, cur_span, cur_flags = parts(answer["current"])
        assert in_trace == cur_trace == root.trace_id
        assert in_flags == cur_flags == "01"
        assert cur_span != in_span
        handler = seen[1]
        assert handler is not None
        assert handler.trace_id == root.trace_id
        # the C call's span caused the Python handler's: neither A's span nor the C
        # handler's own (each frame sent gets a span of its own)
        assert handler.cause not in (None, in_span, cur_span, root.span_id)
        # the notification sent from the C handler carries the trace as well
        with trio.fail_after(10):
            event = await events.receive()
        assert event.header["event"] == "relayed"
        ev_trace, ev_span, _ = parts(event.header["traceparent"])
        assert ev_trace == root.trace_id
        assert ev_span not in (in_span, cur_span, handler.cause)
        assert event.header["tracecause"] == in_span

        hops: list[dict[str, Any]] = []
        with trio.fail_after(10):
            while len(hops) < 5:
                hops = (await bus.call("msgq", "trace", {"trace_id": root.trace_id}))["hops"]
                await trio.sleep(0.05)
    summary = [(h["kind"], h.get("name"), h["from"][1], h["to"], h["outcome"]) for h in hops]
    assert summary == [
        ("request", "relay", "py", "Zones", "delivered"),
        ("notify", "relayed", "introspect-check", "PyEvents", "delivered"),
        ("request", "ping", "introspect-check", "Py", "delivered"),
        ("reply", None, "py", component_lname(hops), "forwarded"),
        ("reply", None, "introspect-check", bus.lname, "forwarded"),
    ]
    assert hops[0]["span"] == in_span
    assert hops[1]["span"] == ev_span
    assert hops[2]["span"] == handler.cause
    # what the C handler sent names the request whose handler sent it
    assert hops[1]["cause"] == hops[2]["cause"] == in_span


def component_lname(hops: list[dict[str, Any]]) -> str:
    lname: str = hops[2]["from"][0]
    return lname
