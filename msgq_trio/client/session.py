"""The client's side of the protocol without I/O: one :class:`Session` per connection.

The trio :class:`~msgq_trio.client.bus.Bus`, the asyncio
:class:`~msgq_trio.client.aio.AioBus` and the blocking
:class:`~msgq_trio.client.direct.DirectBus` are drivers over it: they own the socket,
their tasks or waits, backpressure and descriptor passing; every protocol decision is
made here, once. Its parts: the pending calls (client/calls.py), the encoders
(client/encoders.py), the handler contract (client/handlers.py), the connection's
life with the reconnect schedule (client/lifecycle.py) and what a loss and a reconnect
mean for the session, with the restore policy (client/restore.py).

Rules:

1. The session never reads, writes, sleeps or waits. Bytes come in through
   :attr:`Session.conn` (the wire codec); frames to send are return values (lists of
   buffers, or one ``bytes``) that the driver writes in the order it got them.
2. Time is an argument: ``now`` on any monotonic clock, the same one for a call's start
   and its expiry (the trio driver passes ``trio.current_time()``, the blocking one
   ``time.monotonic()``).
3. :meth:`Session.handle` turns every received frame into at most one event (the one
   dispatch): a :class:`~msgq_trio.client.message.Message` for the application, a
   :class:`Request` for a handler, a :class:`PendingCall` that got (part of) its answer,
   :class:`Send` (frames the session answers by itself), :class:`Closed` (the broker
   ended the connection), or None (nothing to do).
4. :meth:`Session.answer_for` maps a handler's result or exception to its answer (the
   one mapping; its docstring is the handler contract).
5. A pending call completes by ``done`` becoming True; the session then calls the
   driver's ``wake(call)`` (set ``waiter`` on the call to find what to wake). The
   session holds no event-loop object.
6. After :meth:`Session.fail` (the connection ended) every pending call has failed with
   :class:`~msgq_trio.errors.ConnectionLost`; ``lost`` says why, and stays.
7. What follows a loss is :attr:`Session.life`'s to decide (:meth:`connection_lost`,
   :meth:`attempt_failed`): the drivers dial and sleep as it says, and run the restore
   it describes (:meth:`restore_groups`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import (
    ConnectError,
    ConnectionLost,
    MalformedMessage,
    UsageError,
)
from ..protocol.codes import ErrorCode
from ..protocol.connection import Connection, Role
from ..protocol.errors import LocalProtocolError, RemoteProtocolError
from ..protocol.framing import (
    DEFAULT_MAX_FRAME_SIZE,
    Frame,
    close_fds,
    encode_cbor,
    encode_frame,
    encode_simple,
)
from .calls import LOCAL_GRACE, PendingCall, request_header
from .encoders import TARGET_CACHE_MAX, Encoders
from .handlers import Handler, HandlerContract, InlineHandler, Request, as_handler, never_suspends
from .interface import INTROSPECT, Interface
from .lifecycle import CONNECT_TIMEOUT, Lifecycle
from .message import (
    Buffer,
    Message,
    Sources,
    new_message,
    split_source,
)
from .reconnect import Reconnect
from .restore import RestorePolicy
from .tracing import CURRENT, FLAG_TRACED, OTEL_MODULE, SPAN_KIND, Outgoing, outgoing
from .wire import ERROR as _ERROR
from .wire import FLAG_ALL as _FLAG_ALL
from .wire import GOODBYE as _GOODBYE
from .wire import MESSAGE as _MESSAGE
from .wire import NOTIFY as _NOTIFY
from .wire import REPLY as _REPLY
from .wire import REQUEST as _REQUEST
from .wire import ROUTED as _ROUTED

log = logging.getLogger("msgq_trio.client")
_current_trace = CURRENT.get
_modules = sys.modules
_OTEL = OTEL_MODULE

__all__ = [
    "CLOSE_WAIT",
    "DEFAULT_MAX_FDS",
    "IN_HIGH_COUNT",
    "IN_HIGH_WATER",
    "LOCAL_GRACE",
    "TARGET_CACHE_MAX",
    "Closed",
    "Event",
    "Handler",
    "InlineHandler",
    "PendingCall",
    "Request",
    "Send",
    "Session",
    "as_handler",
    "close_patience",
    "goodbye_error",
    "never_suspends",
    "request_header",
]


# -- limits shared by the drivers (ARCHITECTURE.md "Limits") ---------------------------
#: Closing waits this long for the broker's GOODBYE; longer while bytes we sent are still
#: unread by the broker (see close_patience: its reads of a sender it has paused for
#: backpressure resume as receivers drain; bytes it never read are lost with the socket).
CLOSE_WAIT = 2.0
#: Bytes of received messages a client holds for the application before it reads no
#: more (trio: backpressure travels to the broker, which pauses the senders; blocking:
#: the waiting method raises LimitExceeded): never silent loss. 64 MiB, one default
#: max frame.
IN_HIGH_WATER = 64 * 1024 * 1024
#: Received messages of any size a trio or asyncio client holds for the application
#: before it reads no more (the same backpressure as ``IN_HIGH_WATER``). A reader far
#: ahead of the application keeps every waiting message alive through the garbage
#: collector's passes, and full passes over a hundred thousand of them cost more than
#: the messages themselves (BENCHMARKS.md, "Client CPU per message"). 2,048 is about
#: one receive of 100-byte messages (the drivers' ``RECEIVE_SIZE``): the application always has a
#: receive's worth to take while the next one arrives; 8,192 cost more CPU per message.
IN_HIGH_COUNT = 2048
#: Descriptors one message may carry until WELCOME gives the broker's
#: ``max_fds_per_message`` (its default, Linux's SCM_MAX_FD).
DEFAULT_MAX_FDS = 253


def close_patience(header: dict[str, object]) -> float:
    """How long a closing client waits for the broker's GOODBYE while the broker takes
    none of its bytes: CLOSE_WAIT plus the broker's ``slow_consumer_timeout`` (WELCOME
    ``limits``), the longest the broker lets a receiver hold up a sender it paused;
    CLOSE_WAIT alone if the broker does not say."""
    limits = header.get("limits")
    t = limits.get("slow_consumer_timeout") if isinstance(limits, dict) else None
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 3600:
        return CLOSE_WAIT + float(t)
    return CLOSE_WAIT


def goodbye_error(frame: Frame) -> ConnectionLost:
    """The ConnectionLost for the broker's GOODBYE ``frame``: its ``reason`` (e.g.
    ``broker-shutdown``) is the code.

    Raises:
        RemoteProtocolError: the GOODBYE's header is malformed.
    """
    reason = frame.header().get("reason")
    if not reason:
        return ConnectionLost("the broker closed the connection (GOODBYE without a reason)")
    return ConnectionLost(f"the broker closed the connection ({reason})", code=str(reason))


class Send:
    """Event: frames the session answers by itself (a request for an unknown command,
    or one whose header is malformed); the driver writes ``pieces``."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: list[Buffer]) -> None:
        self.pieces = pieces


