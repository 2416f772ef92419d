"""Wildcard subscriptions through real broker processes: the access policy per delivery
(a TCP client granted a pattern never receives a group it is denied), the pattern limits
from the command line, and the CLI (``listen 'Zone.>'``, ``dump --target 'Zone.*'``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from test_e2e_tcp import ALICE, tcp_broker  # noqa: F401  (a fixture used by name)

import msgq_trio
from msgq_trio import Forbidden, LimitExceeded

MSGQ = str(Path(sys.executable).with_name("msgq-trio"))
HANG = 30.0


async def test_policy_hides_a_denied_group_from_a_pattern(tcp_broker: Any) -> None:  # noqa: F811
    """alice may subscribe to the pattern ``Zone.*`` and to ``Zone.public``, not to
    ``Zone.secret``: through her pattern she receives ``Zone.public`` and never
    ``Zone.secret``; a wider pattern she is not granted is refused."""
    rules = [{"who": ["tcp:alice"], "subscribe": ["Zone.[*]", "Zone.public"]}]
    b = tcp_broker(rules)
    async with (
        msgq_trio.connect(b.url, name="alice", token=ALICE) as alice,
        msgq_trio.connect(b.path, name="pub") as pub,
        msgq_trio.connect(b.path, name="local") as local,
    ):
        assert await alice.subscribe("Zone.*") is True
        with pytest.raises(Forbidden):
            await alice.subscribe("Zone.>")
        await local.subscribe("Zone.*")  # unrestricted: gets both
        await pub.send("Zone.secret", "s")
        await pub.send("Zone.public", "p")
        await pub.send(alice.lname, "marker")
        with trio.fail_after(HANG):
            got = [(await alice.receive()).body for _ in range(2)]
            local_got = [(await local.receive()).body for _ in range(2)]
    assert got == ["p", "marker"]
    assert local_got == ["s", "p"]


async def test_pattern_limits_from_the_command_line(broker_factory: Callable[..., Any]) -> None:
    """``--max-pattern-tokens``/``--max-pattern-bytes``: a pattern over either is
    refused with limit-exceeded naming the limit; one within is accepted."""
    b = broker_factory("--max-pattern-tokens", "3", "--max-pattern-bytes", "20")
    async with msgq_trio.connect(b.path, name="c") as c:
        with pytest.raises(LimitExceeded, match="max_pattern_tokens=3"):
            await c.subscribe("a.b.c.*")
        with pytest.raises(LimitExceeded, match="max_pattern_bytes=20"):
            await c.subscribe("Zone." + "x" * 20 + ".*")
        assert await c.subscribe("a.b.*") is True


def test_cli_listen_and_dump_take_patterns(broker: Any) -> None:
    """``listen 'Zone.>'`` prints what a matching group gets (not the others);
    ``dump --target 'Zone.*'`` shows only frames to a group that pattern matches."""

    def start(*argv: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [MSGQ, *argv, "-s", str(broker.path)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )

    def send(target: str, n: int) -> None:
        r = subprocess.run(
            [MSGQ, "send", "-s", str(broker.path), target, str(n)],
            capture_output=True,
            text=True,
            timeout=HANG,
            check=False,
        )
        assert r.returncode == 0, r.stderr

    listen = start("listen", "Zone.>", "--count", "2")
    dump = start("dump", "--json", "--target", "Zone.*", "--count", "1")
    try:
        assert dump.stderr is not None and dump.stderr.readline().startswith("# dumping")

        def listening() -> bool:
            r = subprocess.run(
                [MSGQ, "members", "-s", str(broker.path), "Zone.>"],
                capture_output=True,
                text=True,
                timeout=HANG,
                check=False,
            )
            return "msgq-trio-listen" in r.stdout

        for _ in range(200):
            if listening():
                break
            time.sleep(0.05)
        else:
            pytest.fail("listen never subscribed")
        send("Other.a", 0)
        send("Zone.a.b", 1)
        send("Zone.a", 2)
        out, err = listen.communicate(timeout=HANG)
        dout, derr = dump.communicate(timeout=HANG)
    finally:
        for p in (listen, dump):
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert listen.returncode == 0, err
    assert [(r["to"], r["body"]) for r in map(json.loads, out.splitlines())] == [
        ("Zone.a.b", 1),
        ("Zone.a", 2),
    ]
    assert dump.returncode == 0, derr
    assert [r["target"] for r in map(json.loads, dout.splitlines())] == ["Zone.a"]
