"""``msgq-trio ctl ...`` and ``msgq-trio dump``: the operator's side of the control commands.

Each subcommand is one REQUEST to ``msgq`` (see :mod:`msgq_trio.ops.control`), printed as
a readable table, or as JSON with ``--json``. ``dump`` asks the broker to stream capture
records to this connection and prints them as they come, like dbus-monitor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

from ..config import CAPTURE_BODY_MODES, CAPTURE_KINDS


def _common(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--socket / --json / --timeout, accepted before or after the subcommand."""
    d = (lambda v: v) if top else (lambda _v: argparse.SUPPRESS)
    p.add_argument("--socket", "-s", type=Path, default=d(None),
                   help="broker socket (default: $MSGQ_TRIO_SOCKET or the per-user path)")
    p.add_argument("--json", action="store_true", default=d(False),
                   help="print the broker's answer as JSON")
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
    q.add_argument("lname")
    q.add_argument("--reason", default=None)
    q = leaf("shutdown", "stop the broker (clients get GOODBYE)")
    q.add_argument("--reason", default=None)
    leaf("stats", "broker statistics")
    q = leaf("links", "state of the link plugin's links to other brokers")
    q.add_argument("--group", default="msgq-link", help="the link plugin's group")
    cfg = sub.add_parser("config", help="get, set or reload the configuration")
    csub = cfg.add_subparsers(dest="config_cmd", required=True, metavar="ACTION")
    q = leaf("get", "the running configuration, or one key", csub)
    q.add_argument("key", nargs="?")
    q = leaf("set", "change one key of the running configuration", csub)
    q.add_argument("key", help="e.g. limits.request_timeout (or just request_timeout)")
    q.add_argument("value", help="JSON (30, true, [1000], \"x\"), or a plain string")
    leaf("reload", "re-read the configuration file (like SIGHUP)", csub)
    cap = sub.add_parser("capture", help="traffic capture to files")
    capsub = cap.add_subparsers(dest="capture_cmd", required=True, metavar="ACTION")
    q = leaf("start", "start (or update) the capture", capsub)
    # Absolute: the broker resolves paths against its own working directory, not ours.
    q.add_argument("--dir", default=None, type=os.path.abspath)
    q.add_argument("--prefix", default=None)
    _filter_args(q)
    q.add_argument("--max-bytes", type=int, default=None, help="per file")
    q.add_argument("--max-files", type=int, default=None, help="files kept")
    leaf("stop", "stop the capture and wait for its files to be written", capsub)
    leaf("status", "the capture's state and counters", capsub)


def _filter_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--kind", action="append", default=None, choices=CAPTURE_KINDS,
                   help="only these kinds (repeat)")
    q.add_argument("--sender", action="append", default=None,
                   help="only frames from this lname or client name (repeat)")
    q.add_argument("--target", action="append", default=None,
                   help="only frames to this target or group (repeat)")
    q.add_argument("--body", default=None, choices=CAPTURE_BODY_MODES,
                   help="include bodies: base64 of the CBOR, or decoded (json)")


def add_dump_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", "-s", type=Path, default=None)
    _filter_args(p)
    p.add_argument("--json", action="store_true", help="one JSON record per line")
    p.add_argument("--count", type=int, default=0, help="exit after N records")


# -- formatting -----------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_age(seconds: float) -> str:
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
    headers = ["LNAME", "NAME", "PID", "UID", "GROUPS", "MSGS IN", "MSGS OUT", "BYTES IN",
               "BYTES OUT", "QUEUED", "PENDING OUT/IN", "CONNECTED"]
    out = []
    for r in rows:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["connected_at"]))
        out.append([
            r["lname"], r["name"], str(r["pid"]), str(r["uid"]),
            ",".join(r["groups"]) or "-", str(r["msgs_in"]), str(r["msgs_out"]),
            human_bytes(r["bytes_in"]), human_bytes(r["bytes_out"]),
            human_bytes(r["queued_bytes"]), f"{r['pending_out']}/{r['pending_in']}",
            f"{since} ({human_age(r['connected_for'])})",
        ])
    return table(headers, out, right=frozenset({2, 3, 5, 6, 7, 8, 9}))


def format_links(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """The link plugin's ``status`` rows (docs/QUEUE.md, "Chained queues / links")."""
    now = time.time() if now is None else now
    headers = ["LINK", "STATE", "SINCE", "QUEUES", "ADDRESS", "FORWARDED", "IN FLIGHT",
               "RETRIES", "FAILURES", "LAST ERROR"]
    out = []
    for r in rows:
        err = r.get("last_error") or "-"
        if r.get("last_error_at"):
            err += f" ({human_age(now - r['last_error_at'])} ago)"
        out.append([
            r["link"], r["state"], human_age(now - r["since"]),
            f"{r['from_queue']} -> {r['to_queue']}", r["address"], str(r["forwarded"]),
            str(r["in_flight"]), str(r["retries"]), str(r["failures"]), err,
        ])
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


def format_changes(result: dict[str, Any]) -> str:
    lines = []
    for c in result.get("changed", []):
        when = c["applies"]
        note = {"now": "applied", "new connections": "applies to new connections",
                "restart": "needs a restart: NOT applied"}.get(when, when)
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
    for key, label in (("request_id", "id"), ("reply_to", "reply-to"), ("command", "cmd"),
                       ("event", "event"), ("code", "code"), ("error_message", "msg")):
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
        async with connect(args.socket, name="msgq-trio-ctl") as bus:

            async def call(cmd: str, params: Any = None) -> Any:
                return await bus.call("msgq", cmd, params, timeout=args.timeout)

            c = args.ctl_cmd
            if c == "clients":
                rows = await call("clients")
                emit(rows, format_clients(rows))
            elif c == "drop":
                row = await call("drop", {"lname": args.lname, "reason": args.reason})
                emit(row, f"dropped {row['lname']} (name={row['name']!r} pid={row['pid']} "
                          f"uid={row['uid']})")
            elif c == "shutdown":
                r = await call("shutdown", {"reason": args.reason})
                emit(r, "broker shutting down")
            elif c == "stats":
                r = await call("stats")
                emit(r, format_pairs(r, sep="  "))
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

    n = 0
    try:
        async with connect(args.socket, name="msgq-trio-dump") as bus:
            await bus.call("msgq", "dump-start", _filter_params(args))
            print(f"# dumping traffic seen by the broker (this client is {bus.lname})",
                  file=sys.stderr, flush=True)
            async for msg in bus:
                body = msg.body
                if msg.sender != "l.0" or not isinstance(body, dict) or "records" not in body:
                    continue
                if body.get("dropped"):
                    print(f"# {body['dropped']} records dropped (the broker's dump buffer was "
                          "full)", file=sys.stderr, flush=True)
                for rec in body["records"]:
                    print(json.dumps(rec, default=str) if args.json else format_record(rec),
                          flush=True)
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
