"""One request followed through separate processes: component A calls B, whose handler
calls C, whose handler puts a message into the durable queue ``work`` (the queue plugin)
that consumer D fetches and processes; every component is its own process with the
OpenTelemetry SDK (README: ``@bus.command`` handlers, ``tracing.continued`` for a queued
message), the broker runs with ``--otel`` writing its spans (and its queue plugin's) as
JSON lines to ``[tracing] otel_file``. Meanwhile a fifth process E drives untraced calls
through the same chain without a pause.

Every span of every process is then one trace whose parent links are exactly the
chain: A's call, the broker's hop of it and B's handler; B's call, its hop and C's
handler; C's put, its hop and the queue plugin's delivery; the plugin's call of D, its
hop and D's receipt, and D's processing under it. The broker forwards frames unchanged, so
its span of a hop is the child of the sender's span, beside the receiver's (as
docs/PROTOCOL.md "Trace context" says). No span lacks its parent, and E's traffic (which
crossed every process at the same time) added none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import STOP_TIMEOUT, LineReader

pytest.importorskip("opentelemetry.sdk.trace")

#: One component of the chain, as an application writes it (README: "Knowing your bus").
COMPONENT = textwrap.dedent("""
    import json, sys
    import trio
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    import msgq_trio
    from msgq_trio.client import tracing

    role, socket, spans = sys.argv[1], sys.argv[2], sys.argv[3]
    provider = TracerProvider(resource=Resource.create({"service.name": role}))
    out = open(spans, "a", buffering=1)
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
        out=out, formatter=lambda span: span.to_json(indent=None) + "\\n")))
    trace.set_tracer_provider(provider)

    def say(*parts):
        print(*parts, flush=True)

    async def main():
        async with msgq_trio.connect(socket, role) as bus:
            if role == "B":
                @bus.command("hop")
                async def hop(params):
                    return await bus.call("C", "leaf", params)

                await bus.subscribe("B")
            elif role == "C":
                producer = bus.queue("work", producer="C")
                await producer.prepare()

                @bus.command("leaf")
                async def leaf(params):
                    return await producer.put(params)

                await bus.subscribe("C")
            elif role == "D":
                say("ready")
                async for m in bus.queue("work").consume():
                    with tracing.continued(m.trace_header, "process work"):
                        await m.ack()
                    say("got", json.dumps(m.body))
            elif role == "A":
                tracer = trace.get_tracer("component-a")
                with tracer.start_as_current_span("root") as root:
                    answer = await bus.call("B", "hop", {"job": 1})
                say("trace", f"{root.get_span_context().trace_id:032x}")
                say("answer", json.dumps(answer))
                return
            elif role == "E":  # untraced traffic through the whole chain
                n = 0
                while True:
                    n += 1
                    await bus.call("B", "hop", {"noise": n})
                    say("noise", n)
            say("ready")
            await trio.sleep_forever()

    trio.run(main)
