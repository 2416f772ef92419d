"""Where a client connects and what it says in HELLO: the address (a Unix path, or a
``tcp://``/``tls://`` URL), the client's name and the TCP credential. Shared by every
driver; no I/O."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..config import default_socket_path
from ..errors import UsageError

__all__ = ["client_name", "connect_target", "hello_extra", "parse_address"]


def parse_address(address: str) -> tuple[str, str, int]:
    """``tcp://HOST:PORT`` / ``tls://HOST:PORT`` -> (scheme, host, port).

    Raises:
        UsageError: not such a URL (the caller's address is malformed).
    """
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if scheme not in ("tcp", "tls") or not sep or not host or not port.isdigit():
        raise UsageError(f"bus address {address!r} must be tcp://HOST:PORT or tls://HOST:PORT")
    return scheme, host, int(port)


def connect_target(socket: str | os.PathLike[str] | None) -> str:
    """The address ``connect()`` dials: ``socket``, else ``$MSGQ_TRIO_SOCKET`` (a path or
    a ``tcp://``/``tls://`` URL), else the per-user path
    (:func:`msgq_trio.config.default_socket_path`)."""
    if socket is not None:
        return os.fspath(socket)
    return os.environ.get("MSGQ_TRIO_SOCKET", "") or str(default_socket_path())


def client_name(name: str | None) -> str:
    """The name sent in HELLO: ``name``, else the program's file name."""
    return name or Path(sys.argv[0] or "client").name


def hello_extra(remote: bool, token: str | None) -> dict[str, object]:
    """HELLO's fields beyond the name: over TCP the credential (``token``, else
    ``$MSGQ_TRIO_TOKEN``); nothing on a Unix socket (the kernel vouches for the peer)."""
    hello: dict[str, object] = {}
    if remote:
        tok = token if token is not None else os.environ.get("MSGQ_TRIO_TOKEN")
        if tok:
            hello["token"] = tok
    return hello
