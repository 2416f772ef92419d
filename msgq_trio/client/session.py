"""The client's side of the protocol without I/O: one :class:`Session` per connection.

The trio :class:`~msgq_trio.client.bus.Bus` and the blocking
:class:`~msgq_trio.client.direct.DirectBus` are drivers over it: they own the socket,
their tasks or waits, backpressure and descriptor passing; every protocol decision is
made here, once.

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
"""

from __future__ import annotations

import dis
import inspect
import logging
import os
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    MalformedMessage,
    MsgqError,
    RequestTimeout,
    UsageError,
    rpc_error_from_wire,
)
from ..protocol.codes import ErrorCode, Flag, FrameType
from ..protocol.connection import Connection, Role
from ..protocol.errors import LocalProtocolError, RemoteProtocolError
from ..protocol.framing import (
    DEFAULT_MAX_FRAME_SIZE,
    FdBuffer,
    Frame,
    close_fds,
    encode_bytes_message,
    encode_cbor,
    encode_frame,
    encode_simple,
    encode_small_bytes,
)
from .lifecycle import Lifecycle, State
from .message import (
    Buffer,
    Message,
    Reply,
    Result,
    Sources,
    dup_all,
    new_message,
    split_source,
)
from .reconnect import Reconnect

log = logging.getLogger("msgq_trio.client")

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
#: A call with a ``timeout`` gives up locally this long after it: the broker enforces the
#: deadline and answers ``timeout`` itself; the local limit only covers a broker that
#: stopped answering at all.
LOCAL_GRACE = 1.0
#: Encoded targets cached per connection (bounded, like every cache here).
TARGET_CACHE_MAX = 4096
#: Encoded ``{"cmd": name}`` request headers by command name; stops growing at the cap.
_CMD_HEADERS: dict[str, bytes] = {}
_CMD_HEADERS_MAX = 256

# Plain ints: compared once or more per received frame (an IntEnum compares slower).
_MESSAGE, _REQUEST, _REPLY, _ERROR, _NOTIFY, _ROUTED, _GOODBYE = (
    int(FrameType.MESSAGE),
    int(FrameType.REQUEST),
    int(FrameType.REPLY),
    int(FrameType.ERROR),
    int(FrameType.NOTIFY),
    int(FrameType.ROUTED),
    int(FrameType.GOODBYE),
)
_FLAG_ALL = int(Flag.ALL)

#: A command handler as the session stores it: ``fn(params, request)``, returning the
#: result (or an awaitable of it, for a driver that can await).
Handler = Callable[[Any, Message], Any]
#: A handler that answers by itself (:meth:`Session.encode_answer`), called in order.
InlineHandler = Callable[[Message], None]


def request_header(command: str, timeout: float | None) -> bytes:
    """The CBOR header of a REQUEST for ``command`` (and the caller's ``timeout``).

    Raises:
        UsageError: ``command`` is not a str, or ``timeout`` is not positive.
        LocalProtocolError: ``timeout`` cannot be encoded.
    """
    if type(command) is not str:
        raise UsageError(f"command must be a str, not {type(command).__name__}")
    if timeout is None:
        # Encoded once per command name (a CBOR encode per call is ~1.5 us here).
        head = _CMD_HEADERS.get(command)
        if head is None:
            head = encode_cbor({"cmd": command})
            if len(_CMD_HEADERS) < _CMD_HEADERS_MAX:
                _CMD_HEADERS[command] = head
        return head
    if timeout <= 0:
        raise UsageError("timeout must be positive")
    return encode_cbor({"cmd": command, "timeout": float(timeout)})


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


def as_handler(fn: Callable[..., Any]) -> Handler:
    """``fn`` as a :data:`Handler`: the one handler signature is ``fn(params)`` or
    ``fn(params, request)``.

    Raises:
        UsageError: ``fn`` takes another number of parameters.
    """
    nparams = len(inspect.signature(fn).parameters)
    if nparams == 2:
        return fn
    if nparams == 1:
        return lambda params, _request: fn(params)
    raise UsageError("a command handler takes (params) or (params, request)")


