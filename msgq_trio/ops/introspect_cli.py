"""``msgq-trio introspect`` and the declaration side of ``msgq-trio call``: gathering the
descriptions the members of groups answer to ``msgq.introspect``, printing them, checking
a call's params against them before sending, and completing command and parameter names.

The command line gathers, not the broker: the broker's commands answer at once from its
own state (core/commands.py), while a description is the member's to give, so gathering
in the broker would mean the broker calling its clients and waiting for them. The command
line calls every member itself (one ``call_many`` to their lnames, with a short
timeout), so a member that does not answer (an old client, a C client, a hung one)
costs only that timeout and shows up with "no description" and why.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..client.interface import INTROSPECT, CommandDecl, Param, check_params
from ..errors import MsgqError, NoRecipient, RpcError
from .ctl_client import CliUsageError

__all__ = [
    "DEFAULT_INTROSPECT_TIMEOUT",
    "add_call_check_arguments",
    "add_introspect_arguments",
    "call_checks",
    "check_call",
    "command_line",
    "find_command",
    "format_command",
    "format_groups",
    "gather",
    "run_introspect",
]

#: Seconds a member has to answer ``msgq.introspect``: the description is built from
#: memory at once (client/interface.py), so a member silent this long is hung or ignores
#: the request; the command line must not wait the broker's request deadline (300 s).
DEFAULT_INTROSPECT_TIMEOUT = 2.0


def _why(exc: MsgqError) -> str:
    if isinstance(exc, RpcError):
        if exc.code == "unknown-command":
            return "no description (it does not answer msgq.introspect)"
        return f"no description ({exc.code}: {exc.message})"
    return f"no description ({exc})"


async def gather(bus: Any, group: str | None, timeout: float) -> list[dict[str, Any]]:
    """Each group (``group``, else every group with members, from the broker's
    ``groups``) with its members and each member's description or, when it gave none,
    ``"description": None`` and ``"why"``.

    Raises:
        MsgqError: the broker refused ``groups`` or ``members`` (e.g. ``forbidden``).
    """
    names = [group] if group else [g["group"] for g in await bus.call("msgq", "groups")]
    out: list[dict[str, Any]] = []
    lnames: dict[str, None] = {}
    for g in names:
        members = await bus.members(g)
        out.append(
            {
                "group": g,
                "members": [{"lname": m.lname, "name": m.name, "pid": m.pid} for m in members],
            }
        )
        lnames.update(dict.fromkeys(m.lname for m in members))
    results = await bus.call_many([(ln, INTROSPECT) for ln in lnames], timeout=timeout)
    found: dict[str, tuple[Any, str | None]] = {}
    for ln, r in zip(lnames, results, strict=True):
        if r.ok and isinstance(r.value, dict):
            found[ln] = (r.value, None)
        elif r.ok:
            found[ln] = (None, f"no description (answered {type(r.value).__name__})")
        else:
            assert r.error is not None
            found[ln] = (None, _why(r.error))
    for g_row in out:
        for m in g_row["members"]:
            desc, why = found[m["lname"]]
            m["description"] = desc
            if why is not None:
                m["why"] = why
    return out


def _param_text(p: dict[str, Any]) -> str:
    text = f"{p.get('name')}: {p.get('type', 'any')}"
    if not p.get("required", True):
        text += f" = {json.dumps(p['default'])}" if "default" in p else " (optional)"
    return text


def command_line(c: dict[str, Any]) -> str:
    """One command of a description as a signature: ``name(*, p: type = default) -> result``
    (``name(params)`` when its parameters are not declared)."""
    params = c.get("params")
    args = "params" if params is None else ", ".join(_param_text(p) for p in params)
    if params:
        args = "*, " + args
    result = c.get("result", "any")
    if c.get("attachments"):
        result += " (+ attachments)"
    return f"{c.get('name')}({args}) -> {result}"


def format_command(c: dict[str, Any], head: str = "", indent: str = "") -> str:
    """A command's declaration: its signature (after ``head``), then indented by
    ``indent`` its doc, parameter docs and raised codes."""
    lines = [head + command_line(c)]
    if c.get("doc"):
        lines.append(f"{indent}    {c['doc']}")
    for p in c.get("params") or ():
        if p.get("doc"):
            lines.append(f"{indent}    {p['name']}: {p['doc']}")
    if c.get("raises"):
        lines.append(f"{indent}    raises: {', '.join(map(str, c['raises']))}")
    return "\n".join(lines)


def format_groups(rows: list[dict[str, Any]]) -> str:
    """The text of ``msgq-trio introspect``: groups, members, their commands and events."""
    lines: list[str] = []
    for g in rows:
        n = len(g["members"])
        lines.append(f"{g['group']} ({n} member{'s' if n != 1 else ''})")
        for m in g["members"]:
            desc = m.get("description")
            head = f"  {m['lname']}\t{m['name']}\tpid={m['pid']}"
            if desc is None:
                lines.append(f"{head}\t{m.get('why', 'no description')}")
                continue
            lines.append(head)
            for c in desc.get("commands") or ():
                lines.append(format_command(c, "    command ", "        "))
            for e in desc.get("events") or ():
                params = e.get("params")
                args = "params" if params is None else ", ".join(_param_text(p) for p in params)
                to = f" to {e['group']}" if e.get("group") else ""
                doc = f"\n            {e['doc']}" if e.get("doc") else ""
                lines.append(f"    event {e.get('name')}({args}){to}{doc}")
            if not desc.get("commands") and not desc.get("events"):
                lines.append("    (declares nothing)")
    return "\n".join(lines)


def _group_of(target: str) -> str | None:
    """The group of a call target (``G``, ``G[?]``, ``G[N]``), None for an lname."""
    if target.startswith("l.") and target[2:].isdigit():
        return None
    return target.split("[", 1)[0]


async def descriptions(bus: Any, target: str, timeout: float) -> list[dict[str, Any]]:
    """The descriptions the recipients of ``target`` (an lname or a group) give; members
    that give none are left out."""
    group = _group_of(target)
    if group == "msgq":  # the broker's own commands: docs/PROTOCOL.md lists them
        return []
    if group is None:
        lnames = [target]
    else:
        try:
            lnames = [m.lname for m in await bus.members(group)]
        except MsgqError:
            return []
    results = await bus.call_many([(ln, INTROSPECT) for ln in lnames], timeout=timeout)
    return [r.value for r in results if r.ok and isinstance(r.value, dict)]


def find_command(descs: list[dict[str, Any]], command: str) -> dict[str, Any] | None:
    """The first description's declaration of ``command`` (wire form), or None."""
    for d in descs:
        for c in d.get("commands") or ():
            if isinstance(c, dict) and c.get("name") == command:
                return c
    return None


