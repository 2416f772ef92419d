# PYTHON_ARGCOMPLETE_OK (argcomplete looks for this marker to offer completion)
"""The msgq-trio command line: serve, ctl, dump, send, call, notify, listen, reply, members,
introspect, pipe, queue, token, demo, scenario, analyze.

Broker address: -s/--socket takes a socket path or a tcp://HOST:PORT / tls://HOST:PORT URL
(default $MSGQ_TRIO_SOCKET, else the per-user socket). Remote brokers: --token (or
$MSGQ_TRIO_TOKEN), --tls-ca (or $MSGQ_TRIO_TLS_CA), --tls-cert/--tls-key for a client
certificate. These flags and --log-level go before or after the subcommand.

Exit status: 0 done; 1 the command failed (one "error:" line on stderr says why); 2 bad
usage or input (e.g. a body that is not JSON); 130 interrupted (Ctrl-C); 141 the reader
of standard output went away (| head).

Shell completion: with argcomplete installed (the 'completion' extra), run
eval "$(register-python-argcomplete msgq-trio)" in bash or zsh.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

# The rest is imported where it is used: until main() runs, Ctrl-C can only end the
# program with a traceback, so the module does as little as it can before main().

log = logging.getLogger("msgq_trio.cli")

EXIT_FAILED = 1
EXIT_USAGE = 2
#: 128 + SIGINT and 128 + SIGPIPE: what a shell reports for a program those signals end,
#: so scripts see the same status as with other command line tools.
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

#: Subcommands with their own argument parser: everything after the name is theirs
#: (argparse's REMAINDER would reject a first argument that looks like an option).
_DELEGATED = ("scenario", "analyze")
#: Subcommands that talk to a broker as a client: they take --token and the TLS flags.
_CLIENTS = (
    "ctl",
    "dump",
    "send",
    "call",
    "notify",
    "listen",
    "reply",
    "members",
    "pipe",
    "queue",
    "introspect",
    "trace",
    "console",
)
#: Values of the flags accepted anywhere (added with default SUPPRESS at every level, so
#: a flag given before the subcommand is not reset by the subcommand's copy).
GLOBAL_DEFAULTS: dict[str, Any] = {
    "log_level": None,
    "socket": None,
    "token": None,
    "tls_ca": None,
    "tls_cert": None,
    "tls_key": None,
}


def plain(doc: str | None) -> str:
    """A docstring as --help text: reST literals (````x````) and roles (``:func:`x```)
    shown as plain text."""
    import re

    text = doc or ""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line (the usage itself is in --help), exit 2;
    subcommands' parsers are of this class too (argparse copies the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_global_flags(p: argparse.ArgumentParser, *, client: bool) -> None:
    """--log-level and --socket (and for clients --token, --tls-*), default SUPPRESS.
    A parser that already has one of them (e.g. its own -s) keeps its own."""

    def add(*names: str, **kw: Any) -> None:
        try:
            p.add_argument(*names, default=argparse.SUPPRESS, **kw)
        except argparse.ArgumentError:
            pass  # already defined by this parser

    add(
        "--log-level",
        choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRAFFIC"],
        help="default INFO (serve: log.level of the configuration file); TRAFFIC logs "
        "every frame the broker routes",
    )
    add(
        "--socket",
        "-s",
        metavar="ADDRESS",
        help="broker socket path, or tcp://HOST:PORT / tls://HOST:PORT (default: "
        "$MSGQ_TRIO_SOCKET or the per-user path)",
    )
    if not client:
        return
    add(
        "--token",
        metavar="TOKEN",
        help="credential for a TCP/TLS broker (default $MSGQ_TRIO_TOKEN; `msgq-trio token` "
        "makes one)",
    )
    add(
        "--tls-ca",
        metavar="PEM",
        help="CA bundle to trust a tls:// broker with (default $MSGQ_TRIO_TLS_CA, else the "
        "system's trust store)",
    )
    add(
        "--tls-cert",
        metavar="PEM",
        help="client certificate chain for tls:// (default $MSGQ_TRIO_TLS_CERT)",
    )
    add(
        "--tls-key",
        metavar="PEM",
        help="its private key (default $MSGQ_TRIO_TLS_KEY; default: in --tls-cert)",
    )


def _subparsers(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser below ``p`` (the choices of its subparsers, recursively)."""
    for action in p._actions:  # argparse has no public walk over subparsers
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield child
                yield from _subparsers(child)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``msgq-trio`` (delegated subcommands only show their help line)."""
    from . import __version__
    from .console.cli import add_console_arguments
    from .ops.ctl_client import add_ctl_arguments, add_dump_arguments
    from .ops.introspect_cli import add_call_check_arguments, add_introspect_arguments
    from .ops.queue_cli import add_queue_arguments
    from .ops.serve import add_serve_arguments
    from .ops.trace_cli import add_trace_arguments
    from .protocol.framing import SPEEDUPS

    parser = _Parser(
        prog="msgq-trio",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Which frame codec runs (README "Install"): a benchmark or a bug report names it.
    build = "compiled fast path" if SPEEDUPS else "pure Python"
    parser.add_argument("--version", action="version", version=f"msgq-trio {__version__} ({build})")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the broker daemon")
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
    p.add_argument("target", help="a group or an lname (l.N)")
    p.add_argument(
        "body",
        nargs="?",
        default="null",
        help="the message body as JSON (default null; a string needs quotes: '\"text\"')",
    )

    p = sub.add_parser("call", help="call a command and print its result as JSON")
    p.add_argument("target", help="the group (or lname) that answers the command")
    p.add_argument("command", help="the command's name")
    p.add_argument("params", nargs="?", default="null", help="parameters as JSON (default null)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the answer (default: the broker's request deadline)",
    )
    add_call_check_arguments(p)

    p = sub.add_parser(
        "trace", help="make one traced call and print the tree of its hops with their times"
    )
    add_trace_arguments(p)

    p = sub.add_parser("notify", help="publish a notification")
    p.add_argument("group", help="the group to notify")
    p.add_argument("event", help="the event's name")
    p.add_argument("params", nargs="?", default="null", help="parameters as JSON (default null)")

    p = sub.add_parser("listen", help="subscribe to groups and print what arrives")
    p.add_argument("groups", nargs="+", help="groups or patterns (Zone.*, Zone.>) to subscribe to")
    p.add_argument("--count", type=int, default=0, help="exit after N messages")

    p = sub.add_parser(
        "reply",
        help="answer a command from the shell: print each request "
        "(JSON line) and answer it with RESULT",
    )
    p.add_argument("group", help="the group to join (callers call GROUP COMMAND)")
    p.add_argument("command", help="the command to answer")
    p.add_argument("result", nargs="?", default="null", help="the answer as JSON (default null)")
    p.add_argument("--count", type=int, default=0, help="exit after answering N requests")

    p = sub.add_parser(
        "introspect", help="groups, members and the commands and events each declares"
    )
    add_introspect_arguments(p)

    p = sub.add_parser("members", help="list the members of a group")
    p.add_argument("group", help="the group")
    p.add_argument("--json", action="store_true", help="one JSON array of members")

    p = sub.add_parser(
        "pipe", help="named pipe: 'write NAME' sends stdin, 'read NAME' prints it (docs/PIPES.md)"
    )
    _pipe_arguments(p)

    p = sub.add_parser(
        "queue", help="the queue plugin's durable queues: ls, stats, peek, purge (docs/QUEUE.md)"
    )
    add_queue_arguments(p)

    p = sub.add_parser(
        "console", help="the web console: see the bus live and act on it (docs/CONSOLE.md)"
    )
    add_console_arguments(p)

    sub.add_parser("demo", help="start a broker and show messages and RPC flowing")
    for name, text in (
        ("scenario", "run fault scenarios (scenarios/*.toml)"),
        ("analyze", "analyse captures and scenario results on Spark (needs the 'spark' extra)"),
    ):
        p = sub.add_parser(name, help=f"{text} (msgq-trio {name} --help)")
        p.add_argument(
            "args", nargs=argparse.REMAINDER, help=f"arguments of msgq-trio {name} (its own --help)"
        )

    _add_global_flags(parser, client=True)
    for name, child in sub.choices.items():
        _add_global_flags(child, client=name in _CLIENTS)
        for grandchild in _subparsers(child):
            _add_global_flags(grandchild, client=name in _CLIENTS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msgq-trio``; returns the exit status (see the module docstring).

    ``argv`` None: this is the program (the console script, ``python -m msgq_trio``),
    which ignores Ctrl-C once its status is known: the interpreter's exit that follows
    would otherwise die of the signal (status -2 instead of 130) or print a traceback;
    and which records a Ctrl-C the interpreter swallowed (``ops/swallowed.py``).
    """
    program = argv is None
    if program:
        from .ops import swallowed

        swallowed.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here for buffered output
        if program:
            swallowed.raise_if_pending()  # a short command that ran on regardless
    except BaseException as exc:
        if program:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return _exit_status(exc)
    if program:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _interrupted(exc: BaseException) -> bool:
    """Ctrl-C, or an error raised *from* it: Python 3.11 turns a KeyboardInterrupt in a
    descriptor's ``__set_name__`` (a class being defined while a module imports) into
    ``RuntimeError("Error calling __set_name__ ...")`` with the interrupt as its cause."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__
    return False


def _exit_status(exc: BaseException) -> int:
    """The status for an exception that ended the command, or re-raise it (a bug).

    Ctrl-C and a closed standard output end a command, quietly, even when trio wrapped
    them in exception groups or the interpreter in another error (``_interrupted``);
    SystemExit (argparse) keeps its status."""
    leaves = list(_leaves(exc))
    if all(_interrupted(e) for e in leaves):
        return EXIT_INTERRUPTED
    if all(isinstance(e, BrokenPipeError) or _interrupted(e) for e in leaves):
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else EXIT_FAILED
    raise exc


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's final flush would raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _delegate(name: str, argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    if name == "analyze":  # pyspark is imported only when a job runs
        from .analytics.cli import main as analyze_main

        return int(analyze_main(argv))
    from .scenario.cli import main as scenario_main

    return int(scenario_main(argv))


def _complete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request and exit (argcomplete's protocol); nothing
    happens without argcomplete installed."""
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (argcomplete)
        _complete(parser)
    args = parser.parse_args(argv)
    if args.cmd in _DELEGATED:  # global flags came first: `msgq-trio -s X scenario list`
        return _delegate(args.cmd, args.args)
    for key, value in GLOBAL_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    from .ops.ctl_client import CliUsageError
    from .ops.interrupt import run

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
    prog = f"msgq-trio {args.cmd}"
    try:
        if args.cmd == "demo":
            from .demo import run_demo

            return run_demo(Path(args.socket) if args.socket else None)
        if args.cmd == "console":
            from .console.cli import run_console

            return run_console(args)
        runner: Callable[[argparse.Namespace], Awaitable[int]]
        if args.cmd == "ctl":
            from .ops.ctl_client import run_ctl as runner
        elif args.cmd == "dump":
            from .ops.ctl_client import run_dump as runner
        elif args.cmd == "queue":
            from .ops.queue_cli import run_queue as runner
        elif args.cmd == "trace":
            from .ops.trace_cli import run_trace as runner
        elif args.cmd == "pipe":
            runner = _pipe_command
        else:
            runner = _client_command
        return run(runner, args)  # Ctrl-C: KeyboardInterrupt once the command cleaned up
    except CliUsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _json_arg(text: str, what: str) -> Any:
    """``text`` parsed as JSON, or CliUsageError naming the argument (exit status 2)."""
    from .ops.ctl_client import CliUsageError

    try:
        return json.loads(text)
    except ValueError as exc:
        hint = (
            ""
            if text[:1] in ("{", "[", '"')
            else (f"; a string needs quotes, e.g. '\"{text[:20]}\"'")
        )
        raise CliUsageError(f"{what} is not JSON ({exc}): {text[:60]!r}{hint}") from None


