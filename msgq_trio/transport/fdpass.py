"""The trio-free part of the socket toolkit: descriptors in and out of ``recvmsg``'s
ancillary data, and the unsent-byte query a closing client waits on.

Plain stdlib (``socket``, ``fcntl``): :mod:`.sockets` (trio) re-exports these for the
broker and the trio client, and the asyncio driver, which must not import trio, imports
them from here (``tests/test_layering.py``).
"""

from __future__ import annotations

import array
import fcntl
import socket as pysocket
import termios

from ..protocol.codes import ErrorCode
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import close_fds

__all__ = [
    "RECEIVE_SIZE",
    "SEND_BUFFER",
    "ancillary_size",
    "close_fds",
    "take_fds",
    "unconsumed_bytes",
]

_FD_SIZE = array.array("i").itemsize
#: Bytes one client receive asks the kernel for (every client driver).
RECEIVE_SIZE = 256 * 1024
#: Bytes one client receive may put straight into a large frame's own buffer (the trio
#: and asyncio drivers; ``Connection.receive_buffer``). A receive gets what the socket
#: holds, about the broker's SO_SNDBUF (1 MiB); capped at ``RECEIVE_SIZE`` it took four
#: receives, each a pass of the event loop, per MiB of a 4 MiB message
#: (BENCHMARKS.md, "The client's per-message path"). The broker keeps its own cap (its
#: ``RECEIVE_SIZE``) for fairness between connections; a client's receive delays only
#: the client's own tasks, by at most one copy of what its socket held.
RECEIVE_INTO_SIZE = 4 * 1024 * 1024
#: SO_SNDBUF asked for a client's socket: the bytes in flight towards the broker. Same
#: default and reason as the broker's ``Limits.socket_send_buffer`` (1 MiB; the kernel's
#: 208 KiB default costs a wakeup per 208 KiB of a large frame).
SEND_BUFFER = 1024 * 1024


def ancillary_size(max_fds: int) -> int:
    """recvmsg ancillary buffer for up to ``max_fds`` descriptors in one receive."""
    return pysocket.CMSG_SPACE(max_fds * _FD_SIZE)


def take_fds(anc: list[tuple[int, int, bytes]], flags: int) -> list[int]:
    """The descriptors in recvmsg's ancillary data (we own them from here on).

    Raises:
        RemoteProtocolError: the ancillary buffer was too small (MSG_CTRUNC); the
            descriptors that did arrive are closed.
    """
    fds: list[int] = []
    for level, kind, cdata in anc:
        if level == pysocket.SOL_SOCKET and kind == pysocket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(cdata[: len(cdata) - len(cdata) % _FD_SIZE])
            fds.extend(arr)
    if flags & pysocket.MSG_CTRUNC:
        close_fds(fds)
        raise RemoteProtocolError(
            "peer sent more file descriptors in one message than max_fds_per_message",
            ErrorCode.LIMIT_EXCEEDED,
        )
    return fds


def unconsumed_bytes(fd: int) -> int:
    """Bytes written to socket ``fd`` that its peer has not taken yet (SIOCOUTQ: on a
    Unix stream socket, what the receiver has not read; on TCP, what is unsent or
    unacknowledged); 0 if it cannot tell. A closing client waits while this shrinks."""
    try:
        buf = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return array.array("i", buf)[0]
