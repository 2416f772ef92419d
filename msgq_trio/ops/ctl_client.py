"""``msgq-trio ctl ...`` and ``msgq-trio dump``: the operator's side of the control commands.

Each subcommand is one REQUEST to ``msgq`` (see :mod:`msgq_trio.ops.control`), printed as
a readable table, or as JSON with ``--json``. ``dump`` asks the broker to stream capture
records to this connection and prints them as they come, like dbus-monitor; its own
frames (the dump-start command and answer) are left out unless ``--self``.

Also the pieces every client subcommand shares: :func:`connect_options` (``--token``, the
TLS flags and their environment variables) and :class:`CliUsageError`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import trio

from ..config import CAPTURE_BODY_MODES, CAPTURE_KINDS
from ..errors import UsageError
from ..transport.tls import client_context


class CliUsageError(Exception):
    """The command line's input is wrong (the user's fault): exit status 2, one line."""


def connect_options(args: argparse.Namespace) -> dict[str, Any]:
    """``connect()`` keywords from ``--token``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``
    or, for each flag not given, ``$MSGQ_TRIO_TOKEN``, ``$MSGQ_TRIO_TLS_CA``,
    ``$MSGQ_TRIO_TLS_CERT``, ``$MSGQ_TRIO_TLS_KEY``. Without CA or certificate the TLS
    context is left to ``connect`` (the system's trust store).

    Raises:
        CliUsageError: a CA, certificate or key file that cannot be loaded.
    """

    def get(flag: str, env: str) -> str | None:
        value = getattr(args, flag, None)
        return value if value else os.environ.get(env) or None

    out: dict[str, Any] = {}
    token = get("token", "MSGQ_TRIO_TOKEN")
    if token:
        out["token"] = token
    ca = get("tls_ca", "MSGQ_TRIO_TLS_CA")
    cert = get("tls_cert", "MSGQ_TRIO_TLS_CERT")
    key = get("tls_key", "MSGQ_TRIO_TLS_KEY")
    if ca or cert:
        try:
            out["ssl_context"] = client_context(ca, cert, key, names=("--tls-ca", "--tls-cert"))
        except UsageError as exc:
            raise CliUsageError(str(exc)) from None
    return out


def _common(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--json / --timeout, accepted before or after the subcommand (--socket and the
    other connection flags are added to every parser by the command line's builder)."""
    d = (lambda v: v) if top else (lambda _v: argparse.SUPPRESS)
    p.add_argument(
        "--json", action="store_true", default=d(False), help="print the broker's answer as JSON"
    )
    p.add_argument("--timeout", type=float, default=d(10.0), help="seconds to wait for answers")


def add_ctl_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, top=True)
    sub = p.add_subparsers(dest="ctl_cmd", required=True, metavar="COMMAND")

    def leaf(name: str, help_text: str, parent: Any = sub) -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = parent.add_parser(name, help=help_text)
        _common(q, top=False)
        return q

    leaf("clients", "list connected clients")
    q = leaf("drop", "disconnect a client")
    q.add_argument("lname", help="the client's lname (l.N, from `ctl clients`)")
    q.add_argument("--reason", default=None, help="told to the client and logged")
    q = leaf("shutdown", "stop the broker (clients get GOODBYE)")
    q.add_argument("--reason", default=None, help="logged with the shutdown")
    q = leaf("stats", "broker statistics")
    q.add_argument(
        "--commands",
        action="store_true",
        help="per (group, command): requests, outcomes, error codes, latency (most used first)",
    )
    q.add_argument(
        "--top", type=_positive_int, default=None, metavar="N", help="with --commands: the N first"
    )
    leaf("users", "each connected user's use against each quota")
    q = leaf("links", "state of the link plugin's links to other brokers")
    q.add_argument("--group", default="msgq-link", help="the link plugin's group")
    cfg = leaf("config", "get, set or reload the configuration")
    csub = cfg.add_subparsers(dest="config_cmd", required=True, metavar="ACTION")
    q = leaf("get", "the running configuration, or one key", csub)
    q.add_argument("key", nargs="?", help="e.g. limits.request_timeout (default: every key)")
    q = leaf("set", "change one key of the running configuration", csub)
    q.add_argument("key", help="e.g. limits.request_timeout (or just request_timeout)")
    q.add_argument("value", help='JSON (30, true, [1000], "x"), or a plain string')
    leaf("reload", "re-read the configuration file (like SIGHUP)", csub)
    cap = leaf("capture", "traffic capture to files")
    capsub = cap.add_subparsers(dest="capture_cmd", required=True, metavar="ACTION")
    q = leaf("start", "start (or update) the capture", capsub)
    # Absolute: the broker resolves paths against its own working directory, not ours.
    q.add_argument(
        "--dir",
        default=None,
        type=os.path.abspath,
        help="directory of the capture files (default: capture.dir)",
    )
    q.add_argument("--prefix", default=None, help="file name prefix (default: capture)")
    _filter_args(q)
    q.add_argument("--max-bytes", type=int, default=None, help="per file")
    q.add_argument("--max-files", type=int, default=None, help="files kept")
    leaf("stop", "stop the capture and wait for its files to be written", capsub)
    leaf("status", "the capture's state and counters", capsub)


