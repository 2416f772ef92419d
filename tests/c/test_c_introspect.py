"""The C client's declared interface (clients/c, msgq_declare_command /
msgq_declare_event; docs/PROTOCOL.md "Interfaces and introspection"): a C component
(clients/c/tests/introspect_check.c) is described by ``msgq-trio introspect`` with
exactly what it declared, ``msgq-trio call`` checks a call against that declaration
before sending, the library checks it again before the handler runs, and bad
declarations are refused with an error code, never a crash. Every test runs with the
plain and the sanitized build."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from libmsgq_build import CBuild, CProcess, check_clean

import msgq_trio

RUN_TIMEOUT = 60.0

#: What introspect_check.c declares, as the v1 description lists it.
GET_ZONE_COUNT = {
    "name": "get_zone_count",
    "doc": "Count the zones of a class.",
    "params": [
        {
            "name": "zone_class",
            "type": "str",
            "required": False,
            "default": "IN",
            "doc": "the class to count",
        },
        {"name": "verbose", "type": "bool", "required": False, "default": False},
        {"name": "serials", "type": "list[int] | null", "required": False},
    ],
    "result": "int",
    "raises": ["no-zone"],
}
PLAIN = {"name": "plain", "doc": "", "params": None, "result": "any", "raises": []}
RELAY = {
    "name": "relay",
    "doc": "Ping Python from inside the handler.",
    "params": [{"name": "text", "type": "str", "required": True}],
    "result": "dict[str, any]",
    "raises": [],
}
EVENTS = [
    {"name": "tick", "group": None, "doc": "", "params": None},
    {
        "name": "zone_added",
        "group": "Zones",
        "doc": "A zone was added.",
        "params": [
            {"name": "zone", "type": "str", "required": True},
            {"name": "serial", "type": "int", "required": False, "default": 1},
        ],
    },
]


@pytest.fixture
def component(cbuild: CBuild, broker: Any, short_tmp: Path) -> Iterator[CProcess]:
    """introspect-check serving group Zones (and Second) on the broker; stopped (and its
    stderr checked clean) at teardown."""
    proc = CProcess(
        [str(cbuild.dir / "introspect-check"), "serve", str(broker.path), "Zones"],
        cbuild.env,
        short_tmp / "introspect.err",
    )
    try:
        proc.wait_ready()
        yield proc
        assert proc.stop() == 0, proc.stderr()
        check_clean(proc.stderr())
    finally:
        proc.kill()


async def cli(broker: Any, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "msgq_trio", *args[:1], "--socket", str(broker.path), *args[1:]]
    with trio.fail_after(RUN_TIMEOUT):
        r = await trio.run_process(
            argv, capture_stdout=True, capture_stderr=True, check=False, env=env
        )
    return r.returncode, r.stdout.decode(), r.stderr.decode()


async def test_introspect_lists_exactly_the_declaration(broker: Any, component: CProcess) -> None:
    """``introspect Zones --json`` shows the C member with its name, lname, groups in join
    order, the commands that have handlers sorted by name (declared ones with exactly
    their parameters, an undeclared one with params null, a declared-then-removed one not
    at all) and the declared events."""
    rc, out, err = await cli(broker, "introspect", "--json", "Zones")
    assert rc == 0, err
    (group,) = json.loads(out)
    (member,) = group["members"]
    description = member["description"]
    assert description == {
        "version": 1,
        "name": "introspect-check",
        "lname": member["lname"],
        "groups": ["Zones", "Second"],
        "commands": [GET_ZONE_COUNT, PLAIN, RELAY],
        "events": EVENTS,
    }


async def test_call_checks_a_c_command_before_sending(broker: Any, component: CProcess) -> None:
    """``msgq-trio call`` refuses a wrong parameter type for the C command, naming the
    parameter, without sending; with ``--no-check`` the C library refuses it itself
    (bad-request naming the parameter, the handler does not run); a right call is
    answered."""
    rc, out, err = await cli(broker, "call", "Zones", "get_zone_count", '{"verbose": 3}')
    assert rc != 0 and out == ""
    assert "parameter 'verbose' must be bool" in err, err
    rc, out, err = await cli(broker, "call", "Zones", "get_zone_count", '{"serials": [1, 2]}')
    assert (rc, out.strip()) == (0, "42"), err
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        wrong: list[tuple[Any, str, str, str]] = [
            ({"verbose": 3}, "verbose", "must be bool, got int", "get_zone_count"),
            ({"serials": [1, "x"]}, "serials", "must be list[int] | null", "get_zone_count"),
            ({"zone": "IN"}, "zone", "unknown parameter 'zone'", "get_zone_count"),
            ([1], "", "params must be a map", "get_zone_count"),
            ({}, "text", "missing required parameter 'text'", "relay"),
        ]
        for params, name, text, command in wrong:
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await bus.call("Zones", command, params)
            assert ei.value.code == "bad-request"
            assert ei.value.data == {"param": name}
            assert text in ei.value.message and ei.value.message.startswith(command + ": ")
        assert await bus.call("Zones", "get_zone_count", None) == 42
        assert (
            await bus.call("Zones", "get_zone_count", {"zone_class": "CH", "serials": None}) == 42
        )
        assert await bus.call("Zones", "plain", [1, "any params"]) == "plain"


async def test_bad_declarations_are_refused(cbuild: CBuild, broker: Any) -> None:
    """Every bad argument to msgq_declare_command / msgq_declare_event returns -EINVAL
    (NULL or empty names, over-long or non-UTF-8 text, a reserved name, too many or
    duplicate parameters, type strings outside the grammar, defaults that are not a JSON
    scalar or belong to a required parameter); the bound on declarations per connection
    returns -ENOSPC; the good ones return 0; nothing crashes or leaks."""
    with trio.fail_after(RUN_TIMEOUT):
        r = await trio.run_process(
            [str(cbuild.dir / "introspect-check"), "args", str(broker.path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=cbuild.env,
        )
    stderr = r.stderr.decode(errors="replace")
    assert r.returncode == 0, stderr
    check_clean(stderr)
    lines = r.stdout.decode().splitlines()
    results = dict(line.split(" ", 1) for line in lines)
    good = {"most-params", "good", "event-good", "check-type-good"}
    assert results.pop("declarations-bound") == "-28 at 1022"  # -ENOSPC; "c", "e" count too
    assert {k for k, v in results.items() if v == "0"} == good
    assert {k: v for k, v in results.items() if k not in good} == dict.fromkeys(
        set(results) - good, "-22"
    )
    assert len(results) == 36


async def test_description_over_the_frame_limit_is_refused(
    cbuild: CBuild, broker_factory: Any, short_tmp: Path
) -> None:
    """Under a broker whose frames are too small for the description (under 1 KiB,
    plus the 4 KiB the library keeps for the frame's other sections), ``msgq.introspect``
    is answered limit-exceeded naming the sizes, not left unanswered; the component
    keeps serving."""
    small = broker_factory("--max-frame-size", "4400")
    proc = CProcess(
        [str(cbuild.dir / "introspect-check"), "serve", str(small.path), "Zones"],
        cbuild.env,
        short_tmp / "small.err",
    )
    try:
        lname = await trio.to_thread.run_sync(proc.wait_ready)
        async with msgq_trio.connect(str(small.path), name="py") as bus:
            with trio.fail_after(RUN_TIMEOUT), pytest.raises(msgq_trio.LimitExceeded) as ei:
                await bus.call(lname, "msgq.introspect")
            assert "exceeds the frame limit of 4400" in str(ei.value)
            assert await bus.call("Zones", "get_zone_count", {}) == 42
        assert proc.stop() == 0, proc.stderr()
        check_clean(proc.stderr())
    finally:
        proc.kill()
