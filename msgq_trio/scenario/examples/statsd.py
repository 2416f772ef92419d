"""The stats collector of the example DNS system: ``python -m
msgq_trio.scenario.examples.statsd [--interval S] [--timeout T] [--members M]``.

Waits until ``Auth`` has M members (the servers came up), prints ``ready``, then every S
seconds asks every member of ``Auth`` for its counters (``call_all("Auth", "stats")``,
deadline T) and records the round as one ``stats`` operation: ``ok`` with how many
members answered and how many failed, by error code (``{"answered": 2,
"recipient-gone": 1}``: a member that died is reported gone by the broker, the round
does not wait for it), or ``fail`` with ``no-recipient`` when ``Auth`` is empty. The
deadline is long on purpose (default 30 s): a round left waiting shows as silence in
the history. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter

import trio

import msgq_trio
from msgq_trio.errors import NoRecipient

from ._history import History
from ._members import wait_for_members


async def main(interval: float, timeout: float, members: int) -> None:
    h = History()
    async with msgq_trio.connect(name="statsd") as bus:
        await wait_for_members(bus, "Auth", members)
        print("ready", flush=True)
        for n in itertools.count():
            key = f"round{n}"
            op = h.invoke("stats", key=key)
            try:
                results = await bus.call_all("Auth", "stats", timeout=timeout)
            except NoRecipient:
                h.complete(op, "fail", "stats", key=key, error="no-recipient")
            else:
                outcome = Counter(
                    "answered" if r.ok else str(getattr(r.error, "code", r.error)) for r in results
                )
                h.complete(op, "ok", "stats", key=key, value=dict(outcome))
            await trio.sleep(interval)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.25, help="seconds between rounds")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of one round")
    p.add_argument("--members", type=int, default=1)
    a = p.parse_args()
    trio.run(main, a.interval, a.timeout, a.members)