async def _client_command(args: argparse.Namespace) -> int:
    from . import connect
    from .errors import MsgqError, RpcError
    from .ops.ctl_client import connect_options
    from .ops.interrupt import interruptible

    # Checked before connecting: bad input is the caller's fault, not the broker's.
    body = params = result = None
    if args.cmd == "send":
        body = _json_arg(args.body, "BODY")
    elif args.cmd in ("call", "notify"):
        params = _json_arg(args.params, "PARAMS")
    elif args.cmd == "reply":
        result = _json_arg(args.result, "RESULT")
    try:
        async with connect(
            args.socket, name=f"msgq-trio-{args.cmd}", **connect_options(args)
        ) as bus:
            with interruptible():
                await _client_body(bus, args, body, params, result)
    except RpcError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.data is not None:
            print(json.dumps(exc.data, default=_json_default), file=sys.stderr)
        return EXIT_FAILED
    except MsgqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


async def _client_body(
    bus: Any, args: argparse.Namespace, body: Any, params: Any, result: Any
) -> None:
    """What the client commands do once connected (``body``/``params``/``result``: their
    JSON argument, parsed)."""
    if args.cmd == "send":
        await bus.send(args.target, body)
        await bus.flush()
    elif args.cmd == "call":
        if args.help_for or not args.no_check:
            from .ops.introspect_cli import call_checks

            if await call_checks(bus, args, params):
                return
        value = await bus.call(args.target, args.command, params, timeout=args.timeout)
        print(json.dumps(value, default=_json_default))
    elif args.cmd == "notify":
        await bus.notify(args.group, args.event, params)
        await bus.flush()
    elif args.cmd == "introspect":
        from .ops.introspect_cli import run_introspect

        await run_introspect(bus, args)
    elif args.cmd == "members":
        members = await bus.members(args.group)
        if args.json:
            print(json.dumps([{"lname": m.lname, "name": m.name, "pid": m.pid} for m in members]))
        for m in [] if args.json else members:
            print(f"{m.lname}\t{m.name}\tpid={m.pid}")
    elif args.cmd == "reply":
        await _reply(bus, args, result)
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