#: Bytecode that lets a coroutine suspend (an ``await``, ``async with``, ``async for``).
_SUSPENDING_OPS = frozenset(
    {"GET_AWAITABLE", "SEND", "YIELD_VALUE", "BEFORE_ASYNC_WITH", "GET_AITER", "GET_ANEXT"}
)
_never_suspends: dict[types.CodeType, bool] = {}


def never_suspends(coro: object) -> bool:
    """Whether ``coro`` is a coroutine whose code has no ``await``, ``async with`` or
    ``async for``: it cannot suspend, so running it to its end with one ``send(None)``
    is the same as awaiting it, in any event loop, without a task. (An ``async def``
    handler that only computes its answer is common: the README's is one.) Cached per
    code object.
    """
    if not isinstance(coro, types.CoroutineType):
        return False
    code = coro.cr_code
    hit = _never_suspends.get(code)
    if hit is None:
        hit = not any(i.opname in _SUSPENDING_OPS for i in dis.get_instructions(code))
        if len(_never_suspends) < 4096:  # bounded: handlers are few, code objects fixed
            _never_suspends[code] = hit
    return hit


class PendingCall:
    """One call in flight: PENDING until ``done``, then ANSWERED (``result``/``frame``),
    FAILED (``error``) or, for a call to every member, COLLECTED (``answers`` for the
    members the broker said it routed to, ``expected``).

    The first outcome wins: an answer after a local timeout or the connection's loss is
    dropped (its descriptors closed).
    """

    __slots__ = (
        "_wake",
        "answers",
        "deadline",
        "done",
        "error",
        "expected",
        "frame",
        "multi",
        "request_id",
        "result",
        "target",
        "timeout",
        "waiter",
    )

    def __init__(
        self,
        request_id: int,
        target: str,
        multi: bool,
        timeout: float | None,
        deadline: float | None,
        wake: Callable[[PendingCall], None] | None,
    ) -> None:
        self.request_id = request_id
        self.target = target
        self.multi = multi
        self.timeout = timeout
        #: When the caller gives up locally (``now`` + timeout + LOCAL_GRACE), or None.
        self.deadline = deadline
        self.done = False
        self.result: Any = None
        self.error: MsgqError | None = None
        self.expected: list[tuple[str, str]] | None = None  # ROUTED (multi only)
        self.answers: dict[str, Result] = {}
        self.frame: Frame | None = None  # the REPLY of a single call (for request())
        #: The driver's object to wake (a trio.Event...); the session does not touch it.
        self.waiter: Any = None
        self._wake = wake

    def _finish(self) -> None:
        self.done = True
        if self._wake is not None:
            self._wake(self)

    def answer(self, frame: Frame, sender: str) -> None:
        """A REPLY or ERROR for this call from ``sender``. A malformed answer fails the
        call with MalformedMessage (the callee's bug: the broker does not decode bodies);
        the connection carries on."""
        try:
            self._answer(frame, sender)
        except RemoteProtocolError as exc:
            close_fds(frame.fds)
            err = MalformedMessage(
                f"answer from {sender} to a call to {self.target!r} is malformed: {exc}", sender
            )
            res = Result(self.target, False, None, err, sender)
            self._answer_result(frame._replace(fds=()), res, sender)

    def _answer(self, frame: Frame, sender: str) -> None:
        if frame.type == _REPLY and not self.multi:
            # The common case, without a Result: _answer_result's single-call branch.
            if self.done:  # already failed (timeout, connection lost)
                close_fds(frame.fds)
                return
            self.result = frame.body()
            self.frame = frame
            self._finish()
            return
        if frame.type == _REPLY:
            res = Result(self.target, True, frame.body(), None, sender)
        else:
            close_fds(frame.fds)
            h = frame.header()
            res = Result(
                self.target,
                False,
                None,
                rpc_error_from_wire(
                    str(h.get("code", "")), str(h.get("message", "")), frame.body(), sender
                ),
                sender,
            )
        self._answer_result(frame, res, sender)

    def _answer_result(self, frame: Frame, res: Result, sender: str) -> None:
        if not self.multi:
            if self.done:
                close_fds(frame.fds)
                return
            self.result, self.error = res.value, res.error
            self.frame = frame
            self._finish()
            return
        close_fds(frame.fds)  # call_all answers carry no descriptors to the caller
        if self.done:
            return
        if self.expected is None:
            # ROUTED always precedes the members' answers on the same connection, so an
            # answer before it is the broker refusing the whole call (e.g. no-recipient).
            self.error = res.error
            self._finish()
            return
        self.answers[sender] = res
        self._maybe_done()

    def routed(self, to: list[tuple[str, str]]) -> None:
        """The broker's ROUTED: the members this call to every member went to."""
        if self.done:
            return
        self.expected = to
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.expected is not None and len(self.answers) >= len(self.expected):
            self._finish()

    def fail(self, error: MsgqError) -> None:
        """Fail the call with ``error`` unless it already has its outcome."""
        if not self.done:
            self.error = error
            self._finish()

    def expire(self, now: float) -> bool:
        """Fail the call with RequestTimeout if ``now`` is past its local deadline and
        it is still pending; True if it did."""
        if self.done or self.deadline is None or now < self.deadline:
            return False
        self.fail(
            RequestTimeout(
                f"no answer from {self.target!r} within {self.timeout} s "
                "(and none from the broker)",
                sender=None,
            )
        )
        return True

    def member_results(self) -> list[Result]:
        """The outcome of a call to every member: one Result per member routed to, in the
        broker's (join) order; a member without an answer yields an error Result.

        Raises:
            MsgqError: the broker refused the whole call (e.g. NoRecipient), or the call
                failed before the broker routed it.
        """
        if self.error is not None and self.expected is None:
            raise self.error
        out = []
        for lname, _name in self.expected or []:
            res = self.answers.get(lname)
            if res is None:
                err = self.error or RequestTimeout(f"{lname} did not answer", sender=lname)
                res = Result(self.target, False, None, err, lname)
            out.append(res)
        return out