""")


@pytest.fixture
def traced_bus(
    broker_factory: Any, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Path]:
    """A broker with the queue plugin (queue ``work``) and ``--otel``, whose console
    exporter writes to a file (``[tracing] otel_file``)."""
    out = short_tmp / "broker-spans.jsonl"
    cfg = short_tmp / "chain.toml"
    cfg.write_text(
        f"[tracing]\notel_file = {json.dumps(str(out))}\n"
        f"[plugins.queue]\ndir = {json.dumps(str(short_tmp / 'store'))}\n"
        '[plugins.queue.queues."work"]\n'
    )
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    return broker_factory("--config", str(cfg), "--otel"), out


class Component:
    def __init__(self, role: str, proc: subprocess.Popen[bytes], spans: Path) -> None:
        self.role, self.proc, self.spans = role, proc, spans
        assert proc.stdout is not None
        self.reader = LineReader(proc.stdout.fileno())

    def expect(self, word: str, timeout: float = 30.0) -> str:
        """The rest of the next line starting with ``word`` (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.reader.readline(max(0.1, deadline - time.monotonic()))
            assert line is not None, f"{self.role} ended before printing {word!r}"
            if line.split(" ", 1)[0] == word:
                return line.partition(" ")[2]


@pytest.fixture
def components(short_tmp: Path, broker_factory: Any) -> Iterator[Callable[..., Component]]:
    """``start(role, socket)``: a component process; SIGKILLed at the end (before the
    broker stops: it depends on ``broker_factory``)."""
    script = short_tmp / "component.py"
    script.write_text(COMPONENT)
    started: list[Component] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def start(role: str, socket: Path) -> Component:
        spans = short_tmp / f"{role}-spans.jsonl"
        with open(short_tmp / f"{role}.log", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(script), role, str(socket), str(spans)],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        c = Component(role, proc, spans)
        started.append(c)
        return c

    yield start
    for c in reversed(started):
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait(STOP_TIMEOUT)
        assert c.proc.stdout is not None
        c.proc.stdout.close()


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


#: The chain's spans: (process, name, kind) -> its parent's key (None: the root).
CHAIN: dict[tuple[str, str, str], tuple[str, str, str] | None] = {
    ("A", "root", "INTERNAL"): None,
    ("A", "hop B", "CLIENT"): ("A", "root", "INTERNAL"),
    ("broker", "msgq request hop", "INTERNAL"): ("A", "hop B", "CLIENT"),
    ("B", "hop", "SERVER"): ("A", "hop B", "CLIENT"),
    ("B", "leaf C", "CLIENT"): ("B", "hop", "SERVER"),
    ("broker", "msgq request leaf", "INTERNAL"): ("B", "leaf C", "CLIENT"),
    ("C", "leaf", "SERVER"): ("B", "leaf C", "CLIENT"),
    ("C", "put msgq-queue", "PRODUCER"): ("C", "leaf", "SERVER"),
    ("broker", "msgq request put", "INTERNAL"): ("C", "put msgq-queue", "PRODUCER"),
    ("queue", "deliver work", "PRODUCER"): ("C", "put msgq-queue", "PRODUCER"),
    ("queue", "queue.deliver D", "CLIENT"): ("queue", "deliver work", "PRODUCER"),
    ("broker", "msgq request queue.deliver", "INTERNAL"): ("queue", "queue.deliver D", "CLIENT"),
    ("D", "deliver work", "CONSUMER"): ("queue", "deliver work", "PRODUCER"),
    ("D", "process work", "CONSUMER"): ("D", "deliver work", "CONSUMER"),
}


def _key(span: dict[str, Any], role: str) -> tuple[str, str, str]:
    """(process, name, kind) of a span: the process is the component's role, or for the
    broker's file the broker itself or its queue plugin (by their service names); the
    plugin's call to D is named after D's lname, which varies."""
    who = role
    if role == "broker":
        service = span["resource"]["attributes"]["service.name"]
        who = {"msgq-trio-broker": "broker", "msgq-trio-queue": "queue"}.get(service, service)
    name = span["name"]
    if who == "queue" and name.startswith("queue.deliver l."):
        name = "queue.deliver D"
    return who, name, span["kind"].removeprefix("SpanKind.")


def test_one_request_through_a_b_c_queue_d_is_one_trace(
    traced_bus: tuple[Any, Path], components: Callable[..., Component]
) -> None:
    broker, broker_spans = traced_bus
    socket = broker.path
    d = components("D", socket)
    c = components("C", socket)
    b = components("B", socket)
    for ready in (d, c, b):
        ready.expect("ready")
    e = components("E", socket)
    e.expect("noise")  # untraced traffic runs through B, C, the queue and D...
    assert json.loads(d.expect("got")).get("noise")

    a = components("A", socket)
    trace_id = a.expect("trace")
    assert json.loads(a.expect("answer")) in ("stored", "consumed")
    while json.loads(d.expect("got")) != {"job": 1}:
        pass
    first = int(e.expect("noise"))
    assert int(e.expect("noise")) > first  # ...and went on after the traced request

    files = {"broker": broker_spans, **{p.role: p.spans for p in (a, b, c, d, e)}}
    deadline = time.monotonic() + 10
    while True:  # the last spans end as their answers pass: wait for them all
        spans = {_key(s, role): s for role, path in files.items() for s in read_spans(path)}
        if len(spans) >= len(CHAIN) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    everything = [s for path in files.values() for s in read_spans(path)]

    # Exactly the chain: one span each, nothing from E's untraced traffic.
    assert sorted(spans) == sorted(CHAIN)
    assert len(everything) == len(CHAIN), [s["name"] for s in everything]
    assert {s["context"]["trace_id"] for s in everything} == {f"0x{trace_id}"}
    by_id = {s["context"]["span_id"]: key for key, s in spans.items()}
    parents = {key: by_id.get(s["parent_id"]) for key, s in spans.items()}
    assert parents == CHAIN  # every parent is a span of the trace: no orphan
    assert not any(s["parent_id"] and s["parent_id"] not in by_id for s in everything)
