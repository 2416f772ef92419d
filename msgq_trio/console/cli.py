"""``msgq-trio console``: start the web console and print its URL on the first line.

Loopback by default. Any other address needs TLS (``--tls-certfile``/``--tls-keyfile``)
and a login with the broker's tokens (so the broker must be reached over ``tcp://`` or
``tls://``, where it checks tokens): the console refuses to start otherwise, naming what
is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from ..ops.ctl_client import CliUsageError, connect_options
from .model import DEFAULT_INTERVAL

DEFAULT_LISTEN = "127.0.0.1:8470"


def add_console_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"where the console serves its page (default {DEFAULT_LISTEN}; port 0: any "
        "free port); an address other than loopback needs --tls-certfile/--tls-keyfile "
        "and a tcp:// or tls:// broker (viewers log in with its tokens)",
    )
    p.add_argument("--tls-certfile", default=None, metavar="PEM", help="serve HTTPS with this")
    p.add_argument("--tls-keyfile", default=None, metavar="PEM", help="its private key")
    p.add_argument(
        "--login",
        action="store_true",
        help="viewers log in with a broker token also on loopback (their actions run as "
        "that identity); always on for other addresses",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL,
        help=f"seconds between snapshots of the broker (default {DEFAULT_INTERVAL})",
    )


def split_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) as host and port. Raises CliUsageError."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise CliUsageError(f"--listen wants HOST:PORT, got {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def is_loopback(host: str) -> bool:
    import ipaddress  # here: every command line builds this parser

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(host: str, *, tls: bool, login: bool, broker: str | None) -> None:
    """Refuse a non-loopback console without TLS or login (CliUsageError saying which)."""
    if is_loopback(host):
        if login and not _tcp_broker(broker):
            raise CliUsageError(
                "--login needs a tcp:// or tls:// broker address (-s): only there does the "
                "broker check tokens"
            )
        return
    if not tls:
        raise CliUsageError(
            f"--listen {host} is not loopback: serve it over TLS "
            "(--tls-certfile and --tls-keyfile), or listen on 127.0.0.1"
        )
    if not _tcp_broker(broker):
        raise CliUsageError(
            f"--listen {host} is not loopback: viewers must log in with a broker token, so "
            "reach the broker over tcp:// or tls:// (-s), where it checks tokens"
        )


def _tcp_broker(broker: str | None) -> bool:
    import os

    address = broker or os.environ.get("MSGQ_TRIO_SOCKET") or ""
    return address.startswith(("tcp://", "tls://"))


def run_console(args: argparse.Namespace) -> int:
    """Run until Ctrl-C or SIGTERM; exit status 0, 2 for bad options."""
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from .app import create_app
    from .service import Console

    host, port = split_listen(args.listen)
    tls = bool(args.tls_certfile)
    if tls != bool(args.tls_keyfile):
        raise CliUsageError("--tls-certfile and --tls-keyfile go together")
    login = bool(args.login) or not is_loopback(host)
    check_listen(host, tls=tls, login=login, broker=args.socket)
    if not args.interval > 0:
        raise CliUsageError(f"--interval must be positive, got {args.interval}")
    kw: dict[str, Any] = connect_options(args)
    console = Console(args.socket, kw, login=login, interval=args.interval)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None  # the console logs through logging; hypercorn stays quiet
    if tls:
        config.certfile = args.tls_certfile
        config.keyfile = args.tls_keyfile

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            # SIGTERM (systemd, kill) and Ctrl-C end the console quietly, status 0.
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            await nursery.start(console.run)
            binds = await nursery.start(serve, create_app(console, secure=tls), config)
            print(binds[0] + "/", flush=True)
            if console.bus is None:
                print(
                    f"msgq-trio console: broker not reachable yet ({args.socket or 'default'}); "
                    "retrying",
                    file=sys.stderr,
                    flush=True,
                )

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as group:
        # The listening socket is made inside hypercorn's nursery: an address in use or
        # not ours is the operator's to fix, not a traceback.
        match, rest = group.split(OSError)
        if match is None or rest is not None:
            raise
        first = next(_leaves(match))
        raise CliUsageError(f"cannot listen on {args.listen}: {first}") from None
    except OSError as exc:
        raise CliUsageError(f"cannot listen on {args.listen}: {exc}") from None
    return 0


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


async def _stop_on_signal(scope: Any) -> None:
    import signal

    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return