class Request:
    """Event: a request for a handler of this client.

    ``inline`` set: call ``inline(message)`` now, in arrival order; it answers by itself.
    Otherwise call ``handler(message.body, message)`` and send
    :meth:`Session.answer_for` of its outcome."""

    __slots__ = ("handler", "inline", "message")

    def __init__(
        self, message: Message, handler: Handler | None, inline: InlineHandler | None
    ) -> None:
        self.message = message
        self.handler = handler
        self.inline = inline


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


class Session:
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
    ) -> None:
        self.name = name
        #: The connection's life and the reconnect supervisor's policy
        #: (client/lifecycle.py): the drivers dial and sleep as it says.
        self.life = Lifecycle(reconnect, target)
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
        self.commands: dict[str, Handler] = {}
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

    def subscribed(self, group: str) -> None:
        """The broker confirmed a ``subscribe`` to ``group``: a reconnect joins it
        again."""
        self.groups[group] = None

    def unsubscribed(self, group: str) -> None:
        """The broker confirmed an ``unsubscribe``: a reconnect does not join it."""
        self.groups.pop(group, None)

    def fail(self, exc: ConnectionLost) -> ConnectionLost:
        """The connection ended: record why (the first reason stays) and fail every
        pending call with it. Returns the recorded reason."""
        if self.lost is None:
            self.lost = exc
        lost = self.lost
        for call in list(self.calls.values()):
            call.fail(ConnectionLost(str(lost), code=lost.code))
        return lost

    # -- the connection's life (client/lifecycle.py) and what a reconnect restores --------
    def welcomed(self, remote: bool) -> State:
        """WELCOME was taken on a connection (:meth:`receive_welcome`): it is up, sends
        and calls go out again. Over TCP (``remote``) no descriptors can pass (no
        SCM_RIGHTS): sending any is refused up front, by every driver alike. Returns
        the new state: READY, or RESTORING after a reconnect (the driver then runs the
        restore: :meth:`restore_groups`, :meth:`restore_refused`, :meth:`restored`)."""
        self.lost = None
        if remote:
            self.fd_passing = False
        return self.life.welcomed()

    def connection_lost(self, exc: ConnectionLost, now: float) -> bool:
        """The connection ended with ``exc`` (the first reason stays): every pending call
        fails with it, and the lifecycle decides what follows. ``lost`` is then what
        sends and calls raise: the loss itself when the end is final, else the
        reconnecting error. Returns True if the end is final (reconnect off, the bus
        closed, or the policy gave up)."""
        lost = self.fail(exc)
        self.lost = self.life.lost(lost, now, closing=self.closing)
        return self.life.final

    def attempt_failed(self, exc: BaseException, now: float) -> bool:
        """A reconnect attempt failed with ``exc`` (dial, handshake, restore, or its
        deadline). Returns True once the policy gave up: ``lost`` is then the final
        ConnectionLost (code ``reconnect-gave-up``)."""
        log.debug("reconnect attempt to %s failed: %s", self.life.target, exc)
        gave_up = self.life.attempt_failed(exc, now)
        if gave_up is None:
            return False
        self.lost = gave_up
        return True

    def restore_groups(self) -> list[str]:
        """The groups a reconnect joins again, in the order they were joined: what this
        client joined by its own ``subscribe`` and did not leave.

        The restore policy (the rest needs no step here): command handlers, inline
        handlers, the default handler and notification callbacks are client-side and
        stay as they are (the broker routes by lname or group and knows none of them);
        a group the broker now refuses is dropped and logged (:meth:`restore_refused`);
        queue consumers consume again from the bus's ``on_reconnected`` callbacks, run
        once the groups are joined (client/queue.py); pipe ends are not restored: a
        handle's requests in flight fail with ConnectionLost and the pipe plugin
        forgets a connection's handles, so a pipe is opened again by its owner; calls
        pending at the loss failed with the loss (request ids go on increasing, so a
        late answer never meets a new call); a request received on the old connection
        is not answered on the new one (:attr:`generation`)."""
        return list(self.groups)

    def restore_refused(self, group: str, exc: MsgqError) -> None:
        """The broker refused to let this client join ``group`` again after a reconnect:
        logged as an ERROR, and the group is no longer joined."""
        log.error("after reconnecting, cannot join %r again: %s", group, exc)
        self.unsubscribed(group)

    def restored(self) -> None:
        """The reconnect's restore is complete: READY (the reconnect is counted and
        logged)."""
        self.life.restored(self.lname)

    def goodbye(self) -> list[Buffer]:
        """Our GOODBYE; from now on the broker's GOODBYE is the clean end.

        Raises:
            LocalProtocolError: the codec is past sending (it failed or closed).
        """
        self.closing = True
        return self.conn.send(_GOODBYE)

    # -- encoders --------------------------------------------------------------------
    def target(self, target: str) -> bytes:
        """``target`` encoded (cached, bounded)."""
        tb = self._targets.get(target)
        if tb is None:
            tb = target.encode()
            if len(self._targets) < TARGET_CACHE_MAX:
                self._targets[target] = tb
        return tb

    def relay_stamp(self, origin: tuple[str, str]) -> bytes:
        """The relayed stamp for traffic forwarded on behalf of ``origin`` (``(lname,
        name)``): this client's stamp, NUL, the origin's lname, NUL, its name.

        Raises:
            UsageError: a name contains NUL.
        """
        lname, name = origin
        if "\0" in lname or "\0" in name:
            raise UsageError(f"on_behalf_of {origin!r}: names cannot contain NUL")
        return self.stamp + f"\0{lname}\0{name}".encode()

    def encode_message(
        self,
        target: str,
        body: Any = None,
        *,
        header: dict[str, object] | None = None,
        attachments: Sequence[Buffer] = (),
        fds: Sequence[int] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> bytes | list[Buffer]:
        """A one-way MESSAGE (one ``bytes`` in the common case); duplicates of ``fds``
        go with it (see :meth:`attach_fds`).

        Raises:
            UsageError: ``body`` or ``header`` cannot be encoded, a section is too long,
                or a descriptor cannot be sent.
        """
        try:
            if attachments or fds or on_behalf_of:
                pieces = encode_frame(
                    _MESSAGE,
                    target=target,
                    header=encode_cbor(header) if header else b"",
                    body=encode_cbor(body) if body is not None else b"",
                    blobs=attachments,
                    n_fds=len(fds),
                    source=self.relay_stamp(on_behalf_of) if on_behalf_of else self.stamp,
                )
                return self.attach_fds(pieces, fds) if fds else pieces
            if type(body) is bytes and not header:
                return self.encode_bytes_message(target, body)
            tb = self._targets.get(target) or self.target(target)
            return encode_simple(
                _MESSAGE,
                tb,
                encode_cbor(body) if body is not None else b"",
                encode_cbor(header) if header else b"",
                source=self.stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc

    def encode_bytes_message(self, target: str, body: bytes) -> bytes | list[Buffer]:
        """:meth:`encode_message` for the commonest message, a ``bytes`` body and nothing
        else (no header, attachments, descriptors or relaying), called positionally: the
        drivers' ``send`` takes this way for such a message, saving the general call's
        keyword arguments and checks on the path every small message takes.

        Raises:
            UsageError: ``target`` is malformed, or the frame would be too large.
        """
        try:
            tb = self._targets.get(target) or self.target(target)
            no_join = self._no_join
            if no_join is not None and len(body) >= no_join:
                # A large binary body goes out as it is (bytes cannot change under us):
                # no CBOR copy, no join; the driver sends both pieces in one sendmsg.
                return encode_bytes_message(_MESSAGE, tb, body, self.stamp)  # type: ignore[return-value]
            return encode_small_bytes(_MESSAGE, tb, body, self.stamp)
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc

    def encode_messages(self, target: str, bodies: Iterable[Any]) -> list[Buffer]:
        """One-way MESSAGEs to ``target``, one per body, in order: the pieces of all the
        frames, consecutive small ones joined into one buffer (one append and one write
        for a batch instead of one per message). Every body is encoded before anything
        is returned, so a body that cannot be encoded sends none of them.

        Raises:
            UsageError: a body cannot be encoded (named by its index), or ``target`` is
                too long.
        """
        try:
            tb = self._targets.get(target) or self.target(target)
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc
        stamp = self.stamp
        no_join = self._no_join
        out: list[Buffer] = []
        run: list[bytes] = []
        for i, body in enumerate(bodies):
            if type(body) is bytes and (no_join is None or len(body) < no_join):
                run.append(encode_small_bytes(_MESSAGE, tb, body, stamp))
                continue
            try:
                frame = self.encode_message(target, body)
            except UsageError as exc:
                raise UsageError(f"body {i} of the batch: {exc}") from exc
            if type(frame) is bytes:
                run.append(frame)
                continue
            if run:
                out.append(b"".join(run))
                run = []
            out.extend(frame)  # type: ignore[arg-type]  # a large body's two pieces
        if run:
            out.append(b"".join(run))
        return out

    def encode_notify(self, group: str, event: str, params: Any = None) -> list[Buffer]:
        """A NOTIFY of ``event`` to ``group``.

        Raises:
            UsageError: ``params`` cannot be encoded, or a section is too long.
        """
        try:
            return encode_frame(
                _NOTIFY,
                target=group,
                header=encode_cbor({"event": event}),
                body=encode_cbor(params) if params is not None else b"",
            )
        except LocalProtocolError as exc:
            raise UsageError(str(exc)) from exc

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
        try:
            body = encode_cbor(params) if params is not None else b""
            flags = _FLAG_ALL if multi else 0
            if attachments or fds:
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
            raise UsageError(f"cannot call {command!r} on {target!r}: {exc}") from exc
        if fds:
            pieces = self.attach_fds(pieces, fds)
        self._next_rid = rid
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

    def encode_ping(self) -> list[Buffer]:
        """A ``ping`` to the broker whose answer is ignored (never registered as a call):
        any traffic proves the broker alive (the TCP heartbeat)."""
        self._next_rid += 1
        return encode_frame(
            _REQUEST,
            target="msgq",
            request_id=self._next_rid,
            header=request_header("ping", None),
            source=self.stamp,
        )

    def attach_fds(
        self, pieces: Sequence[Buffer], fds: Sequence[int], *, owned: bool = False
    ) -> list[Buffer]:
        """Make the frame's first piece carry ``fds``: duplicates (the caller keeps its
        own), or the descriptors themselves when ``owned`` (then they are ours to close,
        also on error).

        Raises:
            UsageError: more than the broker's ``max_fds_per_message``, a driver that
                cannot pass descriptors, or a bad fd.
        """
        limit = self.max_fds if self.fd_passing else 0
        if len(fds) > limit:
            if owned:
                close_fds(tuple(fds))
            raise UsageError(
                f"{len(fds)} file descriptors in one message; the broker allows "
                f"max_fds_per_message={limit}"
                if self.fd_passing
                else f"{len(fds)} file descriptors in one message; this connection "
                "cannot pass descriptors (a Unix socket with the trio client can)"
            )
        dups = tuple(fds) if owned else dup_all(fds)
        return [FdBuffer(bytes(pieces[0]), dups), *pieces[1:]]

    def encode_answer(
        self, request: Message, result: Any = None, attachments: Sequence[Buffer] = ()
    ) -> list[Buffer]:
        """The REPLY to ``request`` with ``result`` and binary ``attachments``.

        Raises:
            UsageError: ``result`` cannot be encoded.
        """
        try:
            return encode_frame(
                _REPLY,
                target=request._reply_to,
                request_id=request.request_id,
                body=encode_cbor(result) if result is not None else b"",
                blobs=attachments,
                source=self.stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"answer cannot be encoded: {exc}") from exc

    def encode_error(
        self, request: Message, code: str, message: str, data: object = None
    ) -> list[Buffer]:
        """The ERROR answer ``code`` to ``request``.

        Raises:
            UsageError: ``data`` cannot be encoded.
        """
        try:
            return encode_frame(
                _ERROR,
                target=request._reply_to,
                request_id=request.request_id,
                header=encode_cbor({"code": str(code), "message": message}),
                body=encode_cbor(data) if data is not None else b"",
                source=self.stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"error answer cannot be encoded: {exc}") from exc

    # -- the handler contract ----------------------------------------------------------
    def answer_for(
        self, request: Message, result: Any, error: Exception | None
    ) -> list[Buffer] | None:
        """The answer to ``request`` for its handler's ``result``, or for the exception
        ``error`` it raised. This is the handler contract of every driver:

        * a value: the answer (CBOR); a :class:`~msgq_trio.client.message.Reply`: the
          answer with its blobs and descriptors (refused where the connection cannot
          pass descriptors);
        * :class:`~msgq_trio.errors.CommandFailed` ``(code, message, data)``: that error;
        * :class:`~msgq_trio.errors.MalformedMessage` (the request's body or header is
          not well-formed CBOR): ``bad-request`` with its message, which names the
          caller whose bug it is;
        * ``TypeError``, ``ValueError``, ``KeyError`` (the params did not fit):
          ``bad-request`` naming the exception's type;
        * :class:`~msgq_trio.errors.UsageError` or a result CBOR cannot encode:
          ``internal-error`` "handler result cannot be encoded";
        * :class:`~msgq_trio.errors.ConnectionLost` while this connection is lost: None,
          no answer (nobody to send it to; the driver raises or drops it);
        * any other exception: ``internal-error`` naming its type (``data`` ``{"type":
          name}``), logged with its traceback: the handler's bug.

        The request's descriptors that the handler did not take are closed here.
        """
        try:
            if error is not None:
                raise error
            if isinstance(result, Reply):
                try:
                    pieces = encode_frame(
                        _REPLY,
                        target=request._reply_to,
                        request_id=request.request_id,
                        body=encode_cbor(result.result) if result.result is not None else b"",
                        blobs=result.attachments,
                        n_fds=len(result.fds),
                        source=self.stamp,
                    )
                except BaseException:
                    close_fds(result.fds)
                    raise
                if result.fds:
                    pieces = self.attach_fds(pieces, result.fds, owned=True)
                return pieces
            reply_to = request._reply_to
            return [
                encode_simple(
                    _REPLY,
                    self._targets.get(reply_to) or self.target(reply_to),
                    encode_cbor(result) if result is not None else b"",
                    request_id=request.request_id,
                    source=self.stamp,
                )
            ]
        except CommandFailed as exc:
            return self.encode_error(request, str(exc.code), exc.message, exc.data)
        except MalformedMessage as exc:
            return self.encode_error(request, ErrorCode.BAD_REQUEST, str(exc))
        except (TypeError, ValueError, KeyError, RemoteProtocolError) as exc:
            return self.encode_error(request, ErrorCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
        except (LocalProtocolError, UsageError) as exc:
            return self.encode_error(
                request, ErrorCode.INTERNAL_ERROR, f"handler result cannot be encoded: {exc}"
            )
        except ConnectionLost as exc:
            if self.lost is not None:
                return None
            return self._internal_error(request, exc)
        except Exception as exc:
            return self._internal_error(request, exc)
        finally:
            request.close()  # descriptors the handler did not take_fds() are closed here

    def _internal_error(self, request: Message, exc: Exception) -> list[Buffer]:
        log.error("handler for %r raised", request.command, exc_info=exc)
        return self.encode_error(
            request,
            ErrorCode.INTERNAL_ERROR,
            f"{type(exc).__name__}: {exc}",
            {"type": type(exc).__name__},
        )

    def inline_failed(self, request: Message, exc: Exception) -> list[Buffer]:
        """The answer when an inline handler raised: ``internal-error``, logged. Not
        :meth:`answer_for`: an inline handler decodes the request and answers by itself,
        so its exception is its own bug, never the caller's ``bad-request``."""
        log.error("inline handler for %r raised", request.command, exc_info=exc)
        return self.encode_error(request, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

    def unknown_command(self, request: Message, command: str | None) -> list[Buffer]:
        """``unknown-command`` for a request no handler takes; ``data`` lists ours."""
        request.close()
        return self.encode_error(
            request,
            ErrorCode.UNKNOWN_COMMAND,
            f"{self.name} ({self.lname}) has no command {command!r}",
            sorted(self.commands),
        )

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


class SessionView:
    """The connection's identity, read from the session: shared by every driver (the
    blocking ``DirectBus`` too)."""

    _s: Session

    @property
    def name(self) -> str:
        """The client name sent in HELLO."""
        return self._s.name

    @property
    def lname(self) -> str:
        """This connection's unique address, assigned by the broker (``l.N``)."""
        return self._s.lname

    @property
    def broker_version(self) -> str:
        """The broker's version from WELCOME."""
        return self._s.broker_version

    @property
    def session(self) -> Session:
        """The sans-I/O protocol state under this driver (for plugin clients and tests)."""
        return self._s
