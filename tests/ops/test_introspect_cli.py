"""``msgq-trio introspect`` and ``msgq-trio call``'s declaration check, run as the real
program against a real broker process and a real declaring component, next to members
that describe nothing (a silent raw peer, a client with an old-style handler)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from ops_helpers import run_cli

import msgq_trio
from msgq_trio import CommandFailed, Reply

EXIT_USAGE = 2


@asynccontextmanager
async def zonemgr(path: Path, calls: list[Any]) -> AsyncIterator[Any]:
    """A component in group ``Zones`` with three annotated handlers (an async one, one
    returning a descriptor, one raising ``CommandFailed``) and an event; ``calls``
    records every call that reached a handler."""
    async with msgq_trio.connect(path, "zonemgr") as bus:

        @bus.command("get_zone_count")
        async def get_zone_count(*, zone_class: str = "IN", verbose: bool = False) -> int:
            """Count the zones of a class."""
            calls.append(("get_zone_count", zone_class, verbose))
            return 3

        @bus.command("remove_zone", raises=["not-found"])
        def remove_zone(*, zone: str) -> None:
            """Remove a zone."""
            calls.append(("remove_zone", zone))
            raise CommandFailed("not-found", f"no zone {zone!r}")

        @bus.command("open_log")
        def open_log(*, name: str) -> Reply:
            """Hand over a zone's log."""
            calls.append(("open_log", name))
            r, w = os.pipe()
            try:
                return Reply({"name": name}, fds=[r])
            finally:
                os.close(r)
                os.close(w)

        bus.declare_event("zone_added", group="Zones.events", params={"zone": str})
        await bus.subscribe("Zones")
        yield bus


async def cli(path: Path, *argv: str) -> Any:
    return await trio.to_thread.run_sync(lambda: run_cli("-s", str(path), *argv))


async def test_introspect_prints_groups_members_and_declarations(
    broker: Any, raw_peer: Callable[[Path], Any]
) -> None:
    """Text and ``--json``: every group, its members, each member's commands (with
    parameters, result, doc, raised codes) and events; a member that does not answer
    ``msgq.introspect`` (a raw peer here, like an old or C client that stays silent)
    is listed with "no description" and why, after the ``--timeout``."""
    calls: list[Any] = []
    async with zonemgr(broker.path, calls) as bus, raw_peer(broker.path) as silent:
        await silent.hello("silent")
        await silent.subscribe("Zones")
        r = await cli(broker.path, "introspect", "--timeout", "0.5")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "Zones (2 members)" in out
        assert f"{bus.lname}\tzonemgr\tpid=" in out
        assert (
            '    command get_zone_count(*, zone_class: str = "IN", verbose: bool = false) -> int\n'
            "            Count the zones of a class.\n"
        ) in out
        assert "    command remove_zone(*, zone: str) -> null\n" in out
        assert "            raises: not-found" in out
        assert "    command open_log(*, name: str) -> any (+ attachments)\n" in out
        assert "    event zone_added(zone: str) to Zones.events" in out
        assert f"{silent.lname}\tsilent\tpid=" in out
        assert "no description (timeout" in out
        r = await cli(broker.path, "introspect", "Zones", "--json", "--timeout", "0.5")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [g["group"] for g in rows] == ["Zones"]
        members = {m["name"]: m for m in rows[0]["members"]}
        assert members["silent"]["description"] is None
        assert members["silent"]["why"].startswith("no description (timeout")
        desc = members["zonemgr"]["description"]
        assert desc["lname"] == bus.lname and desc["groups"] == ["Zones"]
        assert [c["name"] for c in desc["commands"]] == [
            "get_zone_count",
            "open_log",
            "remove_zone",
        ]
        assert desc["events"][0]["name"] == "zone_added"
    assert calls == []  # describing never calls a handler


