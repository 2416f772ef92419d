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

The exporter and the provider are built by plugins/otel.py, which also gives the
broker's plugin processes spans of their own while the broker emits spans.

Spans are batched and exported by the SDK's own thread (``console``: written as they
end, for a file someone reads while the broker runs), and flushed at shutdown.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Any

from .._version import __version__
from ..plugins.otel import OtelError, tracer_provider

__all__ = ["OtelError", "OtelSink", "open_sink"]

log = logging.getLogger("msgq_trio.otel")

#: The service name of the broker's spans unless OTEL_SERVICE_NAME says otherwise.
SERVICE_NAME = "msgq-trio-broker"


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
    made = tracer_provider(otel_file, os.environ if environ is None else environ, SERVICE_NAME)
    return None if made is None else OtelSink(*made)
