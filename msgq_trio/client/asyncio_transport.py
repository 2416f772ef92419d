"""The asyncio driver's transports: a Unix socket, TCP, or TLS through a local socket
pair (asyncio's TLS runs in two copy tasks, and the driver reads and writes a plain
socket whatever the transport, as the trio driver does). No trio."""

from __future__ import annotations

import asyncio
import contextlib
import socket as pysocket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..errors import ConnectError
from ..transport.fdpass import RECEIVE_SIZE  # no trio
from ..transport.tls import client_context_from_env  # ssl only: no trio
from .address import parse_address
from .session import CLOSE_WAIT

__all__ = ["open_transport"]


async def _open_tcp(host: str, port: int, target: str) -> pysocket.socket:
    """A connected non-blocking TCP socket to ``host:port`` (each address in turn).

    Raises:
        ConnectError: no address could be reached.
    """
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=pysocket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectError(f"cannot connect to the broker at {target}: {exc}") from exc
    last: OSError | None = None
    for family, kind, proto, _name, addr in infos:
        sock = pysocket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(pysocket.IPPROTO_TCP, pysocket.TCP_NODELAY, 1)
        return sock
    raise ConnectError(f"cannot connect to the broker at {target}: {last}")


async def _pump_in(reader: asyncio.StreamReader, sock: pysocket.socket) -> None:
    """TLS bridge, network to the bus's socket pair: copy until EOF, then pass it on."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(RECEIVE_SIZE):
            await loop.sock_sendall(sock, data)
        sock.shutdown(pysocket.SHUT_WR)


async def _pump_out(sock: pysocket.socket, writer: asyncio.StreamWriter) -> None:
    """TLS bridge, the bus's socket pair to the network: copy until EOF, then close."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, ConnectionError):
        while data := await loop.sock_recv(sock, RECEIVE_SIZE):
            writer.write(data)
            await writer.drain()
    writer.close()


@asynccontextmanager
async def open_transport(
    target: str, ssl_context: ssl.SSLContext | None, server_hostname: str | None
) -> AsyncIterator[tuple[pysocket.socket, bool]]:
    """A connected non-blocking socket to the broker and whether it is a TCP one.

    For ``tls://`` asyncio's TLS runs in two copy tasks between the network and one end
    of a local socket pair, and the bus gets the other end: the bus reads and writes a
    plain socket whatever the transport (as the trio client does).

    Raises:
        ConnectError: cannot connect, or the TLS handshake failed.
    """
    loop = asyncio.get_running_loop()
    if not target.startswith(("tcp://", "tls://")):
        sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, target)
        except OSError as exc:
            sock.close()
            raise ConnectError(
                f"cannot connect to the broker at {target}: {exc.strerror or exc}"
            ) from exc
        except BaseException:
            sock.close()
            raise
        try:
            yield sock, False
        finally:
            sock.close()
        return
    scheme, host, port = parse_address(target)
    if scheme == "tcp":
        sock = await _open_tcp(host, port, target)
        try:
            yield sock, True
        finally:
            sock.close()
        return
    # Built before connecting (a context that cannot be built leaks nothing), the same
    # way as the trio client's and the command line's.
    ctx = ssl_context if ssl_context is not None else client_context_from_env()
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ctx, server_hostname=server_hostname or host
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConnectError(f"TLS connection to the broker at {target} failed: {exc}") from exc
    inner, outer = pysocket.socketpair(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    inner.setblocking(False)
    outer.setblocking(False)
    pumps = [
        loop.create_task(_pump_in(reader, outer)),
        loop.create_task(_pump_out(outer, writer)),
    ]
    try:
        yield inner, True
    finally:
        inner.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        outer.close()
        writer.close()
        # TLS says close_notify first; a broker that is gone must not hold us up.
        try:
            await asyncio.wait_for(writer.wait_closed(), CLOSE_WAIT)
        except (OSError, ConnectionError, ssl.SSLError, TimeoutError):
            writer.transport.abort()