def _decl_from_wire(c: dict[str, Any]) -> CommandDecl:
    params = c.get("params")
    return CommandDecl(
        name=str(c.get("name")),
        params=None
        if params is None
        else tuple(
            Param(
                str(p.get("name")),
                str(p.get("type", "any")),
                bool(p.get("required", True)),
                p.get("default"),
            )
            for p in params
        ),
    )


async def check_call(
    bus: Any, target: str, command: str, params: Any, timeout: float = DEFAULT_INTROSPECT_TIMEOUT
) -> None:
    """Refuse a call whose ``params`` do not fit the declaration of ``command`` by the
    recipients of ``target``; nothing to check against (no recipient declares it, or
    none answers ``msgq.introspect``) lets the call go.

    Raises:
        CliUsageError: the params do not fit (names the parameter and the declaration).
    """
    try:
        decl = find_command(await descriptions(bus, target, timeout), command)
    except NoRecipient:
        return  # the call itself says so
    if decl is None:
        return
    wrong = check_params(_decl_from_wire(decl), params)
    if wrong is not None:
        raise CliUsageError(
            f"PARAMS: {command}: {wrong[1]}; declared: {command_line(decl)} "
            "(--no-check sends it anyway)"
        )


async def help_for(bus: Any, target: str, command: str, timeout: float) -> str:
    """``call --help-for TARGET COMMAND``: the declaration of ``command``.

    Raises:
        CliUsageError: no recipient of ``target`` declares ``command``.
    """
    descs = await descriptions(bus, target, timeout)
    decl = find_command(descs, command)
    if decl is None:
        known = sorted({str(c.get("name")) for d in descs for c in d.get("commands") or ()})
        raise CliUsageError(
            f"{target} declares no command {command!r}"
            + (f" (declared: {', '.join(known)})" if known else " (no member describes itself)")
        )
    return format_command(decl)


