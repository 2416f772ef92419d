"""Socket helpers for broker and client: OSError translation (the one place), write batching."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

import trio

Buffer = bytes | bytearray | memoryview

#: accept() errors that mean "out of resources right now": log, back off, keep serving.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@contextlib.contextmanager
def translate_socket_errors() -> Iterator[None]:
    """Turn OSError into trio.BrokenResourceError (the peer or the OS broke the resource).

    ``trio.ClosedResourceError`` (we closed it) and ``trio.Cancelled`` pass through untouched.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.ENOTSOCK):
            raise trio.ClosedResourceError("socket was closed") from exc
        raise trio.BrokenResourceError(f"socket error: {exc}") from exc


#: Buffers at least this large are sent as they are instead of being copied into a join.
NO_JOIN = 64 * 1024


def coalesce(bufs: list[Buffer]) -> list[Buffer]:
    """Join runs of small buffers into one; pass large ones through without copying."""
    out: list[Buffer] = []
    run: list[Buffer] = []
    for b in bufs:
        if len(b) >= NO_JOIN:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(b)
        else:
            run.append(b)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out
