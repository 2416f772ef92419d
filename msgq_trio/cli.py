"""Command line: ``msgq-trio serve | ctl | dump | send | call | listen | members | pipe |
queue | demo | bench | scenario | analyze``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from . import __version__
from .ops.ctl_client import add_ctl_arguments, add_dump_arguments
from .ops.queue_cli import add_queue_arguments
from .ops.serve import add_serve_arguments

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
        "--log-level",
        default=None,
        choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRAFFIC"],
        help="default INFO (serve: log.level of the configuration file); TRAFFIC logs "
        "every frame the broker routes",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="run the broker daemon")
    _add_socket(p)
    add_serve_arguments(p)

    p = sub.add_parser(
        "token", help="make a random token for a TCP client and its [tcp.tokens] line"
    )
    p.add_argument("identity", help="the identity name the token stands for (tcp:NAME)")

    p = sub.add_parser(
        "ctl", help="control a running broker: clients, drop, shutdown, config, stats, capture"
    )
    add_ctl_arguments(p)

    p = sub.add_parser("dump", help="show the traffic through the broker live")
    add_dump_arguments(p)

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

    p = sub.add_parser("pipe", help="named pipe: 'write NAME' sends stdin, 'read NAME' "
                       "prints it (docs/PIPES.md)")
    _add_socket(p)
    from .client.pipe import add_cli_arguments

    add_cli_arguments(p)

    p = sub.add_parser("queue", help="the queue plugin's durable queues: ls, stats, peek, "
                       "purge (docs/QUEUE.md)")
    add_queue_arguments(p)

    p = sub.add_parser("demo", help="start a broker and show messages and RPC flowing")
    p.add_argument("--socket", "-s", type=Path, default=None)

    p = sub.add_parser("bench", help="benchmark msgq_trio next to a raw socket ceiling")
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("scenario", help="run fault scenarios (scenarios/*.toml)")
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser("analyze", help="analyse captures and scenario results on Spark "
                       "(needs the 'spark' extra)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


#: Subcommands with their own argument parser: everything after the name is theirs
#: (argparse's REMAINDER would reject a first argument that looks like an option).
_DELEGATED = ("bench", "scenario", "analyze")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msgq-trio``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        logging.basicConfig(level=logging.WARNING)
        if argv[0] == "bench":
            from .bench.run import main as bench_main

            return int(bench_main(argv[1:]))
        if argv[0] == "analyze":  # pyspark is imported only when a job runs
            from .analytics.cli import main as analyze_main

            return int(analyze_main(argv[1:]))
        from .scenario.cli import main as scenario_main

        return int(scenario_main(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.cmd == "token":
        import secrets

        from .core.access import hash_token

        token = secrets.token_urlsafe(32)  # 256 bits: no dictionary to attack the hash with
        print(f"token (give it to the client, e.g. as $MSGQ_TRIO_TOKEN): {token}")
        print("configuration line (under [tcp.tokens]):")
        print(f'{json.dumps(args.identity)} = "{hash_token(token)}"')
        return 0
    if args.cmd == "serve":
        from .ops.serve import serve_main

        return serve_main(args)  # configures logging from the file and flags
    level = args.log_level or "INFO"
    logging.basicConfig(
        level=logging.DEBUG if level == "TRAFFIC" else getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.cmd == "ctl":
            from .ops.ctl_client import run_ctl

            return trio.run(run_ctl, args)
        if args.cmd == "dump":
            from .ops.ctl_client import run_dump

            return trio.run(run_dump, args)
        if args.cmd == "pipe":
            from .client.pipe import run_cli

            return trio.run(run_cli, args)
        if args.cmd == "queue":
            from .ops.queue_cli import run_queue

            return trio.run(run_queue, args)
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