def _filter_args(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--kind",
        action="append",
        default=None,
        choices=CAPTURE_KINDS,
        help="only these kinds (repeat)",
    )
    q.add_argument(
        "--sender",
        action="append",
        default=None,
        help="only frames from this lname or client name (repeat)",
    )
    q.add_argument(
        "--target",
        action="append",
        default=None,
        help="only frames to this target or group, or a pattern (Zone.*, Zone.>) (repeat)",
    )
    q.add_argument(
        "--body",
        default=None,
        choices=CAPTURE_BODY_MODES,
        help="include bodies: base64 of the CBOR, or decoded (json)",
    )


def add_dump_arguments(p: argparse.ArgumentParser) -> None:
    _filter_args(p)
    p.add_argument("--json", action="store_true", help="one JSON record per line")
    p.add_argument(
        "--count",
        type=int,
        default=0,
        help="exit after N records (the ones shown: not its own frames)",
    )
    p.add_argument(
        "--self",
        action="store_true",
        dest="show_self",
        help="also show this dump's own frames (its dump-start command and answer)",
    )


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


# -- formatting -----------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_age(seconds: float) -> str:
    """``42s``, ``3m07s``, ``5h02m``, ``2d03h``; under 10 s with a tenth: ``1.5s``."""
    if seconds < 10:
        return f"{max(seconds, 0):.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def table(headers: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> str:
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def format_clients(rows: list[dict[str, Any]]) -> str:
    headers = [
        "LNAME",
        "NAME",
        "PID",
        "UID",
        "GROUPS",
        "MSGS IN",
        "MSGS OUT",
        "BYTES IN",
        "BYTES OUT",
        "QUEUED",
        "PENDING OUT/IN",
        "CONNECTED",
    ]
    out = []
    for r in rows:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["connected_at"]))
        out.append(
            [
                r["lname"],
                r["name"],
                str(r["pid"]),
                str(r["uid"]),
                ",".join(r["groups"]) or "-",
                str(r["msgs_in"]),
                str(r["msgs_out"]),
                human_bytes(r["bytes_in"]),
                human_bytes(r["bytes_out"]),
                human_bytes(r["queued_bytes"]),
                f"{r['pending_out']}/{r['pending_in']}",
                f"{since} ({human_age(r['connected_for'])})",
            ]
        )
    return table(headers, out, right=frozenset({2, 3, 5, 6, 7, 8, 9}))


