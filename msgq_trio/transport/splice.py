"""The broker's zero-copy path for large frames: the rest of a frame moved from the
sender's socket into pipes and from the pipes into the receiver's socket with
``splice(2)``, so the kernel passes page references instead of copying the bytes into
the broker and out again.

Why: a large frame through the broker cost two kernel copies there (receive, send), the
largest part of the broker's CPU per 4 MiB message (BENCHMARKS.md, "Large frames
spliced through the broker"). Unix stream sockets support ``splice`` in both directions
without copying on Linux 6.5 and later; on older kernels it still works, with copies.

A frame is spliced only once all of it is in the broker's pipes: a sender that dies in
the middle of a frame leaves nothing half-sent to a receiver, exactly as with buffers.

Resources: each :class:`PipeTail` holds pipes (two descriptors each, about 1 MiB of
kernel memory each at most) from the moment its frame starts arriving until the frame is
written to its receiver or dropped. :class:`PipeBudget` caps the pipes held by the whole
broker (``limits.splice_max_pipes``); a frame that cannot get one falls back to the
copying path, so the cap costs speed, never a message.
"""

from __future__ import annotations

import errno
import fcntl
import os

import trio

from .errors import translate_socket_errors, translated

#: Bytes asked for each pipe: Linux's default ``fs.pipe-max-size`` (what an unprivileged
#: process may ask for). A pipe holds as many bytes as its page slots take, at least this.
PIPE_SIZE = 1024 * 1024

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_FIONREAD = 0x541B  # Linux's FIONREAD (SIOCINQ): bytes waiting in a socket

#: True where this Python can splice (Linux, Python 3.10 and later).
AVAILABLE = hasattr(os, "splice")
#: errnos by which splice says it cannot work here at all (an old kernel without
#: splice for this kind of socket, a sandbox that forbids it), not that a socket failed.
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM})


class SpliceUnavailable(Exception):
    """No pipe could be had (the budget, ``EMFILE``, the per-user pipe quota): the caller
    takes the copying path instead."""


class PipeBudget:
    """How many pipes the broker may hold at once for large frames in flight."""

    __slots__ = ("held", "limit", "unsupported")

    def __init__(self, limit: int) -> None:
        #: ``limits.splice_max_pipes``.
        self.limit = limit
        #: Pipes open now (stats: ``splice_pipes``).
        self.held = 0
        #: Why splice cannot work in this process (the first such error), or "": then
        #: no pipe is handed out again and every large frame is copied.
        self.unsupported = ""


