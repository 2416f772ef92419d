"""``msgq-trio trace TARGET COMMAND [JSON]``: one traced call, then the tree of the hops
the broker saw for it (README "Knowing your bus"; docs/PROTOCOL.md, "Trace context").

The call is made as the root of a new trace (client/tracing.py); every hop it causes
(nested calls made by handlers, messages, notifications, queue puts and deliveries)
carries the trace, and the broker records each one it routes (core/traces.py). After the
answer, and ``--wait`` seconds for hops that follow it (a queue's delivery), the command
asks the broker for the trace (broker command ``trace``) and prints it as a tree: each
hop under the hop that caused it, with its time since the first one.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_trace_arguments", "render", "run_trace"]

EXIT_FAILED = 1


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="the group (or lname) that answers the command")
    p.add_argument("command", help="the command's name")
    p.add_argument("params", nargs="?", default="null", help="parameters as JSON (default null)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the answer (default: the broker's request deadline)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0.2,
        help="seconds to wait after the answer for hops that follow it, such as a queue's "
        "delivery to its consumer (default 0.2)",
    )
    p.add_argument("--json", action="store_true", help="print the broker's answer as JSON")


def _who(pair: Any) -> str:
    if isinstance(pair, list) and len(pair) == 2:
        return f"{pair[1]} ({pair[0]})"
    return str(pair)


def _line(hop: dict[str, Any]) -> str:
    kind = hop.get("kind", "?")
    name = hop.get("name")
    head = f"{kind} {name}" if name and kind not in ("reply", "error") else kind
    if kind == "error" and name:
        head = f"error {name}"
    text = f"{head}  {_who(hop.get('from'))} -> {hop.get('to')}"
    delivered = hop.get("delivered")
    if delivered:
        text += ": " + ", ".join(_who(d) for d in delivered)
    outcome = hop.get("outcome")
    if outcome not in ("delivered", "forwarded"):
        text += f"  [{outcome}]"
    at = hop.get("at")
    if isinstance(at, (int, float)):
        text += f"  +{at * 1000:.3f} ms"
    return text


def render(answer: dict[str, Any]) -> str:
    """The broker's ``trace`` answer as a tree of hops: a hop sits under the hop whose
    span caused it (its ``cause``), an answer under its request; hops whose cause the
    broker did not see (a hop before the trace reached the bus) sit at the top."""
    hops: list[dict[str, Any]] = list(answer.get("hops", []))
    by_span = {h["span"]: i for i, h in enumerate(hops) if h.get("span")}
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for i, h in enumerate(hops):
        parent = by_span.get(h.get("cause"))
        if parent is None or parent == i:
            roots.append(i)
        else:
            children.setdefault(parent, []).append(i)
    lines = [f"trace {answer.get('trace_id')}: {len(hops)} hops"]
    if answer.get("dropped"):
        lines[0] += f" ({answer['dropped']} more not kept: the broker's trace_max_hops)"

    def walk(i: int, prefix: str, last: bool) -> None:
        lines.append(prefix + ("└─ " if last else "├─ ") + _line(hops[i]))
        kids = children.get(i, [])
        for k, c in enumerate(kids):
            walk(c, prefix + ("   " if last else "│  "), k == len(kids) - 1)

    for k, r in enumerate(roots):
        walk(r, "", k == len(roots) - 1)
    return "\n".join(lines)


async def run_trace(args: argparse.Namespace) -> int:
    import trio

    from .. import connect
    from ..client.tracing import start_trace
    from ..errors import MsgqError, RpcError
    from .ctl_client import CliUsageError, connect_options

    try:
        params = json.loads(args.params)
    except ValueError as exc:
        raise CliUsageError(f"PARAMS is not JSON ({exc}): {args.params[:60]!r}") from None
    try:
        async with connect(args.socket, name="msgq-trio-trace", **connect_options(args)) as bus:
            status = 0
            with start_trace() as root:
                try:
                    value = await bus.call(args.target, args.command, params, timeout=args.timeout)
                    print(f"result: {json.dumps(value, default=repr)}")
                except RpcError as exc:
                    print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
                    status = EXIT_FAILED
            if args.wait > 0:
                await trio.sleep(args.wait)
            answer = await bus.call("msgq", "trace", {"trace_id": root.trace_id})
    except RpcError as exc:  # the broker refused the trace command
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except MsgqError as exc:  # no broker, connection lost
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(answer))
    else:
        print(render(answer))
    return status
