"""The one place where OSError from socket calls becomes Trio's resource-error vocabulary."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

import trio

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
