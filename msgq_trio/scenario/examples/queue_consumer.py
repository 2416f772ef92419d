"""A consumer of a durable queue: ``python -m msgq_trio.scenario.examples.queue_consumer
QUEUE N [--producer NAME] [--window W] [--delay S]``.

Consumes QUEUE (push, window W), acks each message, until it has seen the integers 1..N
that the example producer puts; reconnects after a broker restart. Prints ``ready`` once
consuming; exits 0 when it saw all N. History: a ``deliver`` event per message with its
session (``connection.reattach``): a message may come again after a crash (at least
once), but never twice within one session.
"""

from __future__ import annotations

import argparse

import trio

import msgq_trio
from msgq_trio.errors import ConnectError, ConnectionLost, RpcError

from ._history import History


async def main(queue: str, n: int, producer: str, window: int, delay: float) -> None:
    h = History()
    seen: set[int] = set()
    connection = 0
    ready = False
    while len(seen) < n:
        try:
            async with msgq_trio.connect(name="consumer") as bus:
                connection += 1
                async with bus.queue(queue).consume(window=window) as msgs:
                    if not ready:
                        print("ready", flush=True)
                        ready = True
                        await trio.sleep(delay)  # let a backlog build up first
                    async for m in msgs:
                        seq = m.body
                        h.event(
                            "deliver",
                            key=f"{producer}:{seq}",
                            producer=producer,
                            seq=seq,
                            value={
                                "session": f"{connection}.{msgs.reattached}",
                                "deliveries": m.deliveries,
                            },
                        )
                        seen.add(seq)
                        await m.ack()
                        if len(seen) >= n:
                            return
        except (ConnectionLost, ConnectError, RpcError, OSError):
            await trio.sleep(0.05)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("queue")
    p.add_argument("n", type=int)
    p.add_argument("--producer", default="p1")
    p.add_argument("--window", type=int, default=16)
    p.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="seconds between consuming and taking the first message",
    )
    a = p.parse_args()
    trio.run(main, a.queue, a.n, a.producer, a.window, a.delay)
