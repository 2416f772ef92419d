"""The hops of traced traffic, as the broker routes it (docs/PROTOCOL.md, "Trace context").

A frame whose prefix has the TRACED flag carries a W3C ``traceparent`` in its header;
the dispatcher hands each such frame to :meth:`Traces.frame` once it has routed it, and
each answer to a traced request to :meth:`Traces.answer`. The table keeps, per trace id,
the hops in arrival order, bounded twice (``Limits.trace_max_traces``, the oldest trace
is forgotten first; ``Limits.trace_max_hops`` per trace, later hops are counted, not
kept). The broker command ``trace`` answers a trace's hops (``msgq-trio trace``).

Untraced traffic costs one test of the prefix flag per frame here, and one test of an
empty dict per answer while no traced request waits for its answer.

Spans: with a :class:`SpanSink` set (:attr:`Traces.sink`; the broker's OpenTelemetry
exporter, ops/otel.py, when ``[tracing] otel`` is on), each traced hop is also a span,
the child of the sender's span (the frame's ``traceparent``): a one-way frame's span
starts and ends as it is routed (receive to deliver), a delivered request's lasts until
its answer or its failure (answered, the callee's error code, ``recipient-gone``,
``timeout``; ``forgotten`` if its trace leaves the table first). Without a sink nothing
of this runs; untraced frames never reach this module.

Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame
from .peers import Peer

__all__ = ["SpanSink", "Traces"]

#: The frame types by number, as the hops name them.
_KINDS = {3: "message", 4: "request", 5: "reply", 6: "error", 7: "notify"}
_HEX = frozenset("0123456789abcdef")
#: Longest command, event or error name and target a hop keeps (they are free-form
#: strings up to the frame size; a hop is a summary, not a capture, and must stay small
#: for the table's bound to bound its memory).
_NAME_MAX = 200


class SpanSink(Protocol):
    """Where the spans of traced hops go (ops/otel.py: OpenTelemetry). Both calls are
    made while the hop is routed: the sink takes its own clock."""

    def start(
        self, trace_id: str, parent_span: str, sampled: bool, name: str, attributes: dict[str, Any]
    ) -> Any:
        """Start the span of a hop, the child of ``parent_span`` (the sender's span) in
        ``trace_id``; returns the span, which :meth:`end` ends."""

    def end(self, span: Any, attributes: dict[str, Any], error: str | None) -> None:
        """End ``span`` with more ``attributes``; ``error`` (a code) marks it failed."""


#: Outcomes of a routed hop that are not the sender's failure.
_FINE = frozenset({"delivered", "forwarded", "stored", "consumed"})


def _trace_fields(header: dict[str, object]) -> tuple[str, str, str | None] | None:
    """``(trace_id, span_id, cause)`` from a traced frame's header, None if it has no
    valid ``traceparent`` (the sender's bug: the frame is routed, its hop not kept)."""
    tp = header.get("traceparent")
    if type(tp) is not str or len(tp) < 55 or tp[2] != "-" or tp[35] != "-" or tp[52] != "-":
        return None
    trace_id, span_id = tp[3:35], tp[36:52]
    if not _HEX.issuperset(trace_id + span_id):
        return None
    cause = header.get("tracecause")
    if type(cause) is not str or len(cause) != 16 or not _HEX.issuperset(cause):
        cause = None
    return trace_id, span_id, cause


class _Trace:
    __slots__ = ("dropped", "first", "hops", "keys")

    def __init__(self, first: float) -> None:
        self.first = first
        self.hops: list[dict[str, Any]] = []
        #: Keys of :attr:`Traces.calls` that belong to this trace (forgotten with it).
        self.keys: list[tuple[str, int]] = []
        #: Hops past ``max_hops``: counted only.
        self.dropped = 0


class Traces:
    """The bounded table of traced hops (see the module)."""

    def __init__(self, max_traces: int, max_hops: int) -> None:
        self.max_traces = max_traces
        self.max_hops = max_hops
        self._traces: OrderedDict[str, _Trace] = OrderedDict()
        #: Traced requests delivered and not answered: (caller lname, request id) ->
        #: (trace id, the request's span id, whether every member answers). The
        #: dispatcher tests it per answer: empty, an answer costs nothing more.
        self.calls: dict[tuple[str, int], tuple[str, str, bool]] = {}
        #: Recipients of the traced request being routed (set by the dispatcher).
        self.delivered_to: list[Peer] = []
        #: Where the hops' spans go; None (the default): no spans.
        self.sink: SpanSink | None = None
        #: The open spans of delivered traced requests, by the key of :attr:`calls`.
        self.spans: dict[tuple[str, int], Any] = {}

    def _trace(self, trace_id: str, now: float) -> _Trace:
        t = self._traces.get(trace_id)
        if t is None:
            while len(self._traces) >= self.max_traces:
                _, old = self._traces.popitem(last=False)
                for key in old.keys:
                    self.calls.pop(key, None)
                    self._end_span(key, {"msgq.outcome": "forgotten"}, None)
            t = self._traces[trace_id] = _Trace(now)
        return t

    def _add(self, t: _Trace, hop: dict[str, Any]) -> bool:
        if len(t.hops) >= self.max_hops:
            t.dropped += 1
            return False
        t.hops.append(hop)
        return True

    def frame(self, peer: Peer, frame: Frame, outcome: str, now: float) -> None:
        """Record a traced ``frame`` from ``peer``, routed with ``outcome`` (the capture's
        word: ``delivered``, ``no-recipient``, ``refused``...)."""
        try:
            header = frame.header()
        except RemoteProtocolError:
            return  # a one-way frame's header is the receivers' business: not ours to judge
        fields = _trace_fields(header)
        if fields is None:
            return
        trace_id, span_id, cause = fields
        t = self._trace(trace_id, now)
        hop: dict[str, Any] = {
            "at": now - t.first,
            "kind": _KINDS.get(frame.type, str(frame.type)),
            "from": [peer.lname, peer.name],
            "to": frame.target[:_NAME_MAX],
            "span": span_id,
            "cause": cause,
            "outcome": outcome,
        }
        name = header.get("cmd") if frame.type == 4 else header.get("event")
        if isinstance(name, str):
            hop["name"] = name[:_NAME_MAX]
        sink = self.sink
        if frame.type == 4:
            to = self.delivered_to
            self.delivered_to = []
            hop["delivered"] = [[p.lname, p.name] for p in to]
            if to:
                kept = self._add(t, hop)
                # With spans the answer is followed past max_hops too, up to as many
                # requests per trace: the table stays bounded.
                if kept or (sink is not None and len(t.keys) < self.max_hops):
                    key = (peer.lname, frame.request_id)
                    self.calls[key] = (trace_id, span_id, bool(frame.flags & 1))
                    t.keys.append(key)
                    if sink is not None:
                        # Open until the answer (:meth:`answer`) or failure (:meth:`failed`).
                        self.spans[key] = sink.start(
                            trace_id, span_id, _sampled(header), _span_name(hop), _attributes(hop)
                        )
                elif sink is not None:
                    span = sink.start(
                        trace_id, span_id, _sampled(header), _span_name(hop), _attributes(hop)
                    )
                    sink.end(span, {}, None)  # delivered; its answer is not followed
                return
        self._add(t, hop)
        if sink is not None:
            span = sink.start(
                trace_id, span_id, _sampled(header), _span_name(hop), _attributes(hop)
            )
            sink.end(span, {}, None if outcome in _FINE else outcome)

    def answer(self, caller: Peer, peer: Peer, frame: Frame, now: float) -> None:
        """Record ``peer``'s answer to ``caller``'s request if that request was traced
        (one answer per callee is kept for a request to every member)."""
        key = (caller.lname, frame.request_id)
        hit = self.calls.get(key)
        if hit is None:
            return
        trace_id, span_id, every = hit
        t = self._traces.get(trace_id)
        if t is None or not every:
            self.calls.pop(key, None)  # (a request to every member: until its trace goes)
        if self.spans:
            # A request to every member: its span ends at the first answer.
            code = _error_code(frame) if frame.type == 6 else None
            done = {"msgq.outcome": "error" if frame.type == 6 else "answered"}
            done["msgq.answered_by"] = peer.lname
            if code is not None:
                done["msgq.code"] = code
            self._end_span(key, done, code or ("error" if frame.type == 6 else None))
        if t is None:
            return
        hop: dict[str, Any] = {
            "at": now - t.first,
            "kind": _KINDS.get(frame.type, str(frame.type)),
            "from": [peer.lname, peer.name],
            "to": caller.lname,
            "span": None,
            "cause": span_id,
            "outcome": "forwarded",
        }
        if frame.type == 6:
            code = _error_code(frame)
            if code is not None:
                hop["name"] = code
        self._add(t, hop)

    def failed(self, caller: Peer, request_id: int, code: str, callee: Peer) -> None:
        """The broker answered ``caller``'s traced request ``request_id`` with ``code``
        (``recipient-gone``, ``timeout``) in ``callee``'s name: its span ends failed."""
        key = (caller.lname, request_id)
        if key in self.spans:
            done = {"msgq.outcome": code, "msgq.code": code, "msgq.answered_by": callee.lname}
            self._end_span(key, done, code)

    def _end_span(
        self, key: tuple[str, int], attributes: dict[str, Any], error: str | None
    ) -> None:
        span = self.spans.pop(key, None)
        if span is not None and self.sink is not None:
            self.sink.end(span, attributes, error)

    def hops(self, trace_id: str) -> dict[str, Any]:
        """The answer of the broker command ``trace``: the hops of ``trace_id`` in
        arrival order (``at``: seconds since its first hop), and how many were not kept
        (``dropped``). An unknown trace has no hops."""
        t = self._traces.get(trace_id)
        if t is None:
            return {"trace_id": trace_id, "hops": [], "dropped": 0}
        return {"trace_id": trace_id, "hops": list(t.hops), "dropped": t.dropped}

    def __len__(self) -> int:
        return len(self._traces)


def _error_code(frame: Frame) -> str | None:
    try:
        code = frame.header().get("code")
    except RemoteProtocolError:
        return None
    return code[:_NAME_MAX] if isinstance(code, str) else None


def _sampled(header: dict[str, object]) -> bool:
    """The sampled bit of a traceparent ``_trace_fields`` accepted (``00-T-S-FF``)."""
    tp = header.get("traceparent")
    return isinstance(tp, str) and tp[53:55] in _SAMPLED


_SAMPLED = frozenset(f"{b:02x}" for b in range(256) if b & 1)


def _span_name(hop: dict[str, Any]) -> str:
    """``msgq request CMD``, ``msgq notify EVENT``, ``msgq message TARGET``."""
    return f"msgq {hop['kind']} {hop.get('name') or hop['to']}"


def _attributes(hop: dict[str, Any]) -> dict[str, Any]:
    """A hop's span attributes: what it is, where it went, what became of it, who sent it
    and (a request) to whom it was delivered; ``msgq.group`` when the target is a group
    (``G``, ``G[N]``, ``G[?]``), not an lname."""
    to = hop["to"]
    out: dict[str, Any] = {
        "msgq.kind": hop["kind"],
        "msgq.target": to,
        "msgq.outcome": hop["outcome"],
        "msgq.sender": hop["from"][0],
        "msgq.sender_name": hop["from"][1],
    }
    if not to.startswith("l."):
        out["msgq.group"] = to.partition("[")[0]
    name = hop.get("name")
    if name is not None:
        out["msgq.command" if hop["kind"] == "request" else "msgq.event"] = name
    delivered = hop.get("delivered")
    if delivered:
        out["msgq.delivered_to"] = [lname for lname, _ in delivered]
    return out
