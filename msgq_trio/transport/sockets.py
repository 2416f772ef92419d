"""Socket receive/send shared by the broker and the clients: fd passing over SCM_RIGHTS,
the per-thread receive buffer, write batching, hang-up and unsent-byte queries.

Errors from socket calls are translated by :mod:`msgq_trio.transport.errors`; the
trio-free helpers (descriptors in ancillary data, the unsent-byte query) live in
:mod:`msgq_trio.transport.fdpass` and are re-exported here.
"""

from __future__ import annotations

import array
import contextlib
import select
import socket as pysocket
import threading
from collections.abc import Sequence

import trio

from ..protocol.connection import Connection
from ..protocol.framing import FdBuffer
from .errors import translate_socket_errors, translated
from .fdpass import ancillary_size, close_fds, take_fds, unconsumed_bytes
from .splice import PipeTail, splice_out

# The fdpass helpers are re-exported: the broker and the trio client take them from here
# with the rest.
__all__ = [
    "FD_DRAIN_MAX_FDS",
    "FD_DRAIN_ROUNDS",
    "NO_JOIN",
    "Buffer",
    "SocketReceiver",
    "ancillary_size",
    "close_fds",
    "coalesce",
    "hung_up",
    "receive_with_fds",
    "scratch_buffer",
    "send_buffers",
    "send_with_fds",
    "set_send_buffer",
    "take_fds",
    "unconsumed_bytes",
]

Buffer = bytes | bytearray | memoryview

_HANGUP_EVENTS = select.POLLRDHUP | select.POLLHUP | select.POLLERR


def hung_up(fd: int) -> bool:
    """Whether the peer of socket ``fd`` has closed its end, found without reading.

    For a connection whose reads are paused (backpressure): EOF sits behind unread data,
    so only the socket's poll state can tell that the client is gone. A closed
    descriptor also counts as hung up. Never blocks.
    """
    poller = select.poll()
    try:
        poller.register(fd, _HANGUP_EVENTS)
        events = poller.poll(0)
    except (OSError, ValueError):
        return True
    return any(ev & (_HANGUP_EVENTS | select.POLLNVAL) for _, ev in events)


def set_send_buffer(sock: pysocket.socket | trio.socket.SocketType, size: int) -> None:
    """Ask for an SO_SNDBUF of ``size`` bytes (0: keep the kernel's default).

    On a Unix stream socket the sender's buffer bounds the bytes in flight, so the default
    (208 KiB) makes a multi-megabyte frame cost a wakeup per 208 KiB on each hop (see
    ``Limits.socket_send_buffer``). The kernel caps the value at ``net.core.wmem_max``
    without an error; a failure to set it is not worth failing a connection over.
    """
    if size:
        with contextlib.suppress(OSError):
            sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_SNDBUF, size)


#: Buffers at least this large are sent as they are instead of being copied into a join.
NO_JOIN = 64 * 1024


def coalesce(bufs: Sequence[Buffer | PipeTail]) -> list[Buffer | PipeTail]:
    """Join runs of small buffers into one; pass large ones through without copying."""
    out: list[Buffer | PipeTail] = []
    run: list[Buffer] = []
    for b in bufs:
        if isinstance(b, PipeTail) or len(b) >= NO_JOIN or type(b) is FdBuffer:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(b)
        else:
            run.append(b)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


#: Most extra receives taken without waiting after one that brought descriptors. Linux
#: ends a recvmsg at every message that carries descriptors, so without this a burst of
#: them costs one trio wake-up (an ``epoll_wait`` and a scheduler pass) per message.
FD_DRAIN_ROUNDS = 64

#: The drain stops once this many descriptors are taken. Why: descriptors received but
#: not yet parsed are charged to no receiver (``max_fds_queued`` and the user quota count
#: what is queued for delivery), so a sender whose frame is held keeps these open in the
#: broker beside the receivers' bounds. Counting rounds alone would let one receive take
#: 65 messages of 253 descriptors each. The same figure as the rounds: a burst of
#: one-descriptor messages still costs one wake-up per 64.
FD_DRAIN_MAX_FDS = 64


