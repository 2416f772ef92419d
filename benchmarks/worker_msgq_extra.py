"""msgq_trio-only benchmark clients: ``python -m benchmarks.worker_msgq_extra SPEC``.

Roles (the line protocol of :mod:`benchmarks.common`, plus these lines):

* ``callee-pool``: a fork server for callees, so 200 kills a repetition cost no 200
  interpreter start-ups. It imports trio and msgq_trio, prints READY, and never runs trio
  itself (forking a process that runs trio is not safe). On ``SPAWN <k>`` it forks ``k``
  callees; each joins group ``bench.victim<pid>``, prints ``CALLEE <pid>``, and answers
  command ``hang`` by printing ``GOT <pid>`` and never answering. On ``KILL <pid>`` the
  pool SIGKILLs that callee and prints ``KILLED <pid> <kill time> <eof time>``: the
  second time is when a socket the callee held (and never used) reached EOF in the
  pool, i.e. when the kernel had closed the dead callee's descriptors, the earliest
  moment a broker could notice (0 if not seen within 5 s). Ends on ``STOP``, EOF or the
  deadline, killing the callees left;
* ``caller``: prints READY, then for each ``CALL <group>`` line on stdin calls
  ``<group>``/``hang`` and prints ``GONE <monotonic time> <error code>`` when the call
  fails (``recipient-gone`` expected); ends on ``STOP``, EOF or the deadline;
* ``idle``: opens ``spec["clients"]`` connections (full HELLO/WELCOME handshakes, at most
  ``spec["parallel"]`` at once), prints ``READY <seconds it took>`` and holds them, idle,
  until GO or the deadline. Raises its own RLIMIT_NOFILE soft limit to the hard one.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import trio

from msgq_trio import connect
from msgq_trio._procs import raise_nofile
from msgq_trio.errors import MsgqError, RpcError

from .common import Deadline, Spec, ready, wait_go, worker_main


def _run(fn: Any, spec: Spec) -> dict[str, Any]:
    result: dict[str, Any] = trio.run(fn, spec)
    return result


def _line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def _pooled_callee(spec: Spec, deadline: Deadline) -> None:
    pid = os.getpid()
    async with connect(spec["addr"]["socket"], name=f"bench-callee-{pid}") as bus:

        @bus.command("hang")
        async def hang(_params: Any) -> Any:
            _line(f"GOT {pid}")
            # Never answers: the harness has this process killed while the call is pending.
            await trio.sleep(deadline.left())

        await bus.subscribe(f"bench.victim{pid}")
        _line(f"CALLEE {pid}")
        await trio.sleep(deadline.left())


def _fork_callee(spec: Spec, deadline: Deadline) -> tuple[int, socket.socket]:
    """Fork one callee; returns its pid and this end of a socket pair it holds."""
    mine, theirs = socket.socketpair()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the callee: never returns
        code = 1
        try:
            mine.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            trio.run(_pooled_callee, spec, deadline)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    return pid, mine


def _callee_pool(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    children: dict[int, socket.socket] = {}
    spawned = killed = 0
    ready()
    try:
        while not deadline.expired():
            readable, _, _ = select.select([sys.stdin], [], [], deadline.left())
            words = sys.stdin.readline().split() if readable else []
            if not words or words[0] == "STOP":
                break
            if words[0] == "SPAWN":
                for _ in range(min(int(words[1]), spec["max_callees"] - spawned)):
                    pid, mine = _fork_callee(spec, deadline)
                    children[pid] = mine
                    spawned += 1
            elif words[0] == "KILL":
                pid = int(words[1])
                mine = children.pop(pid)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                eof_at = 0.0
                r, _, _ = select.select([mine], [], [], min(5.0, deadline.left()))
                if r and mine.recv(1) == b"":
                    eof_at = time.monotonic()
                mine.close()
                os.waitpid(pid, 0)
                killed += 1
                _line(f"KILLED {pid} {killed_at:.9f} {eof_at:.9f}")
    finally:
        for pid, mine in children.items():
            mine.close()
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return {"spawned": spawned, "killed": killed}


async def _caller(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    calls = 0
    async with connect(spec["addr"]["socket"], name="bench-caller") as bus:
        ready()
        # Until STOP, also after max_calls: the harness always sends it, and a caller
        # that ended by itself could close its stdin before that write (BrokenPipeError
        # in the harness: "caller exited before STOP").
        while not deadline.expired():
            line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            words = line.split()
            if not words or words[0] != "CALL":
                break  # STOP or EOF
            if calls >= spec["max_calls"]:
                raise RuntimeError(f"CALL beyond max_calls={spec['max_calls']}")
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
                        connect(spec["addr"]["socket"], name=f"idle-{spec['index']}-{i}")
                    )
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
    "callee-pool": _callee_pool,
    "caller": lambda spec: _run(_caller, spec),
    "idle": lambda spec: _run(_idle, spec),
}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
