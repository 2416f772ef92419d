"""One peer connection of the broker: its reader and writer tasks, backpressure, and the
handshake and final-error helpers around them.

A connection depends on the daemon that runs it only through :class:`ConnectionHost`
(the core, the limits, the busy poller, splicing state, the other connections' progress,
applying the core's effects), never on ``Server``: the server imports this module, not
the other way round.

Shape (trio's serve_listeners, hypercorn's trio server): per connection a reader (receive,
parse every complete frame, ``core.handle_many``) and a writer (joins all queued frames
into one ``send_all``: each trio send costs a scheduler round trip and a system call,
which would dominate the cost of a small frame if it were paid per frame). The
server wraps each connection in ``finally: aclose_forcefully`` plus
``core.disconnect``, so a clean close, a crash, a protocol violation or a kick all run
the same cleanup.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import trio

from ..config import Limits
from ..core.broker import Broker
from ..core.delivery import user_full
from ..core.peers import Peer
from ..protocol.codes import ErrorCode, FrameType
from ..protocol.connection import EOF, NEED_DATA, Connection, connection_error_frame
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame, Run, SplicedRest, encode_cbor, encode_frame
from ..transport import splice
from ..transport.errors import translate_socket_errors
from ..transport.sockets import (
    SocketReceiver,
    ancillary_size,
    close_fds,
    hung_up,
    receive_with_fds,
    send_buffers,
)
from .listeners import Stream
from .polling import BusyPoller
from .wakeup import Wakeup

log = logging.getLogger("msgq_trio.io")

#: One receive takes up to this much: enough to parse thousands of small frames per
#: trio call; the kernel's AF_UNIX buffer is ~200 KiB by default.
RECEIVE_SIZE = 256 * 1024
#: The writer joins queued small frames up to this many bytes into one send_all.
WRITE_BATCH = 1024 * 1024
_GOODBYE = FrameType.GOODBYE
#: Queues up to this size are written directly by the host's batcher (send_now) when the
#: writer is idle.
_DIRECT_SEND_MAX = 256 * 1024
#: While a sender's reads are paused by backpressure its EOF sits behind unread data, so
#: the broker looks at the socket's poll state this often (one non-blocking poll(2), cheap
#: next to the interval): a client that dies while paused is dropped, and the calls pending on it
#: fail, within this time rather than when its receivers have drained (which can take
#: slow_consumer_timeout per receiver).
HANGUP_POLL_INTERVAL = 0.02


class Splicing:
    """What the connections of one broker share to splice large frames through pipes
    (transport/splice.py): the pipe budget and the figures ``stats`` reports."""

    __slots__ = ("budget", "fallbacks", "spliced_frames", "unsupported_logged")

    def __init__(self, max_pipes: int) -> None:
        #: Pipes held for large frames in flight (limits.splice_max_pipes).
        self.budget = splice.PipeBudget(max_pipes)
        #: Large frames spliced through, and those that fell back to copying for want
        #: of a pipe.
        self.spliced_frames = 0
        self.fallbacks = 0
        #: The first fallback for want of kernel support is logged, the rest counted.
        self.unsupported_logged = False


class ConnectionHost(Protocol):
    """What a :class:`PeerConnection` needs from the daemon that runs it."""

    @property
    def core(self) -> Broker: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def busy_poll(self) -> BusyPoller: ...

    @property
    def splicing(self) -> Splicing: ...

    @property
    def shutting_down(self) -> bool:
        """True once the broker is shutting down (a GOODBYE sent then ends in EOF)."""
        ...

    def connection_of(self, peer: Peer) -> PeerConnection | None:
        """The connection of ``peer`` (a receiver a paused sender waits for), if any."""
        ...

    def after_core(self) -> None:
        """Apply what the core decided (``Broker.effects``): wake writers, close the
        connections of kicked peers, re-arm the deadline timer."""
        ...


class PeerConnection:
    """One admitted client's connection: its stream, its reader and writer, backpressure.

    :meth:`run` reads and routes (this task) and writes (a child task) until either
    ends; the caller (the host) owns admission before and the cleanup after.
    """

    def __init__(
        self,
        host: ConnectionHost,
        peer: Peer,
        stream: Stream,
        conn: Connection,
        principals: list[str] | None = None,
    ) -> None:
        self.host = host
        self.peer = peer
        self.stream = stream
        self.conn = conn
        self.wake = Wakeup()
        #: Unparked after every completed write: senders paused on this receiver re-check.
        self.progress = trio.lowlevel.ParkingLot()
        self.scope = trio.CancelScope()
        self.goodbye_sent = trio.Event()
        self.closing_reason: str | None = None
        self.final_error: tuple[ErrorCode, str] | None = None
        #: True while the writer task is inside send_all; otherwise the socket is free and
        #: the host's batcher may write to it directly (send_now), saving a task switch.
        self.writing = False
        #: -1 for TLS: bytes must go through the SSL object, never straight to the fd.
        self.fd = -1 if isinstance(stream, trio.SSLStream) else stream.socket.fileno()
        #: The socket's descriptor, also under TLS: only polled, for a hang-up while paused.
        self.sock_fd = (
            stream.transport_stream.socket.fileno()
            if isinstance(stream, trio.SSLStream)
            else self.fd
        )
        #: Identities the access policy matched (re-matched on a policy change).
        self.principals = principals or []
        # Heartbeat bookkeeping (TCP only): received-byte count and write progress seen at
        # the last tick, intervals without a byte from the client, and whether the reader
        # is paused by backpressure (then silence is ours, not the client's).
        self.hb_rx = -1
        self.hb_missed = 0
        self.hb_progress = 0
        self.writes = 0
        self.paused = False
        #: While paused: when to look at the socket for a hang-up next (HANGUP_POLL_INTERVAL).
        self.next_hangup_check = 0.0

    def kick(self, code: ErrorCode, message: str) -> None:
        """Close this connection because the core dropped the client."""
        self.closing_reason = str(code)
        self.final_error = (code, message)
        self.scope.cancel()
        self.progress.unpark_all()

    def queue_goodbye(self, goodbye: list[bytes | bytearray | memoryview]) -> None:
        """Queue our GOODBYE (once) behind what the client is owed and wake the writer;
        nothing may be queued after it (the peer is sealed)."""
        if self.conn.sent_goodbye:
            return
        self.conn.check_send(FrameType.GOODBYE)
        self.peer.sealed = True
        for b in goodbye:
            self.peer.outq.append(b)
            self.peer.outq_bytes += len(b)
        self.wake.set()

    async def run(self) -> None:
        """Run the reader (in this task) and the writer (a child task) until either ends.

        Errors from either side are turned into a closing reason here, inside the nursery,
        so the caller sees plain exceptions (a protocol error) rather than groups.
        """
        srv = self.host
        failure: BaseException | None = None
        with self.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer_task, nursery.cancel_scope)
                try:
                    goodbye = await self._reader()
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    log.debug("connection %s lost: %s", self.peer.describe(), exc)
                    self.closing_reason = self.closing_reason or "connection-lost"
                    goodbye = False
                except Exception as exc:  # protocol errors and bugs: re-raised below
                    failure = exc
                    goodbye = False
                if goodbye:
                    # The client leaves: flush what it is owed, then our GOODBYE, then close.
                    self.closing_reason = "closed"
                    srv.core.disconnect(self.peer, "closed", keep_queue=True)
                    srv.after_core()
                    self.queue_goodbye(encode_frame(FrameType.GOODBYE))
                    with trio.move_on_after(srv.limits.shutdown_grace):
                        await self.goodbye_sent.wait()
                elif self.closing_reason is None and failure is None:
                    self.closing_reason = "connection-lost"
                nursery.cancel_scope.cancel()
        if failure is not None:
            try:
                raise failure
            finally:
                # The traceback refers to this frame: without this the exception, this
                # frame and the connection's buffers would form a cycle.
                failure = None

    async def _writer_task(self, scope: trio.CancelScope) -> None:
        try:
            await self._writer()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("connection %s lost while writing: %s", self.peer.describe(), exc)
            self.closing_reason = self.closing_reason or "connection-lost"
            scope.cancel()

    async def _reader(self) -> bool:
        """Read and route until EOF (False) or the client's GOODBYE (True)."""
        srv = self.host
        stream = self.stream
        if isinstance(stream, trio.SSLStream):
            tls_receive = tls_receiver(stream)

            async def receive_tls(conn: Connection) -> int:
                data, fds = await tls_receive()
                conn.receive_data(data, fds)
                return len(data)

            return await self._read_loop(receive_tls)
        rx = SocketReceiver(
            stream.socket, RECEIVE_SIZE, ancillary_size(srv.limits.max_fds_per_message)
        )
        try:
            return await self._read_loop(rx.receive_into)
        finally:
            rx.close()

    async def _read_loop(self, receive: Callable[[Connection], Awaitable[int]]) -> bool:
        # ``receive(conn)`` receives once and hands the bytes to conn (in place for a large
        # frame: SocketReceiver.receive_into); it returns the count, 0 at EOF.
        srv = self.host
        poller = srv.busy_poll
        conn, peer, core = self.conn, self.peer, srv.core
        handle_many = core.handle_many
        idle_in_frame = srv.limits.idle_in_frame_timeout
        # Large frames from a Unix socket client may be spliced (transport/splice.py).
        can_splice = splice.AVAILABLE and self.fd >= 0 and not peer.remote
        # The spliced rest of the frame being handled: released here unless a receiver's
        # queue took it (Broker._deliver) or the frame is still held.
        rest: SplicedRest | None = None
        # Frames pipelined right behind HELLO are already buffered: the first pass
        # handles them before waiting for more data.
        received = False
        while True:
            if received:
                if conn.in_frame:
                    n = -1
                    with trio.move_on_after(idle_in_frame) as cs:
                        n = await receive(conn)
                    if cs.cancelled_caught and n < 0:
                        raise RemoteProtocolError(
                            f"stalled in the middle of a frame for {idle_in_frame} s "
                            "(idle_in_frame_timeout)",
                            ErrorCode.PROTOCOL_ERROR,
                        )
                else:
                    n = await receive(conn)
                if not n:
                    # EOF: descriptors that came with it are the connection's orphans,
                    # closed with it (Connection.close).
                    if conn.in_frame:
                        log.info(
                            "client %s closed the connection in the middle of a frame",
                            peer.describe(),
                        )
                    return False
                if can_splice and conn.in_large_frame:
                    min_rest = srv.limits.splice_min_size
                    want = conn.splice_rest(min_rest) if min_rest else 0
                    if want:
                        more, rest = await self._splice_rest(want)
                        if not more:
                            log.info(
                                "client %s closed the connection in the middle of a frame",
                                peer.describe(),
                            )
                            return False
            received = True
            now = trio.current_time()
            if not poller.polling and poller.limit:
                poller.adapt(now)
            poller.last_read = now
            try:
                # Runs also with capture on: Broker.handle_many taps each of their frames.
                events = conn.events_with_runs(peer.stamp)
                if not events:
                    continue
                last = events[-1]
                # GOODBYE and EOF can only come last (the state table rejects anything after).
                tail = last is EOF or (isinstance(last, Frame) and last.type == _GOODBYE)
                if tail:
                    events.pop()
                if events:
                    frames: list[Frame | Run] = events  # type: ignore[assignment]
                    done = handle_many(peer, frames, now)
                    while done < len(frames):
                        # A frame is held: its receivers must drain first (see
                        # Broker.handle). This sender stays paused meanwhile.
                        frames = frames[done:]
                        try:
                            srv.after_core()
                            self._pause()
                            await self._wait_for_room()
                        except _HungUp:
                            return await self._discard_unread(receive, frames)
                        except BaseException:
                            core.discard_frames(frames)
                            raise
                        finally:
                            self.paused = False
                        if not self.peer.alive:  # dropped while it waited
                            core.discard_frames(frames)
                            break
                        done = handle_many(peer, frames, trio.current_time())
                    if not peer.alive:
                        return False
                if tail:
                    return last is not EOF
            finally:
                if rest is not None:
                    if not rest.taken:
                        rest.close()  # delivered to nobody, refused, or the sender failed
                    rest = None
                srv.after_core()
            if conn.error_pending:
                conn.events()  # raises the protocol error that followed the valid frames
            if core.effects.pause:
                self._pause()
                try:
                    await self._wait_for_receivers()
                except _HungUp:
                    return await self._discard_unread(receive, [])
                finally:
                    self.paused = False

    async def _splice_rest(self, want: int) -> tuple[bool, SplicedRest | None]:
        """Move the ``want`` bytes still to come of the large frame in progress from the
        client's socket into pipes (``Connection.splice_rest`` announced them), then hand
        them to the connection, which completes the frame. Returns (False, None) at EOF
        (the connection knows it), else (True, what holds the rest: a
        :class:`~msgq_trio.transport.splice.PipeTail`, or None if it is to come the
        ordinary way).

        Where no pipe can be had, what was spliced is read back and the rest is received
        as usual (``Connection.unsplice``). ``idle_in_frame_timeout`` bounds each wait, as
        for a receive. The pipes are closed on any error or cancellation.

        Raises:
            RemoteProtocolError: the client stalled in the middle of the frame.
            trio.BrokenResourceError: the socket failed.
        """
        srv, conn = self.host, self.conn
        stream = self.stream
        assert isinstance(stream, trio.SocketStream)  # (fd >= 0: not TLS)
        sock = stream.socket
        fd, poller = self.fd, srv.busy_poll
        idle = srv.limits.idle_in_frame_timeout
        splicing = srv.splicing
        tail = splice.PipeTail(splicing.budget)
        handed = False
        try:
            left = want
            while left:
                try:
                    n = tail.fill_from(fd, min(left, splice.PIPE_SIZE))
                except BlockingIOError:
                    with trio.move_on_after(idle):
                        await trio.lowlevel.wait_readable(sock)
                        continue
                    raise RemoteProtocolError(
                        f"stalled in the middle of a frame for {idle} s (idle_in_frame_timeout)",
                        ErrorCode.PROTOCOL_ERROR,
                    ) from None
                except splice.SpliceUnavailable:
                    tail.materialize()
                    assert tail.data is not None
                    conn.unsplice(tail.data)
                    splicing.fallbacks += 1
                    budget = splicing.budget
                    if budget.unsupported and not splicing.unsupported_logged:
                        splicing.unsupported_logged = True
                        log.warning("%s: large frames are copied from now on", budget.unsupported)
                    return True, None
                if not n:
                    conn.unsplice(b"")
                    conn.receive_data(b"")
                    return False, None
                left -= n
                now = trio.current_time()
                if not poller.polling and poller.limit:
                    poller.adapt(now)
                poller.last_read = now
                await trio.lowlevel.checkpoint()
            conn.complete_spliced(tail)
            handed = True
            splicing.spliced_frames += 1
            return True, tail
        finally:
            if not handed:
                tail.close()

    async def _discard_unread(
        self,
        receive: Callable[[Connection], Awaitable[int]],
        held: list[Frame | Run],
    ) -> bool:
        """This connection's client hung up while its reads were paused: count and drop what it sent
        that the broker had not delivered, log it, and return False (connection lost).

        That is ``held`` (frames waiting for room at receivers) plus what is left in the
        socket, read to EOF here: a closed peer can send no more, so that is bounded by
        its socket buffer, and parsing it tells whether it died in the middle of a frame.
        These frames are discarded as a dead receiver's queue is: delivering them would
        keep the dead client's calls pending until its receivers drained. Descriptors
        they carry are closed; ``stats.counters.discarded_frames`` counts them.
        """
        srv = self.host
        conn, core = self.conn, srv.core
        frames = list(held)
        unreadable = ""
        try:
            with trio.move_on_after(srv.limits.idle_in_frame_timeout):
                while True:
                    n = await receive(conn)
                    frames.extend(
                        e
                        for e in conn.events_with_runs(self.peer.stamp)
                        if isinstance(e, (Frame, Run))
                    )
                    if not n:
                        break
        except trio.BrokenResourceError as exc:
            unreadable = f"; the rest was unreadable: {exc}"
        except RemoteProtocolError as exc:
            unreadable = f"; the rest was invalid: {exc}"
        count = sum(f.count if isinstance(f, Run) else 1 for f in frames)
        size = sum(len(f.raw) for f in frames)
        log.warning(
            "client %s closed the connection%s while its reads were paused by backpressure: "
            "discarding %d frames (%d bytes) it sent that were not delivered yet%s",
            self.peer.describe(),
            " in the middle of a frame" if conn.in_frame else "",
            count,
            size,
            unreadable,
        )
        core.stats["discarded_frames"] += count
        core.discard_frames(frames)
        self.closing_reason = self.closing_reason or "connection-lost"
        return False

    def _pause(self) -> None:
        """Mark This connection's reader paused by backpressure (heartbeats and stats see it)."""
        self.paused = True
        self.next_hangup_check = trio.current_time() + HANGUP_POLL_INTERVAL

    async def _await_progress(self, rpc: PeerConnection, deadline: float) -> bool | None:
        """This paused sender waits for write progress on receiver ``rpc``, until
        ``deadline`` at most, and looks at its own socket for a hang-up every
        HANGUP_POLL_INTERVAL meanwhile (its EOF is behind the data we are not reading).

        Returns True on progress, None when it woke only to look for a hang-up, False
        once ``deadline`` has passed. Whatever it returns, the caller re-checks its
        condition before waiting again: a wake-up given while this task was between two
        waits would otherwise be lost.

        Raises:
            _HungUp: This connection's client closed the connection (see :meth:`_discard_unread`).
        """
        now = trio.current_time()
        if now >= self.next_hangup_check:
            self.next_hangup_check = now + HANGUP_POLL_INTERVAL
            if hung_up(self.sock_fd):
                raise _HungUp
        with trio.move_on_at(min(deadline, self.next_hangup_check)) as cs:
            await rpc.progress.park()
        if not cs.cancelled_caught:
            return True
        return False if trio.current_time() >= deadline else None

    async def _wait_for_receivers(self) -> None:
        """Backpressure: stop reading from this sender while a receiver it fed is over its
        soft limit. A receiver that makes no write progress for ``slow_consumer_timeout``
        is dropped (slow-consumer), so a stopped reader cannot pause its senders forever.
        A sender that hangs up meanwhile is dropped (see :meth:`_await_progress`)."""
        srv = self.host
        blocked = srv.core.effects.take_pause()
        soft = srv.limits.out_soft_limit
        patience = srv.limits.slow_consumer_timeout
        for r in blocked:
            rpc = srv.connection_of(r)
            deadline = trio.current_time() + patience
            while rpc is not None and r.alive and r.outq_bytes > soft and self.peer.alive:
                progressed = await self._await_progress(rpc, deadline)
                if progressed:
                    deadline = trio.current_time() + patience
                elif progressed is False and r.alive and r.outq_bytes > soft:
                    srv.core.kick(
                        r,
                        ErrorCode.SLOW_CONSUMER,
                        f"no progress on {r.outq_bytes} queued bytes for "
                        f"{srv.limits.slow_consumer_timeout} s (slow_consumer_timeout)",
                    )
                    srv.after_core()

    async def _wait_for_room(self) -> None:
        """Wait until every receiver of This connection's held frame can take it (or is gone).

        A receiver that makes no write progress for ``slow_consumer_timeout`` is dropped
        (slow-consumer); one that drains, however slowly, is waited for. A sender that
        hangs up meanwhile is dropped (see :meth:`_await_progress`). A receiver whose
        user is over its memory or descriptor quota (core/users.py) is waited for until
        the user has room; if it has none for ``slow_consumer_timeout``, that user's
        connection holding the most is dropped (``limit-exceeded``, reason
        ``quota:<quota>``).
        """
        srv = self.host
        hold = srv.core.effects.take_hold()
        if hold is None:
            return
        held, size, nfds = hold.receivers, hold.size, hold.fds
        room = srv.limits.out_hard_limit - size
        max_fds = srv.limits.max_fds_queued - nfds
        patience = srv.limits.slow_consumer_timeout
        for r in held:
            rpc = srv.connection_of(r)
            deadline = trio.current_time() + patience
            while (
                rpc is not None
                and r.alive
                and self.peer.alive
                and (
                    r.outq_bytes > room
                    or (nfds and r.outq_fds > max_fds)
                    or user_full(r, size, nfds)
                )
            ):
                progressed = await self._await_progress(rpc, deadline)
                if progressed:
                    deadline = trio.current_time() + patience
                elif progressed is False and r.alive:
                    if not (r.outq_bytes > room or (nfds and r.outq_fds > max_fds)):
                        # Within its own bounds: it is its user's quota that holds the
                        # frame (or nothing any more: the loop's condition looks again).
                        self._drop_for_quota(r, size, nfds)
                        deadline = trio.current_time() + patience
                        continue
                    srv.core.kick(
                        r,
                        ErrorCode.SLOW_CONSUMER,
                        f"no progress for {srv.limits.slow_consumer_timeout} s "
                        f"(slow_consumer_timeout) on {r.outq_bytes} queued bytes; "
                        f"{self.peer.describe()} waits to send it {size} more",
                    )
                    srv.after_core()

    def _drop_for_quota(self, r: Peer, size: int, nfds: int) -> bool:
        """``r``'s user had no room for ``size`` bytes (``nfds`` descriptors) for
        ``slow_consumer_timeout``: drop the connection of that user holding the most
        (``limit-exceeded``). False if the user has room after all."""
        quota = user_full(r, size, nfds)
        if not quota:
            return False
        acct = r.account
        used = acct.memory() if quota == "memory" else acct.fds()
        limit = acct.limits[quota]
        victim = cast(
            Peer, max(acct.peers, key=lambda p: p.outq_bytes if quota == "memory" else p.outq_fds)
        )
        core = self.host.core
        core.quota_drop(
            victim,
            quota,
            f"quota {quota!r} of user {acct.key} full ({used} of {limit}) for "
            f"{self.host.limits.slow_consumer_timeout} s (slow_consumer_timeout) with "
            f"{self.peer.describe()} waiting to send {r.lname} {size} bytes; "
            f"this connection held {victim.outq_bytes} bytes, {victim.outq_fds} descriptors",
        )
        self.host.after_core()
        return True

    async def _writer(self) -> None:
        srv = self.host
        stream, peer = self.stream, self.peer
        while True:
            await self.wake.wait()
            while peer.outq:
                bufs, n = peer.take_outgoing(WRITE_BATCH)
                self.writing = True
                try:
                    await send_buffers(stream, bufs)
                finally:
                    self.writing = False
                peer.sent(n)
                self.writes += 1
                self.progress.unpark_all()
            if self.conn.sent_goodbye and not peer.outq:
                self.goodbye_sent.set()
                if srv.shutting_down:
                    # Shutdown: our GOODBYE is out; close our side so the client sees EOF.
                    await send_eof(stream)
                return

    def send_now(self) -> bool:
        """Write a small queue straight to the socket if the writer is idle; True when
        that woke a sender paused by backpressure.

        Saves the writer task's wake-up on the latency path (request -> callee -> answer).
        Whatever the kernel does not take right away stays queued for the writer; errors
        are left for the writer to discover, so they are handled in one place.
        """
        peer = self.peer
        if (
            self.writing
            or peer.outq_bytes > _DIRECT_SEND_MAX
            or peer.outq_fds  # descriptors need sendmsg: the writer does that
            or self.conn.sent_goodbye
            or self.fd < 0  # TLS: only the SSL object may write
        ):
            return False
        bufs, n = peer.take_outgoing(_DIRECT_SEND_MAX)
        data = bufs[0] if len(bufs) == 1 else b"".join(bufs)
        try:
            sent = os.write(self.fd, data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0  # the writer will hit the same error and report it
        if sent < len(data):
            peer.outq.appendleft(memoryview(data)[sent:])
        peer.outq_bytes -= n - (len(data) - sent)
        peer.bytes_out += sent
        if sent and self.progress:  # a paused sender waits on it (rarely: skip the call)
            return bool(self.progress.unpark_all())
        return False


class _HungUp(Exception):
    """A paused sender's client closed its socket (PeerConnection._await_progress)."""


async def read_hello(
    stream: Stream, conn: Connection, who: str, limits: Limits
) -> tuple[str, dict[str, object]] | None:
    """Read until HELLO, for up to ``limits.handshake_timeout``.

    Returns:
        (name, header), the name "anonymous" if empty; None if the client left or timed
        out (logged).
    Raises:
        RemoteProtocolError: the client sent something other than a valid HELLO.
        trio.BrokenResourceError: the socket failed.
    """
    receive = _receiver(stream, limits)
    with trio.move_on_after(limits.handshake_timeout):
        while True:
            data, fds = await receive()
            conn.receive_data(data, fds)
            ev = conn.next_event()
            if ev is EOF:
                return None
            if ev is NEED_DATA:
                continue
            assert isinstance(ev, Frame)
            close_fds(ev.fds)  # descriptors on HELLO mean nothing: not kept
            header = ev.header()
            name = header.get("name", "")
            if not isinstance(name, str) or len(name) > 255 or "\0" in name:
                raise RemoteProtocolError("HELLO name must be a string of <= 255 chars, no NUL")
            return name or "anonymous", header
    log.warning("dropping connection %s: no HELLO within %.1f s", who, limits.handshake_timeout)
    return None


def _receiver(stream: Stream, limits: Limits) -> Callable[[], Awaitable[tuple[bytes, list[int]]]]:
    """The receive call for the handshake (the reader loop uses a SocketReceiver)."""
    if isinstance(stream, trio.SSLStream):
        return tls_receiver(stream)
    sock = stream.socket
    ancsize = ancillary_size(limits.max_fds_per_message)

    def receive() -> Awaitable[tuple[bytes, list[int]]]:
        return receive_with_fds(sock, RECEIVE_SIZE, ancsize)

    return receive


def tls_receiver(
    ssl_stream: trio.SSLStream[trio.SocketStream],
) -> Callable[[], Awaitable[tuple[bytes, list[int]]]]:
    """The receive call for a TLS stream: the decrypted bytes (no descriptors can
    come over TCP). Sockets use :class:`SocketReceiver`."""

    async def receive_tls() -> tuple[bytes, list[int]]:
        try:
            data = await ssl_stream.receive_some(RECEIVE_SIZE)
        except trio.BrokenResourceError as exc:
            # A client that closes without close_notify is just a disconnect.
            if isinstance(exc.__cause__, ssl.SSLError) and "EOF" in str(exc.__cause__):
                return b"", []
            raise
        return bytes(data), []

    return receive_tls


async def send_eof(stream: Stream) -> None:
    """Close our sending side: a socket's shutdown(SHUT_WR); TLS has no half-close, so
    there the connection is left for aclose (close_notify) to end."""
    if isinstance(stream, trio.SocketStream):
        with translate_socket_errors():
            await stream.send_eof()


async def send_final(stream: Stream, code: ErrorCode, message: str, data: object = None) -> None:
    """Best effort: tell the peer why we close (it may be gone already)."""
    frame = connection_error_frame(code, message)
    if data is not None:
        frame = encode_frame(
            FrameType.ERROR,
            header=encode_cbor({"code": str(code), "message": message}),
            body=encode_cbor(data),
        )
    try:
        with translate_socket_errors():
            await stream.send_all(b"".join(frame))
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
        pass


#: Longest a refused connection is kept open to let the client read our ERROR.
_LINGER_TIME = 0.5
_LINGER_BYTES = 64 * 1024


async def linger(stream: Stream) -> None:
    """Close our side, then read and discard what the client still sends (its HELLO) for a
    moment, so it gets our ERROR instead of EPIPE on its write (a "lingering close").
    Bounded: at most ``_LINGER_BYTES`` bytes and ``_LINGER_TIME`` seconds."""
    got = 0
    with trio.move_on_after(_LINGER_TIME):
        try:
            await send_eof(stream)
            with translate_socket_errors():
                while got < _LINGER_BYTES:
                    data = await stream.receive_some(RECEIVE_SIZE)
                    if not data:
                        break
                    got += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass
