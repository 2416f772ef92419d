"""The broker's own OpenTelemetry spans (``--otel``, ops/otel.py) against a real broker
process writing them with the SDK's console exporter to a file: a traced call's hop is a
span of the client's trace, the child of the client's CLIENT span, lasting until the
answer or the failure, with its group, command, outcome or code and the clients'
lnames; a traced notification's hop is one too; untraced traffic adds no span; a broker
told to use an exporter it cannot have does not start, naming why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import CommandFailed, RecipientGone, RemoteError
from msgq_trio.client.message import Message

otel_trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

_EXPORTER = InMemorySpanExporter()
_INSTALLED = False


@pytest.fixture
def client_spans() -> Iterator[InMemorySpanExporter]:
    """The client side's spans: the process's SDK tracer provider (another test file may
    have set it already: the API allows one) with an in-memory exporter added once."""
    global _INSTALLED
    if not _INSTALLED:
        provider = otel_trace.get_tracer_provider()
        if not isinstance(provider, sdk_trace.TracerProvider):
            provider = sdk_trace.TracerProvider()
            otel_trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        _INSTALLED = True
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


@pytest.fixture
def otel_broker(
    broker_factory: Any, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Path]:
    """A broker with ``--otel`` whose console exporter writes to a file (from the
    configuration file's ``[tracing] otel_file``); the exporter chosen by the standard
    variable."""
    out = short_tmp / "spans.jsonl"
    cfg = short_tmp / "otel.toml"
    cfg.write_text(f"[tracing]\notel_file = {json.dumps(str(out))}\n")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "test-broker")
    return broker_factory("--config", str(cfg), "--otel"), out


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def spans_until(path: Path, n: int) -> list[dict[str, Any]]:
    """The broker's spans once there are at least ``n`` (the exporter writes each as it
    ends, but the answer that ends a call's span may pass the caller's return)."""
    with trio.fail_after(10):
        # Another process writes the file: there is no event to wait on.
        while len(got := read_spans(path)) < n:  # noqa: ASYNC110
            await trio.sleep(0.02)
    return got


def hex_ids(span: Any) -> tuple[str, str]:
    ctx = span.get_span_context()
    return f"0x{ctx.trace_id:032x}", f"0x{ctx.span_id:016x}"


async def test_broker_spans_are_children_of_the_clients(
    otel_broker: tuple[Any, Path], client_spans: InMemorySpanExporter
) -> None:
    broker, out = otel_broker
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
        msgq_trio.connect(broker.path, "W") as w,
    ):

        @b.command("echo")
        def echo(params: Any) -> Any:
            return params

        @b.command("refuse")
        def refuse(_params: Any) -> Any:
            raise CommandFailed("not-today", "refused")

        await b.subscribe("Svc")
        await w.subscribe("Zone")
        await a.call("Svc", "echo", 0)  # untraced: no span anywhere
        assert read_spans(out) == [] and not client_spans.get_finished_spans()

        tracer = otel_trace.get_tracer("test")
        with tracer.start_as_current_span("root"):
            assert await a.call("Svc", "echo", {"x": 1}) == {"x": 1}
            with pytest.raises(RemoteError) as info:
                await a.call("Svc", "refuse")
            assert info.value.code == "not-today"
            await a.notify("Zone", "changed", {"n": 1})
        with trio.fail_after(5):
            assert (await w.receive()).event == "changed"
        got = await spans_until(out, 3)

        mine = {s.name: s for s in client_spans.get_finished_spans()}
        root_trace, _ = hex_ids(mine["root"])
        assert {s["context"]["trace_id"] for s in got} == {root_trace}  # one trace
        by_name = {s["name"]: s for s in got}
        assert set(by_name) == {"msgq request echo", "msgq request refuse", "msgq notify changed"}
        assert all(s["resource"]["attributes"]["service.name"] == "test-broker" for s in got)

        call = by_name["msgq request echo"]
        assert call["parent_id"] == hex_ids(mine["echo Svc"])[1]  # the client's CLIENT span
        attrs = call["attributes"]
        assert attrs["msgq.group"] == "Svc" and attrs["msgq.command"] == "echo"
        assert attrs["msgq.sender"] == a.lname and attrs["msgq.sender_name"] == "A"
        assert attrs["msgq.delivered_to"] == [b.lname]
        assert attrs["msgq.outcome"] == "answered" and attrs["msgq.answered_by"] == b.lname
        assert call["status"]["status_code"] == "UNSET"

        failed = by_name["msgq request refuse"]
        assert failed["parent_id"] == hex_ids(mine["refuse Svc"])[1]
        assert failed["attributes"]["msgq.outcome"] == "error"
        assert failed["attributes"]["msgq.code"] == "not-today"
        assert failed["status"]["status_code"] == "ERROR"

        note = by_name["msgq notify changed"]
        assert note["attributes"]["msgq.group"] == "Zone"
        assert note["attributes"]["msgq.event"] == "changed"
        assert note["attributes"]["msgq.outcome"] == "delivered"
        assert note["start_time"] <= note["end_time"]
        assert call["start_time"] <= call["end_time"]


async def test_a_call_whose_callee_vanishes_ends_its_span_failed(
    otel_broker: tuple[Any, Path], client_spans: InMemorySpanExporter
) -> None:
    broker, out = otel_broker
    async with msgq_trio.connect(broker.path, "A") as a:
        entered = trio.Event()
        async with msgq_trio.connect(broker.path, "B") as b:

            @b.command("hang")
            async def hang(_params: Any, _request: Message) -> Any:
                entered.set()
                await trio.sleep_forever()

            failure: list[BaseException] = []

            async def caller() -> None:
                try:
                    with otel_trace.get_tracer("test").start_as_current_span("root"):
                        await a.call(b.lname, "hang")
                except RecipientGone as exc:
                    failure.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
                with trio.fail_after(5):
                    await entered.wait()
                    assert read_spans(out) == []  # open until the call ends
                await b._close()  # the callee leaves without answering
        assert failure, "the call did not fail with recipient-gone"
        got = await spans_until(out, 1)
        assert got[0]["name"] == "msgq request hang"
        assert got[0]["attributes"]["msgq.outcome"] == "recipient-gone"
        assert got[0]["status"]["status_code"] == "ERROR"


@pytest.mark.parametrize(
    ("exporter", "says"),
    [("bogus", "OTEL_TRACES_EXPORTER='bogus'"), ("otlp", "opentelemetry-exporter-otlp")],
)
def test_an_exporter_the_broker_cannot_have_stops_it(
    broker_factory: Any, monkeypatch: pytest.MonkeyPatch, exporter: str, says: str
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", exporter)
    if exporter == "otlp":
        try:
            import opentelemetry.exporter.otlp  # type: ignore[import-not-found]  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("opentelemetry-exporter-otlp is installed: it would start")
    with pytest.raises(RuntimeError, match="did not start") as info:
        broker_factory("--otel")
    assert says in str(info.value)
