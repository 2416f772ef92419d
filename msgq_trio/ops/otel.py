"""The broker's OpenTelemetry spans: a :class:`~msgq_trio.core.traces.SpanSink` over the
OpenTelemetry SDK (the optional ``otel`` extra), for ``[tracing] otel = true`` or
``msgq-trio serve --otel`` (docs/CONFIG.md, README "Knowing your bus").

Each traced hop the broker routes becomes a span, the child of the sender's span
(core/traces.py says which hops and how long each lasts); untraced traffic never gets
here. The exporter is chosen by the standard OpenTelemetry environment variables:

* ``OTEL_TRACES_EXPORTER``: ``otlp`` (the OpenTelemetry default; needs the package
  ``opentelemetry-exporter-otlp``, which reads ``OTEL_EXPORTER_OTLP_ENDPOINT`` and the
  rest itself; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``
  ``grpc`` picks its gRPC flavour, anything else HTTP), ``console`` (one JSON object a
  line, to ``[tracing] otel_file`` or, without one, standard error: standard output
  carries the broker's "listening" lines, which supervisors read) or ``none``.
* ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource (service name
  ``msgq-trio-broker`` unless set); ``OTEL_SDK_DISABLED=true`` turns the spans off.

Spans are batched and exported by the SDK's own thread (``console``: written as they
end, for a file someone reads while the broker runs), and flushed at shutdown.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import IO, Any

from .._version import __version__

__all__ = ["OtelError", "OtelSink", "open_sink"]

log = logging.getLogger("msgq_trio.otel")

#: The service name of the broker's spans unless OTEL_SERVICE_NAME says otherwise.
SERVICE_NAME = "msgq-trio-broker"


class OtelError(Exception):
    """The spans cannot be set up as configured (the extra missing, an unknown exporter,
    an unwritable file): the broker does not start, naming which."""


class OtelSink:
    """Spans of traced hops through an OpenTelemetry tracer (see the module)."""

    def __init__(self, provider: Any, out: IO[str] | None = None) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._provider = provider
        self._tracer = provider.get_tracer("msgq_trio.broker", __version__)
        self._out = out

    def start(
        self, trace_id: str, parent_span: str, sampled: bool, name: str, attributes: dict[str, Any]
    ) -> Any:
        t = self._trace
        parent = t.SpanContext(
            int(trace_id, 16),
            int(parent_span, 16),
            is_remote=True,
            trace_flags=t.TraceFlags(t.TraceFlags.SAMPLED if sampled else t.TraceFlags.DEFAULT),
        )
        ctx = t.set_span_in_context(t.NonRecordingSpan(parent))
        return self._tracer.start_span(
            name, context=ctx, kind=t.SpanKind.INTERNAL, attributes=attributes
        )

    def end(self, span: Any, attributes: dict[str, Any], error: str | None) -> None:
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end()

    def close(self) -> None:
        """Export what is still buffered, and close the file (at the broker's end)."""
        try:
            self._provider.shutdown()
        except Exception:  # an exporter's failure must not fail the broker's shutdown
            log.exception("flushing the OpenTelemetry spans failed")
        if self._out is not None and self._out is not sys.stderr:
            self._out.close()


def open_sink(otel_file: str = "", environ: dict[str, str] | None = None) -> OtelSink | None:
    """The broker's span sink as the OTEL_* variables of ``environ`` (default the
    process's) choose (see the module); None when they turn spans off
    (``OTEL_SDK_DISABLED=true``, ``OTEL_TRACES_EXPORTER=none``).

    Raises:
        OtelError: the ``otel`` extra is not installed, the exporter is unknown or its
            package missing, or ``otel_file`` cannot be opened.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter_name = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if exporter_name == "none":
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError as exc:
        raise OtelError(
            f"[tracing] otel needs the OpenTelemetry SDK: pip install 'msgq-trio[otel]' ({exc})"
        ) from None
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    out: IO[str] | None = None
    if exporter_name == "console":
        try:
            # Open for the broker's life; OtelSink.close() closes it.
            out = open(otel_file, "a", encoding="utf-8", buffering=1) if otel_file else sys.stderr  # noqa: SIM115
        except OSError as exc:
            raise OtelError(f"[tracing] otel_file {otel_file!r} cannot be opened: {exc}") from None
        exporter: Any = ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n"
        )
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif exporter_name == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
    else:
        raise OtelError(
            f"OTEL_TRACES_EXPORTER={exporter_name!r} is not one the broker knows "
            "(otlp, console, none)"
        )
    return OtelSink(provider, out)


def _otlp_exporter(env: Any) -> Any:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    ).strip()
    module = (
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
        if protocol == "grpc"
        else "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    )
    try:
        exporter_class = importlib.import_module(module).OTLPSpanExporter
    except ImportError as exc:
        raise OtelError(
            "OTEL_TRACES_EXPORTER=otlp needs the package opentelemetry-exporter-otlp "
            f"(pip install opentelemetry-exporter-otlp), or set OTEL_TRACES_EXPORTER=console "
            f"({exc})"
        ) from None
    return exporter_class()
