"""The hops of traced traffic, as the broker routes it (docs/PROTOCOL.md, "Trace context").

A frame whose prefix has the TRACED flag carries a W3C ``traceparent`` in its header;
the dispatcher hands each such frame to :meth:`Traces.frame` once it has routed it, and
each answer to a traced request to :meth:`Traces.answer`. The table keeps, per trace id,
the hops in arrival order, bounded twice (``Limits.trace_max_traces``, the oldest trace
is forgotten first; ``Limits.trace_max_hops`` per trace, later hops are counted, not
kept). The broker command ``trace`` answers a trace's hops (``msgq-trio trace``).

Untraced traffic costs one test of the prefix flag per frame here, and one test of an
empty dict per answer while no traced request waits for its answer.

Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame
from .peers import Peer

__all__ = ["Traces"]

#: The frame types by number, as the hops name them.
_KINDS = {3: "message", 4: "request", 5: "reply", 6: "error", 7: "notify"}
_HEX = frozenset("0123456789abcdef")
#: Longest command, event or error name and target a hop keeps (they are free-form
#: strings up to the frame size; a hop is a summary, not a capture, and must stay small
#: for the table's bound to bound its memory).
_NAME_MAX = 200


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

    def _trace(self, trace_id: str, now: float) -> _Trace:
        t = self._traces.get(trace_id)
        if t is None:
            while len(self._traces) >= self.max_traces:
                _, old = self._traces.popitem(last=False)
                for key in old.keys:
                    self.calls.pop(key, None)
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
        if frame.type == 4:
            to = self.delivered_to
            self.delivered_to = []
            hop["delivered"] = [[p.lname, p.name] for p in to]
            if to and self._add(t, hop):
                key = (peer.lname, frame.request_id)
                self.calls[key] = (trace_id, span_id, bool(frame.flags & 1))
                t.keys.append(key)
                return
        self._add(t, hop)

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
            try:
                code = frame.header().get("code")
            except RemoteProtocolError:
                code = None
            if isinstance(code, str):
                hop["name"] = code[:_NAME_MAX]
        self._add(t, hop)

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
