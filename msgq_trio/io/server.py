"""The broker daemon's Server: owns the core, the listeners, the connections and the
housekeeping tasks, and runs them under one nursery until shutdown.

The only broker code that imports trio is this package. It feeds bytes to the sans-I/O
connection, hands frames to the pure core, writes what the core queued and applies what
the core decided (``Broker.effects``). The jobs live apart, and import each other in one
direction only (``wakeup < polling < connection < housekeeping < server``;
``listeners < connection``): :mod:`.listeners` (sockets, accept, credentials,
authentication), :mod:`.connection` (one peer's reader, writer and backpressure, over
the narrow :class:`~.connection.ConnectionHost` this server implements),
:mod:`.housekeeping` (timer, heartbeats, memory trim), :mod:`.polling` (busy polling),
:mod:`.wakeup` (the wake-up flag). Shape (trio's serve_listeners, hypercorn's trio
server):

* accept tasks, separate from the nursery that holds connection tasks;
* per connection a reader and a writer (:class:`~.connection.PeerConnection`);
* ``finally: aclose_forcefully`` plus ``core.disconnect`` on every exit path, so a clean
  close, a crash, a protocol violation or a kick all run the same cleanup;
* ``task_status.started(path)`` so tests and the CLI learn where the broker listens;
* graceful shutdown: GOODBYE to everyone, flush for ``shutdown_grace``, then cancel.
"""

from __future__ import annotations

import logging
import os
import socket as pysocket
import ssl
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from .._version import __version__
from ..config import AccessSettings, CommandAccess, Limits, QuotaSettings, TcpSettings
from ..core.broker import Broker
from ..core.peers import Peer
from ..protocol.codes import PROTOCOL_VERSION, ErrorCode, FrameType
from ..protocol.connection import Connection, Role
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import encode_cbor, encode_frame
from ..transport.errors import translate_socket_errors
from ..transport.sockets import close_fds, set_send_buffer
from ..transport.splice import PipeBudget
from .batching import WriteBatcher
from .connection import PeerConnection, Splicing, linger, read_hello, send_final
from .housekeeping import (
    DeadlineTimer,
    count_fds,
    count_tasks,
    heartbeat_task,
    rss_bytes,
    trim_task,
)
from .listeners import (
    BrokerAlreadyRunning,
    SpareFd,
    Stream,
    accept_loop,
    adopt_tcp,
    authenticate,
    fd_connection_capacity,
    open_tcp,
    peer_address,
    peer_credentials,
    prepare_socket_path,
    server_ssl_context,
    set_socket_permissions,
    unix_principals,
)
from .polling import BusyPoller

__all__ = ["BrokerAlreadyRunning", "Server"]

log = logging.getLogger("msgq_trio.io")


