"""``msgq-trio serve``: configuration, logging, the broker, operations, signals.

Exit status: 0 after SIGINT/SIGTERM or the ``shutdown`` control command, 1 when the
broker cannot start (socket in use, not a socket, metrics port or capture directory
unusable), 2 for an invalid configuration, 70 if the broker itself crashed (logged).
Signals: SIGINT/SIGTERM shut down gracefully, SIGHUP reloads the configuration.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import attrs

from ..config import LOG_FORMATS, Limits, default_socket_path
from .config_file import ConfigError, ConfigSource

log = logging.getLogger("msgq_trio.serve")

EXIT_CANNOT_START = 1
EXIT_BAD_CONFIG = 2
EXIT_CRASHED = 70


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``serve``. Every flag defaults to None ("not given"), so that only
    flags actually given override the configuration file."""
    p.add_argument(
        "--config", "-c", type=Path, default=None, metavar="PATH",
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
    p.add_argument("--log-file", default=None, metavar="PATH",
                   help="append the log to this file instead of stderr")
    p.add_argument("--log-format", default=None, choices=LOG_FORMATS,
                   help="text (default) or json (one object per line)")
    p.add_argument("--syslog", action="store_true", default=None,
                   help="log to syslog/journald through /dev/log")
    p.add_argument("--listen", action="append", default=None, metavar="HOST:PORT",
                   help="also listen for TCP clients here (repeat; tcp.listen; TLS and tokens "
                        "from the configuration file, docs/SECURITY.md)")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any)")
    p.add_argument("--ctl-allow-uid", type=int, action="append", default=None, metavar="UID",
                   help="uid allowed to use control commands (repeat; default: the broker's)")
    p.add_argument("--capture-dir", default=None, metavar="DIR",
                   help="start capturing traffic to DIR (capture.enabled = true)")
    p.add_argument("--plugin", action="append", default=None, metavar="NAME",
                   help="run plugin NAME (repeat; its [plugins.NAME] table, if any, "
                        "configures it; docs/QUEUE.md)")


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
    if getattr(args, "listen", None) is not None:
        o["tcp.listen"] = list(args.listen)
    if args.ctl_allow_uid is not None:
        o["control.allow_uids"] = list(args.ctl_allow_uid)
    if args.capture_dir is not None:
        o["capture.dir"] = args.capture_dir
        o["capture.enabled"] = True
    for name in getattr(args, "plugin", None) or ():
        o[f"plugins.{name}"] = {}
    return o


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
    try:
        return trio.run(_serve, config, source)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.critical("the broker crashed", exc_info=True)
        return EXIT_CRASHED


def _single(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _serve(config: Any, source: ConfigSource) -> int:
    import trio

    from ..io.server import BrokerAlreadyRunning, Server
    from . import metrics
    from .control import Operations

    path = Path(config.socket) if config.socket else default_socket_path()
    server = Server(path, config.limits, tcp=config.tcp, access=config.access)
    listeners = None
    address = None
    if config.metrics.listen:
        try:
            listeners, address = await metrics.open_listeners(config.metrics.listen)
        except (OSError, ValueError) as exc:
            print(f"msgq-trio serve: cannot serve metrics on {config.metrics.listen}: {exc}",
                  file=sys.stderr)
            return EXIT_CANNOT_START
    ops = Operations(server, config, source, metrics_listeners=listeners,
                     metrics_address=address)
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
                    # (_shutting_down: a plugin leaving during shutdown is not restarted.)
                    supervisor = PluginSupervisor(
                        server.path, config.plugins, stopping=lambda: server._shutting_down
                    )
                    await nursery.start(supervisor.run)
                started = True
                print(f"msgq-trio broker listening on {server.path}", flush=True)
                scheme = "tls" if config.tcp.certfile else "tcp"
                for a in server.tcp_addresses:
                    print(f"msgq-trio broker listening on {scheme}://{a}", flush=True)
                if address is not None:
                    print(f"msgq-trio metrics on http://{address}/metrics", flush=True)

                async def on_signal() -> None:
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            log.info("received SIGHUP: reloading the configuration")
                            try:
                                ops.reload("SIGHUP")
                            except ConfigError:
                                pass  # logged by reload; the running configuration stays
                            continue
                        log.info("received %s", signal.Signals(signum).name)
                        await server.shutdown()
                        return

                nursery.start_soon(on_signal)
                # Ends by a signal or by the shutdown control command.
                await server.shutdown_complete.wait()
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
    log.info("broker stopped")
    return 0
