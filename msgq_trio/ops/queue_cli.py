"""``msgq-trio queue ls | stats NAME | peek NAME [N] | purge NAME --yes``: the operator's
view of the queue plugin's durable queues (docs/QUEUE.md, "Operating queues").

Each subcommand is a REQUEST to the queue plugin's group (``--group``, default
``msgq-queue``): ``queues`` and ``stats`` (``ls``, ``stats``), ``peek`` and ``purge``
(plugins/queue/admin.py). Output is a table or ``key: value`` lines, or JSON with
``--json``. Exit status: 0 done; 1 an error (one line on stderr: no broker, no queue
plugin, unknown queue, timeout); 2 ``purge`` refused without ``--yes``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import Any

import cbor2

from ..client.queue import DEFAULT_GROUP
from .ctl_client import connect_options, human_bytes, table

__all__ = ["add_queue_arguments", "format_peek", "format_queues", "format_stats", "run_queue"]

#: ``peek`` without N: a screenful.
DEFAULT_PEEK = 10
#: Longest body shown by ``peek`` (decoded, as JSON) before it is shortened.
BODY_WIDTH = 60
#: Seconds to wait for ``ls``/``stats``/``peek`` answers without ``--timeout``. ``purge``
#: waits for the broker's request deadline instead: it reads and deletes the whole backlog.
DEFAULT_TIMEOUT = 10.0


def _common(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--group / --json / --timeout, accepted before or after the subcommand (the
    subcommand's copies must not overwrite values given before it; --socket and the other
    connection flags are added to every parser by the command line's builder)."""
    d = (lambda v: v) if top else (lambda _v: argparse.SUPPRESS)
    p.add_argument(
        "--group",
        default=d(DEFAULT_GROUP),
        help=f"the queue plugin's group (its 'group' setting; {DEFAULT_GROUP})",
    )
    p.add_argument(
        "--json", action="store_true", default=d(False), help="print the plugin's answer as JSON"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=d(None),
        help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT:g}; "
        "purge: the broker's request deadline)",
    )


def add_queue_arguments(p: argparse.ArgumentParser) -> None:
    """The ``queue`` subcommand's arguments (``msgq-trio queue --help``)."""
    _common(p, top=True)
    sub = p.add_subparsers(dest="queue_cmd", required=True, metavar="COMMAND")

    def leaf(name: str, help_text: str) -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        _common(q, top=False)
        return q

    leaf("ls", "list the queues: depth, bytes, ready, in flight, consumers, paging")
    q = leaf("stats", "every statistic of one queue")
    q.add_argument("name", help="the queue")
    q = leaf("peek", "show the first N ready messages without consuming them")
    q.add_argument("name", help="the queue")
    q.add_argument(
        "n",
        nargs="?",
        type=int,
        default=DEFAULT_PEEK,
        help=f"how many (default {DEFAULT_PEEK}, at most 1000)",
    )
    q = leaf("purge", "remove every message no consumer holds (needs --yes)")
    q.add_argument("name", help="the queue")
    q.add_argument(
        "--yes",
        action="store_true",
        help="really remove them: purged messages cannot be brought back",
    )


# -- formatting -----------------------------------------------------------------------------
def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return repr(value)


def decode_body(raw: bytes) -> Any:
    """A peeked body decoded from CBOR, made JSON-safe (bytes as hex, other non-JSON
    values as their repr); a body that is not CBOR as ``<not CBOR: N bytes>``."""
    try:
        value = cbor2.loads(raw) if raw else None
    except Exception:  # cbor2 raises several types for garbage; none may end the listing
        return f"<not CBOR: {len(raw)} bytes>"
    return json.loads(json.dumps(value, default=_json_default))


