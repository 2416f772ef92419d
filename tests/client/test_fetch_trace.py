"""A pulled queue message carries the trace it was put with, as a pushed one does: the
queue plugin's ``fetch`` answer adds each traced message's ``traceparent`` (a fourth
item of its row), and ``QueueMessage.trace_header`` hands it to the consumer."""

from __future__ import annotations

import json
from typing import Any

import trio

import msgq_trio
from msgq_trio.client import tracing


async def test_fetched_messages_carry_their_puts_trace(broker_factory: Any, short_tmp: Any) -> None:
    cfg = short_tmp / "queue.toml"
    cfg.write_text(
        f"[plugins.queue]\ndir = {json.dumps(str(short_tmp / 'store'))}\n"
        '[plugins.queue.queues."work"]\n'
    )
    broker = broker_factory("--config", str(cfg))
    async with msgq_trio.connect(broker.path, "P") as p, msgq_trio.connect(broker.path, "F") as f:
        producer = p.queue("work", producer="P")
        await producer.prepare()
        await producer.put({"n": 0})  # untraced
        with tracing.start_trace() as root:
            await producer.put({"n": 1})
        await producer.put({"n": 2})
        q = f.queue("work")
        got = []
        with trio.fail_after(10):
            while len(got) < 3:
                got += await q.fetch(3)
        assert [m.body for m in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert got[0].trace_header == {} and got[2].trace_header == {}
        sent = tracing.context_of(got[1].trace_header)
        assert sent is not None and sent.trace_id == root.trace_id
        # The consumer continues it: what it sends while processing belongs to the trace.
        with tracing.continued(got[1].trace_header) as tc:
            assert tc is not None and tc.trace_id == root.trace_id and tc.cause == sent.span_id
        assert await q.ack(got) == 3
