"""The one place an ``OSError`` from a socket call becomes trio's resource-error vocabulary.

``trio.ClosedResourceError``: we closed the socket; ``trio.BrokenResourceError``: the peer
or the OS broke it. Everything in :mod:`msgq_trio.transport` and its users (the broker's
I/O and every client driver) translates through here, ``raise ... from exc``.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

import trio

#: accept() errors that mean "out of resources right now": log, back off, keep serving.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def translated(exc: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    """The trio error an ``OSError`` from a socket call stands for: ClosedResourceError
    when the descriptor is gone (we closed it), else BrokenResourceError (the peer or the
    OS broke the resource). The caller raises it ``from exc``."""
    if exc.errno in (errno.EBADF, errno.ENOTSOCK):
        return trio.ClosedResourceError("socket was closed")
    return trio.BrokenResourceError(f"socket error: {exc}")


@contextlib.contextmanager
def translate_socket_errors() -> Iterator[None]:
    """Turn OSError into trio.BrokenResourceError (the peer or the OS broke the resource).

    ``trio.ClosedResourceError`` (we closed it) and ``trio.Cancelled`` pass through untouched.
    Hot paths call :func:`translated` in a plain ``except`` instead (a generator-based
    context manager costs a few microseconds per use).
    """
    try:
        yield
    except OSError as exc:
        raise translated(exc) from exc