def shorten(text: str, width: int = BODY_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_queues(rows: list[dict[str, Any]]) -> str:
    """``ls``: one row per queue (``stats`` answers)."""
    if not rows:
        return "no queues"
    out = [
        [
            r["queue"],
            str(r["depth"]),
            human_bytes(r["bytes"]),
            str(r["ready"]),
            str(r["in_flight"]),
            str(r["consumers"]),
            "yes" if r.get("paging") else "no",
        ]
        for r in rows
    ]
    return table(
        ["QUEUE", "DEPTH", "BYTES", "READY", "IN FLIGHT", "CONSUMERS", "PAGING"],
        out,
        right=frozenset({1, 2, 3, 4, 5}),
    )


def format_stats(st: dict[str, Any]) -> str:
    """``stats``: ``key: value`` lines in the plugin's order."""
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in st.items())


def peek_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``peek --json``: the plugin's rows with ``body`` decoded and the exact CBOR as
    base64 (``cbor``)."""
    return [
        {
            **{k: v for k, v in r.items() if k != "body"},
            "body": decode_body(bytes(r["body"])),
            "cbor": base64.b64encode(bytes(r["body"])).decode(),
        }
        for r in rows
    ]


def format_peek(rows: list[dict[str, Any]]) -> str:
    """``peek``: one row per message, the body decoded and shortened."""
    if not rows:
        return "no ready messages"
    out = []
    for r in rows:
        body = shorten(json.dumps(decode_body(bytes(r["body"])), ensure_ascii=False))
        if r.get("attachments"):
            body += f" [+{r['attachments']} attachments]"
        out.append(
            [
                "-" if r["seq"] is None else str(r["seq"]),
                str(r["producer"]),
                str(r["producer_seq"]),
                str(r["deliveries"]),
                str(r["size"]),
                str(r.get("kind", "body")),
                body,
            ]
        )
    return table(
        ["SEQ", "PRODUCER", "PRODUCER SEQ", "DELIVERIES", "SIZE", "KIND", "BODY"],
        out,
        right=frozenset({0, 2, 3, 4}),
    )


# -- running --------------------------------------------------------------------------------
async def run_queue(args: argparse.Namespace) -> int:
    """Run one ``msgq-trio queue`` subcommand; returns the exit status."""
    from .. import connect
    from ..errors import MsgqError, NoRecipient, RpcError

    group: str = args.group
    timeout = DEFAULT_TIMEOUT if args.timeout is None else args.timeout

    def emit(result: Any, text: str) -> None:
        try:
            print(
                json.dumps(result, indent=2, default=_json_default) if args.json else text,
                flush=True,
            )
        except BrokenPipeError:
            # The reader left (``| head``): not an error; keep the exit quiet too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    try:
        async with connect(args.socket, name="msgq-trio-queue", **connect_options(args)) as bus:

            async def call(cmd: str, params: Any = None, wait: float | None = timeout) -> Any:
                return await bus.call(group, cmd, params, timeout=wait)

            c = args.queue_cmd
            if c == "ls":
                rows = [await call("stats", {"queue": name}) for name in await call("queues")]
                emit(rows, format_queues(rows))
            elif c == "stats":
                st = await call("stats", {"queue": args.name})
                emit(st, format_stats(st))
            elif c == "peek":
                if args.n < 1:
                    print("error: N must be at least 1", file=sys.stderr)
                    return 2
                rows = await call("peek", {"queue": args.name, "n": args.n})
                emit(peek_rows(rows), format_peek(rows))
            elif c == "purge":
                if not args.yes:
                    # Ask first: an unknown queue is reported as such, and the refusal
                    # says how much would go.
                    st = await call("stats", {"queue": args.name})
                    print(
                        f"error: not purging queue {args.name!r} without --yes: it would "
                        f"remove every message no consumer holds (now {st['ready']} "
                        f"ready, {st['depth']} held), for good",
                        file=sys.stderr,
                    )
                    return 2
                n = await call("purge", {"queue": args.name}, args.timeout)
                emit(
                    {"queue": args.name, "purged": n},
                    f"purged {n} messages from queue {args.name!r}",
                )
    except NoRecipient:
        print(
            f"error: no queue plugin is running: nobody answers on group {group!r} "
            "(enable it with a [plugins.queue] table)",
            file=sys.stderr,
        )
        return 1
    except RpcError as exc:
        print(f"error: {exc.code}: {' '.join(str(exc.message).split())}", file=sys.stderr)
        return 1
    except MsgqError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0