def format_users(rows: list[dict[str, Any]]) -> str:
    """``ctl users``: per user, each quota as ``use/limit``, a ``*`` on the ones at their
    limit, the refusals and the held frames so far."""
    quotas = ["memory", "connections", "fds", "subscriptions", "pending_requests"]
    headers = [
        "USER",
        "MEMORY",
        "CONNECTIONS",
        "FDS",
        "SUBSCRIPTIONS",
        "PENDING",
        "REFUSED",
        "HELD",
    ]
    out = []
    for r in rows:
        cells = [r["user"]]
        for q in quotas:
            use, limit = r["use"][q], r["limits"][q]
            shown = (human_bytes(use), human_bytes(limit)) if q == "memory" else (use, limit)
            text = f"{shown[0]}/{shown[1]}"
            cells.append(text + ("*" if q in r["at_limit"] else ""))
        refused = r["refused"]
        cells.append(", ".join(f"{q} {n}" for q, n in sorted(refused.items())) or "-")
        held = r.get("held", {})
        cells.append(", ".join(f"{q} {n}" for q, n in sorted(held.items())) or "-")
        out.append(cells)
    return table(headers, out)


def format_links(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """The link plugin's ``status`` rows (docs/QUEUE.md, "Chained queues / links")."""
    now = time.time() if now is None else now
    headers = [
        "LINK",
        "STATE",
        "SINCE",
        "QUEUES",
        "ADDRESS",
        "FORWARDED",
        "IN FLIGHT",
        "RETRIES",
        "FAILURES",
        "LAST ERROR",
    ]
    out = []
    for r in rows:
        err = r.get("last_error") or "-"
        if r.get("last_error_at"):
            err += f" ({human_age(now - r['last_error_at'])} ago)"
        out.append(
            [
                r["link"],
                r["state"],
                human_age(now - r["since"]),
                f"{r['from_queue']} -> {r['to_queue']}",
                r["address"],
                str(r["forwarded"]),
                str(r["in_flight"]),
                str(r["retries"]),
                str(r["failures"]),
                err,
            ]
        )
    text = table(headers, out, right=frozenset({5, 6, 7, 8}))
    # One endpoint per plugin process: every row carries the same address.
    served = sorted({r["metrics"] for r in rows if r.get("metrics")})
    if served:
        text += "\n" + "\n".join(f"metrics: http://{a}/metrics" for a in served)
    return text


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            out.extend(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return [(prefix, value)]


def format_pairs(value: Any, sep: str = " = ") -> str:
    pairs = flatten(value)
    if not pairs:
        return ""
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}{sep}{json.dumps(v, default=str)}" for k, v in pairs)


def _local_time(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(epoch))


def format_stats(stats: dict[str, Any], now: float | None = None) -> str:
    """``ctl stats``: ``key  value`` lines with human units: byte counts (``*bytes*``) in
    KiB/MiB, ``uptime`` as a duration, times since the epoch (``*_at``) as local time
    with their age."""
    now = time.time() if now is None else now
    pairs = flatten(stats)
    width = max((len(k) for k, _ in pairs), default=0)
    lines = []
    for key, value in pairs:
        name = key.rpartition(".")[2]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and name == "uptime":
            text = human_age(value)
        elif number and name.endswith("_at") and value > 0:
            text = f"{_local_time(value)} ({human_age(now - value)} ago)"
        elif number and "bytes" in name and "records" not in name:
            text = human_bytes(value)
        elif number and name == "busy_poll_window":
            text = f"{value * 1e6:.0f} us"
        else:
            text = json.dumps(value, default=str)
        lines.append(f"{key.ljust(width)}  {text}")
    return "\n".join(lines)


def _latency(seconds: float | None) -> str:
    """A latency bucket's upper bound: ``<=250us``, ``<=2.5ms``, ``<=1s``; ``-`` for none."""
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return ">60s"
    if seconds < 0.001:
        return f"<={seconds * 1e6:g}us"
    if seconds < 1:
        return f"<={seconds * 1e3:g}ms"
    return f"<={seconds:g}s"


def format_command_stats(stats: dict[str, Any]) -> str:
    """``ctl stats --commands``: one row per (group, command), most requests first, the
    latency quantiles as the bucket bounds they fall under, and the table's bound."""
    headers = [
        "GROUP",
        "COMMAND",
        "REQUESTS",
        "OK",
        "ERROR",
        "NO-RCPT",
        "REFUSED",
        "GONE",
        "TIMEOUT",
        "CANCELLED",
        "P50",
        "P99",
        "ERROR CODES",
    ]
    rows = []
    for r in stats["commands"]:
        o = r["outcomes"]
        rows.append(
            [
                r["group"],
                r["command"],
                str(r["requests"]),
                str(o["ok"]),
                str(o["error"]),
                str(o["no-recipient"]),
                str(o["refused"]),
                str(o["recipient-gone"]),
                str(o["timeout"]),
                str(o["cancelled"]),
                _latency(r["latency"]["p50"]),
                _latency(r["latency"]["p99"]),
                ",".join(f"{c}={n}" for c, n in sorted(r["errors"].items())) or "-",
            ]
        )
    out = table(headers, rows, right=frozenset(range(2, 12)))
    foot = f"{stats['pairs']} of at most {stats['max_pairs']} (group, command) pairs tracked"
    if stats["overflow"]:
        foot += f"; {stats['overflow']} requests past the bound counted under other"
    return f"{out}\n{foot}"


def format_changes(result: dict[str, Any]) -> str:
    lines = []
    for c in result.get("changed", []):
        when = c["applies"]
        note = {
            "now": "applied",
            "new connections": "applies to new connections",
            "restart": "needs a restart: NOT applied",
        }.get(when, when)
        lines.append(f"{c['key']}: {json.dumps(c['old'])} -> {json.dumps(c['new'])} ({note})")
    if not lines:
        lines.append("no change")
    return "\n".join(lines)


def format_capture(st: dict[str, Any]) -> str:
    if st.get("state") == "off":
        return "capture: off"
    f = st.get("filter", {})
    flt = " ".join(f"{k}={','.join(v)}" for k, v in f.items() if v) or "everything"
    lines = [
        f"capture: {st['state']}" + (f" ({st['error']})" if st.get("error") else ""),
        f"  writing  {st.get('file')}",
        f"  filter   {flt}; body {st.get('body')}",
        f"  bounds   {human_bytes(st.get('max_bytes', 0))} x {st.get('max_files')} files",
        f"  records  {st.get('records_written')} written, {st.get('records_dropped')} dropped, "
        f"{human_bytes(st.get('bytes_written', 0))}",
        f"  files    {len(st.get('files', []))}",
    ]
    return "\n".join(lines)


def format_record(r: dict[str, Any]) -> str:
    """One dump line: time kind sender -> target details size outcome."""
    ts = time.strftime("%H:%M:%S", time.localtime(r["ts"])) + f".{int(r['ts'] * 1000) % 1000:03d}"
    if r.get("kind") == "capture-dropped":
        return f"{ts}  -- {r.get('dropped')} records dropped (buffer full) --"
    details = []
    for key, label in (
        ("request_id", "id"),
        ("reply_to", "reply-to"),
        ("command", "cmd"),
        ("event", "event"),
        ("code", "code"),
        ("error_message", "msg"),
    ):
        v = r.get(key)
        if v is not None and not (key == "request_id" and r.get("reply_to") is not None):
            details.append(f"{label}={v}")
    if r.get("on_behalf_of"):
        details.append(f"for={r['on_behalf_of']}")
    line = (
        f"{ts}  {r['kind']:<12} {r['sender']} ({r['sender_name']}) -> {r['target']}"
        f"  {' '.join(details)}  {r['size']} B  {r['outcome']}/{r['recipients']}"
    )
    if r.get("body_encoding"):
        line += "  body=" + json.dumps(r.get("body"), default=str)
    return line.replace("   ", "  ")


# -- running --------------------------------------------------------------------------------
def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _filter_params(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.kind:
        out["kinds"] = args.kind
    if args.sender:
        out["senders"] = args.sender
    if args.target:
        out["targets"] = args.target
    if args.body:
        out["body"] = args.body
    return out


async def run_ctl(args: argparse.Namespace) -> int:
    from .. import connect
    from ..errors import MsgqError, RpcError

    def emit(result: Any, text: str) -> None:
        print(json.dumps(result, indent=2, default=str) if args.json else text)

    try:
        async with connect(args.socket, name="msgq-trio-ctl", **connect_options(args)) as bus:

            async def call(cmd: str, params: Any = None) -> Any:
                return await bus.call("msgq", cmd, params, timeout=args.timeout)

            c = args.ctl_cmd
            if c == "clients":
                rows = await call("clients")
                emit(rows, format_clients(rows))
            elif c == "drop":
                row = await call("drop", {"lname": args.lname, "reason": args.reason})
                emit(
                    row,
                    f"dropped {row['lname']} (name={row['name']!r} pid={row['pid']} "
                    f"uid={row['uid']})",
                )
            elif c == "shutdown":
                r = await call("shutdown", {"reason": args.reason})
                emit(r, "broker shutting down")
            elif c == "stats" and args.commands:
                r = await call("command-stats", {"top": args.top} if args.top else None)
                emit(r, format_command_stats(r))
            elif c == "stats":
                if args.top:
                    raise CliUsageError("--top goes with --commands")
                r = await call("stats")
                emit(r, format_stats(r))
            elif c == "users":
                rows = await call("users")
                emit(rows, format_users(rows))
            elif c == "links":
                # Answered by the link plugin (its group), not by the broker.
                rows = await bus.call(args.group, "status", timeout=args.timeout)
                emit(rows, format_links(rows))
            elif c == "config":
                if args.config_cmd == "get":
                    params = {"key": args.key} if args.key else None
                    r = await call("config-get", params)
                    if args.key:
                        emit(r, json.dumps(r, default=str))
                    else:
                        emit(r, format_pairs(r))
                elif args.config_cmd == "set":
                    r = await call("config-set", {"key": args.key, "value": _value(args.value)})
                    emit(r, format_changes(r))
                else:
                    r = await call("config-reload")
                    emit(r, format_changes(r))
            elif c == "capture":
                if args.capture_cmd == "start":
                    params = _filter_params(args)
                    for key in ("dir", "prefix", "max_bytes", "max_files"):
                        v = getattr(args, key)
                        if v is not None:
                            params[key] = v
                    r = await call("capture-start", params)
                    emit(r, format_capture(r))
                elif args.capture_cmd == "stop":
                    r = await call("capture-stop")
                    with trio.move_on_after(args.timeout):
                        while r.get("state") == "stopping":
                            await trio.sleep(0.05)
                            r = await call("capture-status")
                    emit(r, format_capture(r))
                else:
                    r = await call("capture-status")
                    emit(r, format_capture(r))
    except RpcError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except MsgqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def run_dump(args: argparse.Namespace) -> int:
    from .. import connect
    from ..errors import MsgqError, RpcError
    from .interrupt import interruptible

    n = 0
    try:
        async with connect(args.socket, name="msgq-trio-dump", **connect_options(args)) as bus:
            with interruptible():
                await bus.call("msgq", "dump-start", _filter_params(args))
                own = bus.lname
                print(
                    f"# dumping traffic seen by the broker (this client is {bus.lname})",
                    file=sys.stderr,
                    flush=True,
                )
                async for msg in bus:
                    body = msg.body
                    if msg.sender != "l.0" or not isinstance(body, dict) or "records" not in body:
                        continue
                    if body.get("dropped"):
                        print(
                            f"# {body['dropped']} records dropped "
                            "(the broker's dump buffer was full)",
                            file=sys.stderr,
                            flush=True,
                        )
                    for rec in body["records"]:
                        if not args.show_self and own in (rec.get("sender"), rec.get("target")):
                            continue
                        print(
                            json.dumps(rec, default=str) if args.json else format_record(rec),
                            flush=True,
                        )
                        n += 1
                        if args.count and n >= args.count:
                            return 0
    except RpcError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except MsgqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
