"""The direct client: blocking calls that do their own socket I/O in the calling thread.

No event loop and no background thread: ``call()`` writes the request and reads the
socket itself until the answer is there. For synchronous programs (command-line tools,
scripts, a component written without async) and for the lowest round-trip latency: no
scheduler between the socket and the caller, so a call costs less CPU and less time than
on the trio client (BENCHMARKS.md, "The round trip, measured hop by hop").
:func:`msgq_trio.sync.connect` is the full synchronous API (queues, pipes, handlers in
worker threads) over a background trio loop; this one covers what a component needs on
the hot path: calls, one-way messages, subscriptions and serving commands. Unix sockets
only.

Where frames go while a method waits (all in the calling thread):

* the answer to the call being made: returned by ``call``;
* a REQUEST: answered at once by its handler (:meth:`DirectBus.command`) inside whichever
  method is waiting (``call``, ``receive``, ``serve``, a blocked ``send``), so two
  direct clients calling each other never deadlock; a command without a handler is
  answered ``unknown-command``;
* a MESSAGE or NOTIFY: kept, in order, for :meth:`DirectBus.receive`, up to
  ``max_buffered`` bytes (past that, the methods that must read raise
  :class:`~msgq_trio.errors.LimitExceeded`; nothing is dropped);
* a late answer (to a call that gave up locally): discarded.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConnectError, ConnectionLost, MsgqError, UsageError
from ..protocol.codes import FrameType
from ..protocol.errors import LocalProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE
from ..transport.fdpass import SEND_BUFFER
from ..transport.sockets import (
    close_fds,
    unconsumed_bytes,
)
from .address import client_name, connect_target
from .blocking_socket import DEFAULT_MAX_BUFFERED, BlockingSocket, dial
from .lifecycle import CONNECT_TIMEOUT, State, connect_timeout
from .message import Member, Message, new_message
from .reconnect import Reconnect, reconnect_policy
from .session import (
    CLOSE_WAIT,
)

_GOODBYE = FrameType.GOODBYE
_MESSAGE = FrameType.MESSAGE
_NOTIFY = FrameType.NOTIFY
#: A command handler: ``fn(params)`` or ``fn(params, request)``, a plain function.
Handler = Callable[..., Any]


class DirectBus(BlockingSocket):
    """A connection whose methods block the calling thread and do their own I/O.

    Create it with :func:`connect`. Not thread-safe: one thread uses it (other threads
    use their own connection). Command handlers run in that thread, inside whichever
    method is waiting for the socket; a handler may itself call :meth:`call`.

    The blocking driver of the client :class:`~msgq_trio.client.session.Session`: the
    socket and the waits are here; what frames mean and what to answer is the session's.

    Resource handling: :meth:`close` (or leaving the ``with`` block) says GOODBYE, waits
    for the broker's (``CLOSE_WAIT`` s, longer while the broker still takes our bytes;
    see :func:`msgq_trio.client.session.close_patience`), and closes the socket and the
    descriptors of messages never received. After the connection is lost every method raises
    :class:`~msgq_trio.errors.ConnectionLost`.
    """

    # -- reconnect (connect(..., reconnect=...); the session's lifecycle decides) --------
    @property
    def connected(self) -> bool:
        """Whether the bus is connected (after a reconnect: once the groups it had
        joined are joined again)."""
        return self._s.lost is None and not self._closed

    @property
    def reconnects(self) -> int:
        """How many times this bus reconnected (``connect(..., reconnect=...)``)."""
        return self._s.life.reconnects

    def wait_connected(self, timeout: float | None = None) -> None:
        """Return once the bus is connected: at once while it is; after a loss with
        ``reconnect``, reconnect (this driver has no thread of its own: its waiting
        methods make the attempts) and join the groups again.

        Raises:
            TimeoutError: not connected within ``timeout`` s.
            ConnectionLost: the loss is final (reconnect off or given up).
            UsageError: the bus is closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._s.lost is not None or self._frames:
            if self._frames:  # what came before the loss is handled first
                self._dispatch()
                continue
            if not self._reconnected(deadline, wait=True):
                raise TimeoutError(f"not connected within {timeout} s")
        if self._closed:
            raise UsageError("the bus is closed")

    def _reconnected(self, deadline: float | None, *, wait: bool) -> bool:
        """The connection is lost: make the reconnect attempts that the session's
        lifecycle says are due (``wait``: sleeping until each, up to ``deadline``). True
        once connected again, False if ``deadline`` came first.

        Raises:
            ConnectionLost: reconnect is off, the bus is closed, the policy gave up
                (final), or (not ``wait``) no attempt succeeded now: the client is
                reconnecting.
        """
        s = self._s
        life = s.life
        if life.state is State.READY and s.lost is not None:
            self._begin_outage()
        # The loop of the asynchronous drivers' ``_supervise``, driven from the caller's
        # wait (this driver has no task of its own): the lifecycle says when to dial.
        while (delay := life.wait(time.monotonic())) is not None:
            if delay == 0:
                if self._attempt():
                    return True
                if deadline is not None and deadline <= time.monotonic():
                    return False
                continue
            if not wait:
                break  # the reconnecting error
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                delay = min(delay, left)
            time.sleep(delay)
        self._check_open()
        return True

    def _ready(self) -> None:
        """Raise unless connected; while reconnecting, first make an attempt that is
        due (without waiting for one)."""
        if self._s.lost is not None:
            self._reconnected(None, wait=False)
        elif self._closed:
            self._check_open()

    def _begin_outage(self) -> None:
        """The loss is noticed: the session's lifecycle decides what follows. With a
        reconnect: the socket is closed, and what came before the loss is kept for
        receive() (messages) or dropped (requests and answers belong to the old
        connection: their callers were told by the broker)."""
        s = self._s
        assert s.lost is not None
        if s.connection_lost(s.lost, time.monotonic()):
            return  # final: the socket and what it brought stay for close()
        self._sock.close()
        close_fds(self._conn.take_orphan_fds())
        while self._frames:
            frame = self._frames.popleft()
            self._frames_bytes -= len(frame.raw) + len(frame.large_body)
            if frame.type in (_MESSAGE, _NOTIFY):
                self._inbox.items.append(new_message(frame, s.sources))
                self._inbox.put(1, len(frame.raw) + len(frame.large_body))
            else:
                close_fds(frame.fds)

    def _attempt(self) -> bool:
        """One reconnect attempt: dial, handshake, join the groups again (the session's
        restore policy). False if any of it failed (the lifecycle schedules the next
        attempt, or gives up)."""
        s = self._s
        down = s.lost
        s.life.dialing(time.monotonic())
        deadline = s.life.attempt_deadline
        assert deadline is not None  # RECONNECTING under a policy: attempt_timeout
        try:
            sock = dial(self._target, self._send_buffer, max(0.001, deadline - time.monotonic()))
        except ConnectError as exc:
            s.attempt_failed(exc, time.monotonic())
            return False
        s.reset()
        self._attach(sock)
        try:
            self._handshake(deadline)
            for group in s.restore_groups():
                try:
                    self.call("msgq", "subscribe", {"group": group})
                except ConnectionLost:
                    raise
                except MsgqError as exc:
                    s.restore_refused(group, exc)
        except (ConnectError, ConnectionLost) as exc:
            sock.close()
            s.lost = down
            s.attempt_failed(exc, time.monotonic())
            return False
        s.restored()
        return True

    # -- connection ------------------------------------------------------------------

    def close(self) -> None:
        """Say GOODBYE, wait for the broker's, close the socket. Idempotent.

        The wait ends after ``CLOSE_WAIT`` s, or while bytes we sent are still unread by
        the broker, after ``close_patience`` s in which it took none of them (it may be
        pausing our reads for backpressure: bytes it never read are lost)."""
        if self._closed:
            return
        self._closed = True
        self._s.life.close()
        try:
            if self._s.lost is None:
                try:
                    self._write(b"".join(self._s.goodbye()))
                    now = time.monotonic()
                    deadline, since = now + CLOSE_WAIT, now
                    unread = unconsumed_bytes(self._sock.fileno())
                    while self._s.lost is None and not self._goodbye:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            # The broker may be pausing our reads (backpressure): wait on
                            # while it still takes our bytes (unread ones die with us).
                            before, unread = unread, unconsumed_bytes(self._sock.fileno())
                            now = time.monotonic()
                            if unread < before:
                                since = now
                            if not unread or now - since >= self._s.close_patience:
                                break
                            deadline = now + CLOSE_WAIT
                            continue
                        self._read(left)
                        # Frames after our GOODBYE are moot; only the broker's counts.
                        while self._frames:
                            frame = self._frames.popleft()
                            close_fds(frame.fds)
                            if frame.type == _GOODBYE:
                                self._goodbye = True
                except (ConnectionLost, LocalProtocolError):
                    pass
        finally:
            self._sock.close()
            for frame in self._frames:
                close_fds(frame.fds)
            self._frames.clear()
            self._frames_bytes = 0
            for msg in self._inbox.clear():
                msg.close()
            self._s.connection_lost(ConnectionLost("the bus was closed"), time.monotonic())

    def __enter__(self) -> DirectBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- dispatch ----------------------------------------------------------------------

    # -- the API ---------------------------------------------------------------------
    def call(
        self, target: str, command: str, params: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Call ``command`` on exactly one recipient and return its result.

        The same contract as :meth:`msgq_trio.Bus.call`: no timeout is needed (the broker
        answers ``no-recipient`` at once, ``recipient-gone`` when the callee leaves, and
        ``timeout`` after its deadline); ``timeout`` shortens that deadline, and the
        client gives up by itself one second after it if even the broker is silent.

        Raises:
            NoRecipient, RecipientGone, RequestTimeout, ReceiverFull, MultipleRecipients,
            LimitExceeded, RemoteError (and subclasses): the answer's error.
            MalformedMessage: the answer's body is not well-formed CBOR.
            LimitExceeded: ``max_buffered`` bytes of messages wait for receive().
            UsageError: a bad argument, or the bus is closed.
            ConnectionLost: the broker went away (with ``reconnect``: a call under way at
                the loss; one while the client reconnects fails at once, saying so).
        """
        self._ready()
        s = self._s
        now = time.monotonic() if timeout is not None else 0.0  # no deadline without one
        call, pieces = s.start_call(target, command, params, now=now, timeout=timeout)
        try:
            self._write(b"".join(pieces))
            while not call.done:
                left = None
                if call.deadline is not None:
                    now = time.monotonic()
                    if call.expire(now):
                        break
                    left = call.deadline - now
                self._pump(left)
        finally:
            s.finish(call)
        return s.call_result(call, command)

    def send(self, target: str, body: Any = None) -> None:
        """Send a one-way message to ``target`` (lname, group, ``G[N]`` or ``G[?]``);
        returns once the kernel has taken it.

        Raises:
            UsageError: ``body`` cannot be encoded as CBOR, or the bus is closed.
            ConnectionLost: the broker went away (with ``reconnect``: the client is
                reconnecting; nothing is queued).
        """
        self._ready()
        frame = self._s.encode_message(target, body)
        self._write(frame if isinstance(frame, bytes) else b"".join(frame))

    def send_many(self, target: str, bodies: Iterable[Any]) -> None:
        """Send one one-way message per body to ``target``, in order, as :meth:`send`
        would one by one, in one write; returns once the kernel has taken them all.
        Every body is encoded before anything is written, so a body that cannot be
        encoded sends none of them.

        Raises:
            UsageError: a body cannot be encoded (named by its index; nothing was sent),
                or the bus is closed.
            ConnectionLost: the broker went away.
        """
        self._ready()
        pieces = self._s.encode_messages(target, bodies)
        self._write(b"".join(pieces))

    def receive(self, timeout: float | None = None) -> Message:
        """The next one-way message or notification (a :class:`msgq_trio.Message`),
        answering requests while it waits. The caller owns the message's descriptors.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            ConnectionLost: the connection ended (messages that came before are still
                returned first); with ``reconnect`` only when the loss is final: the
                reconnect attempts are made while this waits.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._inbox.items:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no message within {timeout} s")
            self._pump(left)
        return self._inbox.items.popleft()

    def serve(self, duration: float | None = None) -> None:
        """Answer requests (and keep messages for :meth:`receive`) for ``duration``
        seconds, or until the connection ends when None.

        Raises:
            ConnectionLost: the connection ended (with ``reconnect``: for good; the
                reconnect attempts are made while this serves).
            LimitExceeded: ``max_buffered`` bytes of messages wait for receive().
        """
        deadline = None if duration is None else time.monotonic() + duration
        if self._closed:
            self._check_open()
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._pump(left)

    def _check_handler(self, fn: Handler) -> None:
        """Refuse an ``async def`` handler: this driver runs handlers in the thread that
        waits."""
        if inspect.iscoroutinefunction(fn):
            raise UsageError(
                "the direct client runs plain-function handlers; use msgq_trio.connect "
                "for async ones"
            )

    def subscribe(self, group: str) -> bool:
        """Join ``group``; False if already a member. Confirmed by the broker. With
        ``reconnect``, a reconnect joins it again (at the end of its join order)."""
        joined = bool(self.call("msgq", "subscribe", {"group": group}))
        self._s.subscribed(group)
        return joined

    def unsubscribe(self, group: str) -> bool:
        """Leave ``group``; False if not a member. Confirmed by the broker."""
        left = bool(self.call("msgq", "unsubscribe", {"group": group}))
        self._s.unsubscribed(group)
        return left

    def members(self, group: str) -> list[Member]:
        """Members of ``group`` in join order (``G[0]`` first)."""
        rows = self.call("msgq", "members", {"group": group})
        return [Member(r["lname"], r["name"], r.get("pid", -1)) for r in rows]


