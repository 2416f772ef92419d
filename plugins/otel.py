"""The OpenTelemetry tracer provider of the broker's processes: the broker's own spans
(msgq_trio/ops/otel.py) and, while the broker emits spans, its plugin processes' (a
plugin is a component of the trace like any client: the queue plugin's delivery is a
span between the put and the consumer, so that the broker's hop of the delivery has a
parent that exists).

The broker hands its setting to each plugin process in the environment variable
:data:`OTEL_FILE_ENV` (``[tracing] otel_file``, empty for none); a plugin process without
it emits no spans and never imports OpenTelemetry. Both read the standard ``OTEL_*``
variables alike (ops/otel.py says which): a plugin's spans go wherever the broker's go,
the ``console`` exporter appending to the same file, one line per span.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

__all__ = ["OTEL_FILE_ENV", "OtelError", "start_plugin_spans", "tracer_provider"]

log = logging.getLogger("msgq_trio.plugins.otel")

#: Set by the broker for its plugin processes while it emits spans: its ``otel_file``.
OTEL_FILE_ENV = "MSGQ_TRIO_OTEL_FILE"


class OtelError(Exception):
    """The spans cannot be set up as configured (the extra missing, an unknown exporter,
    an unwritable file): the broker does not start, naming which."""


def tracer_provider(
    otel_file: str, environ: Mapping[str, str], service: str
) -> tuple[Any, IO[str] | None] | None:
    """An OpenTelemetry SDK tracer provider exporting as the OTEL_* variables of
    ``environ`` choose (``service``: the service name unless ``OTEL_SERVICE_NAME`` says
    otherwise), and the file the ``console`` exporter writes to (``otel_file``, else
    standard error; the caller closes it after the provider's shutdown); None when the
    variables turn spans off (``OTEL_SDK_DISABLED=true``, ``OTEL_TRACES_EXPORTER=none``).

    Raises:
        OtelError: the ``otel`` extra is not installed, the exporter is unknown or its
            package missing, or ``otel_file`` cannot be opened.
    """
    env = environ
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
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attributes))
    out: IO[str] | None = None
    if exporter_name == "console":
        try:
            # Appended to, one line per write: the broker and its plugin processes share
            # the file. Open for the process's life; the caller closes it.
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
    return provider, out


def _otlp_exporter(env: Mapping[str, str]) -> Any:
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


class PluginSpans:
    """A plugin process's tracer provider, installed as OpenTelemetry's global one (so
    the client's tracing, msgq_trio/client/tracing.py, records the plugin's spans)."""

    def __init__(self, provider: Any, out: IO[str] | None) -> None:
        self._provider = provider
        self._out = out

    def close(self) -> None:
        """Export what is still buffered, and close the file (at the process's end)."""
        try:
            self._provider.shutdown()
        except Exception:  # an exporter's failure must not fail the plugin's exit
            log.exception("flushing the OpenTelemetry spans failed")
        if self._out is not None and self._out is not sys.stderr:
            self._out.close()


def start_plugin_spans(name: str, environ: Mapping[str, str] | None = None) -> PluginSpans | None:
    """Emit the spans of plugin ``name``'s process (service ``msgq-trio-NAME``) when its
    broker emits its own (:data:`OTEL_FILE_ENV` set in ``environ``, default the
    process's); None otherwise. A setting the broker accepted but this process cannot
    have (the file gone meanwhile) is logged, and the plugin runs without spans: its
    work matters more than its spans."""
    env = os.environ if environ is None else environ
    otel_file = env.get(OTEL_FILE_ENV)
    if otel_file is None:
        return None
    try:
        made = tracer_provider(otel_file, env, f"msgq-trio-{name}")
    except OtelError as exc:
        log.error("plugin %s: no spans: %s", name, exc)
        return None
    if made is None:
        return None
    from opentelemetry import trace

    trace.set_tracer_provider(made[0])
    return PluginSpans(*made)