# -- the command line's arguments and runners ---------------------------------------------
def add_introspect_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``msgq-trio introspect``."""
    p.add_argument("group", nargs="?", default=None, help="one group (default: every group)")
    p.add_argument("--json", action="store_true", help="one JSON array of groups")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_INTROSPECT_TIMEOUT,
        help="seconds each member has to describe itself (default %(default)s)",
    )


def add_call_check_arguments(p: argparse.ArgumentParser) -> None:
    """``call``'s ``--no-check`` and ``--help-for``, and completion of its command and
    params from the declarations (argcomplete)."""
    p.add_argument(
        "--no-check",
        action="store_true",
        help="send the params without checking them against the command's declaration",
    )
    p.add_argument(
        "--help-for",
        action="store_true",
        help="print the declaration of COMMAND by TARGET's members instead of calling it",
    )
    for action in p._actions:  # argcomplete reads a completer attribute on the action
        if action.dest == "command":
            action.completer = complete_command  # type: ignore[attr-defined]
        elif action.dest == "params":
            action.completer = complete_params  # type: ignore[attr-defined]


async def run_introspect(bus: Any, args: argparse.Namespace) -> None:
    """``msgq-trio introspect [GROUP] [--json]``."""
    rows = await gather(bus, args.group, args.timeout)
    if args.json:
        print(json.dumps(rows, default=_json_default))
    elif rows:
        print(format_groups(rows))


async def call_checks(bus: Any, args: argparse.Namespace, params: Any) -> bool:
    """``call``'s ``--help-for`` (prints the declaration: True, the call is done) and
    the params check (unless ``--no-check``).

    Raises:
        CliUsageError: the params do not fit the declaration, or ``--help-for`` found
            none.
    """
    timeout = min(args.timeout or DEFAULT_INTROSPECT_TIMEOUT, DEFAULT_INTROSPECT_TIMEOUT)
    if args.help_for:
        print(await help_for(bus, args.target, args.command, timeout))
        return True
    await check_call(bus, args.target, args.command, params, timeout)
    return False


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return str(value)


# -- shell completion (argcomplete calls these; they must not raise) -----------------------
def _descriptions_now(parsed_args: argparse.Namespace) -> list[dict[str, Any]]:
    """The descriptions of ``parsed_args.target``'s members, asked with the blocking
    client (completion runs outside any event loop); none on any failure."""
    from .. import connect_direct

    try:
        with connect_direct(parsed_args.socket, "msgq-trio-complete") as bus:
            group = _group_of(parsed_args.target)
            members = [] if group is None else bus.members(group)
            lnames = [parsed_args.target] if group is None else [m.lname for m in members]
            out = []
            for ln in lnames:
                value = bus.call(ln, INTROSPECT, timeout=DEFAULT_INTROSPECT_TIMEOUT)
                if isinstance(value, dict):
                    out.append(value)
            return out
    except Exception:  # completion offers nothing rather than a traceback in the shell
        return []


def complete_command(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Command names TARGET's members declare, starting with ``prefix``."""
    names = {
        str(c.get("name"))
        for d in _descriptions_now(parsed_args)
        for c in d.get("commands") or ()
        if isinstance(c, dict)
    }
    return sorted(n for n in names if n.startswith(prefix))


def complete_params(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """A JSON map of COMMAND's declared parameters (required ones and defaults) to edit."""
    decl = find_command(_descriptions_now(parsed_args), getattr(parsed_args, "command", ""))
    if decl is None or not decl.get("params"):
        return []
    skeleton = {
        p["name"]: p.get("default") for p in decl["params"] if isinstance(p, dict) and "name" in p
    }
    text = json.dumps(skeleton)
    return [text] if text.startswith(prefix) else []