def _raw_view(sock: trio.socket.SocketType) -> pysocket.socket:
    """A stdlib socket object on ``sock``'s descriptor, for non-blocking calls that skip
    trio's checkpoint. The caller must ``detach()`` it (closing it would close ``sock``)."""
    return pysocket.socket(sock.family, sock.type, sock.proto, sock.fileno())


async def receive_with_fds(
    sock: trio.socket.SocketType, nbytes: int, ancbufsize: int
) -> tuple[bytes, list[int]]:
    """Receive bytes and any descriptors sent with them (close-on-exec set).

    Linux never merges two descriptor-carrying sendmsgs into one receive, so when
    descriptors arrive, up to ``FD_DRAIN_ROUNDS`` more receives are made at once without
    waiting (up to ``nbytes`` in all), stopping once ``FD_DRAIN_MAX_FDS`` descriptors are
    taken: one call returns at most that many plus those of one message. The descriptors
    are returned in arrival order, which is the order of the frames that declare them.

    Raises:
        RemoteProtocolError: the peer sent more descriptors than ``ancbufsize`` holds (the
            kernel discarded the rest, so the stream can no longer be trusted); every
            descriptor received by this call is closed.
        trio.BrokenResourceError: the socket failed.
    """
    with translate_socket_errors():
        data, anc, flags, _addr = await sock.recvmsg(nbytes, ancbufsize, pysocket.MSG_CMSG_CLOEXEC)
    fds = take_fds(anc, flags)
    if not fds or len(data) >= nbytes:
        return data, fds
    raw = _raw_view(sock)
    try:
        return _drain_fds(raw, data, fds, nbytes, ancbufsize)
    finally:
        raw.detach()


def _drain_fds(
    raw: pysocket.socket,
    data: bytes | memoryview,
    fds: list[int],
    nbytes: int,
    ancbufsize: int,
) -> tuple[bytes, list[int]]:
    """Descriptors arrived with ``data``: read what else is queued at once (see
    :func:`receive_with_fds`). Closes every descriptor on error."""
    chunks: list[bytes | memoryview] = [data]
    total = len(data)
    try:
        for _ in range(FD_DRAIN_ROUNDS):
            if len(fds) >= FD_DRAIN_MAX_FDS:
                break
            try:
                more, anc, flags, _addr = raw.recvmsg(
                    nbytes - total, ancbufsize, pysocket.MSG_CMSG_CLOEXEC | pysocket.MSG_DONTWAIT
                )
            except OSError:
                # Nothing more queued (EAGAIN), or an error the next receive reports
                # through translate_socket_errors like any other.
                break
            if not more:
                break  # EOF: a stream socket reports it again on the next receive
            chunks.append(more)
            total += len(more)
            fds.extend(take_fds(anc, flags))
            if total >= nbytes:
                break
    except BaseException:
        close_fds(fds)
        raise
    return b"".join(chunks), fds


