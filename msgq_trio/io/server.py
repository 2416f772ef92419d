"""The broker's I/O layer: listeners, one supervised task pair per connection, timers, shutdown.

The only broker module that imports trio. It feeds bytes to the sans-I/O connection,
hands frames to the pure core, and writes what the core queued. Shape (trio's
serve_listeners, hypercorn's trio server):

* an accept task, separate from the nursery that holds connection tasks;
* per connection: a reader (receive, parse every complete frame, ``core.handle``) and a
  writer (joins all queued frames into one ``send_all``: a trio call costs ~10 us, so a
  send per frame is ~30x slower);
* ``finally: aclose_forcefully`` plus ``core.disconnect`` on every exit path, so a clean
  close, a crash, a protocol violation or a kick all run the same cleanup;
* ``task_status.started(path)`` so tests and the CLI learn where the broker listens;
* graceful shutdown: GOODBYE to everyone, flush for ``shutdown_grace``, then cancel.
"""

from __future__ import annotations

import errno
import grp
import logging
import math
import os
import pwd
import socket as pysocket
import ssl
import stat
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from .. import __version__
from ..config import AccessSettings, Limits, TcpSettings
from ..core.access import check_token
from ..core.broker import Broker
from ..core.peers import Peer
from ..protocol.codes import PROTOCOL_VERSION, ErrorCode, FrameType
from ..protocol.connection import EOF, NEED_DATA, Connection, Role, connection_error_frame
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame, Run, encode_cbor, encode_frame
from ..transport.errors import ACCEPT_CAPACITY_ERRNOS, translate_socket_errors
from ..transport.sockets import (
    SocketReceiver,
    ancillary_size,
    close_fds,
    hung_up,
    receive_with_fds,
    send_buffers,
    set_send_buffer,
)

log = logging.getLogger("msgq_trio.io")

#: One receive takes up to this much: enough to parse thousands of small frames per
#: trio call; the kernel's AF_UNIX buffer is ~200 KiB by default.
RECEIVE_SIZE = 256 * 1024
#: The writer joins queued small frames up to this many bytes into one send_all.
WRITE_BATCH = 1024 * 1024
_PEERCRED = struct.Struct("3i")
_GOODBYE = FrameType.GOODBYE
#: Queues up to this size are written directly by _after_core when the writer is idle.
_DIRECT_SEND_MAX = 256 * 1024
#: Memory give-back (see Server._trim_task): look every TRIM_INTERVAL seconds, trim when
#: the resident size grew by TRIM_GROWTH bytes since the last trim.
TRIM_INTERVAL = 2.0
TRIM_GROWTH = 8 * 1024 * 1024
#: While a sender's reads are paused by backpressure its EOF sits behind unread data, so
#: the broker looks at the socket's poll state this often (one poll(2) of a few
#: microseconds): a client that dies while paused is dropped, and the calls pending on it
#: fail, within this time rather than when its receivers have drained (which can take
#: slow_consumer_timeout per receiver).
HANGUP_POLL_INTERVAL = 0.02


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None under another C library."""
    import ctypes

    try:
        fn: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return fn


#: What the accept loops hand to _serve_connection: a Unix or TCP socket stream, or a
#: TLS stream over a TCP one.
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


def _peer_address(stream: Stream) -> str:
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


class _HungUp(Exception):
    """A paused sender's client closed its socket (Server._await_progress)."""


class _Wakeup:
    """A level-triggered flag a single task waits on (cheaper than a new Event per wait)."""

    __slots__ = ("_lot", "flag")

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()
        self.flag = False

    def set(self) -> None:
        if not self.flag:
            self.flag = True
            self._lot.unpark_all()

    async def wait(self) -> None:
        """Wait until set, then clear. Always a checkpoint, so a waker cannot starve others."""
        if self.flag:
            self.flag = False
            await trio.lowlevel.checkpoint()
            return
        await self._lot.park()
        self.flag = False


class PeerConnection:
    """I/O state of one admitted client: its stream, writer wake-up and cancel scope."""

    def __init__(
        self,
        server: Server,
        peer: Peer,
        stream: Stream,
        conn: Connection,
        principals: list[str] | None = None,
    ) -> None:
        self.server = server
        self.peer = peer
        self.stream = stream
        self.conn = conn
        self.wake = _Wakeup()
        #: Unparked after every completed write: senders paused on this receiver re-check.
        self.progress = trio.lowlevel.ParkingLot()
        self.scope = trio.CancelScope()
        self.goodbye_sent = trio.Event()
        self.closing_reason: str | None = None
        self.final_error: tuple[ErrorCode, str] | None = None
        #: True while the writer task is inside send_all; otherwise the socket is free and
        #: _after_core may write to it directly (non-blocking), saving a task switch.
        self.writing = False
        #: -1 for TLS: bytes must go through the SSL object, never straight to the fd.
        self.fd = -1 if isinstance(stream, trio.SSLStream) else stream.socket.fileno()
        #: The socket's descriptor, also under TLS: only polled, for a hang-up while paused.
        self.sock_fd = (
            stream.transport_stream.socket.fileno()
            if isinstance(stream, trio.SSLStream)
            else self.fd
        )
        #: Identities the access policy matched (re-matched on a policy change).
        self.principals = principals or []
        # Heartbeat bookkeeping (TCP only): received-byte count and write progress seen at
        # the last tick, intervals without a byte from the client, and whether the reader
        # is paused by backpressure (then silence is ours, not the client's).
        self.hb_rx = -1
        self.hb_missed = 0
        self.hb_progress = 0
        self.writes = 0
        self.paused = False
        #: While paused: when to look at the socket for a hang-up next (HANGUP_POLL_INTERVAL).
        self.next_hangup_check = 0.0

    def kick(self, code: ErrorCode, message: str) -> None:
        """Close this connection because the core dropped the client."""
        self.closing_reason = str(code)
        self.final_error = (code, message)
        self.scope.cancel()
        self.progress.unpark_all()


