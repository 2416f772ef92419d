"""msgq_trio benchmark clients on the trio client: ``python -m benchmarks.worker_msgq
SPEC_JSON``; the role bodies are shared with the asyncio client's worker
(:mod:`benchmarks.worker_msgq_aio`), which differs only in its :class:`Runtime`.

Roles (see :mod:`benchmarks.common` for the spec and the READY/GO/RESULT lines):

* ``sub``: subscribe to the group, count ``n`` messages (``async for msg in bus``);
* ``pub``: ``bus.send(group, body)`` ``n`` times, then ``bus.flush()``;
* ``responder``: member of the echo group, answering ``echo`` with its params through
  ``@bus.command("echo")`` on an ``async def`` handler (the form the README teaches: a
  task per request), or with spec ``"handler": "plain"`` a plain ``def`` (answered
  inline by the reader as the request arrives: the ``-def-handler`` systems);
* ``requester``: ``conc`` tasks each doing ``calls`` sequential ``bus.call`` on one bus.

Bodies are ``bytes``, so they travel as CBOR byte strings.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import trio

from msgq_trio import Bus, connect
from msgq_trio.aio import AioBus

from .common import Deadline, RoleFn, Spec, calls_result, payloads, ready, wait_go, worker_main

GROUP = "bench.data"
ECHO = "bench.echo"

Role = Callable[["Runtime", Spec], Awaitable[dict[str, Any]]]
AnyBus = Bus | AioBus


class Runtime:
    """What a role needs from its event loop, here trio's: one role body serves the trio
    client and (in a subclass) the asyncio one, so both measure the same client calls."""

    #: ``connect(socket, name=, token=, ssl_context=[, busy_poll=])``: the client's async
    #: context manager (``busy_poll`` only for the trio client: see _connect).
    connect: Callable[..., AbstractAsyncContextManager[AnyBus]] = staticmethod(connect)

    def run(self, role: Role, spec: Spec) -> dict[str, Any]:
        """Run ``role`` to its end in a fresh event loop; returns its result."""
        result: dict[str, Any] = trio.run(role, self, spec)
        return result

    @asynccontextmanager
    async def within(self, seconds: float) -> AsyncIterator[None]:
        """Run the body for at most ``seconds``, then move on (no exception)."""
        with trio.move_on_after(seconds):
            yield

    async def wait_go(self, deadline: Deadline) -> None:
        """Wait for GO in a thread (the loop keeps serving the connection meanwhile)."""
        await trio.to_thread.run_sync(wait_go, deadline.left())

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    async def gather(self, fns: list[Callable[[], Awaitable[None]]]) -> None:
        """Run every ``fn()`` concurrently until all returned."""
        async with trio.open_nursery() as nursery:
            for fn in fns:
                nursery.start_soon(fn)


def _connect(rt: Runtime, spec: Spec, name: str) -> AbstractAsyncContextManager[AnyBus]:
    """connect() to the run's broker: a Unix socket, or (msgq_trio-tcp / -tls) a URL with
    the run's token and, for TLS, the CA file that signed the broker's certificate; with
    the run's ``busy_poll`` for the trio client if it sets one (msgq_trio-no-busy-poll)."""
    addr = spec["addr"]
    ctx = None
    if addr.get("cafile"):
        import ssl

        ctx = ssl.create_default_context(cafile=addr["cafile"])
    options = {"busy_poll": addr["busy_poll"]} if "busy_poll" in addr else {}
    return rt.connect(
        addr["socket"], name=name, token=addr.get("token"), ssl_context=ctx, **options
    )


async def _sub(rt: Runtime, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, size = spec["n"], spec["size"]
    count = bad = 0
    first = last = 0.0
    async with _connect(rt, spec, name=f"bench-sub-{spec.get('index', 0)}") as bus:
        await bus.subscribe(GROUP)
        ready()
        async with rt.within(deadline.left()):
            async for msg in bus:
                if len(msg.body) != size:
                    bad += 1
                count += 1
                if count == 1:
                    first = time.monotonic()
                if count >= n:
                    break
        last = time.monotonic()
    return {"count": count, "bad": bad, "first": first, "last": last, "timeout": count < n}


async def _pub(rt: Runtime, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n = spec["n"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    async with _connect(rt, spec, name="bench-pub") as bus:
        ready()
        await rt.wait_go(deadline)
        start = time.monotonic()
        sent = 0
        async with rt.within(deadline.left()):
            send = bus.send
            for i in range(n):
                await send(GROUP, bodies[i & mask])
                sent += 1
            await bus.flush()
        end = time.monotonic()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


async def _responder(rt: Runtime, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    served = 0
    async with _connect(rt, spec, name="bench-echo") as bus:
        if spec.get("handler") == "plain":

            @bus.command("echo")
            def echo(params: Any) -> Any:
                nonlocal served
                served += 1
                return params

        else:

            @bus.command("echo")
            async def echo_async(params: Any) -> Any:
                nonlocal served
                served += 1
                return params

        await bus.subscribe(ECHO)
        ready()
        # Serves until the parent ends this process (or the deadline).
        await rt.sleep(deadline.left())
    return {"served": served}


async def _requester(rt: Runtime, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls, size = spec["conc"], spec["calls"], spec["size"]
    bodies = payloads(size, spec.get("seed", 0))
    mask = len(bodies) - 1
    lat: list[int] = []
    done = 0
    errors = 0
    async with _connect(rt, spec, name=f"bench-req-{spec.get('index', 0)}") as bus:
        for i in range(spec.get("warmup", 0)):
            await bus.call(ECHO, "echo", bodies[i & mask])
        ready()
        await rt.wait_go(deadline)

        def requester(slot: int) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                nonlocal done, errors
                call, clock = bus.call, time.perf_counter_ns
                for i in range(calls):
                    body = bodies[(i + slot) & mask]
                    t0 = clock()
                    reply = await call(ECHO, "echo", body)
                    lat.append(clock() - t0)
                    if reply != body:
                        errors += 1
                    done += 1

            return run

        start = time.monotonic()
        async with rt.within(deadline.left()):
            await rt.gather([requester(slot) for slot in range(conc)])
        end = time.monotonic()
    return calls_result(spec, done, errors, start, end, lat)


def roles(rt: Runtime) -> dict[str, RoleFn]:
    """The four roles run on ``rt``, for :func:`~benchmarks.common.worker_main`."""

    def role(fn: Role) -> RoleFn:
        return lambda spec: rt.run(fn, spec)

    return {
        "sub": role(_sub),
        "pub": role(_pub),
        "responder": role(_responder),
        "requester": role(_requester),
    }


ROLES = roles(Runtime())

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
