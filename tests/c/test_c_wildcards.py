"""The C client subscribes to wildcard patterns like any other group name (it does not
check names: the broker does): ``msgq-c listen 'Zone.*'`` hears the groups the pattern
matches and not the others."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import trio
from libmsgq_build import CBuild, CProcess, check_clean

import msgq_trio


async def test_c_listener_subscribes_to_patterns(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess]
) -> None:
    """Subscribed to ``Zone.*``, the C listener prints one line per message to
    ``Zone.a`` and ``Zone.b``, none for ``Other`` or ``Zone.b.c`` (two tokens below)."""
    listen = c_process(cbuild, "listen", "-s", str(broker.path), "Zone.*")
    await trio.to_thread.run_sync(listen.wait_ready)
    async with msgq_trio.connect(str(broker.path), name="sender") as bus:
        for group in ("Zone.a", "Other", "Zone.b.c", "Zone.b"):
            await bus.send(group, group)
        lines = [await trio.to_thread.run_sync(listen.readline) for _ in range(2)]
    assert [json.loads(line)["target"] for line in lines] == ["Zone.a", "Zone.b"], lines
    assert listen.stop() == 0
    check_clean(listen.stderr())
