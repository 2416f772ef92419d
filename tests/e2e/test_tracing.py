"""End-to-end tracing against a real broker: a chain A -> B -> C under the OpenTelemetry
SDK with an in-memory exporter is one trace with the parent/child structure; the broker
records the hops of traced frames (and of their answers) and ``msgq-trio trace`` prints
them as a tree; untraced traffic leaves no hop behind."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio.client import tracing
from msgq_trio.client.message import Message
from msgq_trio.errors import RemoteError

otel_trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

_PROVIDER: Any = None
_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK's tracer provider (set once per process: the API allows one) and its
    in-memory exporter, emptied for the test."""
    global _PROVIDER
    if _PROVIDER is None:
        # Another test file of this process may have set the provider already (the API
        # takes the first one only): the exporter is added to whichever is in force.
        _PROVIDER = otel_trace.get_tracer_provider()
        if not isinstance(_PROVIDER, sdk_trace.TracerProvider):
            _PROVIDER = sdk_trace.TracerProvider()
            otel_trace.set_tracer_provider(_PROVIDER)
        _PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


async def chain(a: Any, b: Any, c: Any) -> None:
    """B's ``hop`` calls C's ``leaf``; C's ``leaf`` answers what it saw."""

    @c.command("leaf")
    def leaf(params: Any, request: Message) -> Any:
        tc = tracing.CURRENT.get()
        return {"trace_id": tc.trace_id if tc else None, "params": params}

    @b.command("hop")
    async def hop(params: Any) -> Any:
        return await b.call("C", "leaf", params)

    @b.command("broken")
    async def broken(_params: Any) -> Any:
        return await b.call("nobody-here", "leaf")

    await b.subscribe("B")
    await c.subscribe("C")


async def test_otel_spans_form_one_trace(broker: Any, spans: InMemorySpanExporter) -> None:
    tracer = otel_trace.get_tracer("test")
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await chain(a, b, c)
        with tracer.start_as_current_span("root") as root:
            out = await a.call("B", "hop", {"x": 1})
        assert out["params"] == {"x": 1}
        trace_id = root.get_span_context().trace_id
        assert out["trace_id"] == f"{trace_id:032x}"
        # An untraced call afterwards makes no span at all.
        n = len(spans.get_finished_spans())
        await a.call("B", "hop", None)
        await a.send(c.lname, b"untraced")
        await a.send_many(c.lname, [b"untraced too"])
        with tracer.start_as_current_span("sending"):
            await a.send(c.lname, b"traced")
        with trio.fail_after(5):
            got = [await c.receive() for _ in range(3)]
        assert [(m.body, m.traced) for m in got] == [
            (b"untraced", False),
            (b"untraced too", False),
            (b"traced", True),
        ]
        assert len(spans.get_finished_spans()) == n + 2  # "sending" and its send
    got = {
        (s.name, s.kind.name): s
        for s in spans.get_finished_spans()
        if s.context.trace_id == trace_id
    }
    assert set(got) == {
        ("root", "INTERNAL"),
        ("hop B", "CLIENT"),
        ("hop", "SERVER"),
        ("leaf C", "CLIENT"),
        ("leaf", "SERVER"),
    }, sorted(got)
    assert {s.context.trace_id for s in got.values()} == {trace_id}

    def parent(name: str, kind: str) -> Any:
        p = got[(name, kind)].parent
        return p.span_id if p is not None else None

    ids = {k: s.context.span_id for k, s in got.items()}
    assert parent("hop B", "CLIENT") == ids[("root", "INTERNAL")]
    assert parent("hop", "SERVER") == ids[("hop B", "CLIENT")]
    assert parent("leaf C", "CLIENT") == ids[("hop", "SERVER")]
    assert parent("leaf", "SERVER") == ids[("leaf C", "CLIENT")]


async def test_failed_calls_mark_their_spans(broker: Any, spans: InMemorySpanExporter) -> None:
    tracer = otel_trace.get_tracer("test")
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await chain(a, b, c)
        with tracer.start_as_current_span("root"), pytest.raises(RemoteError):
            await a.call("B", "broken")
    status = {s.name: s.status.status_code.name for s in spans.get_finished_spans()}
    assert status["broken B"] == "ERROR"
    assert status["broken"] == "ERROR"
    assert status["leaf nobody-here"] == "ERROR"