class SocketReceiver:
    """Receives from one stream socket with one schedule point and one ``recvmsg`` per
    wakeup: the same results as :func:`receive_with_fds`, for a connection's reader loop.

    Why: trio's ``sock.recvmsg`` first tries the call, and a reader that has drained its
    socket gets ``EAGAIN`` (an exception) before it parks, so every small message costs two
    syscalls, an exception and trio's retry machinery. Here a receive that came back short
    (the socket is drained) makes the next call wait for readability first; a full one
    makes it yield (``checkpoint``) and read at once. For a request/reply ping-pong that
    is a fifth of each hop's Python work.

    The bytes come back as a ``memoryview`` into the thread's scratch buffer (see
    :func:`scratch_buffer`): valid only until the caller's next ``await``, when another receive
    in this thread may overwrite it. The caller must hand it to something that copies
    (``Connection.receive_data``: the parser appends it to its own buffer) before it
    yields. Why: a ``bytes`` copy of every receive was a copy the parser made again, and
    for a large frame a fresh 256 KiB object (and its page faults) per read.

    The receiver holds a second socket object on the same descriptor: the owner must call
    :meth:`close` (it only detaches; the trio socket still owns the descriptor) before
    the trio socket is closed. Cancellation passes through (both awaits are checkpoints).
    """

    __slots__ = ("_ancbufsize", "_drained", "_into_nbytes", "_nbytes", "_raw", "_sock")

    def __init__(
        self, sock: trio.socket.SocketType, nbytes: int, ancbufsize: int, into_nbytes: int = 0
    ) -> None:
        self._sock = sock
        self._raw = _raw_view(sock)
        self._nbytes = nbytes
        # At most this much per receive into a caller's buffer (``nbytes`` if 0).
        self._into_nbytes = into_nbytes or nbytes
        self._ancbufsize = ancbufsize
        self._drained = True

    async def receive(self, into: memoryview | None = None) -> tuple[bytes | memoryview, list[int]]:
        """Like :func:`receive_with_fds` (same errors; empty at EOF), but the data is a
        view valid until the caller's next ``await`` (see the class docstring).

        ``into``: receive into this buffer instead (a large frame's own buffer,
        ``Connection.receive_buffer``); the data is then a view of it. At most
        ``into_nbytes`` go in per call there (``nbytes`` unless the owner gave another).
        The broker keeps ``nbytes``: a receive of all a sender's socket holds (up to
        2 MiB) makes every other connection's small calls wait for that copy while a
        large frame passes (scenario big-message-64mib bounds their worst latency); a
        client's receive delays only its own tasks (``RECEIVE_INTO_SIZE``).
        """
        raw = self._raw
        if self._sock.fileno() == -1:  # closed while we were away: the number may be reused
            raise trio.ClosedResourceError("socket was closed")
        if self._drained:
            await trio.lowlevel.wait_readable(raw)
        else:
            await trio.lowlevel.checkpoint()
        while True:
            try:
                return self._receive_once(into)
            except BlockingIOError:
                pass
            await trio.lowlevel.wait_readable(raw)  # the readiness was spurious

    def _receive_once(self, into: memoryview | None) -> tuple[bytes | memoryview, list[int]]:
        """One ``recvmsg`` (see :meth:`receive`). Raises BlockingIOError when nothing is
        queued, trio.ClosedResourceError for a closed socket, translated OSErrors."""
        # The trio socket may have been closed while we waited, and its descriptor
        # number reused by another connection: never touch it then.
        if self._sock.fileno() == -1:
            raise trio.ClosedResourceError("socket was closed")
        raw, nbytes, ancbufsize = self._raw, self._nbytes, self._ancbufsize
        view = scratch_buffer(nbytes) if into is None else into[: self._into_nbytes]
        try:
            n, anc, flags, _addr = raw.recvmsg_into((view,), ancbufsize, _RECV_FLAGS)
        except BlockingIOError:
            raise
        except OSError as exc:
            raise translated(exc) from exc
        data = view[:n]
        self._drained = n < len(view)
        if not anc:
            return data, []
        fds = take_fds(anc, flags)
        if fds and into is None and n < nbytes:
            return _drain_fds(raw, data, fds, nbytes, ancbufsize)
        return data, fds

    @property
    def drained(self) -> bool:
        """The last receive emptied the socket: the next :meth:`receive` waits for it."""
        return self._drained

    def receive_now(self, conn: Connection) -> int | None:
        """Receive what is queued, without waiting, and hand it to ``conn``: the number of
        bytes; None when nothing is queued; 0 when the rest is for :meth:`receive_into`:
        the stream ended (not passed on: the kernel reports it again to the next
        receive) or ``conn`` is in the middle of a frame (large frames are received in
        place). Never a checkpoint. Same errors as :meth:`receive_into`."""
        if conn.in_frame:
            return 0
        try:
            data, fds = self._receive_once(None)
        except BlockingIOError:
            return None
        if data:
            conn.receive_data(data, fds)
        return len(data)

    async def receive_into(self, conn: Connection) -> int:
        """Receive once and hand what came to ``conn``: in place, into the buffer of the
        large frame it is assembling (``Connection.receive_buffer``: no copy), else via
        ``conn.receive_data`` (which copies from the scratch buffer). Returns the number
        of bytes received, 0 at EOF (``conn`` knows it too). Same errors as
        :meth:`receive`, and those of ``conn`` (a protocol error); if the receive fails
        or is cancelled, the lent buffer is given back with nothing received.
        """
        target = conn.receive_buffer()
        if target is None:
            data, fds = await self.receive()
            conn.receive_data(data, fds)
            return len(data)
        try:
            data, fds = await self.receive(target)
        except BaseException:
            target.release()
            conn.return_buffer()
            raise
        n = len(data)
        if isinstance(data, memoryview):
            data.release()  # a slice of the frame's buffer: it cannot grow while one lives
        target.release()
        conn.received_into(n, fds)
        return n

    def close(self) -> None:
        """Let go of the descriptor (without closing it). Idempotent."""
        if self._raw.fileno() != -1:
            self._raw.detach()


