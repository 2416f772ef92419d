"""``msgq-trio serve``: configuration, logging, the broker, operations, signals.

Exit status: 0 after SIGINT/SIGTERM or the ``shutdown`` control command, 1 when the
broker cannot start (socket in use, not a socket, metrics port or capture directory
unusable), 2 for an invalid configuration, 70 if the broker itself crashed (logged).
Signals: SIGINT/SIGTERM shut down gracefully, SIGHUP reloads the configuration.

Under systemd (docs/DEPLOY.md): listening sockets passed by socket activation
(``LISTEN_FDS``/``LISTEN_PID``) are served instead of binding new ones, and with
``NOTIFY_SOCKET`` set the broker reports ``READY=1`` once every listener and plugin is
up, ``STOPPING=1`` when it begins to shut down, ``RELOADING=1`` around SIGHUP, and
``WATCHDOG=1`` every half ``WATCHDOG_USEC`` while its event loop runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from ..config import (
    LOG_FORMATS,
    Limits,
    default_socket_path,
    is_loopback,
    parse_socket_mode,
    resolve_group,
)
from ..runtime import tune_collector
from . import swallowed
from .config_file import ConfigError, ConfigSource

log = logging.getLogger("msgq_trio.serve")

EXIT_CANNOT_START = 1
EXIT_BAD_CONFIG = 2
EXIT_CRASHED = 70


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``serve``. Every flag defaults to None ("not given"), so that only
    flags actually given override the configuration file."""
    p.add_argument(
        "--config",
        "-c",
        type=Path,
        default=None,
        metavar="PATH",
        help="TOML configuration file (docs/CONFIG.md); flags override it; SIGHUP re-reads it",
    )
    for field in attrs.fields(Limits):
        typ = str(field.type)
        p.add_argument(
            "--" + field.name.replace("_", "-"),
            type=float if typ == "float" else int,
            default=None,
            metavar="N",
            help=f"limits.{field.name} (default {field.default})",
        )
    p.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="append the log to this file instead of stderr",
    )
    p.add_argument(
        "--log-format",
        default=None,
        choices=LOG_FORMATS,
        help="text (default) or json (one object per line)",
    )
    p.add_argument(
        "--syslog",
        action="store_true",
        default=None,
        help="log to syslog/journald through /dev/log",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="also listen for TCP clients here (repeat; tcp.listen; TLS and tokens "
        "from the configuration file, docs/SECURITY.md)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any)",
    )
    p.add_argument(
        "--otel",
        action="store_true",
        default=None,
        help="emit OpenTelemetry spans of traced traffic (tracing.otel; exporter from "
        "OTEL_TRACES_EXPORTER etc.; needs the otel extra)",
    )
    p.add_argument(
        "--ctl-allow-uid",
        type=int,
        action="append",
        default=None,
        metavar="UID",
        help="uid allowed to use control commands (repeat; default: the broker's)",
    )
    p.add_argument(
        "--capture-dir",
        default=None,
        metavar="DIR",
        help="start capturing traffic to DIR (capture.enabled = true)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=None,
        metavar="NAME",
        help="run plugin NAME (repeat; its [plugins.NAME] table, if any, "
        "configures it; docs/QUEUE.md)",
    )
    p.add_argument(
        "--pipe-peer",
        action="append",
        default=None,
        metavar="ADDRESS",
        help="a peer broker whose pipe service joins this one's (repeat; "
        "plugins.pipe.peers, replaced; enables the pipe plugin; docs/PIPES.md)",
    )
    p.add_argument(
        "--socket-mode",
        default=None,
        metavar="MODE",
        help="permission bits of the socket file, e.g. 0660 (socket_mode; "
        "default: as the umask makes them)",
    )
    p.add_argument(
        "--socket-group",
        default=None,
        metavar="GROUP",
        help="group of the socket file, a name or gid (socket_group); with "
        "--socket-mode 0660 its members may connect",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="durable state (state_dir; default $STATE_DIRECTORY, "
        "/var/lib/msgq-trio for root, else ~/.local/state/msgq-trio)",
    )
    p.add_argument(
        "--queue-dir",
        default=None,
        metavar="DIR",
        help="run the queue plugin with its store in DIR (plugins.queue.dir; "
        "default <state dir>/queue)",
    )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted configuration keys for the flags that were given."""
    o: dict[str, Any] = {}
    if getattr(args, "socket", None) is not None:
        o["socket"] = str(args.socket)
    for field in attrs.fields(Limits):
        v = getattr(args, field.name, None)
        if v is not None:
            o[f"limits.{field.name}"] = v
    if getattr(args, "log_level", None) is not None:
        o["log.level"] = args.log_level
    if args.log_file is not None:
        o["log.file"] = args.log_file
    if args.log_format is not None:
        o["log.format"] = args.log_format
    if args.syslog:
        o["log.syslog"] = True
    if args.metrics is not None:
        o["metrics.listen"] = args.metrics
    if getattr(args, "otel", None):
        o["tracing.otel"] = True
    if getattr(args, "listen", None) is not None:
        o["tcp.listen"] = list(args.listen)
    if args.ctl_allow_uid is not None:
        o["control.allow_uids"] = list(args.ctl_allow_uid)
    if args.capture_dir is not None:
        o["capture.dir"] = args.capture_dir
        o["capture.enabled"] = True
    for name in getattr(args, "plugin", None) or ():
        o[f"plugins.{name}"] = {}
    if getattr(args, "pipe_peer", None):
        o.setdefault("plugins.pipe", {})["peers"] = list(args.pipe_peer)
    for key in ("socket_mode", "socket_group", "state_dir"):
        if getattr(args, key, None) is not None:
            o[key] = getattr(args, key)
    if getattr(args, "queue_dir", None) is not None:
        o["plugins.queue"] = {"dir": os.path.abspath(args.queue_dir)}
    return o


# -- systemd ----------------------------------------------------------------------------------
#: The first descriptor passed by socket activation (SD_LISTEN_FDS_START in sd-daemon.h).
LISTEN_FDS_START = 3


def activated_sockets() -> list[socket.socket]:
    """The listening sockets passed by socket activation, or [] if none were passed.

    The protocol: ``LISTEN_PID`` is this process's pid and ``LISTEN_FDS`` says how many
    descriptors start at 3. The variables are removed from the environment and the
    descriptors marked close-on-exec, so plugin processes inherit neither.

    Raises:
        RuntimeError: a passed descriptor is not a listening stream socket (a unit
            misconfiguration: e.g. ``Accept=yes`` or a datagram socket).
    """
    pid = os.environ.pop("LISTEN_PID", "")
    count = os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if not pid or not count or pid != str(os.getpid()):
        return []
    out = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            raise RuntimeError(
                f"socket activation passed descriptor {fd} that is not a listening stream "
                "socket (the .socket unit needs ListenStream= and Accept=no)"
            )
        out.append(sock)
    if sum(1 for s in out if s.family == socket.AF_UNIX) > 1:
        raise RuntimeError(
            "socket activation passed more than one Unix socket; the broker "
            "serves one (give the .socket unit one ListenStream= path)"
        )
    return out


class Notifier:
    """sd_notify(3): state changes as datagrams to ``$NOTIFY_SOCKET`` (a path, or an
    abstract name when it starts with ``@``). Without the variable every call does
    nothing. The variable is taken out of the environment so that plugin processes
    cannot report for the broker."""

    def __init__(self) -> None:
        addr = os.environ.pop("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + addr[1:]) if addr.startswith("@") else (addr or None)
        usec = os.environ.pop("WATCHDOG_USEC", "")
        wpid = os.environ.pop("WATCHDOG_PID", "")
        #: Seconds between WATCHDOG=1 pings: half the manager's timeout, as sd_watchdog_enabled
        #: advises; None when no watchdog is asked for (or it is for another process).
        self.watchdog_interval: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 2e6

    def notify(self, *fields: str, wait: float = 1.0) -> None:
        """Send ``fields`` (``"READY=1"``, ``"STATUS=..."``) as one datagram, waiting at
        most ``wait`` seconds for room in the manager's queue; a failure is logged, never
        raised: the broker serves on whether or not the manager listens."""
        if self.address is None:
            return
        # Bounded: this runs on the event loop, and a manager that does not read fills
        # its socket's small datagram queue (net.unix.max_dgram_qlen, 10 by default); an
        # unbounded send would then stop the broker, SIGTERM included.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(wait)
                s.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            log.warning("cannot notify the service manager at %r: %s", self.address, exc)

    async def watchdog(self) -> None:
        """Ping the watchdog until cancelled (a stuck event loop stops the pings)."""
        import trio

        if self.watchdog_interval is None:
            return
        while True:
            self.notify("WATCHDOG=1", wait=0.0)  # a ping not taken is dropped, not waited for
            await trio.sleep(self.watchdog_interval)


def serve_main(args: argparse.Namespace) -> int:
    """Load and check the configuration, set up logging, run the broker."""
    import trio

    from . import logsetup

    source = ConfigSource(args.config, overrides_from_args(args))
    try:
        config = source.load()
    except ConfigError as exc:
        print(f"msgq-trio serve: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        logsetup.configure(config.log)
    except logsetup.LogFileError as exc:
        print(f"msgq-trio serve: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    logsetup.install_exception_hooks()
    tune_collector(config.gc_threshold)
    raise_fd_limit()
    from ..io.housekeeping import tune_malloc

    tune_malloc()
    try:
        # KeyboardInterrupt (before the signal receiver opens) only at checkpoints: one
        # raised elsewhere can leave a nursery half updated (ops/interrupt.py).
        return trio.run(_serve, config, source, restrict_keyboard_interrupt_to_checkpoints=True)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.critical("the broker crashed", exc_info=True)
        return EXIT_CRASHED


def raise_fd_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit (logged): each client is a
    descriptor, and the usual soft limit of 1,024 would stop the broker far below
    ``max_connections``. What the limit still leaves is enforced at admission
    (io/listeners.py, ``fd_connection_capacity``). Plugins and other children inherit it."""
    import resource

    from .._procs import raise_nofile

    before, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        soft, hard = raise_nofile()
    except (OSError, ValueError) as exc:
        log.warning("cannot raise RLIMIT_NOFILE from %d: %s", before, exc)
        return
    if soft != before:
        log.info("raised RLIMIT_NOFILE from %d to %d (the hard limit)", before, soft)
    else:
        log.info("RLIMIT_NOFILE is %d (hard limit %d)", soft, hard)


