"""Trace context: W3C ``traceparent`` propagation through the bus, and OpenTelemetry
spans when the application uses OpenTelemetry (docs/PROTOCOL.md, "Trace context").

One context variable, :data:`CURRENT`, holds the trace a piece of code works for. Every
driver runs a traced request's handler with it set (:func:`traced_handler`), and the
encoders put it on every call, message, notification and queue put made meanwhile
(:func:`outgoing`), so user code does nothing to propagate a trace. A context variable
is per task (trio, asyncio) and per thread, so concurrent handlers never see each
other's trace.

OpenTelemetry is never imported here: it is used only when the application imported
``opentelemetry.trace`` itself and configured a tracer provider (a real one, not the
API's default proxy). Then calls get CLIENT spans, handlers SERVER spans, queue puts
PRODUCER spans and :func:`continued` CONSUMER spans, each the child of the span that was
current, and the wire carries those spans' ids.

Untraced traffic pays one context-variable read per frame sent (and one ``sys.modules``
lookup), and one test of a prefix flag per request received.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

from ..errors import MalformedMessage
from ..protocol.codes import Flag

__all__ = [
    "CURRENT",
    "FLAG_TRACED",
    "OTEL_MODULE",
    "SPAN_KIND",
    "Outgoing",
    "TraceContext",
    "active",
    "context_of",
    "continued",
    "delivered_traces",
    "dispatching_in_a_trace",
    "format_traceparent",
    "handler_in_its_trace",
    "new_trace",
    "outgoing",
    "parse_traceparent",
    "producing",
    "received",
    "recording",
    "start_trace",
    "traced_handler",
    "untraced_handler",
]

#: The prefix flag of a frame whose header carries ``traceparent``.
FLAG_TRACED = int(Flag.TRACED)
#: Header keys (docs/PROTOCOL.md, "Trace context").
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACECAUSE = "tracecause"
#: The module whose presence in ``sys.modules`` tells that the application uses
#: OpenTelemetry.
OTEL_MODULE = "opentelemetry.trace"
#: W3C: tracestate is at most 32 list members; 512 characters is what a vendor must
#: propagate at least. Longer values from a sender are dropped, not forwarded.
MAX_TRACESTATE = 512
_HEX = frozenset("0123456789abcdef")


class TraceContext(NamedTuple):
    """The trace a piece of code works for."""

    #: 32 lowercase hex digits, not all zero.
    trace_id: str
    #: 16 lowercase hex digits: the current span (a handler's, or a trace's root).
    span_id: str
    #: The W3C trace-flags byte (bit 0: sampled).
    flags: int = 1
    #: The W3C ``tracestate`` that came with it, passed on unchanged.
    state: str | None = None
    #: The span id carried by the frame whose handler runs (the hop that caused this
    #: code to run), None at a trace's root.
    cause: str | None = None


#: The current trace context (None: untraced).
CURRENT: ContextVar[TraceContext | None] = ContextVar("msgq_trio_trace", default=None)
#: The OpenTelemetry kind of the span a call gets: ``client``, or ``producer`` for a
#: queue put (set by :func:`producing`).
SPAN_KIND: ContextVar[str] = ContextVar("msgq_trio_span_kind", default="client")


@contextlib.contextmanager
def producing() -> Iterator[None]:
    """Calls made in the block put messages into a queue: their spans are PRODUCER
    spans, not CLIENT ones."""
    token = SPAN_KIND.set("producer")
    try:
        yield
    finally:
        SPAN_KIND.reset(token)


def _rand_hex(nbytes: int) -> str:
    while True:
        h = os.urandom(nbytes).hex()
        if h.strip("0"):
            return h


def new_trace(flags: int = 1) -> TraceContext:
    """A new trace's root context (random ids, sampled)."""
    return TraceContext(_rand_hex(16), _rand_hex(8), flags)


@contextlib.contextmanager
def start_trace(flags: int = 1) -> Iterator[TraceContext]:
    """Run the block as the root of a new trace: every call, message, notification and
    queue put it makes (and whatever their handlers do in turn) carries it. Yields the
    root's context (its ``trace_id`` names the trace: ``msgq-trio trace`` asks the broker
    for its hops). Nested inside another trace, the block starts a new one."""
    tc = new_trace(flags)
    token = CURRENT.set(tc)
    try:
        yield tc
    finally:
        CURRENT.reset(token)