async def test_broker_records_the_hops_of_traced_frames(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await chain(a, b, c)
        await a.call("B", "hop", None)  # untraced: nothing recorded anywhere
        with tracing.start_trace() as root:
            await a.call("B", "hop", {"x": 1})
            with pytest.raises(RemoteError):
                await a.call("B", "broken")
            await a.send("C", b"one-way")
        answer: dict[str, Any] = {}
        with trio.fail_after(5):
            while len(answer.get("hops", ())) < 8:
                answer = await a.call("msgq", "trace", {"trace_id": root.trace_id})
        hops = answer["hops"]
        summary = [(h["kind"], h.get("name"), h["from"][1], h["to"], h["outcome"]) for h in hops]
        assert summary == [
            ("request", "hop", "A", "B", "delivered"),
            ("request", "leaf", "B", "C", "delivered"),
            ("reply", None, "C", b.lname, "forwarded"),
            ("reply", None, "B", a.lname, "forwarded"),
            ("request", "broken", "A", "B", "delivered"),
            ("request", "leaf", "B", "nobody-here", "no-recipient"),
            ("error", "internal-error", "B", a.lname, "forwarded"),
            ("message", None, "A", "C", "delivered"),
        ]
        by_span = {h["span"]: h for h in hops if h["span"]}
        # Every hop but the root's requests names the hop that caused it.
        assert hops[1]["cause"] == hops[0]["span"]  # B's call: caused by A's request
        assert hops[2]["cause"] == hops[1]["span"]  # C's answer: to B's call
        assert hops[3]["cause"] == hops[0]["span"]
        assert hops[5]["cause"] == hops[4]["span"]
        assert all(h["cause"] is None or h["cause"] in by_span for h in hops)
        assert hops[0]["delivered"] == [[b.lname, "B"]]
        assert [h["at"] for h in hops] == sorted(h["at"] for h in hops)
        # A bad trace id is the caller's fault.
        with pytest.raises(RemoteError) as err:
            await a.call("msgq", "trace", {"trace_id": "nope"})
        assert err.value.code == "bad-request"


async def test_cli_trace_prints_the_tree(broker: Any) -> None:
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "C") as c,
    ):
        await chain(a, b, c)
        cli = [sys.executable, "-m", "msgq_trio", "trace", "--socket", str(broker.path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with trio.fail_after(30):
            done = await trio.run_process(
                [*cli, "B", "hop", '{"x": 2}'], capture_stdout=True, env=env
            )
            raw = await trio.run_process(
                [*cli, "--json", "--wait", "0", "B", "hop", "3"], capture_stdout=True, env=env
            )
            nobody = await trio.run_process(
                [*cli, "--wait", "0", "nobody", "x"],
                capture_stdout=True,
                capture_stderr=True,
                env=env,
                check=False,
            )
            no_broker = await trio.run_process(
                [*cli[:-1], str(broker.path) + ".gone", "B", "hop"],
                capture_stdout=True,
                capture_stderr=True,
                env=env,
                check=False,
            )
    # A failed call: its error, and still its hops.
    assert nobody.returncode == 1
    assert nobody.stderr.decode().startswith("error: no-recipient: ")
    assert "request x  msgq-trio-trace (" in nobody.stdout.decode()
    assert "[no-recipient]" in nobody.stdout.decode()
    # No broker: one line naming the problem, no traceback.
    assert no_broker.returncode == 1
    assert no_broker.stderr.decode().startswith("error: cannot connect to the broker at ")
    assert "Traceback" not in no_broker.stderr.decode()
    out = done.stdout.decode()
    lines = out.splitlines()
    assert lines[0].startswith("result: {")
    assert lines[1].startswith("trace ") and lines[1].endswith(": 4 hops")
    assert "└─ request hop  msgq-trio-trace (" in lines[2] and f"B ({b.lname})" in lines[2]
    assert lines[3].startswith("   ├─ request leaf  B (") and f"C ({c.lname})" in lines[3]
    assert lines[4].startswith("   │  └─ reply  C (")
    assert lines[5].startswith("   └─ reply  B (")
    assert all(" ms" in line for line in lines[2:])
    parsed = json.loads(raw.stdout.decode().splitlines()[-1])
    assert [h["kind"] for h in parsed["hops"]] == ["request", "request", "reply", "reply"]


# -- the acceptance chain: A -> B -> C -> queue -> D -------------------------------------------
@pytest.fixture
def queue_bus(broker_factory: Any, short_tmp: Any) -> Any:
    """A broker running the queue plugin with a queue ``work``."""
    cfg = short_tmp / "queue.toml"
    cfg.write_text(
        f"[plugins.queue]\ndir = {json.dumps(str(short_tmp / 'store'))}\n"
        '[plugins.queue.queues."work"]\n'
    )
    return broker_factory("--config", str(cfg))


async def queue_chain(
    a: Any, b: Any, c: Any, d: Any, nursery: trio.Nursery, got: list[Any], arrived: trio.Event
) -> None:
    """B's ``hop`` calls C's ``leaf``, which puts its params into the queue ``work``;
    D consumes it (``got``: each message's body and trace header)."""
    producer = c.queue("work", producer="C")
    await producer.prepare()  # declared before any trace: no setup hops in it

    @c.command("leaf")
    async def leaf(params: Any) -> Any:
        return await producer.put(params)

    @b.command("hop")
    async def hop(params: Any) -> Any:
        return await b.call("C", "leaf", params)

    await b.subscribe("B")
    await c.subscribe("C")
    consumer = d.queue("work").consume()

    async def consume() -> None:
        async for m in consumer:
            got.append((m.body, m.trace_header))
            arrived.set()
            await m.ack()

    nursery.start_soon(consume)


async def test_acceptance_chain_is_one_otel_trace(
    queue_bus: Any, spans: InMemorySpanExporter
) -> None:
    tracer = otel_trace.get_tracer("test")
    got: list[Any] = []
    async with (
        msgq_trio.connect(queue_bus.path, "A") as a,
        msgq_trio.connect(queue_bus.path, "B") as b,
        msgq_trio.connect(queue_bus.path, "C") as c,
        msgq_trio.connect(queue_bus.path, "D") as d,
        trio.open_nursery() as nursery,
    ):
        arrived = trio.Event()
        await queue_chain(a, b, c, d, nursery, got, arrived)
        with tracer.start_as_current_span("root") as root:
            assert await a.call("B", "hop", {"job": 1}) in ("stored", "consumed")
        with trio.fail_after(10):
            await arrived.wait()
        nursery.cancel_scope.cancel()
    trace_id = root.get_span_context().trace_id
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    by_key = {(s.name, s.kind.name): s for s in finished}
    assert set(by_key) == {
        ("root", "INTERNAL"),
        ("hop B", "CLIENT"),
        ("hop", "SERVER"),
        ("leaf C", "CLIENT"),
        ("leaf", "SERVER"),
        ("put msgq-queue", "PRODUCER"),
        ("deliver work", "CONSUMER"),
    }, sorted(by_key)

    def parent_of(name: str, kind: str) -> tuple[str, str]:
        pid = by_key[(name, kind)].parent.span_id
        return next(k for k, s in by_key.items() if s.context.span_id == pid)

    assert parent_of("hop B", "CLIENT") == ("root", "INTERNAL")
    assert parent_of("hop", "SERVER") == ("hop B", "CLIENT")
    assert parent_of("leaf C", "CLIENT") == ("hop", "SERVER")
    assert parent_of("leaf", "SERVER") == ("leaf C", "CLIENT")
    assert parent_of("put msgq-queue", "PRODUCER") == ("leaf", "SERVER")
    assert parent_of("deliver work", "CONSUMER") == ("put msgq-queue", "PRODUCER")
    # D holds the consumer span's context: processing continues the trace.
    body, header = got[0]
    assert body == {"job": 1}
    consumer_span = by_key[("deliver work", "CONSUMER")].context.span_id
    parsed = tracing.parse_traceparent(header["traceparent"])
    assert parsed is not None and parsed[:2] == (f"{trace_id:032x}", f"{consumer_span:016x}")


async def test_acceptance_chain_hops_in_the_cli(queue_bus: Any) -> None:
    got: list[Any] = []
    async with (
        msgq_trio.connect(queue_bus.path, "A") as a,
        msgq_trio.connect(queue_bus.path, "B") as b,
        msgq_trio.connect(queue_bus.path, "C") as c,
        msgq_trio.connect(queue_bus.path, "D") as d,
        trio.open_nursery() as nursery,
    ):
        await queue_chain(a, b, c, d, nursery, got, trio.Event())
        cli = [sys.executable, "-m", "msgq_trio", "trace", "--socket", str(queue_bus.path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with trio.fail_after(30):
            done = await trio.run_process(
                [*cli, "--wait", "0.5", "B", "hop", '{"job": 2}'], capture_stdout=True, env=env
            )
        nursery.cancel_scope.cancel()
    assert got and got[0][0] == {"job": 2} and got[0][1]
    lines = done.stdout.decode().splitlines()
    tree = "\n".join(lines[1:])
    # The hops under one another: A's request, B's call, C's put, the queue's delivery to
    # D; each answer under its request.
    assert "└─ request hop  msgq-trio-trace (" in lines[2]
    assert lines[3].startswith("   ├─ request leaf  B (")
    put = next(i for i, line in enumerate(lines) if "request put  C (" in line)
    assert lines[put].startswith("   │  ├─ request put  C (")
    deliver = next(i for i, line in enumerate(lines) if "request queue.deliver" in line)
    assert lines[deliver].startswith("   │  │  ") and f"D ({d.lname})" in lines[deliver]
    assert lines[deliver + 1].startswith("   │  │  ") and "reply  D (" in lines[deliver + 1]
    assert tree.count("reply") == 4, tree