async def _reply(bus: Any, args: argparse.Namespace, result: Any) -> None:
    """``reply GROUP COMMAND RESULT``: join GROUP, print each COMMAND request as a JSON
    line ({from, name, params}) and answer it with RESULT; ``--count`` N: stop after N."""
    import trio

    done = trio.Event()
    answered = 0

    def handle(params: Any, request: Any) -> Any:
        nonlocal answered
        print(
            json.dumps(
                {"from": request.sender, "name": request.sender_name, "params": params},
                default=_json_default,
            ),
            flush=True,
        )
        answered += 1
        if args.count and answered >= args.count:
            done.set()
        return result

    bus.add_command(args.command, handle)
    await bus.subscribe(args.group)
    print(f"# answering {args.group} {args.command} as {bus.lname}", file=sys.stderr, flush=True)
    await done.wait()
    await bus.flush()  # the last answer leaves before the connection closes


async def _pipe_command(args: argparse.Namespace) -> int:
    """``pipe write NAME`` / ``pipe read NAME`` (docs/PIPES.md). Exit status 0, 1 on a
    pipe error (one ``error:`` line; the hint when no pipe plugin runs), 3 on timeout."""
    import trio

    from . import connect
    from .client.pipe import DEFAULT_GROUP, Pipe
    from .errors import ConnectionLost, MsgqError, NoRecipient, PipeTimeout
    from .ops.ctl_client import connect_options
    from .ops.interrupt import interruptible

    try:
        async with connect(
            args.socket, name=f"msgq-trio-pipe-{args.action}", **connect_options(args)
        ) as bus:
            with interruptible():
                if args.action == "ls":
                    listing = await bus.call(DEFAULT_GROUP, "pipe.ls", {"all": True})
                    _print_pipe_listing(listing, args.name)
                    return 0
                pipe = Pipe(bus, args.name)
                if args.action == "write":
                    w = await pipe.open_writer(
                        readers=args.readers,
                        on_reader_gone=args.on_reader_gone,
                        persistent=args.persistent or None,
                    )
                    async with w:
                        while True:
                            # Abandoned on cancel (Ctrl-C): a read of an idle stdin
                            # (a terminal, `tail -f`) may never return.
                            data = await trio.to_thread.run_sync(
                                os.read, 0, w.max_chunk * 4, abandon_on_cancel=True
                            )
                            if not data:
                                break
                            if args.timeout is None:
                                await w.send_all(data)
                            else:
                                await w.write(data, args.timeout)
                        await w.flush(args.timeout)
                else:
                    r = await pipe.open_reader(
                        readers=args.readers, persistent=args.persistent or None
                    )
                    async with r:
                        while True:
                            data = await r.read(None, args.timeout)
                            if not data:
                                break
                            # Abandoned on cancel: a stdout nobody reads blocks for good.
                            await trio.to_thread.run_sync(
                                _write_all, 1, data, abandon_on_cancel=True
                            )
    except NoRecipient:
        print(
            f"error: the pipe plugin is not running (nobody answers on group "
            f"{DEFAULT_GROUP!r}): start the broker with --plugin pipe",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except PipeTimeout as exc:
        print(f"error: timeout: {exc}", file=sys.stderr)
        return 3
    except (MsgqError, ConnectionLost) as exc:
        code = getattr(exc, "code", None)
        print(f"error: {code}: {exc}" if code else f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _print_pipe_listing(listing: Any, pattern: str) -> None:
    """``pipe ls PATTERN``: one line per pipe whose name matches (on its home broker),
    its ends as ROLE@BROKER."""
    from fnmatch import fnmatchcase

    print(f"{'PIPE':24} {'HOME':24} {'MODE':9} {'BUFFERED':>9}  ENDS")
    for b in listing.get("brokers", []):
        for p in b.get("pipes", []):
            if not fnmatchcase(p["name"], pattern):
                continue
            ends = " ".join(f"{e['role']}@{e['broker']}" for e in p.get("ends", []))
            print(f"{p['name']:24} {b['node']:24} {p['mode']:9} {p['buffered']:>9}  {ends}")
    for u in listing.get("unreachable", []):
        print(f"# peer {u['address']} unreachable: {u['error']}")


def _pipe_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``msgq-trio pipe``."""
    p.add_argument(
        "action",
        choices=["read", "write", "ls"],
        help="write: stdin into the pipe; read: the pipe to stdout; ls: list the pipes "
        "matching NAME (a glob: '*' for all) on this broker and its peers, with their "
        "ends and brokers",
    )
    p.add_argument("name", help="the pipe's name (ls: a glob)")
    p.add_argument(
        "--readers",
        choices=["share", "broadcast"],
        default=None,
        help="readers' mode if this creates the pipe (default share)",
    )
    p.add_argument(
        "--on-reader-gone",
        choices=["fail", "wait"],
        default="fail",
        help="write: fail (default) or wait for a new reader when readers left",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="per read/write timeout in seconds (default: wait forever)",
    )
    p.add_argument(
        "--persistent",
        action="store_true",
        help="the pipe is persistent (stored by the plugin: writes need no "
        "reader, the bytes outlive both ends and restarts; docs/PIPES.md)",
    )


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return repr(value)


if __name__ == "__main__":
    sys.exit(main())