async def test_call_refuses_params_that_do_not_fit_before_sending(broker: Any) -> None:
    """A wrong type, an unknown or a missing parameter: exit status 2, the message names
    the parameter and shows the declaration, and the handler never ran; ``--no-check``
    sends it anyway and the callee's own check answers ``bad-request``."""
    calls: list[Any] = []
    async with zonemgr(broker.path, calls):
        for params, named in [
            ('{"zone_class": 5}', "parameter 'zone_class' must be str, got int 5"),
            ('{"zone_klass": "IN"}', "unknown parameter 'zone_klass'"),
            ('"IN"', "params must be a map of named parameters"),
        ]:
            r = await cli(broker.path, "call", "Zones", "get_zone_count", params)
            assert r.returncode == EXIT_USAGE, (params, r.stdout, r.stderr)
            assert r.stderr.startswith("msgq-trio call: error: PARAMS: get_zone_count: "), r.stderr
            assert named in r.stderr
            assert "declared: get_zone_count(*, zone_class: str" in r.stderr
            assert "Traceback" not in r.stderr
        r = await cli(broker.path, "call", "Zones", "remove_zone", "{}")
        assert r.returncode == EXIT_USAGE and "missing required parameter 'zone'" in r.stderr
        assert calls == []
        r = await cli(broker.path, "call", "Zones", "get_zone_count", '{"zone_class": "CH"}')
        assert r.returncode == 0 and json.loads(r.stdout) == 3, r.stderr
        assert calls == [("get_zone_count", "CH", False)]
        r = await cli(
            broker.path, "call", "--no-check", "Zones", "get_zone_count", '{"zone_class": 5}'
        )
        assert r.returncode == 1
        assert "error: bad-request: get_zone_count: parameter 'zone_class'" in r.stderr
        assert len(calls) == 1


async def test_call_help_for_prints_the_declaration(broker: Any) -> None:
    calls: list[Any] = []
    async with zonemgr(broker.path, calls):
        r = await cli(broker.path, "call", "--help-for", "Zones", "remove_zone")
        assert r.returncode == 0, r.stderr
        assert r.stdout == (
            "remove_zone(*, zone: str) -> null\n    Remove a zone.\n    raises: not-found\n"
        )
        r = await cli(broker.path, "call", "--help-for", "Zones", "nope")
        assert r.returncode == EXIT_USAGE
        assert (
            "Zones declares no command 'nope' (declared: get_zone_count, open_log, remove_zone)"
            in r.stderr
        )
    assert calls == []


async def test_members_without_declarations_are_called_unchecked(broker: Any) -> None:
    """A member whose command is not declared (an old-style ``fn(params)`` handler)
    gets the call as before: nothing to check against is no reason to refuse."""
    async with msgq_trio.connect(broker.path, "old") as old:
        old.add_command("echo", lambda params: params)
        await old.subscribe("Old")
        r = await cli(broker.path, "call", "Old", "echo", '{"any": ["thing"]}')
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {"any": ["thing"]}
        r = await cli(broker.path, "introspect", "Old")
        assert "    command echo(params) -> any" in r.stdout


async def test_groups_lists_the_groups_with_members(broker: Any) -> None:
    """The broker's ``groups`` command, which ``introspect`` without a group starts
    from: every group with members, sorted, with the count."""
    async with (
        msgq_trio.connect(broker.path, "a") as a,
        msgq_trio.connect(broker.path, "b") as b,
    ):
        await a.subscribe("Zeta")
        await a.subscribe("Alpha")
        await b.subscribe("Alpha")
        rows = await b.call("msgq", "groups")
        assert [r for r in rows if r["group"] in ("Alpha", "Zeta")] == [
            {"group": "Alpha", "members": 2},
            {"group": "Zeta", "members": 1},
        ]
        await a.unsubscribe("Zeta")
        rows = await b.call("msgq", "groups")
        assert "Zeta" not in [r["group"] for r in rows]


async def test_call_completes_command_names_and_a_params_skeleton(broker: Any) -> None:
    """The completers argcomplete calls for ``call``: TARGET's declared command names
    by prefix, and COMMAND's parameters as a JSON map with their defaults; nothing (no
    traceback) when the broker cannot be reached."""
    import argparse

    from msgq_trio.cli import build_parser
    from msgq_trio.ops.introspect_cli import complete_command, complete_params

    call = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["call"]
    completers = {a.dest: getattr(a, "completer", None) for a in call._actions}
    assert completers["command"] is complete_command
    assert completers["params"] is complete_params

    def ns(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(socket=str(broker.path), target="Zones", **kw)

    async with zonemgr(broker.path, []):
        names = await trio.to_thread.run_sync(lambda: complete_command("", ns()))
        assert names == ["get_zone_count", "open_log", "remove_zone"]
        names = await trio.to_thread.run_sync(lambda: complete_command("rem", ns()))
        assert names == ["remove_zone"]
        skeleton = await trio.to_thread.run_sync(
            lambda: complete_params("", ns(command="get_zone_count"))
        )
        assert skeleton == ['{"zone_class": "IN", "verbose": false}']
    gone = argparse.Namespace(socket=str(broker.path) + ".nope", target="Zones")
    assert complete_command("", gone) == []
