"""Command line: ``msgq-trio serve | send | call | listen | members | demo | bench``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from . import __version__
from .config import Limits, default_socket_path

log = logging.getLogger("msgq_trio.cli")


def _add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        "-s",
        type=Path,
        default=None,
        help="broker socket (default: $MSGQ_TRIO_SOCKET or the per-user path)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msgq-trio", description=__doc__)
    parser.add_argument("--version", action="version", version=f"msgq-trio {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="run the broker daemon")
    _add_socket(p)
    defaults = Limits()
    for field in (
        "max_frame_size",
        "out_soft_limit",
        "out_hard_limit",
        "max_pending_requests",
        "max_subscriptions",
        "max_connections",
    ):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    for field in (
        "slow_consumer_timeout",
        "request_timeout",
        "idle_in_frame_timeout",
        "handshake_timeout",
        "shutdown_grace",
    ):
        p.add_argument("--" + field.replace("_", "-"), type=float, default=getattr(defaults, field))

    p = sub.add_parser("send", help="send one message (body: JSON)")
    _add_socket(p)
    p.add_argument("target")
    p.add_argument("body", nargs="?", default="null")

    p = sub.add_parser("call", help="call a command and print its result as JSON")
    _add_socket(p)
    p.add_argument("target")
    p.add_argument("command")
    p.add_argument("params", nargs="?", default="null", help="JSON")
    p.add_argument("--timeout", type=float, default=None)

    p = sub.add_parser("notify", help="publish a notification")
    _add_socket(p)
    p.add_argument("group")
    p.add_argument("event")
    p.add_argument("params", nargs="?", default="null", help="JSON")

    p = sub.add_parser("listen", help="subscribe to groups and print what arrives")
    _add_socket(p)
    p.add_argument("groups", nargs="+")
    p.add_argument("--count", type=int, default=0, help="exit after N messages")

    p = sub.add_parser("members", help="list the members of a group")
    _add_socket(p)
    p.add_argument("group")

    p = sub.add_parser("demo", help="start a broker and show messages and RPC flowing")
    p.add_argument("--socket", "-s", type=Path, default=None)

    p = sub.add_parser("bench", help="benchmark msgq_trio next to a raw socket ceiling")
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("scenario", help="run fault scenarios (scenarios/*.toml)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msgq-trio``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.cmd == "serve":
            return trio.run(_serve, args)
        if args.cmd == "demo":
            from .demo import run_demo

            return run_demo(args.socket)
        if args.cmd == "bench":
            from .bench.run import main as bench_main

            return int(bench_main(args.args))
        if args.cmd == "scenario":
            from .scenario.cli import main as scenario_main

            return scenario_main(args.args)
        return trio.run(_client_command, args)
    except KeyboardInterrupt:
        return 130


async def _serve(args: argparse.Namespace) -> int:
    from .io.server import BrokerAlreadyRunning, Server

    try:
        limits = Limits(
            **{
                f: getattr(args, f)
                for f in (
                    "max_frame_size",
                    "out_soft_limit",
                    "out_hard_limit",
                    "max_pending_requests",
                    "max_subscriptions",
                    "max_connections",
                    "slow_consumer_timeout",
                    "request_timeout",
                    "idle_in_frame_timeout",
                    "handshake_timeout",
                    "shutdown_grace",
                )
            }
        )
    except (ValueError, TypeError) as exc:
        print(f"msgq-trio serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    server = Server(args.socket or default_socket_path(), limits)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                print(f"msgq-trio broker listening on {server.path}", flush=True)

                async def on_signal() -> None:
                    async for signum in signals:
                        log.info("received %s", signal.Signals(signum).name)
                        await server.shutdown()
                        await server.shutdown_complete.wait()
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(on_signal)
    except BrokerAlreadyRunning as exc:
        print(f"msgq-trio serve: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError) as exc:
        print(f"msgq-trio serve: cannot listen: {exc}", file=sys.stderr)
        return 1
    log.info("broker stopped")
    return 0


async def _client_command(args: argparse.Namespace) -> int:
    from . import connect
    from .errors import MsgqError, RpcError

    try:
        async with connect(args.socket, name=f"msgq-trio-{args.cmd}") as bus:
            if args.cmd == "send":
                await bus.send(args.target, json.loads(args.body))
                await bus.flush()
            elif args.cmd == "call":
                result = await bus.call(
                    args.target, args.command, json.loads(args.params), timeout=args.timeout
                )
                print(json.dumps(result, default=_json_default))
            elif args.cmd == "notify":
                await bus.notify(args.group, args.event, json.loads(args.params))
                await bus.flush()
            elif args.cmd == "members":
                for m in await bus.members(args.group):
                    print(f"{m.lname}\t{m.name}\tpid={m.pid}")
            elif args.cmd == "listen":
                for g in args.groups:
                    await bus.subscribe(g)
                n = 0
                async for msg in bus:
                    print(
                        json.dumps(
                            {
                                "kind": msg.kind,
                                "from": msg.sender,
                                "name": msg.sender_name,
                                "to": msg.target,
                                "event": msg.event,
                                "body": msg.body,
                            },
                            default=_json_default,
                        ),
                        flush=True,
                    )
                    n += 1
                    if args.count and n >= args.count:
                        break
    except RpcError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.data is not None:
            print(json.dumps(exc.data, default=_json_default), file=sys.stderr)
        return 1
    except MsgqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return repr(value)


if __name__ == "__main__":
    sys.exit(main())