class Closed:
    """Event: the broker ended the connection (``goodbye``: it said GOODBYE; otherwise a
    connection-level ERROR). ``error`` is the ConnectionLost the connection failed with,
    None when we had said GOODBYE first (a clean close)."""

    __slots__ = ("error", "goodbye")

    def __init__(self, error: ConnectionLost | None, goodbye: bool) -> None:
        self.error = error
        self.goodbye = goodbye


Event = Message | Request | PendingCall | Send | Closed | None


class Session(Encoders, HandlerContract, RestorePolicy):
    """One connection's protocol state: identity from WELCOME, stamps and caches,
    request ids and the pending calls, the command handlers, encoders, dispatch.

    Args:
        name: the client name sent in HELLO.
        max_frame_size: the largest frame the codec accepts from the broker.
        no_join: a ``bytes`` body at least this long is sent as a piece of its own (no
            CBOR copy; for a driver that writes pieces with one ``sendmsg``); None: every
            message is one ``bytes``.
        wake: called with a :class:`PendingCall` once it is done (None: the driver checks
            ``done``).
        reconnect: the reconnect policy (None: a loss is final).
        target: the address the driver dials (for log lines and errors).
        connect_timeout: the bound of the first connection, dial and WELCOME
            (:data:`~msgq_trio.client.lifecycle.CONNECT_TIMEOUT`).
    """

    def __init__(
        self,
        name: str,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        *,
        no_join: int | None = None,
        wake: Callable[[PendingCall], None] | None = None,
        reconnect: Reconnect | None = None,
        target: str = "",
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.name = name
        #: The connection's life and the reconnect supervisor's policy
        #: (client/lifecycle.py): the drivers dial and sleep as it says.
        self.life = Lifecycle(reconnect, target, connect_timeout=connect_timeout)
        self._max_frame_size = max_frame_size
        #: The codec: the driver feeds it bytes (and descriptors) and takes its frames.
        self.conn = Connection(Role.CLIENT, max_frame_size)
        #: How many connections came before this one (:meth:`reset` counts them): a
        #: request handled on an earlier one is not answered on this one.
        self.generation = 0
        #: Groups this client is a member of by its own ``subscribe`` (not left by
        #: ``unsubscribe``), in join order: what a reconnect joins again.
        self.groups: dict[str, None] = {}
        self.lname = ""
        #: The source section the broker stamps on our frames (``lname NUL name``),
        #: written into them here so the broker only checks it and forwards the bytes as
        #: they are (docs/PROTOCOL.md, "Source"). Empty until WELCOME.
        self.stamp = b""
        self.broker_version = ""
        #: The WELCOME header (limits, identity and heartbeat settings for TCP).
        self.welcome: dict[str, object] = {}
        #: The broker's ``max_fds_per_message``: how many one message may carry (the
        #: receive buffer's size; sending is refused beyond it).
        self.max_fds = DEFAULT_MAX_FDS
        #: False where the driver cannot pass descriptors (TCP, the blocking driver):
        #: sending any is refused up front.
        self.fd_passing = True
        self.close_patience = CLOSE_WAIT
        self.sources: Sources = {}
        self.calls: dict[int, PendingCall] = {}
        self.interface = Interface()
        #: Handlers by command; ``msgq.introspect`` is every client's (:meth:`introspect`).
        self.commands: dict[str, Handler] = {INTROSPECT: self.introspect}
        self.inline: dict[str, InlineHandler] = {}
        self.default_handler: Handler | None = None
        #: None while the connection is up; then why it ended (see :meth:`fail`).
        self.lost: ConnectionLost | None = None
        #: True once we said GOODBYE: the broker's GOODBYE is then the clean end.
        self.closing = False
        self._targets: dict[str, bytes] = {}
        self._next_rid = 0
        self._no_join = no_join
        self._wake = wake
        #: The OpenTelemetry spans of traced calls in flight, by request id
        #: (client/tracing.py): :meth:`finish` ends them.
        self.call_spans: dict[int, Outgoing] = {}

    # -- handshake -------------------------------------------------------------------
    def hello(self, extra: dict[str, object] | None = None) -> list[Buffer]:
        """The HELLO frame: our name, pid and ``extra`` (e.g. a TCP ``token``)."""
        return self.conn.hello(self.name, {"pid": os.getpid(), **(extra or {})})

    def receive_welcome(self, frame: Frame) -> None:
        """Take the broker's answer to HELLO: lname, stamp, broker version, limits.

        Raises:
            ConnectError: the broker refused the connection (an ERROR frame; ``code`` says
                why: ``version-mismatch``, ``limit-exceeded``, ``unauthenticated``...), or
                its WELCOME is malformed (the broker's fault).
        """
        try:
            header = frame.header()
            if frame.type == _ERROR:
                raise ConnectError(
                    f"broker refused the connection: {header.get('message')}",
                    code=str(header.get("code")),
                )
            lname = str(header["lname"])
        except (RemoteProtocolError, KeyError) as exc:
            raise ConnectError(f"broker violated the protocol in the handshake: {exc}") from exc
        self.lname = lname
        # The broker names an empty HELLO name "anonymous" (io/server.py).
        self.stamp = f"{lname}\0{self.name or 'anonymous'}".encode()
        self.welcome = header
        self.broker_version = str(header.get("broker", ""))
        self.close_patience = close_patience(header)
        limits = header.get("limits")
        if isinstance(limits, dict) and isinstance(limits.get("max_fds_per_message"), int):
            self.max_fds = limits["max_fds_per_message"]

    @property
    def limits(self) -> dict[str, object]:
        """The broker's limits from WELCOME, empty before it or from a broker that sent
        none."""
        limits = self.welcome.get("limits")
        return dict(limits) if isinstance(limits, dict) else {}

    def heartbeat_settings(self) -> tuple[float, int] | None:
        """(interval s, misses) from WELCOME's ``heartbeat`` (TCP), or None."""
        hb = self.welcome.get("heartbeat")
        if not isinstance(hb, dict):
            return None
        interval, misses = hb.get("interval"), hb.get("misses")
        if not isinstance(interval, (int, float)) or not isinstance(misses, int) or interval <= 0:
            return None
        return float(interval), max(1, misses)

    # -- lifecycle -------------------------------------------------------------------
    def reset(self) -> None:
        """Start over for a new connection (a reconnect): a fresh codec, no identity
        until WELCOME, not lost, not closing; the generation counts one more.

        What the client set up stays: the command handlers, inline handlers and default
        handler (client-side only: the broker routes a request by the target's lname or
        group, and knows nothing of the handlers), the joined :attr:`groups` (the driver
        subscribes to them again), the caches. Calls pending at the loss were failed by
        :meth:`fail`; their answers can no longer come (request ids go on increasing, so
        none is reused).
        """
        close_fds(self.conn.take_orphan_fds())
        self.conn = Connection(Role.CLIENT, self._max_frame_size)
        self.generation += 1
        self.lname = ""
        self.stamp = b""
        self.broker_version = ""
        self.welcome = {}
        self.max_fds = DEFAULT_MAX_FDS
        self.close_patience = CLOSE_WAIT
        self.lost = None
        self.closing = False

    def fail(self, exc: ConnectionLost) -> ConnectionLost:
        """The connection ended: record why (the first reason stays) and fail every
        pending call with it. Returns the recorded reason."""
        if self.lost is None:
            self.lost = exc
        lost = self.lost
        for call in list(self.calls.values()):
            call.fail(ConnectionLost(str(lost), code=lost.code))
        return lost

    def goodbye(self) -> list[Buffer]:
        """Our GOODBYE; from now on the broker's GOODBYE is the clean end.

        Raises:
            LocalProtocolError: the codec is past sending (it failed or closed).
        """
        self.closing = True
        return self.conn.send(_GOODBYE)

    def start_call(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        now: float,
        timeout: float | None = None,
        attachments: Sequence[Buffer] = (),
        multi: bool = False,
        fds: Sequence[int] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> tuple[PendingCall, list[Buffer]]:
        """Register a call and encode its REQUEST (``multi``: to every member; ``fds``:
        duplicates of these go with it, see :meth:`attach_fds`). The caller writes the
        frame, waits for ``done`` (or :meth:`PendingCall.expire` at its ``deadline``,
        computed from ``now``) and then :meth:`finish` es the call.

        Raises:
            UsageError: a bad command, timeout, ``params`` or descriptor; nothing is
                registered.
        """
        head = request_header(command, timeout)  # UsageError before anything is sent
        source = self.relay_stamp(on_behalf_of) if on_behalf_of else self.stamp
        rid = self._next_rid + 1
        traced = None
        if _current_trace() is not None or _OTEL in _modules:
            traced = outgoing(f"{command} {target}", SPAN_KIND.get())
            if traced is not None:
                head = self.traced_request_header(head, traced.fields)
        try:
            body = encode_cbor(params) if params is not None else b""
            flags = _FLAG_ALL if multi else 0
            if traced is not None:
                flags |= FLAG_TRACED
            if attachments or fds:
                self.target(target)  # refuses a pattern
                pieces = encode_frame(
                    _REQUEST,
                    target=target,
                    request_id=rid,
                    flags=flags,
                    header=head,
                    body=body,
                    blobs=attachments,
                    n_fds=len(fds),
                    source=source,
                )
            else:  # the common case: one bytes object, the target's encoding cached
                tb = self._targets.get(target) or self.target(target)
                pieces = [encode_simple(_REQUEST, tb, body, head, rid, flags, source)]
        except LocalProtocolError as exc:
            if traced is not None:
                traced.end(exc)
            raise UsageError(f"cannot call {command!r} on {target!r}: {exc}") from exc
        if fds:
            pieces = self.attach_fds(pieces, fds)
        self._next_rid = rid
        if traced is not None and traced.span is not None:
            self.call_spans[rid] = traced  # ended by finish()
        deadline = None if timeout is None else now + timeout + LOCAL_GRACE
        call = PendingCall(rid, target, multi, timeout, deadline, self._wake)
        self.calls[rid] = call
        return call, pieces

    def call_result(self, call: PendingCall, command: str) -> Any:
        """The outcome of a finished single call: its result, or its error raised.
        Descriptors in the answer are closed, with a warning: only ``Bus.request`` hands
        them to the caller.

        Raises:
            MsgqError: the call's error (the broker's or the handler's answer, a local
                timeout, ConnectionLost).
        """
        if call.error is not None:
            raise call.error
        frame = call.frame
        if frame is not None and frame.fds:
            log.warning(
                "answer to %r from %s carried %d file descriptors; call() closes them "
                "(use Bus.request() to receive descriptors)",
                command,
                split_source(frame.source, self.sources)[0],
                len(frame.fds),
            )
            close_fds(frame.fds)
        return call.result

    def finish(self, call: PendingCall) -> None:
        """Forget ``call`` (its caller has its outcome, or gave up): a later answer is
        dropped."""
        self.calls.pop(call.request_id, None)
        if self.call_spans:
            traced = self.call_spans.pop(call.request_id, None)
            if traced is not None:
                traced.end(call.error)

    # -- the one dispatch --------------------------------------------------------------
    def handle(self, frame: Frame) -> Event:
        """The event for one received frame (see the module's rule 3).

        Raises:
            RemoteProtocolError: a control frame from the broker is malformed (its fault;
                the driver ends the connection).
        """
        t = frame.type
        if t == _MESSAGE or t == _NOTIFY:
            return new_message(frame, self.sources)
        if t == _REPLY or t == _ERROR:
            rid = frame.request_id
            if not rid:
                # Request id 0: the broker's final word about the connection itself.
                h = frame.header()
                code = str(h.get("code", ""))
                log.error("broker reported: %s (%s)", h.get("message"), code)
                close_fds(frame.fds)
                return Closed(
                    self.fail(
                        ConnectionLost(
                            f"broker closed the connection: {h.get('message')}", code=code
                        )
                    ),
                    goodbye=False,
                )
            call = self.calls.get(rid)
            if call is None:
                close_fds(frame.fds)  # a late answer to a call we gave up on
                return None
            call.answer(frame, split_source(frame.source, self.sources)[0])
            return call
        if t == _REQUEST:
            msg = new_message(frame, self.sources)
            try:
                command = msg.command
            except MalformedMessage as exc:
                # The broker decodes every REQUEST header and drops a sender whose header
                # is malformed, so only a broker's bug gets here: answer, do not crash.
                msg.close()
                return Send(self.encode_error(msg, ErrorCode.BAD_REQUEST, str(exc)))
            if self.inline:
                inline = self.inline.get(command or "")
                if inline is not None:
                    return Request(msg, None, inline)
            handler = self.commands.get(command or "") or self.default_handler
            if handler is None:
                return Send(self.unknown_command(msg, command))
            return Request(msg, handler, None)
        if t == _ROUTED:
            call = self.calls.get(frame.request_id)
            if call is None:
                return None
            to = frame.header().get("to", [])
            if not isinstance(to, list):
                raise RemoteProtocolError(f"ROUTED 'to' is not a list: {to!r}")
            call.routed([(str(a), str(b)) for a, b in to])
            return call
        if t == _GOODBYE:
            lost = goodbye_error(frame)
            if self.closing:
                return Closed(None, goodbye=True)
            return Closed(self.fail(lost), goodbye=True)
        close_fds(frame.fds)
        return None