class Server:
    """One broker: a core plus the trio tasks that connect it to sockets.

    Args:
        path: Unix socket path to listen on.
        limits: bounds (see :class:`msgq_trio.config.Limits`).
        tcp: TCP/TLS listeners, tokens and heartbeats (docs/SECURITY.md); None = Unix only.
        access: the access policy; None = no rules.
        activated: listening sockets handed over by the service manager (socket
            activation, docs/DEPLOY.md): an AF_UNIX one is served instead of binding
            ``path`` (and its file is left to the manager on exit), AF_INET/AF_INET6 ones
            beside ``tcp.listen``. The server owns (and closes) them.
        socket_mode: permission bits of the socket file the server binds (None: as the
            umask makes them). Connecting needs write permission on the file.
        socket_gid: group of that file (None: the broker's group).
    """

    def __init__(
        self,
        path: Path,
        limits: Limits | None = None,
        *,
        tcp: TcpSettings | None = None,
        access: AccessSettings | None = None,
        activated: Sequence[pysocket.socket] = (),
        socket_mode: int | None = None,
        socket_gid: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._activated = list(activated)
        self._socket_mode = socket_mode
        self._socket_gid = socket_gid
        #: False when the socket file came from socket activation: the service manager
        #: created it and keeps it for the next start, so the broker must not remove it.
        self._owns_path = True
        self.limits = limits or Limits()
        self.tcp = tcp or TcpSettings()
        self.core = Broker(self.limits, version=__version__)
        self.core.set_policy(access or AccessSettings(), {})
        #: Where the TCP listeners are bound (``host:port``), once running.
        self.tcp_addresses: list[str] = []
        self._tcp_listeners: list[trio.SocketListener] = []
        self._ssl_context: ssl.SSLContext | None = None
        self.conns: dict[Peer, PeerConnection] = {}
        self.n_connections = 0
        self._timer_wake = _Wakeup()
        self._timer_target = math.inf
        # limits.busy_poll: the time of the last read, the polling task's wake-up, whether
        # it polls now, how many loop passes it has made (stats: its CPU is visible), the
        # limit in force (0 on one CPU) and the adaptive window (_adapt_busy_poll).
        self._last_read = -math.inf
        self._busy_poll_wake = _Wakeup()
        self._busy_polling = False
        self.busy_polls = 0
        self._busy_poll_limit = 0.0
        self.busy_poll_window = 0.0
        self._last_gap_short = False
        self._cpus = len(os.sched_getaffinity(0))
        self._set_busy_poll(self.limits.busy_poll)
        self._listener: trio.SocketListener | None = None
        self._shutting_down = False
        self._handlers: trio.Nursery | None = None
        self.shutdown_complete = trio.Event()
        self.started_at = 0.0
        self.core.commands["stats"] = self._cmd_stats

    # -- top level -------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or :meth:`shutdown` completes.

        Resource handling: the socket file is removed on every exit path; every connection
        task has finished (its peer disconnected from the core) when this returns.
        Raises:
            BrokerAlreadyRunning: a live broker answers on the path.
        """
        unix = [s for s in self._activated if s.family == pysocket.AF_UNIX]
        inet = [s for s in self._activated if s.family != pysocket.AF_UNIX]
        if (self.tcp.listen or inet) and self.tcp.certfile:
            self._ssl_context = server_ssl_context(self.tcp)
        for s in inet:
            self._adopt_tcp(s)
        if unix:
            # The service manager bound and listens already: clients may be queued on it.
            self._owns_path = False
            sock = trio.socket.from_stdlib_socket(unix[0])
            self.path = Path(os.fsdecode(unix[0].getsockname()))
        else:
            prepare_socket_path(self.path)
            sock = trio.socket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        try:
            if not unix:
                with translate_socket_errors():
                    await sock.bind(str(self.path))
                # Before listen(): until then a connect is refused, so no client ever
                # reaches the socket under the umask's permissions.
                self._set_permissions()
                with translate_socket_errors():
                    sock.listen(512)
            self._listener = trio.SocketListener(sock)
            for addr in self.tcp.listen:
                await self._open_tcp(addr)
            async with trio.open_nursery() as top:
                top.start_soon(self._timer_task)
                top.start_soon(self._trim_task)
                top.start_soon(self._busy_poll_task)
                if self._tcp_listeners:
                    top.start_soon(self._heartbeat_task)
                async with trio.open_nursery() as handlers:
                    self._handlers = handlers
                    handlers.start_soon(self._accept_loop, handlers, self._listener)
                    for tl in self._tcp_listeners:
                        handlers.start_soon(self._accept_loop, handlers, tl)
                    log.info(
                        "broker %s listening on %s (pid %d)", __version__, self.path, os.getpid()
                    )
                    if self.limits.busy_poll and self._cpus < 2:
                        log.info("busy polling off: this broker may run on one CPU only")
                    for a in self.tcp_addresses:
                        log.info("listening on %s://%s", "tls" if self._ssl_context else "tcp", a)
                    self.started_at = trio.current_time()
                    task_status.started(self.path)
                top.cancel_scope.cancel()
        finally:
            sock.close()
            for tl in self._tcp_listeners:
                tl.socket.close()
            self._unlink_socket()
            self.shutdown_complete.set()

    async def _open_tcp(self, addr: str) -> None:
        """Bind one ``HOST:PORT`` listener (port 0: any free port, see tcp_addresses)."""
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")
        listeners = await trio.open_tcp_listeners(int(port), host=host, backlog=512)
        for tl in listeners:
            bound = tl.socket.getsockname()
            h = bound[0]
            self.tcp_addresses.append(f"[{h}]:{bound[1]}" if ":" in h else f"{h}:{bound[1]}")
        self._tcp_listeners.extend(listeners)

    def _set_permissions(self) -> None:
        """Give the bound socket file ``socket_gid`` and ``socket_mode``.

        Raises:
            OSError: not allowed (a group the broker's user is not in), naming the setting.
        """
        try:
            if self._socket_gid is not None:
                os.chown(self.path, -1, self._socket_gid)
            if self._socket_mode is not None:
                os.chmod(self.path, self._socket_mode)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot set socket_group {self._socket_gid} / socket_mode "
                f"{self._socket_mode and oct(self._socket_mode)} on {self.path}: "
                f"{exc.strerror}",
            ) from exc

    def _adopt_tcp(self, sock: pysocket.socket) -> None:
        """Serve a TCP listener handed over by socket activation (see tcp_addresses)."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        bound = sock.getsockname()
        h = bound[0]
        self.tcp_addresses.append(f"[{h}]:{bound[1]}" if ":" in h else f"{h}:{bound[1]}")
        self._tcp_listeners.append(listener)

    def _unlink_socket(self) -> None:
        if not self._owns_path:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def shutdown(self) -> None:
        """Stop accepting, say GOODBYE to every client, flush up to ``shutdown_grace``, end."""
        if self._shutting_down:
            return
        self._shutting_down = True
        log.info("shutting down: %d clients connected", len(self.conns))
        if self._listener is not None:
            await self._listener.aclose()
        for tl in self._tcp_listeners:
            await tl.aclose()
        goodbye = encode_frame(
            FrameType.GOODBYE, header=encode_cbor({"reason": str(ErrorCode.BROKER_SHUTDOWN)})
        )
        for pc in list(self.conns.values()):
            pc.closing_reason = str(ErrorCode.BROKER_SHUTDOWN)
            self._queue_goodbye(pc, goodbye)
        if self._handlers is not None:
            self._handlers.cancel_scope.deadline = trio.current_time() + self.limits.shutdown_grace
        self._unlink_socket()

    def _queue_goodbye(
        self, pc: PeerConnection, goodbye: list[bytes | bytearray | memoryview]
    ) -> None:
        if pc.conn.sent_goodbye:
            return
        pc.conn.check_send(FrameType.GOODBYE)
        pc.peer.sealed = True
        for b in goodbye:
            pc.peer.outq.append(b)
            pc.peer.outq_bytes += len(b)
        pc.wake.set()

    def apply_limits(self, limits: Limits) -> None:
        """Enforce ``limits`` from now on (configuration reload, ``config-set``).

        Limits read when a connection starts (``max_frame_size``, ``idle_in_frame_timeout``,
        ``handshake_timeout``, ``max_fds_per_message``) apply to connections made after
        this; the others at once (a lowered ``request_timeout`` to new requests).
        """
        self.limits = limits
        self.core.limits = limits
        self._set_busy_poll(limits.busy_poll)

    def _set_busy_poll(self, limit: float) -> None:
        """Put ``limits.busy_poll`` in force: off where this process may run on one CPU
        only (a spinning broker would only delay the clients it waits for)."""
        if self._cpus < 2:
            limit = 0.0
        self._busy_poll_limit = limit
        self.busy_poll_window = min(self.busy_poll_window, limit)

    def apply_tcp(self, tcp: TcpSettings) -> None:
        """New tokens and heartbeat settings (listeners and TLS files stay until restart):
        tokens apply to handshakes from now on, heartbeats at the next tick."""
        self.tcp = attrs.evolve(
            self.tcp,
            tokens=tcp.tokens,
            heartbeat_interval=tcp.heartbeat_interval,
            heartbeat_misses=tcp.heartbeat_misses,
        )

    def apply_access(self, access: AccessSettings) -> None:
        """Enforce a new access policy, for connected clients too (decisions re-made; a
        client holding a membership or binding the policy revokes is dropped)."""
        self.core.set_policy(access, {pc.peer: pc.principals for pc in self.conns.values()})
        self._after_core()

    def _cmd_stats(self, _peer: Peer, _params: object) -> dict[str, object]:
        """Broker command ``stats``: process-level figures for operators and fault scenarios."""
        core = self.core
        return {
            "connections": len(self.conns),
            "sockets": self.n_connections,
            "tasks": _count_tasks(),
            "fds": _count_fds(),
            "rss_bytes": _rss_bytes(),
            "pending_requests": len(core.rpc),
            "groups": len(core.router.groups),
            "queued_bytes": sum(p.outq_bytes for p in core.peers.values()),
            "paused_readers": sum(1 for pc in self.conns.values() if pc.paused),
            "uptime": trio.current_time() - self.started_at,
            "busy_poll_passes": self.busy_polls,
            "busy_poll_window": self.busy_poll_window,
            "counters": dict(core.stats),
        }

    # -- accepting -------------------------------------------------------------------
    async def _accept_loop(self, handlers: trio.Nursery, listener: trio.SocketListener) -> None:
        tcp = listener is not self._listener
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno in ACCEPT_CAPACITY_ERRNOS:
                    log.error("accept() failed: %s; pausing accepts for 100 ms", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            handlers.start_soon(self._serve_connection, stream, tcp)

    # -- one connection ----------------------------------------------------------------
    async def _serve_connection(self, stream: Stream, tcp: bool = False) -> None:
        self.n_connections += 1
        pid = uid = gid = -1
        address = ""
        if tcp:
            address = _peer_address(stream)
        else:
            assert isinstance(stream, trio.SocketStream)
            # TCP keeps the kernel's send buffer autotuning (setting SO_SNDBUF ends it).
            set_send_buffer(stream.socket, self.limits.socket_send_buffer)
            try:
                with translate_socket_errors():
                    pid, uid, gid = _PEERCRED.unpack(
                        stream.socket.getsockopt(
                            pysocket.SOL_SOCKET, pysocket.SO_PEERCRED, _PEERCRED.size
                        )
                    )
            except trio.BrokenResourceError:
                pass
        conn = Connection(Role.BROKER, self.limits.max_frame_size)
        pc: PeerConnection | None = None
        who = (
            f"tcp client {address} (before HELLO)" if tcp else f"pid={pid} uid={uid} (before HELLO)"
        )
        try:
            # n_connections counts sockets still in their handshake too, so a storm of
            # connections that never say HELLO cannot get past the limit.
            if self.n_connections > self.limits.max_connections:
                log.warning(
                    "refusing connection from %s: max_connections=%d reached",
                    who,
                    self.limits.max_connections,
                )
                await _send_final(
                    stream,
                    ErrorCode.LIMIT_EXCEEDED,
                    f"max_connections={self.limits.max_connections} reached",
                )
                await _linger(stream)
                return
            if tcp and self._ssl_context is not None:
                assert isinstance(stream, trio.SocketStream)
                stream = trio.SSLStream(stream, self._ssl_context, server_side=True)
                # The TLS handshake counts against handshake_timeout like HELLO does.
                with trio.move_on_after(self.limits.handshake_timeout) as cs:
                    try:
                        await stream.do_handshake()
                    except trio.BrokenResourceError as exc:
                        log.warning(
                            "refusing %s: TLS handshake failed: %s", who, exc.__cause__ or exc
                        )
                        return
                if cs.cancelled_caught:
                    log.warning(
                        "dropping %s: no TLS handshake within %.1f s",
                        who,
                        self.limits.handshake_timeout,
                    )
                    return
            hello = await self._handshake(stream, conn, who)
            if hello is None:
                return
            name, header = hello
            if header.get("version") != PROTOCOL_VERSION:
                log.warning(
                    "refusing %s (name=%r): protocol version %r, broker speaks %d",
                    who,
                    name,
                    header.get("version"),
                    PROTOCOL_VERSION,
                )
                conn.check_send(FrameType.ERROR)
                await _send_final(
                    stream,
                    ErrorCode.VERSION_MISMATCH,
                    f"broker speaks protocol version {PROTOCOL_VERSION}, "
                    f"client sent {header.get('version')!r}",
                    data={"supported": [PROTOCOL_VERSION]},
                )
                return
            where = ""
            if tcp:
                identity, why = self._authenticate(stream, header, who, name)
                if identity is None:
                    conn.check_send(FrameType.ERROR)
                    await _send_final(stream, ErrorCode.UNAUTHENTICATED, why)
                    await _linger(stream)
                    return
                principals = [f"tcp:{identity}"]
                where = f"tcp:{identity}@{address}"
                hello_pid = header.get("pid")
                # Not verifiable over TCP: shown to others as the client says.
                if isinstance(hello_pid, int) and not isinstance(hello_pid, bool):
                    pid = hello_pid
            else:
                principals = unix_principals(uid, gid)
            peer = self.core.connect(
                name,
                pid=pid,
                uid=uid,
                gid=gid,
                now=trio.current_time(),
                principals=principals,
                where=where,
            )
            pc = PeerConnection(self, peer, stream, conn, principals)
            self.conns[peer] = pc
            welcome_header = self.core.welcome(peer)
            if tcp:
                welcome_header["identity"] = principals[0]
                welcome_header["heartbeat"] = {
                    "interval": self.tcp.heartbeat_interval,
                    "misses": self.tcp.heartbeat_misses,
                }
            welcome = conn.send(FrameType.WELCOME, header=welcome_header)
            with translate_socket_errors():
                await stream.send_all(b"".join(welcome))
            self._after_core()
            log.debug("client %s connected", peer.describe())
            await self._run_peer(pc)
        except trio.BrokenResourceError as exc:
            if pc is not None and pc.closing_reason is None:
                pc.closing_reason = "connection-lost"
            log.debug("connection %s lost: %s", pc.peer.describe() if pc else who, exc)
        except RemoteProtocolError as exc:
            ident = pc.peer.describe() if pc else who
            log.warning("dropping client %s: protocol violation: %s", ident, exc)
            if pc is not None:
                pc.closing_reason = str(exc.code)
            conn.fail()
            with trio.move_on_after(0.5):
                await _send_final(stream, exc.code, str(exc))
        except Exception:
            # A bug in our own code: confine it to this connection and say whose it was.
            ident = pc.peer.describe() if pc else who
            log.exception("internal error while serving %s; dropping that client only", ident)
            if pc is not None:
                pc.closing_reason = "internal-error"
        finally:
            self.n_connections -= 1
            if pc is not None:
                if pc.final_error is not None:
                    with trio.move_on_after(0.2) as cs:
                        cs.shield = True
                        await _send_final(stream, *pc.final_error)
                self.conns.pop(pc.peer, None)
                self.core.disconnect(pc.peer, pc.closing_reason or "closed")
                self._after_core()
                log.debug(
                    "client %s disconnected: %s", pc.peer.describe(), pc.closing_reason or "closed"
                )
            close_fds(conn.close())
            await trio.aclose_forcefully(stream)

    def _authenticate(
        self, stream: Stream, header: dict[str, object], who: str, name: str
    ) -> tuple[str | None, str]:
        """The identity of a TCP client: its token's name, else its certificate's CN;
        or (None, why it was refused).

        A token that is present must be valid (a wrong token is refused even with a good
        certificate: the client meant to be someone). Refusals are logged at WARNING with
        the address; the token itself is never logged.
        """
        token = header.get("token")
        if token is not None:
            ident = check_token(token, self.tcp.tokens) if isinstance(token, str) else None
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
            "TCP clients must authenticate: a token in HELLO or a client certificate "
            "the broker trusts"
        )

    async def _handshake(
        self, stream: Stream, conn: Connection, who: str
    ) -> tuple[str, dict[str, object]] | None:
        """Read until HELLO; returns (name, header) or None if the client left or timed out."""
        receive = self._receiver(stream)
        with trio.move_on_after(self.limits.handshake_timeout):
            while True:
                data, fds = await receive()
                conn.receive_data(data, fds)
                ev = conn.next_event()
                if ev is EOF:
                    return None
                if ev is NEED_DATA:
                    continue
                assert isinstance(ev, Frame)
                close_fds(ev.fds)  # descriptors on HELLO mean nothing: not kept
                header = ev.header()
                name = header.get("name", "")
                if not isinstance(name, str) or len(name) > 255 or "\0" in name:
                    raise RemoteProtocolError("HELLO name must be a string of <= 255 chars, no NUL")
                return name or "anonymous", header
        log.warning(
            "dropping connection %s: no HELLO within %.1f s", who, self.limits.handshake_timeout
        )
        return None

    def _receiver(self, stream: Stream) -> Callable[[], Awaitable[tuple[bytes, list[int]]]]:
        """The receive call for the handshake (the reader loop uses a SocketReceiver)."""
        if isinstance(stream, trio.SSLStream):
            return self._tls_receiver(stream)
        sock = stream.socket
        ancsize = ancillary_size(self.limits.max_fds_per_message)

        def receive() -> Awaitable[tuple[bytes, list[int]]]:
            return receive_with_fds(sock, RECEIVE_SIZE, ancsize)

        return receive

    def _tls_receiver(
        self, ssl_stream: trio.SSLStream[trio.SocketStream]
    ) -> Callable[[], Awaitable[tuple[bytes, list[int]]]]:
        """The receive call for a TLS stream: the decrypted bytes (no descriptors can
        come over TCP). Sockets use :class:`SocketReceiver`."""

        async def receive_tls() -> tuple[bytes, list[int]]:
            try:
                data = await ssl_stream.receive_some(RECEIVE_SIZE)
            except trio.BrokenResourceError as exc:
                # A client that closes without close_notify is just a disconnect.
                if isinstance(exc.__cause__, ssl.SSLError) and "EOF" in str(exc.__cause__):
                    return b"", []
                raise
            return bytes(data), []

        return receive_tls

    async def _run_peer(self, pc: PeerConnection) -> None:
        """Run the reader (in this task) and the writer (a child task) until either ends.

        Errors from either side are turned into a closing reason here, inside the nursery,
        so the caller sees plain exceptions (a protocol error) rather than groups.
        """
        failure: BaseException | None = None
        with pc.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer_task, pc, nursery.cancel_scope)
                try:
                    goodbye = await self._reader(pc)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    log.debug("connection %s lost: %s", pc.peer.describe(), exc)
                    pc.closing_reason = pc.closing_reason or "connection-lost"
                    goodbye = False
                except Exception as exc:  # protocol errors and bugs: re-raised below
                    failure = exc
                    goodbye = False
                if goodbye:
                    # The client leaves: flush what it is owed, then our GOODBYE, then close.
                    pc.closing_reason = "closed"
                    self.core.disconnect(pc.peer, "closed", keep_queue=True)
                    self._after_core()
                    self._queue_goodbye(pc, encode_frame(FrameType.GOODBYE))
                    with trio.move_on_after(self.limits.shutdown_grace):
                        await pc.goodbye_sent.wait()
                elif pc.closing_reason is None and failure is None:
                    pc.closing_reason = "connection-lost"
                nursery.cancel_scope.cancel()
        if failure is not None:
            try:
                raise failure
            finally:
                # The traceback refers to this frame: without this the exception, this
                # frame and the connection's buffers would form a cycle.
                failure = None

    async def _writer_task(self, pc: PeerConnection, scope: trio.CancelScope) -> None:
        try:
            await self._writer(pc)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("connection %s lost while writing: %s", pc.peer.describe(), exc)
            pc.closing_reason = pc.closing_reason or "connection-lost"
            scope.cancel()

    async def _reader(self, pc: PeerConnection) -> bool:
        """Read and route until EOF (False) or the client's GOODBYE (True)."""
        stream = pc.stream
        if isinstance(stream, trio.SSLStream):
            tls_receive = self._tls_receiver(stream)

            async def receive_tls(conn: Connection) -> int:
                data, fds = await tls_receive()
                conn.receive_data(data, fds)
                return len(data)

            return await self._read_loop(pc, receive_tls)
        rx = SocketReceiver(
            stream.socket, RECEIVE_SIZE, ancillary_size(self.limits.max_fds_per_message)
        )
        try:
            return await self._read_loop(pc, rx.receive_into)
        finally:
            rx.close()

    async def _read_loop(
        self, pc: PeerConnection, receive: Callable[[Connection], Awaitable[int]]
    ) -> bool:
        # ``receive(conn)`` receives once and hands the bytes to conn (in place for a large
        # frame: SocketReceiver.receive_into); it returns the count, 0 at EOF.
        conn, peer, core = pc.conn, pc.peer, self.core
        handle_many = core.handle_many
        idle_in_frame = self.limits.idle_in_frame_timeout
        # Frames pipelined right behind HELLO are already buffered: the first pass
        # handles them before waiting for more data.
        received = False
        while True:
            if received:
                if conn.in_frame:
                    n = -1
                    with trio.move_on_after(idle_in_frame) as cs:
                        n = await receive(conn)
                    if cs.cancelled_caught and n < 0:
                        raise RemoteProtocolError(
                            f"stalled in the middle of a frame for {idle_in_frame} s "
                            "(idle_in_frame_timeout)",
                            ErrorCode.PROTOCOL_ERROR,
                        )
                else:
                    n = await receive(conn)
                if not n:
                    # EOF: descriptors that came with it are the connection's orphans,
                    # closed with it (Connection.close).
                    if conn.in_frame:
                        log.info(
                            "client %s closed the connection in the middle of a frame",
                            peer.describe(),
                        )
                    return False
            received = True
            now = trio.current_time()
            if not self._busy_polling and self._busy_poll_limit:
                self._adapt_busy_poll(now)
            self._last_read = now
            try:
                # Runs also with capture on: Broker.handle_many taps each of their frames.
                events = conn.events_with_runs(peer.stamp)
                if not events:
                    continue
                last = events[-1]
                # GOODBYE and EOF can only come last (the state table rejects anything after).
                tail = last is EOF or (isinstance(last, Frame) and last.type == _GOODBYE)
                if tail:
                    events.pop()
                if events:
                    frames: list[Frame | Run] = events  # type: ignore[assignment]
                    done = handle_many(peer, frames, now)
                    while done < len(frames):
                        # A frame is held: its receivers must drain first (see
                        # Broker.handle). This sender stays paused meanwhile.
                        frames = frames[done:]
                        try:
                            self._after_core()
                            self._pause(pc)
                            await self._wait_for_room(pc)
                        except _HungUp:
                            return await self._discard_unread(pc, receive, frames)
                        except BaseException:
                            core.discard_frames(frames)
                            raise
                        finally:
                            pc.paused = False
                        if not pc.peer.alive:  # dropped while it waited
                            core.discard_frames(frames)
                            break
                        done = handle_many(peer, frames, trio.current_time())
                    if not peer.alive:
                        return False
                if tail:
                    return last is not EOF
            finally:
                self._after_core()
            if conn.error_pending:
                conn.events()  # raises the protocol error that followed the valid frames
            if core.blocked:
                self._pause(pc)
                try:
                    await self._wait_for_receivers(pc)
                except _HungUp:
                    return await self._discard_unread(pc, receive, [])
                finally:
                    pc.paused = False

    async def _discard_unread(
        self,
        pc: PeerConnection,
        receive: Callable[[Connection], Awaitable[int]],
        held: list[Frame | Run],
    ) -> bool:
        """``pc``'s client hung up while its reads were paused: count and drop what it sent
        that the broker had not delivered, log it, and return False (connection lost).

        That is ``held`` (frames waiting for room at receivers) plus what is left in the
        socket, read to EOF here: a closed peer can send no more, so that is bounded by
        its socket buffer, and parsing it tells whether it died in the middle of a frame.
        These frames are discarded as a dead receiver's queue is: delivering them would
        keep the dead client's calls pending until its receivers drained. Descriptors
        they carry are closed; ``stats.counters.discarded_frames`` counts them.
        """
        conn, core = pc.conn, self.core
        frames = list(held)
        unreadable = ""
        try:
            with trio.move_on_after(self.limits.idle_in_frame_timeout):
                while True:
                    n = await receive(conn)
                    frames.extend(
                        e
                        for e in conn.events_with_runs(pc.peer.stamp)
                        if isinstance(e, (Frame, Run))
                    )
                    if not n:
                        break
        except trio.BrokenResourceError as exc:
            unreadable = f"; the rest was unreadable: {exc}"
        except RemoteProtocolError as exc:
            unreadable = f"; the rest was invalid: {exc}"
        count = sum(f.count if isinstance(f, Run) else 1 for f in frames)
        size = sum(len(f.raw) for f in frames)
        log.warning(
            "client %s closed the connection%s while its reads were paused by backpressure: "
            "discarding %d frames (%d bytes) it sent that were not delivered yet%s",
            pc.peer.describe(),
            " in the middle of a frame" if conn.in_frame else "",
            count,
            size,
            unreadable,
        )
        core.stats["discarded_frames"] += count
        core.discard_frames(frames)
        pc.closing_reason = pc.closing_reason or "connection-lost"
        return False

    def _pause(self, pc: PeerConnection) -> None:
        """Mark ``pc``'s reader paused by backpressure (heartbeats and stats see it)."""
        pc.paused = True
        pc.next_hangup_check = trio.current_time() + HANGUP_POLL_INTERVAL

    async def _await_progress(
        self, pc: PeerConnection, rpc: PeerConnection, deadline: float
    ) -> bool | None:
        """Paused sender ``pc`` waits for write progress on receiver ``rpc``, until
        ``deadline`` at most, and looks at its own socket for a hang-up every
        HANGUP_POLL_INTERVAL meanwhile (its EOF is behind the data we are not reading).

        Returns True on progress, None when it woke only to look for a hang-up, False
        once ``deadline`` has passed. Whatever it returns, the caller re-checks its
        condition before waiting again: a wake-up given while this task was between two
        waits would otherwise be lost.

        Raises:
            _HungUp: ``pc``'s client closed the connection (see :meth:`_discard_unread`).
        """
        now = trio.current_time()
        if now >= pc.next_hangup_check:
            pc.next_hangup_check = now + HANGUP_POLL_INTERVAL
            if hung_up(pc.sock_fd):
                raise _HungUp
        with trio.move_on_at(min(deadline, pc.next_hangup_check)) as cs:
            await rpc.progress.park()
        if not cs.cancelled_caught:
            return True
        return False if trio.current_time() >= deadline else None

    async def _wait_for_receivers(self, pc: PeerConnection) -> None:
        """Backpressure: stop reading from this sender while a receiver it fed is over its
        soft limit. A receiver that makes no write progress for ``slow_consumer_timeout``
        is dropped (slow-consumer), so a stopped reader cannot pause its senders forever.
        A sender that hangs up meanwhile is dropped (see :meth:`_await_progress`)."""
        blocked = list(self.core.blocked)
        self.core.blocked.clear()
        soft = self.limits.out_soft_limit
        patience = self.limits.slow_consumer_timeout
        for r in blocked:
            rpc = self.conns.get(r)
            deadline = trio.current_time() + patience
            while rpc is not None and r.alive and r.outq_bytes > soft and pc.peer.alive:
                progressed = await self._await_progress(pc, rpc, deadline)
                if progressed:
                    deadline = trio.current_time() + patience
                elif progressed is False and r.alive and r.outq_bytes > soft:
                    self.core.kick(
                        r,
                        ErrorCode.SLOW_CONSUMER,
                        f"no progress on {r.outq_bytes} queued bytes for "
                        f"{self.limits.slow_consumer_timeout} s (slow_consumer_timeout)",
                    )
                    self._after_core()

    async def _wait_for_room(self, pc: PeerConnection) -> None:
        """Wait until every receiver of ``pc``'s held frame can take it (or is gone).

        A receiver that makes no write progress for ``slow_consumer_timeout`` is dropped
        (slow-consumer); one that drains, however slowly, is waited for. A sender that
        hangs up meanwhile is dropped (see :meth:`_await_progress`).
        """
        core = self.core
        held, size, nfds = core.held, core.held_size, core.held_fds
        core.held = []
        room = self.limits.out_hard_limit - size
        max_fds = self.limits.max_fds_queued - nfds
        patience = self.limits.slow_consumer_timeout
        for r in held:
            rpc = self.conns.get(r)
            deadline = trio.current_time() + patience
            while (
                rpc is not None
                and r.alive
                and pc.peer.alive
                and (r.outq_bytes > room or (nfds and r.outq_fds > max_fds))
            ):
                progressed = await self._await_progress(pc, rpc, deadline)
                if progressed:
                    deadline = trio.current_time() + patience
                elif progressed is False and r.alive:
                    self.core.kick(
                        r,
                        ErrorCode.SLOW_CONSUMER,
                        f"no progress for {self.limits.slow_consumer_timeout} s "
                        f"(slow_consumer_timeout) on {r.outq_bytes} queued bytes; "
                        f"{pc.peer.describe()} waits to send it {size} more",
                    )
                    self._after_core()

    async def _writer(self, pc: PeerConnection) -> None:
        stream, peer = pc.stream, pc.peer
        while True:
            await pc.wake.wait()
            while peer.outq:
                bufs, n = peer.take_outgoing(WRITE_BATCH)
                pc.writing = True
                try:
                    await send_buffers(stream, bufs)
                finally:
                    pc.writing = False
                peer.sent(n)
                pc.writes += 1
                pc.progress.unpark_all()
            if pc.conn.sent_goodbye and not peer.outq:
                pc.goodbye_sent.set()
                if self._shutting_down:
                    # Shutdown: our GOODBYE is out; close our side so the client sees EOF.
                    await _send_eof(stream)
                return

    def _send_now(self, pc: PeerConnection) -> None:
        """Write a small queue straight to the socket if the writer is idle.

        Saves the writer task's wake-up on the latency path (request -> callee -> answer).
        Whatever the kernel does not take right away stays queued for the writer; errors
        are left for the writer to discover, so they are handled in one place.
        """
        peer = pc.peer
        if (
            pc.writing
            or peer.outq_bytes > _DIRECT_SEND_MAX
            or peer.outq_fds  # descriptors need sendmsg: the writer does that
            or pc.conn.sent_goodbye
            or pc.fd < 0  # TLS: only the SSL object may write
        ):
            return
        bufs, n = peer.take_outgoing(_DIRECT_SEND_MAX)
        data = bufs[0] if len(bufs) == 1 else b"".join(bufs)
        try:
            sent = os.write(pc.fd, data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0  # the writer will hit the same error and report it
        if sent < len(data):
            peer.outq.appendleft(memoryview(data)[sent:])
        peer.outq_bytes -= n - (len(data) - sent)
        peer.bytes_out += sent
        if sent and pc.progress:  # a paused sender waits on it (rarely: skip the call)
            pc.progress.unpark_all()

    def _after_core(self) -> None:
        """Act on what the core decided: wake writers, close kicked peers, re-arm the timer."""
        core = self.core
        if core.dirty:
            conns = self.conns
            for p in core.dirty:
                pc = conns.get(p)
                if pc is not None:
                    self._send_now(pc)
                    if p.outq:
                        pc.wake.set()
            core.dirty.clear()
        if core.kicked:
            kicked, core.kicked = core.kicked, []
            for p, code, message in kicked:
                pc = self.conns.get(p)
                if pc is not None:
                    pc.kick(code, message)
        d = core.next_deadline()
        if d is not None and d < self._timer_target:
            self._timer_target = d
            self._timer_wake.set()

    async def _heartbeat_task(self) -> None:
        """Every heartbeat interval: ping each TCP client we heard nothing from during the
        last interval; drop one silent for ``heartbeat_misses`` intervals (it crashed, its
        host died, or the network path did: a Unix socket would have told us at once).

        Not counted as silence: intervals in which our reader was paused by backpressure
        (we were not listening; the client is pinged anyway, so that a dead one answers
        with a reset the paused reader notices), or in which a backlog queued for it kept
        draining (its stack is taking data; the slow-consumer rule judges that case).
        """
        while True:
            interval = self.tcp.heartbeat_interval
            await trio.sleep(interval)
            for pc in list(self.conns.values()):
                peer = pc.peer
                if not peer.remote or not peer.alive or pc.conn.sent_goodbye:
                    continue
                rx = pc.conn.received_bytes
                draining = peer.outq_bytes > 0 and pc.writes != pc.hb_progress
                pc.hb_progress = pc.writes
                if pc.paused:
                    # Its silence is ours, but it is pinged all the same: over TCP a
                    # dead client's FIN waits behind the data we are not reading (a
                    # zero window), while its kernel answers our ping with a reset,
                    # which _await_progress's hang-up poll sees.
                    pc.hb_rx = rx
                    pc.hb_missed = 0
                    self.core.heartbeat(peer)
                    continue
                if rx != pc.hb_rx or draining:
                    pc.hb_rx = rx
                    pc.hb_missed = 0
                    continue
                pc.hb_missed += 1
                if pc.hb_missed >= self.tcp.heartbeat_misses:
                    self.core.kick(
                        peer,
                        ErrorCode.HEARTBEAT_TIMEOUT,
                        f"nothing received for {pc.hb_missed} heartbeat intervals of "
                        f"{interval} s (tcp.heartbeat_misses)",
                    )
                else:
                    self.core.heartbeat(peer)
            self._after_core()

    async def _trim_task(self) -> None:
        """Hand freed heap memory back to the system after bursts of large frames.

        Why: glibc raises its mmap threshold to the largest buffer freed so far, after
        which multi-megabyte frames live on the heap, and freed heap pages stay resident:
        a broker that relayed a burst of 8 MiB frames stayed up to 26 MiB larger for good
        (scenario sigkill-mid-frame). Mapping every large buffer apart instead cost 10 %
        of the 4 MiB throughput (each frame faults fresh pages). So: every
        TRIM_INTERVAL, if the resident size grew by TRIM_GROWTH since the last trim,
        ``malloc_trim(0)`` (1.9 ms here after freeing 40 MiB of large buffers among
        200,000 small objects; it blocks the loop for that long, at most once per
        interval). Under another C library this task ends at once.
        """
        trim = _malloc_trim()
        if trim is None:
            return
        floor = _rss_bytes()
        while True:
            await trio.sleep(TRIM_INTERVAL)
            rss = _rss_bytes()
            if rss - floor >= TRIM_GROWTH:
                trim(0)
                floor = _rss_bytes()
                log.debug("malloc_trim: resident %d -> %d bytes", rss, floor)
            elif rss < floor:
                floor = rss

    def _adapt_busy_poll(self, now: float) -> None:
        """A read came while the loop was asleep: adapt the polling window, then poll.

        After KVM's halt polling: a read that came within ``limits.busy_poll`` of the
        previous one would have been caught by polling that long. Two such reads in a row
        grow the window (to a quarter of the limit, then doubling, up to the limit); one
        that came later closes it. Reads caught while polling change nothing (they are
        within the window). So the broker polls while frames come back to back (request,
        answer, next request: every gap short) and not for traffic spaced wider than the
        limit, nor for calls paced apart (an answer's short gap, then the next request's
        long one): CPU is spent only where it buys latency.
        """
        limit = self._busy_poll_limit
        short = now - self._last_read <= limit
        if not short:
            self.busy_poll_window = 0.0
        elif self._last_gap_short:
            self.busy_poll_window = min(limit, max(2 * self.busy_poll_window, limit / 4))
            self._busy_poll_wake.set()
        self._last_gap_short = short

    async def _busy_poll_task(self) -> None:
        """``limits.busy_poll``: for ``busy_poll_window`` after the last read, keep this
        trio loop running (every pass polls the sockets without sleeping, then yields the
        CPU to any other runnable process), so the next frame is taken without the ~20 us
        wake-up of a sleeping process. Parked, costing nothing, while the window is 0 or
        once no read came for that long."""
        clock = trio.current_time
        checkpoint = trio.lowlevel.checkpoint
        yield_cpu = os.sched_yield
        while True:
            await self._busy_poll_wake.wait()
            self._busy_polling = True
            try:
                while clock() - self._last_read < self.busy_poll_window:
                    self.busy_polls += 1
                    await checkpoint()
                    # Polite spinning: a process runnable on this CPU (a client of ours,
                    # on a small machine) runs now rather than at the end of our time
                    # slice. 16 requesters: 18-19k instead of 17k calls/s; round trip
                    # 130-135 instead of 122-126 us (BENCHMARKS.md, "Busy polling").
                    yield_cpu()
            finally:
                self._busy_polling = False

    async def _timer_task(self) -> None:
        """Sleep until the earliest RPC deadline, then let the core answer ``timeout``."""
        while True:
            d = self.core.next_deadline()
            self._timer_target = d if d is not None else math.inf
            with trio.move_on_at(self._timer_target):
                await self._timer_wake.wait()
            # _timer_target stays at the deadline we slept for while we expire, so the
            # _after_core below re-arms only for an earlier deadline, never in a loop.
            self.core.expire(trio.current_time())
            self._after_core()


def _count_tasks() -> int:
    """Number of live trio tasks in this run (leak checks: back to baseline after faults)."""
    todo = [trio.lowlevel.current_root_task()]
    n = 0
    while todo:
        task = todo.pop()
        if task is None:
            continue
        n += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return n


def _count_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


async def _send_eof(stream: Stream) -> None:
    """Close our sending side: a socket's shutdown(SHUT_WR); TLS has no half-close, so
    there the connection is left for aclose (close_notify) to end."""
    if isinstance(stream, trio.SocketStream):
        with translate_socket_errors():
            await stream.send_eof()


async def _send_final(stream: Stream, code: ErrorCode, message: str, data: object = None) -> None:
    """Best effort: tell the peer why we close (it may be gone already)."""
    frame = connection_error_frame(code, message)
    if data is not None:
        frame = encode_frame(
            FrameType.ERROR,
            header=encode_cbor({"code": str(code), "message": message}),
            body=encode_cbor(data),
        )
    try:
        with translate_socket_errors():
            await stream.send_all(b"".join(frame))
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
        pass


#: Longest a refused connection is kept open to let the client read our ERROR.
_LINGER_TIME = 0.5
_LINGER_BYTES = 64 * 1024


async def _linger(stream: Stream) -> None:
    """Close our side, then read and discard what the client still sends (its HELLO) for a
    moment, so it gets our ERROR instead of EPIPE on its write (a "lingering close").
    Bounded: at most ``_LINGER_BYTES`` bytes and ``_LINGER_TIME`` seconds."""
    got = 0
    with trio.move_on_after(_LINGER_TIME):
        try:
            await _send_eof(stream)
            with translate_socket_errors():
                while got < _LINGER_BYTES:
                    data = await stream.receive_some(RECEIVE_SIZE)
                    if not data:
                        break
                    got += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass
