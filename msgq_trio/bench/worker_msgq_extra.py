"""msgq_trio-only benchmark clients: ``python -m msgq_trio.bench.worker_msgq_extra SPEC``.

Roles (the line protocol of :mod:`msgq_trio.bench.common`, plus these lines):

* ``callee``: joins ``spec["group"]`` and answers command ``hang`` by printing ``GOT`` and
  never answering; the parent SIGKILLs it once it printed ``GOT``;
* ``caller``: prints READY, then for each ``CALL <group>`` line on stdin calls
  ``<group>``/``hang`` and prints ``GONE <monotonic time> <error code>`` when the call
  fails (``recipient-gone`` expected); ends on ``STOP``, EOF or the deadline;
* ``idle``: opens ``spec["clients"]`` connections (full HELLO/WELCOME handshakes, at most
  ``spec["parallel"]`` at once), prints ``READY <seconds it took>`` and holds them, idle,
  until GO or the deadline. Raises its own RLIMIT_NOFILE soft limit to the hard one.
"""

from __future__ import annotations

import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import trio

from .. import connect
from ..errors import MsgqError, RpcError
from .common import Deadline, Spec, ready, wait_go, worker_main
from .procs import raise_nofile


def _run(fn: Any, spec: Spec) -> dict[str, Any]:
    result: dict[str, Any] = trio.run(fn, spec)
    return result


def _line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def _callee(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    async with connect(spec["addr"]["socket"], name="bench-callee") as bus:

        @bus.command("hang")
        async def hang(_params: Any) -> Any:
            _line("GOT")
            # Never answers: the parent kills this process while the call is pending.
            await trio.sleep(deadline.left())

        await bus.subscribe(spec["group"])
        ready()
        await trio.sleep(deadline.left())
    return {}


async def _caller(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    calls = 0
    async with connect(spec["addr"]["socket"], name="bench-caller") as bus:
        ready()
        while calls < spec["max_calls"] and not deadline.expired():
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            words = line.split()
            if not words or words[0] != "CALL":
                break  # STOP or EOF
            calls += 1
            code = "answered"
            try:
                await bus.call(words[1], "hang", timeout=max(0.1, deadline.left()))
            except RpcError as exc:
                code = exc.code
            except MsgqError as exc:
                code = type(exc).__name__
            _line(f"GONE {time.monotonic():.9f} {code}")
    return {"calls": calls}


async def _idle(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    raise_nofile()
    want = spec["clients"]
    limiter = trio.CapacityLimiter(spec.get("parallel", 64))
    connected = 0
    all_in = trio.Event()
    release = trio.Event()
    failures: list[str] = []

    async def hold(i: int) -> None:
        nonlocal connected
        async with AsyncExitStack() as stack:
            try:
                async with limiter:
                    await stack.enter_async_context(
                        connect(spec["addr"]["socket"], name=f"idle-{spec['index']}-{i}"))
            except (MsgqError, OSError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                all_in.set()  # fail fast: the parent sees the error, not a timeout
                return
            connected += 1
            if connected == want:
                all_in.set()
            await release.wait()

    t0 = time.monotonic()
    with trio.move_on_after(deadline.left()):
        async with trio.open_nursery() as nursery:
            for i in range(want):
                nursery.start_soon(hold, i)
            await all_in.wait()
            if failures:
                raise RuntimeError(f"{len(failures)} connections failed: {failures[0]}")
            _line(f"READY {time.monotonic() - t0:.3f}")
            await trio.to_thread.run_sync(wait_go, deadline.left(), abandon_on_cancel=True)
            release.set()
    return {"clients": connected}


ROLES = {
    "callee": lambda spec: _run(_callee, spec),
    "caller": lambda spec: _run(_caller, spec),
    "idle": lambda spec: _run(_idle, spec),
}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
