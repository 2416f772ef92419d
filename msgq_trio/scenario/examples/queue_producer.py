"""A producer that must not lose a message: ``python -m
msgq_trio.scenario.examples.queue_producer QUEUE N [--producer NAME] [--rate R]
[--resend-new-identity]``.

Puts the integers 1..N into the durable queue QUEUE with its own producer name and the
integer as producer seq, at most R per second; a put that fails or whose answer is lost
(broker or plugin killed) is sent again with the same seq until it is acked (the queue
answers ``duplicate`` if the first one was stored). After a restart it goes on from the
queue's record of its highest seq. Prints ``ready`` once connected and ``queue-full`` at
its first refused put; exits 0 when all N are acked. History: ``send`` invoke, then ok
(acked), fail (``queue-full``: not stored) or info (outcome unknown).

Deliberately broken variant, for scenarios that must catch it: ``--resend-new-identity``
reconnects under a new producer name (``NAME~1``, ``NAME~2``...) and resends its last
``RESEND_TAIL`` messages to be safe; the queue has not seen that producer, so it stores
them again (the queue deduplicates per producer name: a resend is only safe under the
same name and seq).
"""

from __future__ import annotations

import argparse

import trio

import msgq_trio
from msgq_trio.errors import ConnectError, ConnectionLost, QueueFull, RpcError

from ._history import History

RETRY = 0.05
#: How many of its last messages the broken variant resends after a reconnect: more
#: than can be in flight (one), so every reconnect resends messages the queue has.
RESEND_TAIL = 10


async def main(queue: str, n: int, producer: str, rate: float, resend_new: bool) -> None:
    h = History()
    seq = 0
    ready = False
    refused = False
    identity = producer
    reconnects = 0
    while seq < n:
        try:
            async with msgq_trio.connect(name=f"producer-{producer}") as bus:
                if ready and resend_new:
                    # The bug: a new name, so the queue cannot tell a resend from news.
                    reconnects += 1
                    identity = f"{producer}~{reconnects}"
                    seq = max(0, seq - RESEND_TAIL)
                q = bus.queue(queue, producer=identity)
                if not ready:
                    seq = await q.producer_state()  # after a restart: where it was
                    print("ready", flush=True)
                    ready = True
                while seq < n:
                    key = f"{producer}:{seq + 1}"
                    op = h.invoke("send", key=key, producer=producer, seq=seq + 1)
                    try:
                        answer = await q.put(seq + 1, seq=seq + 1)
                    except QueueFull:
                        # Definite: not stored (the store is full). Resent after a pause.
                        h.complete(op, "fail", "send", key=key, error="queue-full")
                        if not refused:
                            # A line a scenario can wait for (``when = "line:...``).
                            print("queue-full", flush=True)
                            refused = True
                        await trio.sleep(RETRY)
                        continue
                    except (RpcError, ConnectionLost) as exc:
                        h.complete(op, "info", "send", key=key, error=type(exc).__name__)
                        if isinstance(exc, ConnectionLost):
                            raise
                        await trio.sleep(RETRY)
                        continue
                    h.complete(op, "ok", "send", key=key, value=answer)
                    seq += 1
                    if rate:
                        await trio.sleep(1 / rate)
        except (ConnectionLost, ConnectError, RpcError, OSError):
            await trio.sleep(RETRY)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("queue")
    p.add_argument("n", type=int)
    p.add_argument("--producer", default="p1")
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--resend-new-identity", action="store_true")
    a = p.parse_args()
    trio.run(main, a.queue, a.n, a.producer, a.rate, a.resend_new_identity)