def connect(
    socket: str | os.PathLike[str] | None = None,
    name: str | None = None,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    max_buffered: int = DEFAULT_MAX_BUFFERED,
    send_buffer: int = SEND_BUFFER,
    timeout: float = CONNECT_TIMEOUT,
    reconnect: bool | Reconnect = False,
) -> DirectBus:
    """Connect to the broker on a Unix socket; returns a :class:`DirectBus` (a context
    manager).

    Args:
        socket: the broker's socket path; default ``$MSGQ_TRIO_SOCKET`` or the per-user
            path (:func:`msgq_trio.config.default_socket_path`).
        name: this client's name, shown to others as ``sender_name``.
        max_buffered: bytes of received one-way messages kept for ``receive()``.
        send_buffer: SO_SNDBUF for the socket (0 = kernel default).
        timeout: the longest the connection and the broker's WELCOME may take together
            (:data:`~msgq_trio.client.lifecycle.CONNECT_TIMEOUT`, 30 s).
        reconnect: off by default; True or a :class:`~msgq_trio.client.reconnect.Reconnect`
            reconnects after a loss (README "Reconnecting"). This driver has no thread
            of its own: the attempts are made inside its waiting methods (``receive``,
            ``serve``, :meth:`DirectBus.wait_connected`); ``call`` and ``send`` make one
            that is due and otherwise fail at once with ConnectionLost saying so.

    Raises:
        ConnectError: no broker there, it refused the handshake (``code``), or it did
            not answer within ``timeout``.
        UsageError: a ``tcp://`` or ``tls://`` address (use :func:`msgq_trio.connect`).
    """
    target = connect_target(socket)
    if target.startswith(("tcp://", "tls://")):
        raise UsageError("the direct client speaks to Unix sockets only; use msgq_trio.connect")
    policy = reconnect_policy(reconnect)
    deadline = time.monotonic() + connect_timeout(timeout)
    sock = dial(target, send_buffer, timeout)
    try:
        bus = DirectBus(
            sock,
            client_name(name),
            max_frame_size=max_frame_size,
            max_buffered=max_buffered,
            target=target,
            reconnect=policy,
            send_buffer=send_buffer,
            timeout=timeout,
        )
        bus._handshake(deadline)
    except BaseException:
        sock.close()
        raise
    return bus