def format_traceparent(trace_id: str, span_id: str, flags: int) -> str:
    """The W3C ``traceparent`` value (version 00)."""
    return f"00-{trace_id}-{span_id}-{flags & 0xFF:02x}"


def parse_traceparent(value: object) -> tuple[str, str, int] | None:
    """``(trace_id, span_id, flags)`` of a W3C ``traceparent``, or None if it is not one
    (W3C: an invalid traceparent is ignored, the receiver starts afresh)."""
    if type(value) is not str or len(value) < 55:
        return None
    parts = value.split("-")
    if len(parts) < 4:
        return None
    version, trace_id, span_id, flags = parts[0], parts[1], parts[2], parts[3]
    if (
        len(version) != 2
        or version == "ff"
        or (version == "00" and len(parts) != 4)
        or len(trace_id) != 32
        or len(span_id) != 16
        or len(flags) != 2
        or not _HEX.issuperset(version + trace_id + span_id + flags)
        or not trace_id.strip("0")
        or not span_id.strip("0")
    ):
        return None
    return trace_id, span_id, int(flags, 16)


def context_of(header: dict[str, object]) -> TraceContext | None:
    """The context a received frame's header carries, as the sender's hop: ``span_id``
    is the sender's span, ``cause`` None. None if the header has no valid
    ``traceparent``."""
    parsed = parse_traceparent(header.get(TRACEPARENT))
    if parsed is None:
        return None
    state = header.get(TRACESTATE)
    if type(state) is not str or len(state) > MAX_TRACESTATE:
        state = None
    return TraceContext(parsed[0], parsed[1], parsed[2], state)


# -- OpenTelemetry (only when the application uses it) -----------------------------------
_tracers: dict[int, Any] = {}


def _otel() -> tuple[Any, Any] | None:
    """``(opentelemetry.trace, tracer)`` when the application imported OpenTelemetry and
    set a tracer provider; None otherwise (nothing is imported here)."""
    ot = sys.modules.get(OTEL_MODULE)
    if ot is None:
        return None
    provider = ot.get_tracer_provider()
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return None
    tracer = _tracers.get(id(provider))
    if tracer is None:
        from .._version import __version__

        tracer = provider.get_tracer("msgq_trio", __version__)
        _tracers.clear()  # one provider at a time: never grows
        _tracers[id(provider)] = tracer
    return ot, tracer