class PipeTail:
    """The rest of one frame held in pipes: what the parser did not receive into memory.

    Filled by :meth:`fill_from` (from the sender's socket), emptied by :meth:`drain_to`
    (into one receiver's socket). :meth:`materialize` turns it into ``bytes`` (one copy)
    for a frame going to several receivers or to one that cannot take a splice (TCP,
    TLS); it then holds no pipe. ``len()`` is its size in bytes either way.

    The owner must call :meth:`close` (idempotent) once the tail is written or dropped;
    it closes whatever pipes are left.
    """

    __slots__ = ("_budget", "_out", "_pipes", "data", "size", "taken")

    def __init__(self, budget: PipeBudget) -> None:
        self._budget = budget
        # [read_fd, write_fd, bytes in it, full], in order; the last one is being filled.
        self._pipes: list[list[int]] = []
        self._out = 0  # pipes already drained and closed
        #: Bytes spliced in (the frame's rest, once complete).
        self.size = 0
        #: The bytes, once :meth:`materialize` read them out of the pipes.
        self.data: bytes | None = None
        #: Set by the broker's core once a receiver's queue holds this tail.
        self.taken = False

    def __len__(self) -> int:
        return self.size

    @property
    def pipes(self) -> int:
        """Pipes held now."""
        return len(self._pipes) - self._out

    def piece(self) -> PipeTail | bytes:
        """What a receiver's queue gets: this tail (to be spliced), or its bytes once
        materialized."""
        return self if self.data is None else self.data

    def _new_pipe(self) -> None:
        budget = self._budget
        if budget.unsupported:
            raise SpliceUnavailable(budget.unsupported)
        if budget.held >= budget.limit:
            raise SpliceUnavailable("splice_max_pipes reached")
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SpliceUnavailable(f"no pipe: {exc}") from exc
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
        except OSError as exc:
            # EPERM: the user's pipe quota (fs.pipe-user-pages-soft) is spent; a default
            # pipe of 64 KiB would take a syscall per 64 KiB: copying does better.
            os.close(r)
            os.close(w)
            raise SpliceUnavailable(f"pipe size refused: {exc}") from exc
        self._pipes.append([r, w, 0, 0])
        budget.held += 1

    def fill_from(self, sock_fd: int, want: int) -> int:
        """Move up to ``want`` bytes from the socket into the pipes without blocking:
        the bytes moved (at least 1), 0 at EOF.

        Raises:
            BlockingIOError: nothing is waiting in the socket.
            SpliceUnavailable: the pipes are full and no other pipe can be had, or splice
                cannot work here (then :attr:`PipeBudget.unsupported` says why).
            trio.BrokenResourceError: the socket failed.
        """
        retried = False
        while True:
            if not self._pipes or self._pipes[-1][3] or self._pipes[-1][2] >= PIPE_SIZE:
                self._new_pipe()
            pipe = self._pipes[-1]
            try:
                n = os.splice(sock_fd, pipe[1], want, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                # Either the socket was empty or this pipe's slots are full.
                if not _waiting(sock_fd):
                    raise
                if not retried:
                    # Bytes may have come between the splice and the check; once they
                    # are there they stay (only this task reads the socket), so a
                    # second refusal means the pipe is full.
                    retried = True
                    continue
                retried = False
                if pipe[2] == 0:
                    raise SpliceUnavailable("an empty pipe took nothing") from None
                pipe[3] = 1  # full: the next round takes a new pipe
                continue
            except OSError as exc:
                self._unsupported(exc)
                raise translated(exc) from exc
            pipe[2] += n
            self.size += n
            return n

    def drain_to(self, sock_fd: int) -> int:
        """Move bytes from the pipes into the socket without blocking: the bytes moved; 0
        once the tail is empty (then it holds no pipe).

        Raises:
            BlockingIOError: the socket is full.
            SpliceUnavailable: splice cannot write into this socket (see :meth:`fill_from`);
                what is left can still be had with :meth:`materialize`.
            trio.BrokenResourceError: the socket failed (the receiver went away).
        """
        while self._out < len(self._pipes):
            pipe = self._pipes[self._out]
            if pipe[2] == 0:
                self._close_pipe(pipe)
                self._out += 1
                continue
            try:
                n = os.splice(pipe[0], sock_fd, pipe[2], flags=_SPLICE_FLAGS)
            except BlockingIOError:
                raise
            except OSError as exc:
                self._unsupported(exc)
                raise translated(exc) from exc
            pipe[2] -= n
            return n
        return 0

    def _unsupported(self, exc: OSError) -> None:
        """Raise SpliceUnavailable (and remember why, for good) if ``exc`` says splice
        cannot work here at all."""
        if exc.errno in _UNSUPPORTED:
            self._budget.unsupported = f"splice(2) failed: {exc}"
            raise SpliceUnavailable(self._budget.unsupported) from exc

    def materialize(self) -> None:
        """Read the pipes into :attr:`data` (one copy) and close them. Idempotent.
        Never blocks: the whole tail is in the pipes by then."""
        if self.data is not None:
            return
        parts = []
        for pipe in self._pipes[self._out :]:
            left = pipe[2]
            while left:
                chunk = os.read(pipe[0], left)
                if not chunk:
                    break  # (cannot happen: the write end is ours and open)
                parts.append(chunk)
                left -= len(chunk)
            pipe[2] = 0
        self.data = b"".join(parts)
        self.close()

    def close(self) -> None:
        """Close every pipe still held. Idempotent."""
        while self._out < len(self._pipes):
            self._close_pipe(self._pipes[self._out])
            self._out += 1

    def _close_pipe(self, pipe: list[int]) -> None:
        os.close(pipe[0])
        os.close(pipe[1])
        self._budget.held -= 1


def _waiting(sock_fd: int) -> int:
    """Bytes waiting in socket ``sock_fd`` (0 on error: treated as empty)."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(sock_fd, _FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, "little")


async def splice_out(stream: trio.SocketStream, tail: PipeTail) -> None:
    """Write ``tail`` into ``stream`` (the receiver's socket) and close it. Where splice
    cannot write into the socket, the rest is read out of the pipes and sent.

    Raises:
        trio.BrokenResourceError: the receiver went away (the tail is closed anyway).
        trio.Cancelled: passes through (the tail is closed anyway).
    """
    sock = stream.socket
    fd = sock.fileno()
    try:
        while True:
            try:
                n = tail.drain_to(fd)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            except SpliceUnavailable:
                tail.materialize()
                assert tail.data is not None
                with translate_socket_errors():
                    await stream.send_all(tail.data)
                return
            if not n:
                return
            # One schedule point per piece: other connections' traffic interleaves with a
            # large frame, as it does with the buffered path.
            await trio.lowlevel.checkpoint()
    finally:
        tail.close()


__all__ = ["AVAILABLE", "PIPE_SIZE", "PipeBudget", "PipeTail", "SpliceUnavailable", "splice_out"]
