"""The store's one writer thread: every ``QueueStore`` call of the plugin runs here.

Why one dedicated thread and not ``trio.to_thread.run_sync``: an LMDB write transaction
belongs to the thread that began it, and trio's thread cache may hand a call to any idle
worker. The store opens and ends each transaction within one call, so any thread would
be correct today; one fixed thread also serialises the calls in submission order (a
producer-state lookup queued after a commit sees that commit) and keeps the store's
lock uncontended. Calls are short: no read transaction outlives a call, and no call
spans an ``await``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

__all__ = ["StoreThread"]

T = TypeVar("T")


class StoreThread:
    """Runs functions on one thread, in submission order.

    Resource handling: :meth:`stop` ends the thread after the calls already submitted;
    use it as a context manager (``with StoreThread() as t``).
    """

    def __init__(self, name: str = "msgq-queue-store") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the store thread; return its result or raise its error.

        Not cancellable once submitted (the call runs to its end; a cancelled caller
        leaves after it finished), so no store call is ever left half done.
        """
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        box: list[outcome.Outcome[T]] = []

        def job() -> None:
            box.append(outcome.capture(fn, *args))
            token.run_sync_soon(trio.lowlevel.reschedule, task)

        self._jobs.put(job)
        await trio.lowlevel.wait_task_rescheduled(lambda _raise: trio.lowlevel.Abort.FAILED)
        return box[0].unwrap()

    def stop(self) -> None:
        """End the thread once the submitted calls are done (waits for it)."""
        self._jobs.put(None)
        self._thread.join()

    def __enter__(self) -> StoreThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
