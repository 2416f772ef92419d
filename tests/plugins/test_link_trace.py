"""A message's trace context goes with it through a link: put traced at broker A, the
link forwards it to B's queue, and B's consumer gets the trace it was put with (two real
broker processes, as tests/plugins/test_link.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

import msgq_trio
from msgq_trio.client import tracing


def _table(name: str, values: dict[str, Any]) -> list[str]:
    return [f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]


async def test_the_trace_goes_through_the_link(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    paths = {"a": short_tmp / "a.sock", "b": short_tmp / "b.sock"}
    (short_tmp / "b.toml").write_text(
        "\n".join(
            [
                *_table("plugins.queue", {"dir": str(short_tmp / "b-store")}),
                *_table('plugins.queue.queues."chain"', {}),
            ]
        )
        + "\n"
    )
    (short_tmp / "a.toml").write_text(
        "\n".join(
            [
                *_table("plugins.queue", {"dir": str(short_tmp / "a-store")}),
                *_table('plugins.queue.queues."chain"', {}),
                *_table("plugins.link", {}),
                *_table(
                    "plugins.link.links.tob",
                    {"address": str(paths["b"]), "from_queue": "chain"},
                ),
            ]
        )
        + "\n"
    )
    broker_factory("--config", str(short_tmp / "b.toml"), path=paths["b"])
    broker_factory("--config", str(short_tmp / "a.toml"), path=paths["a"])
    async with (
        msgq_trio.connect(paths["a"], "producer") as p,
        msgq_trio.connect(paths["b"], "consumer") as c,
    ):
        q = p.queue("chain", producer="p1")
        await q.prepare()
        with tracing.start_trace() as root:
            await q.put("traced")
        await q.put("untraced")
        got: list[tuple[Any, dict[str, object]]] = []
        with trio.fail_after(30):
            async with c.queue("chain").consume() as consumer:
                async for m in consumer:
                    got.append((m.body, m.trace_header))
                    await m.ack()
                    if len(got) == 2:
                        break
    assert [body for body, _ in got] == ["traced", "untraced"]
    tc = tracing.context_of(got[0][1])
    assert tc is not None and tc.trace_id == root.trace_id
    assert got[1][1] == {}