class Server:
    """One broker: a core plus the trio tasks that connect it to sockets.

    Args:
        path: Unix socket path to listen on.
        limits: bounds (see :class:`msgq_trio.config.Limits`).
        tcp: TCP/TLS listeners, tokens and heartbeats (docs/SECURITY.md); None = Unix only.
        access: the access policy; None = no rules.
        commands: group -> the verbs the plugin answering on it declared for its
            commands (:class:`~msgq_trio.config.CommandAccess`, resolved by the layer
            that loads plugins); None = no plugin commands are checked beyond ``call``.
        activated: listening sockets handed over by the service manager (socket
            activation, docs/DEPLOY.md): an AF_UNIX one is served instead of binding
            ``path`` (and its file is left to the manager on exit), AF_INET/AF_INET6 ones
            beside ``tcp.listen``. The server owns (and closes) them.
        socket_mode: permission bits of the socket file the server binds (None: as the
            umask makes them). Connecting needs write permission on the file.
        socket_gid: group of that file (None: the broker's group).
        quotas: the per-user quotas (core/users.py); None = the defaults.
    """

    def __init__(
        self,
        path: Path,
        limits: Limits | None = None,
        *,
        tcp: TcpSettings | None = None,
        access: AccessSettings | None = None,
        commands: Mapping[str, CommandAccess] | None = None,
        activated: Sequence[pysocket.socket] = (),
        socket_mode: int | None = None,
        socket_gid: int | None = None,
        quotas: QuotaSettings | None = None,
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
        self.core = Broker(self.limits, version=__version__, quotas=quotas)
        self.core.set_policy(access or AccessSettings(), {}, commands or {})
        #: Where the TCP listeners are bound (``host:port``), once running.
        self.tcp_addresses: list[str] = []
        self._tcp_listeners: list[trio.SocketListener] = []
        self._ssl_context: ssl.SSLContext | None = None
        self.conns: dict[Peer, PeerConnection] = {}
        self.n_connections = 0
        #: Connections the descriptor limit leaves room for (None: unlimited), read at
        #: start: admission refuses past it as past ``max_connections``.
        self.fd_capacity: int | None = None
        self._timer = DeadlineTimer()
        #: limits.busy_poll: the polling task and its state (read by every reader).
        self.busy_poll = BusyPoller(self.limits.busy_poll)
        #: Writes to the peers the core queued frames for, batched per scheduler pass.
        self._writes = WriteBatcher(self.conns)
        #: Pipes for large frames in flight and the splicing figures (shared by the
        #: connections).
        self.splicing = Splicing(self.limits.splice_max_pipes)
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
            listener, address = adopt_tcp(s)
            self._tcp_listeners.append(listener)
            self.tcp_addresses.append(address)
        if unix:
            # The service manager bound and listens already: clients may be queued on it.
            self._owns_path = False
            sock = trio.socket.from_stdlib_socket(unix[0])
            self.path = Path(os.fsdecode(unix[0].getsockname()))
        else:
            prepare_socket_path(self.path)
            sock = trio.socket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        spare: SpareFd | None = None
        try:
            if not unix:
                with translate_socket_errors():
                    await sock.bind(str(self.path))
                # Before listen(): until then a connect is refused, so no client ever
                # reaches the socket under the umask's permissions.
                set_socket_permissions(self.path, self._socket_mode, self._socket_gid)
                with translate_socket_errors():
                    sock.listen(512)
            self._listener = trio.SocketListener(sock)
            self.fd_capacity = fd_connection_capacity(max(count_fds(), 16))
            if self.fd_capacity is not None and self.fd_capacity < self.limits.max_connections:
                log.warning(
                    "RLIMIT_NOFILE leaves room for %d connections only: refusing past "
                    "that, below max_connections=%d",
                    self.fd_capacity,
                    self.limits.max_connections,
                )
            spare = SpareFd()
            for addr in self.tcp.listen:
                listeners, addresses = await open_tcp(addr)
                self._tcp_listeners.extend(listeners)
                self.tcp_addresses.extend(addresses)
            self._writes.start()
            async with trio.open_nursery() as top:
                top.start_soon(self._timer.run, self.core, self.after_core)
                top.start_soon(trim_task)
                top.start_soon(self.busy_poll.run)
                if self._tcp_listeners:
                    top.start_soon(heartbeat_task, self)
                async with trio.open_nursery() as handlers:
                    self._handlers = handlers
                    handlers.start_soon(
                        accept_loop,
                        self._listener,
                        handlers,
                        self._serve_connection,
                        False,
                        spare,
                        self._refuse_out_of_fds,
                    )
                    for tl in self._tcp_listeners:
                        handlers.start_soon(
                            accept_loop,
                            tl,
                            handlers,
                            self._serve_connection,
                            True,
                            spare,
                            self._refuse_out_of_fds,
                        )
                    log.info(
                        "broker %s listening on %s (pid %d)", __version__, self.path, os.getpid()
                    )
                    if self.limits.busy_poll and self.busy_poll.cpus < 2:
                        log.info("busy polling off: this broker may run on one CPU only")
                    for a in self.tcp_addresses:
                        log.info("listening on %s://%s", "tls" if self._ssl_context else "tcp", a)
                    self.started_at = trio.current_time()
                    task_status.started(self.path)
                top.cancel_scope.cancel()
        finally:
            self._writes.stop()
            if spare is not None:
                spare.close()
            sock.close()
            for tl in self._tcp_listeners:
                tl.socket.close()
            self._unlink_socket()
            self.shutdown_complete.set()

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
            pc.queue_goodbye(goodbye)
        if self._handlers is not None:
            self._handlers.cancel_scope.deadline = trio.current_time() + self.limits.shutdown_grace
        self._unlink_socket()

    def apply_limits(self, limits: Limits) -> None:
        """Enforce ``limits`` from now on (configuration reload, ``config-set``).

        Limits read when a connection starts (``max_frame_size``, ``idle_in_frame_timeout``,
        ``handshake_timeout``, ``max_fds_per_message``) apply to connections made after
        this; the others at once (a lowered ``request_timeout`` to new requests).
        """
        self.limits = limits
        self.core.limits = limits
        self.busy_poll.set_limit(limits.busy_poll)
        self.splicing.budget.limit = limits.splice_max_pipes

    def apply_quotas(self, quotas: QuotaSettings) -> None:
        """Enforce new per-user quotas from now on: new use is checked against them;
        what users hold already is not dropped, even above a tightened quota."""
        self.core.users.configure(quotas)

    def apply_tcp(self, tcp: TcpSettings) -> None:
        """New tokens and heartbeat settings (listeners and TLS files stay until restart):
        tokens apply to handshakes from now on, heartbeats at the next tick."""
        self.tcp = attrs.evolve(
            self.tcp,
            tokens=tcp.tokens,
            heartbeat_interval=tcp.heartbeat_interval,
            heartbeat_misses=tcp.heartbeat_misses,
        )

    def apply_access(
        self, access: AccessSettings, commands: Mapping[str, CommandAccess] | None = None
    ) -> None:
        """Enforce a new access policy, for connected clients too (decisions re-made; a
        client holding a membership or binding the policy revokes is dropped).
        ``commands`` replaces the plugins' command table (see :class:`Server`); None
        keeps the one in force."""
        self.core.set_policy(
            access, {pc.peer: pc.principals for pc in self.conns.values()}, commands
        )
        self.after_core()

    def _cmd_stats(self, _peer: Peer, _params: object) -> dict[str, object]:
        """Broker command ``stats``: process-level figures for operators and fault scenarios."""
        core = self.core
        return {
            "connections": len(self.conns),
            "sockets": self.n_connections,
            "tasks": count_tasks(),
            "fds": count_fds(),
            "rss_bytes": rss_bytes(),
            "pending_requests": len(core.rpc),
            "groups": len(core.router.groups),
            "queued_bytes": sum(p.outq_bytes for p in core.peers.values()),
            "paused_readers": self.paused_readers,
            "uptime": trio.current_time() - self.started_at,
            "busy_poll_passes": self.busy_poll.passes,
            "busy_poll_window": self.busy_poll.window,
            "spliced_frames": self.spliced_frames,
            "splice_fallbacks": self.splice_fallbacks,
            "splice_pipes": self.pipe_budget.held,
            "counters": dict(core.stats),
            "quotas": self.quota_state(),
        }

    def quota_state(self) -> dict[str, object]:
        """The per-user quotas in force and the users at one of their limits now."""
        users = self.core.users
        settings = users.settings
        return {
            "enabled": settings.enabled,
            "broker_memory_total": users.memory_total,
            "user_memory_share": settings.user_memory_share,
            "users": len(users.accounts),
            "users_at_limit": [r["user"] for r in users.rows() if r["at_limit"]],
        }

    # -- for the connections (io.connection.ConnectionHost) and housekeeping ------------
    def connection_of(self, peer: Peer) -> PeerConnection | None:
        """The connection of ``peer``, if it is still connected."""
        return self.conns.get(peer)

    def connections(self) -> Iterable[PeerConnection]:
        """The admitted connections, as a snapshot (safe to iterate across awaits)."""
        return list(self.conns.values())

    # -- for operations (msgq_trio.ops) --------------------------------------------------
    @property
    def pipe_budget(self) -> PipeBudget:
        """Pipes held for large frames in flight (limits.splice_max_pipes)."""
        return self.splicing.budget

    @property
    def spliced_frames(self) -> int:
        """Large frames spliced through so far."""
        return self.splicing.spliced_frames

    @property
    def splice_fallbacks(self) -> int:
        """Large frames copied for want of a pipe so far."""
        return self.splicing.fallbacks

    @property
    def shutting_down(self) -> bool:
        """True once :meth:`shutdown` has begun (it never becomes False again)."""
        return self._shutting_down

    @property
    def paused_readers(self) -> int:
        """Connections whose reads are paused by backpressure right now."""
        return sum(1 for pc in self.conns.values() if pc.paused)

    @property
    def busy_polls(self) -> int:
        """Event-loop passes spent polling without sleeping so far (``limits.busy_poll``)."""
        return self.busy_poll.passes

    def after_core(self) -> None:
        """Apply what the core decided (``core.effects``): write to the peers it queued
        frames for (the first time in a scheduler pass; later ones at the pass's end:
        ``io/batching.py``), close the connections of peers it kicked,
        re-arm the deadline timer. (Pauses and holds are the reader's that caused them.)

        Contract: whoever changes the core outside a connection's reader (a command run
        by operations code, a capture tap queueing frames, a policy change) calls this
        afterwards, in the trio thread; until then what the core queued is not sent.
        Cheap when nothing changed. Never raises for a peer's socket (send errors are
        left to that peer's writer).
        """
        core = self.core
        fx = core.effects
        wake = fx.wake
        if wake:
            self._writes.queued(wake)
            wake.clear()
        if fx.kicks:
            for p, code, message in fx.take_kicks():
                pc = self.conns.get(p)
                if pc is not None:
                    pc.kick(code, message)
        self._timer.arm(core.next_deadline())

    # -- one connection ----------------------------------------------------------------
    async def _refuse_out_of_fds(self, stream: Stream) -> None:
        """Tell a client accepted on the spare descriptor that the broker has none left.
        Waits at most 250 ms for the client's HELLO (so that its write finds the socket
        open and it reads our ERROR rather than EPIPE), not for its close as
        :func:`linger` does: the next such refusal waits for this one."""
        await send_final(
            stream,
            ErrorCode.LIMIT_EXCEEDED,
            "the broker is out of file descriptors: connection refused",
        )
        with trio.move_on_after(0.25):
            try:
                with translate_socket_errors():
                    await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _serve_connection(self, stream: Stream, tcp: bool = False) -> None:
        self.n_connections += 1
        pid = uid = gid = -1
        address = ""
        if tcp:
            address = peer_address(stream)
        else:
            assert isinstance(stream, trio.SocketStream)
            # TCP keeps the kernel's send buffer autotuning (setting SO_SNDBUF ends it).
            set_send_buffer(stream.socket, self.limits.socket_send_buffer)
            pid, uid, gid = peer_credentials(stream)
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
                await send_final(
                    stream,
                    ErrorCode.LIMIT_EXCEEDED,
                    f"max_connections={self.limits.max_connections} reached",
                )
                await linger(stream)
                return
            if self.fd_capacity is not None and self.n_connections > self.fd_capacity:
                # Before the descriptors run out: a clear refusal, not EMFILE later in
                # some other part of the broker.
                log.warning(
                    "refusing connection from %s: %d connections, all the RLIMIT_NOFILE "
                    "of this broker allows",
                    who,
                    self.fd_capacity,
                )
                await send_final(
                    stream,
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the broker's descriptor limit allows {self.fd_capacity} connections",
                )
                await linger(stream)
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
            hello = await read_hello(stream, conn, who, self.limits)
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
                await send_final(
                    stream,
                    ErrorCode.VERSION_MISMATCH,
                    f"broker speaks protocol version {PROTOCOL_VERSION}, "
                    f"client sent {header.get('version')!r}",
                    data={"supported": [PROTOCOL_VERSION]},
                )
                return
            where = ""
            if tcp:
                identity, why = authenticate(stream, header, self.tcp.tokens, who, name)
                if identity is None:
                    conn.check_send(FrameType.ERROR)
                    await send_final(stream, ErrorCode.UNAUTHENTICATED, why)
                    await linger(stream)
                    return
                principals = [f"tcp:{identity}"]
                where = f"tcp:{identity}@{address}"
                hello_pid = header.get("pid")
                # Not verifiable over TCP: shown to others as the client says.
                if isinstance(hello_pid, int) and not isinstance(hello_pid, bool):
                    pid = hello_pid
            else:
                principals = unix_principals(uid, gid)
            users = self.core.users
            why = users.admit(users.key_for(uid, tcp, principals))
            if why:
                self.core.stats["quota_refusals"] += 1
                log.warning("refusing %s (name=%r): %s", who, name, why)
                conn.check_send(FrameType.ERROR)
                await send_final(stream, ErrorCode.LIMIT_EXCEEDED, why)
                await linger(stream)
                return
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
            self.after_core()
            log.debug("client %s connected", peer.describe())
            await pc.run()
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
                await send_final(stream, exc.code, str(exc))
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
                        await send_final(stream, *pc.final_error)
                self.conns.pop(pc.peer, None)
                self.core.disconnect(pc.peer, pc.closing_reason or "closed")
                self.after_core()
                log.debug(
                    "client %s disconnected: %s", pc.peer.describe(), pc.closing_reason or "closed"
                )
            close_fds(conn.close())
            await trio.aclose_forcefully(stream)