def _remote_parent(ot: Any, tc: TraceContext) -> Any:
    """An OpenTelemetry context whose current span is ``tc``'s (not recorded here)."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    state = TraceState.from_header([tc.state]) if tc.state else None
    sc = SpanContext(
        int(tc.trace_id, 16),
        int(tc.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(tc.flags & 0xFF),
        trace_state=state,
    )
    return ot.set_span_in_context(NonRecordingSpan(sc))


def _ids(span: Any) -> tuple[str, str, int, str | None]:
    sc = span.get_span_context()
    state = sc.trace_state.to_header() if sc.trace_state else None
    return f"{sc.trace_id:032x}", f"{sc.span_id:016x}", int(sc.trace_flags), state or None


# -- sending --------------------------------------------------------------------------------
class Outgoing(NamedTuple):
    """The trace fields of one frame about to be sent, and its span (OpenTelemetry) that
    whoever sends it ends (:meth:`end`) once the operation is over."""

    fields: dict[str, object]
    span: Any = None

    def end(self, error: BaseException | None = None) -> None:
        """End the span (if any), marking it failed with ``error``."""
        span = self.span
        if span is None:
            return
        if error is not None:
            _fail(span, error)
        span.end()


def outgoing(name: str, kind: str = "client") -> Outgoing | None:
    """The trace fields for a frame sent now (a new span, child of the current one), or
    None when nothing is traced. ``name`` names the span (``"cmd target"``); ``kind`` is
    ``client`` (a call), ``producer`` (a message, notification or queue put).

    With OpenTelemetry the span is a real one, started here: the caller ends it
    (:meth:`Outgoing.end`); a one-way frame's span ends when it is sent.
    """
    tc = CURRENT.get()
    otel = _otel() if OTEL_MODULE in sys.modules else None
    if otel is None:
        if tc is None:
            return None
        trace_id, span_id, flags, state = tc.trace_id, _rand_hex(8), tc.flags, tc.state
        span = None
    else:
        ot, tracer = otel
        parent = ot.get_current_span().get_span_context()
        if tc is None and not parent.is_valid:
            return None
        ctx = None
        if tc is not None and (not parent.is_valid or parent.trace_id != int(tc.trace_id, 16)):
            ctx = _remote_parent(ot, tc)  # a trace started without a span of its own
        span = tracer.start_span(name, context=ctx, kind=_kind(ot, kind))
        trace_id, span_id, flags, state = _ids(span)
    fields: dict[str, object] = {TRACEPARENT: format_traceparent(trace_id, span_id, flags)}
    if state:
        fields[TRACESTATE] = state
    if tc is not None and tc.cause:
        fields[TRACECAUSE] = tc.cause
    return Outgoing(fields, span)


def recording() -> bool:
    """Whether this process records spans (it configured an OpenTelemetry tracer
    provider): the span ids the wire carries from here are then spans that exist."""
    return (_otel() if OTEL_MODULE in sys.modules else None) is not None


def active() -> bool:
    """Whether a frame sent now would carry a trace context (:func:`outgoing` would not
    give None), without starting a span."""
    if CURRENT.get() is not None:
        return True
    otel = _otel() if OTEL_MODULE in sys.modules else None
    return otel is not None and bool(otel[0].get_current_span().get_span_context().is_valid)


def _kind(ot: Any, kind: str) -> Any:
    return {
        "client": ot.SpanKind.CLIENT,
        "server": ot.SpanKind.SERVER,
        "producer": ot.SpanKind.PRODUCER,
        "consumer": ot.SpanKind.CONSUMER,
    }[kind]


def _fail(span: Any, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


# -- receiving ------------------------------------------------------------------------------
def _start(sent: TraceContext, name: str, kind: str) -> tuple[TraceContext, Any]:
    """The context of the code a received frame (``sent``, the sender's hop) runs, and
    its OpenTelemetry span (started; None without OpenTelemetry)."""
    otel = _otel() if OTEL_MODULE in sys.modules else None
    if otel is None:
        return sent._replace(span_id=_rand_hex(8), cause=sent.span_id), None
    ot, tracer = otel
    span = tracer.start_span(name, context=_remote_parent(ot, sent), kind=_kind(ot, kind))
    trace_id, span_id, flags, state = _ids(span)
    return TraceContext(trace_id, span_id, flags, state, sent.span_id), span


@contextlib.contextmanager
def _inside(tc: TraceContext, span: Any) -> Iterator[None]:
    """:data:`CURRENT` is ``tc`` (and ``span`` OpenTelemetry's current span) in the
    block, in the running task's or thread's context only."""
    token = CURRENT.set(tc)
    try:
        if span is None:
            yield
        else:
            ot = sys.modules[OTEL_MODULE]
            with ot.use_span(span, end_on_exit=False, record_exception=False):
                yield
    finally:
        CURRENT.reset(token)


def _end(span: Any, error: BaseException | None) -> None:
    if span is not None:
        Outgoing({}, span).end(error)


@contextlib.contextmanager
def continued(
    header: dict[str, object], name: str = "process", kind: str = "consumer"
) -> Iterator[TraceContext | None]:
    """Run the block in the trace a received frame's ``header`` carries (a message, a
    notification, a queued message): :data:`CURRENT` is set (a new span, child of the
    sender's), so what the block sends belongs to the trace; with OpenTelemetry the
    block is a span of ``kind`` (``consumer`` by default). A header without a valid
    ``traceparent`` runs the block untraced (yields None)."""
    sent = context_of(header)
    if sent is None:
        yield None
        return
    tc, span = _start(sent, name, kind)
    try:
        with _inside(tc, span):
            yield tc
    except BaseException as exc:
        _end(span, exc)
        raise
    _end(span, None)


def received(msg: Any) -> contextlib.AbstractContextManager[TraceContext | None]:
    """:func:`continued` for a received notification or message ``msg`` (a
    :class:`~msgq_trio.client.message.Message`): its callback runs in the trace the
    sender put on it (a CONSUMER span named after its event with OpenTelemetry), so
    what the callback sends continues that trace. An untraced one runs untraced, whatever
    the dispatching task works for (it costs a flag test and a context-variable read);
    a traced one with a malformed header runs untraced too (the sender's bug)."""
    if not msg.traced:
        return _NOTHING if CURRENT.get() is None else _untraced()
    try:
        header = msg.header
    except MalformedMessage:  # the sender's bug, not the callback's
        return _untraced()
    return continued(header, f"{msg.event or msg.kind} {msg.target}", "consumer")


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """The block runs untraced even inside a trace: a frame can be dispatched by a task
    that works for a trace (a caller polling the socket for its answer takes whatever
    arrives), and what it dispatches must not inherit that trace."""
    token = CURRENT.set(None)
    try:
        ot = sys.modules.get(OTEL_MODULE)
        if ot is None:
            yield
        else:
            with ot.use_span(ot.INVALID_SPAN, end_on_exit=False):
                yield
    finally:
        CURRENT.reset(token)


def traced_handler(
    handler: Callable[[Any, Any], Any], header: dict[str, object], command: str
) -> Callable[[Any, Any], Any]:
    """``handler`` run in the trace of the request whose ``header`` is given (see
    :func:`continued`; a SERVER span with OpenTelemetry): a plain function inside the
    context, an ``async`` one for its whole run, inside the task that awaits it (so
    concurrent handlers keep their own contexts). A header without a valid
    ``traceparent`` gives ``handler`` itself."""
    sent = context_of(header)
    if sent is None:
        return handler

    def run(params: Any, request: Any) -> Any:
        tc, span = _start(sent, command, "server")
        try:
            with _inside(tc, span):
                result = handler(params, request)
        except BaseException as exc:
            _end(span, exc)
            raise
        if inspect.isawaitable(result):
            return _await_in(result, tc, span)
        _end(span, None)
        return result

    return run


def dispatching_in_a_trace() -> bool:
    """Whether the running task or thread works for a trace (its own context, or an
    OpenTelemetry span the application may have made current): an untraced request
    dispatched here must then be run with :func:`untraced_handler`. One
    context-variable read and one ``sys.modules`` lookup (and, where OpenTelemetry is
    imported, a look at its current span)."""
    if CURRENT.get() is not None:
        return True
    ot = sys.modules.get(OTEL_MODULE)
    return ot is not None and bool(ot.get_current_span().get_span_context().is_valid)


def handler_in_its_trace(
    handler: Callable[[Any, Any], Any], request: Any
) -> Callable[[Any, Any], Any]:
    """``handler`` for ``request`` (a received :class:`~msgq_trio.client.message.Message`)
    run in the request's trace (:func:`traced_handler`), or untraced
    (:func:`untraced_handler`) when it carries none but the dispatching task works for
    a trace: every driver's one call site of a handler calls this when
    ``request.traced or dispatching_in_a_trace()``."""
    if request.traced:
        return traced_handler(handler, request.header, request.command or "")
    return untraced_handler(handler)


def untraced_handler(handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``handler`` of an untraced request run untraced, whatever the dispatching task
    works for: a caller waiting for its own answer in a trace may take and dispatch
    what arrives meanwhile (the trio driver's polling caller, the blocking driver's
    waiting methods), and the request's handler must not inherit that trace. An
    ``async`` one stays untraced for its whole run, in the task that awaits it."""

    def run(params: Any, request: Any) -> Any:
        with _untraced():
            result = handler(params, request)
        if inspect.isawaitable(result):
            return _await_untraced(result)
        return result

    return run


async def _await_untraced(result: Awaitable[Any]) -> Any:
    with _untraced():
        return await result


async def _await_in(result: Awaitable[Any], tc: TraceContext, span: Any) -> Any:
    try:
        with _inside(tc, span):
            value = await result
    except BaseException as exc:
        _end(span, exc)
        raise
    _end(span, None)
    return value


def delivered_traces(traces: object, n: int, name: str) -> list[str | None] | None:
    """The ``traces`` column of a queue delivery of ``n`` messages (the traceparent each
    was put with, or None), checked: None if it is not such a list (the plugin's bug:
    the messages are delivered untraced). With OpenTelemetry each traced message gets a
    CONSUMER span ``name`` (child of its put's span, ended at once: the delivery), and
    its traceparent then names that span."""
    if type(traces) is not list or len(traces) != n:
        return None
    out: list[str | None] = [t if parse_traceparent(t) is not None else None for t in traces]
    otel = _otel() if OTEL_MODULE in sys.modules else None
    if otel is None:
        return out
    ot, tracer = otel
    for i, t in enumerate(out):
        if t is None:
            continue
        sent = context_of({TRACEPARENT: t})
        assert sent is not None
        span = tracer.start_span(name, context=_remote_parent(ot, sent), kind=_kind(ot, "consumer"))
        trace_id, span_id, flags, _state = _ids(span)
        span.end()
        out[i] = format_traceparent(trace_id, span_id, flags)
    return out