def _single(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _serve(config: Any, source: ConfigSource) -> int:
    import trio

    from ..io.server import BrokerAlreadyRunning, Server
    from ..plugins.loader import PluginConfigError, access_declarations, enforced_commands
    from .control import Operations

    path = Path(config.socket) if config.socket else default_socket_path()
    notifier = Notifier()
    try:
        activated = activated_sockets()
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"msgq-trio serve: cannot start: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    for s in activated:
        if (
            s.family != socket.AF_UNIX
            and not config.tcp.certfile
            and not (config.tcp.insecure and is_loopback(s.getsockname()[0]))
        ):
            # The same rule as for tcp.listen (docs/SECURITY.md), for a socket unit.
            print(
                f"msgq-trio serve: cannot start: socket activation passed the TCP "
                f"listener {s.getsockname()[0]}:{s.getsockname()[1]} but TLS is not "
                "configured (tcp.certfile/keyfile; plain TCP only on loopback with "
                "tcp.insecure)",
                file=sys.stderr,
            )
            return EXIT_CANNOT_START
    try:
        # The verbs the plugins' commands need (plugins/api.py), read before any client
        # can connect: the policy is complete from the first frame.
        declared = access_declarations(config.plugins)
        commands = enforced_commands(config.access, declared)
    except PluginConfigError as exc:
        print(f"msgq-trio serve: cannot start: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    server = Server(
        path,
        config.limits,
        tcp=config.tcp,
        access=config.access,
        commands=commands,
        activated=activated,
        socket_mode=parse_socket_mode(config.socket_mode),
        socket_gid=resolve_group(config.socket_group),
        quotas=config.quotas,
    )
    otel_sink = None
    if config.tracing.otel:
        from .otel import OtelError, open_sink

        try:
            otel_sink = open_sink(config.tracing.otel_file)
        except OtelError as exc:
            print(f"msgq-trio serve: cannot start: {exc}", file=sys.stderr)
            return EXIT_CANNOT_START
        server.core.traces.sink = otel_sink
    listeners = None
    address = None
    if config.metrics.listen:
        from .. import exposition  # prometheus_client, only for a broker serving metrics

        try:
            listeners, address = await exposition.open_listeners(config.metrics.listen)
        except (OSError, ValueError) as exc:
            print(
                f"msgq-trio serve: cannot serve metrics on {config.metrics.listen}: {exc}",
                file=sys.stderr,
            )
            return EXIT_CANNOT_START
    ops = Operations(
        server,
        config,
        source,
        declared_access=declared,
        metrics_listeners=listeners,
        metrics_address=address,
    )
    ops.install()
    started = False
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(ops.run)
                await nursery.start(server.run)
                if config.plugins:
                    from ..plugins.supervisor import PluginSupervisor

                    # Plugins connect to the socket as ordinary clients, so they start
                    # once it listens; "listening" is printed when they are ready too.
                    # (shutting_down: a plugin leaving during shutdown is not restarted.)
                    supervisor = PluginSupervisor(
                        server.path,
                        config.plugins,
                        stopping=lambda: server.shutting_down,
                        gc_threshold=config.gc_threshold,
                        otel_file=config.tracing.otel_file if otel_sink is not None else None,
                    )
                    await nursery.start(supervisor.run)
                started = True
                print(f"msgq-trio broker listening on {server.path}", flush=True)
                scheme = "tls" if config.tcp.certfile else "tcp"
                for a in server.tcp_addresses:
                    print(f"msgq-trio broker listening on {scheme}://{a}", flush=True)
                if address is not None:
                    print(f"msgq-trio metrics on http://{address}/metrics", flush=True)
                notifier.notify(
                    "READY=1", f"MAINPID={os.getpid()}", f"STATUS=serving on {server.path}"
                )
                nursery.start_soon(notifier.watchdog)

                async def on_signal() -> None:
                    if swallowed.pending():
                        # Ctrl-C during start-up that the interpreter swallowed.
                        log.info("received SIGINT during start-up")
                        notifier.notify("STOPPING=1", "STATUS=shutting down")
                        await server.shutdown()
                        return
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            log.info("received SIGHUP: reloading the configuration")
                            # Type=notify-reload wants MONOTONIC_USEC with RELOADING=1.
                            now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
                            notifier.notify("RELOADING=1", f"MONOTONIC_USEC={now_us}")
                            try:
                                ops.reload("SIGHUP")
                            except ConfigError:
                                pass  # logged by reload; the running configuration stays
                            notifier.notify("READY=1", f"STATUS=serving on {server.path}")
                            continue
                        log.info("received %s", signal.Signals(signum).name)
                        notifier.notify("STOPPING=1", "STATUS=shutting down")
                        await server.shutdown()
                        return

                nursery.start_soon(on_signal)
                # Ends by a signal or by the shutdown control command.
                await server.shutdown_complete.wait()
                notifier.notify("STOPPING=1")  # also after the shutdown control command
                nursery.cancel_scope.cancel()
    except BaseException as group:
        inner = _single(group)
        if isinstance(inner, BrokerAlreadyRunning):
            print(f"msgq-trio serve: {inner}", file=sys.stderr)
            return EXIT_CANNOT_START
        if not started and isinstance(inner, (RuntimeError, OSError)):
            print(f"msgq-trio serve: cannot start: {inner}", file=sys.stderr)
            log.error("cannot start: %s", inner)
            return EXIT_CANNOT_START
        raise
    if otel_sink is not None:
        otel_sink.close()  # what is still batched is exported
    log.info("broker stopped")
    return 0