_RECV_FLAGS = pysocket.MSG_CMSG_CLOEXEC | pysocket.MSG_DONTWAIT

_scratch_local = threading.local()


def scratch_buffer(nbytes: int) -> memoryview:
    """This thread's receive buffer of at least ``nbytes`` bytes (one per thread, reused).

    Why: ``recvmsg(256 KiB)`` allocates a 256 KiB object for every receive and shrinks
    it to what arrived. Above glibc's mmap threshold that is mmap + mremap + munmap and a
    fresh page fault per receive: three of a broker hop's seven syscalls (strace of the
    request/reply workload). Receiving into one reused buffer costs nothing of the kind,
    and the parser copies what came into its own buffer anyway. Safe to share within a
    thread: every user hands the bytes to the parser (which copies) before it can yield.
    """
    view: memoryview | None = getattr(_scratch_local, "view", None)
    if view is None or len(view) < nbytes:
        view = memoryview(bytearray(nbytes))
        _scratch_local.view = view
    return view


async def send_with_fds(stream: trio.SocketStream, data: FdBuffer) -> None:
    """Send ``data`` with its descriptors attached to its first byte, then the rest."""
    with translate_socket_errors():
        n = await stream.socket.sendmsg(
            [data], [(pysocket.SOL_SOCKET, pysocket.SCM_RIGHTS, array.array("i", data.fds))]
        )
        if n < len(data):
            await stream.send_all(memoryview(data)[n:])


def _send_fds_now(raw: pysocket.socket, data: FdBuffer) -> int:
    """Try to send ``data`` with its descriptors without waiting; bytes sent (0: none,
    the socket is full). Other errors are raised as ``OSError`` for the caller to
    translate."""
    try:
        return raw.sendmsg(
            [data],
            [(pysocket.SOL_SOCKET, pysocket.SCM_RIGHTS, array.array("i", data.fds))],
            pysocket.MSG_DONTWAIT,
        )
    except BlockingIOError:
        return 0


async def send_buffers(stream: trio.abc.SendStream, bufs: Sequence[Buffer | PipeTail]) -> None:
    """Write queued buffers: small ones joined, large ones as they are, FdBuffers with
    their descriptors (which are closed here, sent or not: the kernel holds its own
    references to sent ones), PipeTails spliced from their pipes (closed here too)."""
    raw: pysocket.socket | None = None
    try:
        for chunk in coalesce(bufs):
            if type(chunk) is FdBuffer:
                # Only socket streams carry descriptors (the core never queues them for
                # a TCP or TLS peer).
                assert isinstance(stream, trio.SocketStream)
                # A run of descriptor-carrying frames cannot be joined (one SCM_RIGHTS
                # per sendmsg), so send each without a trio checkpoint while the socket
                # takes them, and fall back to waiting only when it is full.
                if raw is None:
                    raw = _raw_view(stream.socket)
                with translate_socket_errors():
                    n = _send_fds_now(raw, chunk)
                if n == 0:
                    await send_with_fds(stream, chunk)
                elif n < len(chunk):
                    with translate_socket_errors():
                        await stream.send_all(memoryview(chunk)[n:])
            elif isinstance(chunk, PipeTail):
                # A large frame's rest spliced through the broker (transport/splice.py);
                # only a Unix socket stream's queue gets one (the core sees to it).
                assert isinstance(stream, trio.SocketStream)
                await splice_out(stream, chunk)
            else:
                with translate_socket_errors():
                    await stream.send_all(chunk)
    finally:
        if raw is not None:
            raw.detach()
        for b in bufs:
            if type(b) is FdBuffer:
                close_fds(b.fds)
            elif isinstance(b, PipeTail):
                b.close()
