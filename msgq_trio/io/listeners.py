"""The broker's listeners and who connects: the Unix socket file (path, mode, group), TCP
and TLS listeners, the accept loop, peer credentials and TCP authentication.

Nothing here routes: a connection is admitted (or refused) before the core sees it.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import socket as pysocket
import ssl
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from ..config import TcpSettings
from ..core.access import check_token
from ..transport.errors import ACCEPT_CAPACITY_ERRNOS, translate_socket_errors

log = logging.getLogger("msgq_trio.io")

_PEERCRED = struct.Struct("3i")

#: What the accept loops hand to the server: a Unix or TCP socket stream, or a TLS
#: stream over a TCP one.
Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


class BrokerAlreadyRunning(RuntimeError):
    """A live broker already answers on the socket path."""


def server_ssl_context(tcp: TcpSettings) -> ssl.SSLContext:
    """The TLS context of the TCP listeners (TLS 1.2 at least).

    With ``client_ca`` the broker asks for a client certificate (CERT_OPTIONAL, so token
    clients still connect; a certificate that is presented but does not verify fails the
    handshake), with ``require_client_cert`` it insists on one.

    Raises:
        OSError / ssl.SSLError: unreadable or invalid certificate, key or CA file.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tcp.certfile, tcp.keyfile)
    if tcp.client_ca:
        ctx.load_verify_locations(tcp.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if tcp.require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except (KeyError, OverflowError):
        return str(gid)


def unix_principals(uid: int, gid: int) -> list[str]:
    """The identities the access policy matches for a Unix client with SO_PEERCRED
    ``uid``/``gid``: ``unix:USER``, ``uid:N``, ``gid:N`` (the primary gid the kernel
    reports) and ``group:NAME`` for that gid and for every group of the user in the
    database, as a login gets them (``os.getgrouplist(user, passwd gid)``); a uid
    without a passwd entry has only the group of its gid. Names that the database does
    not know appear as numbers (``unix:1234``, ``group:1234``).

    The groups come from the database, not from the peer process: SO_PEERCRED carries no
    supplementary groups, so a process that dropped its groups with setgroups() still
    counts as in them, and one given extra groups by its parent does not (docs/SECURITY.md).
    Like the passwd lookup, these are NSS calls on the broker's thread, once per
    connection.
    """
    try:
        pw: pwd.struct_passwd | None = pwd.getpwuid(uid)
    except (KeyError, OverflowError):
        pw = None
    gids = [gid]
    if pw is not None:
        try:
            gids += os.getgrouplist(pw.pw_name, pw.pw_gid)
        except OSError:
            pass  # the database failed: the peer's own gid still stands
    groups = dict.fromkeys(f"group:{_group_name(g)}" for g in gids)
    user = pw.pw_name if pw is not None else str(uid)
    return [f"unix:{user}", f"uid:{uid}", f"gid:{gid}", *groups]


def peer_address(stream: Stream) -> str:
    """``host:port`` (``[v6]:port``) of a TCP client, "unix" or the path for a Unix one,
    "?" if the socket no longer knows."""
    sock = stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket
    try:
        addr = sock.getpeername()
    except OSError:
        return "?"
    if isinstance(addr, tuple):
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr) or "unix"


def _cert_common_name(stream: trio.SSLStream[trio.SocketStream]) -> str | None:
    """The subject CN of the client's verified certificate, or None if it sent none."""
    cert = stream.getpeercert()
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    return None


def prepare_socket_path(path: Path) -> None:
    """Create the socket's directory (mode 0700 when we create it) and clear a stale socket.

    Raises:
        BrokerAlreadyRunning: something accepts connections on ``path``.
        RuntimeError: ``path`` exists and is not a socket (we never delete other files).
    """
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.info("removing stale socket %s", path)
            path.unlink(missing_ok=True)
            return
        raise
    finally:
        probe.close()
    raise BrokerAlreadyRunning(f"a broker is already running on {path}")


def peer_credentials(stream: trio.SocketStream) -> tuple[int, int, int]:
    """(pid, uid, gid) of a Unix socket's peer (SO_PEERCRED, as of its connect());
    (-1, -1, -1) if the socket already failed."""
    try:
        with translate_socket_errors():
            pid, uid, gid = _PEERCRED.unpack(
                stream.socket.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_PEERCRED, _PEERCRED.size)
            )
    except trio.BrokenResourceError:
        return -1, -1, -1
    return pid, uid, gid


def authenticate(
    stream: Stream, header: dict[str, object], tokens: dict[str, str], who: str, name: str
) -> tuple[str | None, str]:
    """The identity of a TCP client: its token's name (``tokens``: see
    ``TcpSettings.tokens``), else its certificate's CN; or (None, why it was refused).

    A token that is present must be valid (a wrong token is refused even with a good
    certificate: the client meant to be someone). Refusals are logged at WARNING with
    the address; the token itself is never logged.
    """
    token = header.get("token")
    if token is not None:
        ident = check_token(token, tokens) if isinstance(token, str) else None
        if ident is None:
            log.warning("refusing %s (name=%r): invalid token", who, name)
            return None, "invalid token"
        return ident, ""
    if isinstance(stream, trio.SSLStream):
        cn = _cert_common_name(stream)
        if cn is not None:
            return cn, ""
    log.warning("refusing %s (name=%r): no token and no client certificate", who, name)
    return None, (
        "TCP clients must authenticate: a token in HELLO or a client certificate the broker trusts"
    )


