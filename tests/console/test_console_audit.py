"""The broker's ``audit`` control command, which the console writes its actions with."""

from __future__ import annotations

from typing import Any

import pytest

import msgq_trio
from msgq_trio.errors import RemoteError


async def test_audit_logs_actor_and_caller_and_checks_params(broker: Any) -> None:
    async with msgq_trio.connect(broker.path, name="console-like") as bus:
        assert await bus.call("msgq", "audit", {"actor": "alice", "action": "drop l.9"}) is True
        broker.log_with("audit: drop l.9 by alice via " + bus.lname)
        long = "x" * 5000
        await bus.call("msgq", "audit", {"actor": "bob", "action": "call", "detail": long})
        text = broker.log_with("audit: call by bob")
        line = next(ln for ln in text.splitlines() if "audit: call by bob" in ln)
        assert len(line) < 1400  # the detail is cut at 1,000 characters
        for bad in (
            None,
            {"actor": 1, "action": "x"},
            {"actor": "a"},
            {"actor": "a", "action": "b", "detail": 3},
        ):
            with pytest.raises(RemoteError) as e:
                await bus.call("msgq", "audit", bad)
            assert e.value.code == "bad-request" and "actor" in e.value.message


async def test_audit_is_a_control_command(broker_factory: Any, write_config: Any) -> None:
    b = broker_factory("--config", str(write_config("[control]\nallow_uids = [4242424]\n")))
    async with msgq_trio.connect(b.path, name="nobody") as bus:
        with pytest.raises(RemoteError) as e:
            await bus.call("msgq", "audit", {"actor": "mallory", "action": "x"})
    assert e.value.code == "forbidden"
    assert "audit: x by mallory" not in b.log()
