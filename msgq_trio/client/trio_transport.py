"""The trio driver's transports: a Unix socket, TCP, or TLS through a local socket
pair (the TLS session runs in two copy tasks, and the driver reads and writes a plain
socket whatever the transport)."""

from __future__ import annotations

import socket as pysocket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..errors import ConnectError
from ..transport.fdpass import RECEIVE_SIZE
from ..transport.tls import client_context_from_env
from .address import parse_address

__all__ = ["open_transport"]


async def _pump(source: trio.abc.ReceiveStream, sink: trio.abc.HalfCloseableStream | Any) -> None:
    """Copy bytes until EOF, then pass the EOF on (TLS bridge, see _open_transport)."""
    try:
        while True:
            data = await source.receive_some(RECEIVE_SIZE)
            if not data:
                break
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    if isinstance(sink, trio.SocketStream):
        try:
            await sink.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    else:
        await trio.aclose_forcefully(sink)


@asynccontextmanager
async def open_transport(
    target: str, ssl_context: Any, server_hostname: str | None
) -> AsyncIterator[tuple[trio.SocketStream, bool]]:
    """A socket stream to the broker and whether it is a TCP one.

    For ``tls://`` the TLS session runs in two copy tasks between the network and one end
    of a local socket pair, and the Bus gets the other end: the Bus's reader and writer
    work on a plain socket (recvmsg, direct writes) whatever the transport.

    Raises:
        ConnectError: cannot connect, or the TLS handshake failed.
        UsageError: a malformed address, or a TLS file of the environment unusable.
    """
    if not target.startswith(("tcp://", "tls://")):
        path = target
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to the broker at {path}: {exc.strerror or exc}"
            ) from exc
        yield stream, False
        return
    scheme, host, port = parse_address(target)
    ctx = None
    if scheme == "tls":  # before connecting: a context that cannot be built leaks nothing
        ctx = ssl_context if ssl_context is not None else client_context_from_env()
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise ConnectError(
            f"cannot connect to the broker at {target}: {exc.strerror or exc}"
        ) from exc
    if ctx is None:
        yield tcp, True
        return
    tls = trio.SSLStream(tcp, ctx, server_hostname=server_hostname or host)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tls)
        raise ConnectError(
            f"TLS handshake with the broker at {target} failed: {exc.__cause__ or exc}"
        ) from exc
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    a, b = trio.socket.socketpair(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    inner, outer = trio.SocketStream(a), trio.SocketStream(b)
    body_error: Exception | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, tls, outer)
            nursery.start_soon(_pump, outer, tls)
            try:
                yield inner, True
            except Exception as exc:
                body_error = exc  # re-raised outside the nursery (no ExceptionGroup)
            nursery.cancel_scope.cancel()
    finally:
        # Shielded: closing the bus cancels the task that runs the connection, and an
        # await under that cancel would skip the closes after it.
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(inner)
            await trio.aclose_forcefully(outer)
            await trio.aclose_forcefully(tls)
    if body_error is not None:
        raise body_error