def set_socket_permissions(path: Path, mode: int | None, gid: int | None) -> None:
    """Give the bound socket file ``path`` the group ``gid`` and the mode ``mode`` (None:
    leave as is).

    Raises:
        OSError: not allowed (a group the broker's user is not in), naming the setting.
    """
    try:
        if gid is not None:
            os.chown(path, -1, gid)
        if mode is not None:
            os.chmod(path, mode)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot set socket_group {gid} / socket_mode {mode and oct(mode)} on {path}: "
            f"{exc.strerror}",
        ) from exc


def _bound_address(sock: pysocket.socket | trio.socket.SocketType) -> str:
    bound = sock.getsockname()
    h = bound[0]
    return f"[{h}]:{bound[1]}" if ":" in h else f"{h}:{bound[1]}"


async def open_tcp(addr: str) -> tuple[list[trio.SocketListener], list[str]]:
    """Bind the listeners of one ``HOST:PORT`` (port 0: any free port); returns them and
    the ``host:port`` each is bound to."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    listeners = await trio.open_tcp_listeners(int(port), host=host, backlog=512)
    return listeners, [_bound_address(tl.socket) for tl in listeners]


def adopt_tcp(sock: pysocket.socket) -> tuple[trio.SocketListener, str]:
    """A TCP listener handed over by socket activation, and the ``host:port`` it is
    bound to. The listener owns ``sock`` from here on."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    return listener, _bound_address(sock)


def fd_connection_capacity(open_now: int) -> int | None:
    """How many connections the soft ``RLIMIT_NOFILE`` leaves room for, one descriptor
    each, at least 1; None when it is unlimited. ``open_now``: the descriptors the
    broker holds before its first client (stdio, epoll, wake-up, listeners, logs,
    plugins' pipes). On top of those an eighth of the limit (at most 32) is kept for
    what comes and goes: the spare of :class:`SpareFd`, refused connections while they
    are told why, a plugin restarting. Splice pipes and passed descriptors are not
    counted: pipes fall back to copying when descriptors run short, and a descriptor
    that does not fit is the :class:`SpareFd` path's to refuse."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(1, soft - open_now - min(32, soft // 8))


class SpareFd:
    """One descriptor held back (``/dev/null``) so that the accept loop can still take a
    connection when the process is out of descriptors and tell the client why before
    closing it, instead of leaving it in the backlog (where it would wait for nothing
    and make ``accept`` fail again at once): libev's and nginx's trick."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.acquire()

    def acquire(self) -> bool:
        """Hold the spare again (after :meth:`release`); False if none is free yet."""
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        return True

    def release(self) -> bool:
        """Give the spare up for one accept; False if it was not held."""
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True

    def close(self) -> None:
        self.release()


async def accept_loop(
    listener: trio.SocketListener,
    handlers: trio.Nursery,
    serve: Callable[[Stream, bool], Awaitable[None]],
    tcp: bool,
    spare: SpareFd | None = None,
    refuse: Callable[[Stream], Awaitable[None]] | None = None,
) -> None:
    """Accept on ``listener`` until it is closed, starting ``serve(stream, tcp)`` for each
    connection in ``handlers`` (a nursery apart from the accept task's, so that shutdown
    can stop accepting and still give connections their grace period).

    One connection per pass of the event loop (trio's ``accept`` is a checkpoint), so a
    flood of connects takes turns with the established clients' reads and never starves
    them.

    Running out of descriptors (EMFILE, ENFILE) with a ``spare`` and ``refuse``: the spare
    is given up for one accept, ``refuse(stream)`` tells that client why (it must be
    bounded in time: the next such refusal waits for it), the connection is closed and
    the spare taken back; so every client in the backlog hears why and the loop never
    spins on a connection it cannot take. Without a spare, or out of memory
    (``ACCEPT_CAPACITY_ERRNOS``), the error is logged and accepts pause for 100 ms: the
    broker keeps serving who is connected. Other accept errors propagate.
    """
    # A second handle on the listening socket (same open file, so non-blocking too) for
    # the synchronous accept of a refusal: between giving up the spare and accepting
    # nothing else may run, or another task could take the descriptor.
    raw = pysocket.socket(fileno=os.dup(listener.socket.fileno())) if spare and refuse else None
    refused = 0
    try:
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                emfile = exc.errno in (errno.EMFILE, errno.ENFILE)
                if emfile and raw and spare and refuse and spare.release():
                    waiting = True
                    try:
                        sock: pysocket.socket | None = raw.accept()[0]
                    except BlockingIOError:
                        sock = None
                        waiting = False  # accept() fails on an empty backlog too
                    except OSError:
                        sock = None  # ENFILE system-wide: pause below
                    if sock is not None:
                        # The refused socket holds the spare's place meanwhile; it is
                        # closed (and the spare back) before anything else can run.
                        refused_stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
                        try:
                            await refuse(refused_stream)
                        finally:
                            refused_stream.socket.close()
                            spare.acquire()
                        refused += 1
                        if refused == 1 or refused % 1000 == 0:
                            log.error(
                                "out of file descriptors (%s): refused %d connection(s) "
                                "so far; raise RLIMIT_NOFILE or lower max_connections",
                                exc.strerror,
                                refused,
                            )
                    if spare.acquire() and (sock is not None or not waiting):
                        if waiting:
                            await trio.lowlevel.checkpoint()
                        else:
                            await trio.lowlevel.wait_readable(raw)
                        continue
                log.error("accept() failed: %s; pausing accepts for 100 ms", exc)
                await trio.sleep(0.1)
                continue
            handlers.start_soon(serve, stream, tcp)
    finally:
        if raw is not None:
            raw.close()
