"""The broker's spans over OTLP/HTTP (``serve --otel`` with the default exporter): a
broker process told by the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` where to send them
posts its spans, protobuf-encoded, to a tiny HTTP receiver in the test, which decodes
them with the OpenTelemetry protocol's own messages; a broker asked for an OTLP flavour
whose package is missing does not start, naming the package."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio.client import tracing

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP endpoint: keeps each request to ``/v1/traces`` decoded."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[Any] = []
        self.paths: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) of every span received so far."""
        out = []
        for req in list(self.requests):
            for rs in req.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                out += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
        return out


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = trace_service.ExportTraceServiceRequest()
        req.ParseFromString(body)
        self.server.paths.append(self.path)
        self.server.requests.append(req)
        answer = trace_service.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


async def test_serve_otel_exports_spans_over_otlp_http(
    broker_factory: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)  # the defaults: otlp, over HTTP
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon, not in 5 s
    broker = broker_factory("--otel")
    async with (
        msgq_trio.connect(broker.path, "A") as a,
        msgq_trio.connect(broker.path, "B") as b,
    ):

        @b.command("echo")
        def echo(params: Any) -> Any:
            return params

        await b.subscribe("Svc")
        await a.call("Svc", "echo", "untraced")
        with tracing.start_trace() as root:
            assert await a.call("Svc", "echo", {"x": 1}) == {"x": 1}
        hops = (await a.call("msgq", "trace", {"trace_id": root.trace_id}))["hops"]
        deadline = time.monotonic() + 10
        # Another process posts to a thread of this one: no event to wait on.
        while not receiver.spans() and time.monotonic() < deadline:  # noqa: ASYNC110
            await trio.sleep(0.05)
    got = receiver.spans()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert len(got) == 1, [s.name for _, s in got]  # the untraced call made none
    resource, span = got[0]
    assert resource["service.name"] == "msgq-trio-broker"
    assert span.name == "msgq request echo"
    assert span.trace_id.hex() == root.trace_id
    request = next(h for h in hops if h["kind"] == "request")
    assert span.parent_span_id.hex() == request["span"]  # the caller's span
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["msgq.command"].string_value == "echo"
    assert attrs["msgq.group"].string_value == "Svc"
    assert attrs["msgq.outcome"].string_value == "answered"
    assert attrs["msgq.answered_by"].string_value == b.lname
    assert span.start_time_unix_nano <= span.end_time_unix_nano


def test_an_otlp_flavour_whose_package_is_missing_stops_the_broker(
    broker_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("opentelemetry-exporter-otlp-proto-grpc is installed: it would start")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(RuntimeError, match="did not start") as info:
        broker_factory("--otel")
    assert "opentelemetry-exporter-otlp" in str(info.value)
