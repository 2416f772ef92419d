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

import errno
import fcntl
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import outcome
import trio
from msgq_trio.storage.lmdb_store import LmdbQueueStore

__all__ = ["LOCK_TIMEOUT", "StoreThread", "lock_dir", "open_store_dir"]

#: How long a plugin waits for the previous owner of its store directory (a plugin
#: process of a killed broker that is still exiting).
LOCK_TIMEOUT = 30.0

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


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

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
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


async def lock_dir(path: Path) -> int:
    """Take an exclusive lock on ``path/plugin.lock``; returns the fd (closing releases).

    One process owns a store directory at a time (LMDB map growth is not coordinated
    between processes). A previous plugin process of a killed broker may still be
    exiting: wait for it.

    Raises:
        BlockingIOError: the lock was not free within LOCK_TIMEOUT (names the file; an
            OSError, so the plugin host reports it in one line).
    """
    fd = os.open(path / "plugin.lock", os.O_RDWR | os.O_CREAT, 0o600)
    with trio.move_on_after(LOCK_TIMEOUT):
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            await trio.sleep(0.05)
    os.close(fd)
    raise BlockingIOError(
        errno.EWOULDBLOCK,
        f"{path / 'plugin.lock'} is held by another process for {LOCK_TIMEOUT} s: "
        "is another plugin using this directory?",
    )


@asynccontextmanager
async def open_store_dir(
    path: Path, *, map_size: int, max_map_size: int, sync: bool, thread_name: str
) -> AsyncIterator[tuple[LmdbQueueStore, StoreThread]]:
    """A plugin's store directory, owned: created if missing, locked (:func:`lock_dir`),
    the LMDB store opened and its one writer thread started.

    Resource handling: the thread is stopped, the store closed and the lock released on
    every exit.
    """
    await trio.Path(path).mkdir(parents=True, exist_ok=True)
    lock = await lock_dir(path)
    try:
        store = LmdbQueueStore(path, map_size=map_size, max_map_size=max_map_size, sync=sync)
        with store, StoreThread(thread_name) as thread:
            yield store, thread
    finally:
        os.close(lock)
