"""The event-loop services a plugin client needs (a clock, sleeping, scheduling points,
events, background tasks, cleanup that outlives the caller's cancellation), so that
its protocol logic is written once for the trio and the asyncio driver; each driver
implements them on its own loop."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

__all__ = ["LoopEvent", "LoopServices", "run_callback"]

log = logging.getLogger("msgq_trio.client")


class LoopEvent(Protocol):
    """trio.Event or asyncio.Event: ``set()``, ``is_set()`` and ``await wait()``."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> Any: ...


async def run_callback(cb: Callable[..., Any], *args: Any) -> None:
    """Run a user callback (a plain function or an ``async def``); what it raises is
    logged: nobody else would see it."""
    try:
        r = cb(*args)
        if inspect.isawaitable(r):
            await r
    except Exception:
        log.exception("callback %r raised", cb)


class LoopServices:
    """The services of the driver's event loop (see the module's docstring)."""

    def _now(self) -> float:
        """The driver's clock (the one call deadlines are on)."""
        raise NotImplementedError

    def _task(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run ``fn(*args)`` in a task of this bus (cancelled when it closes)."""
        raise NotImplementedError

    def current_time(self) -> float:
        """The driver's clock in seconds (trio's ``current_time``, the asyncio loop's
        ``time()``): the one call deadlines are on."""
        return self._now()

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` on the driver's event loop."""
        raise NotImplementedError

    async def checkpoint(self) -> None:
        """A scheduling point: other tasks run, and a cancelled caller is cancelled
        here (for plugin clients that must stay fair and cancellable in a loop that
        otherwise never waits)."""
        raise NotImplementedError

    def new_event(self) -> Any:
        """A new event of the driver's event loop (``trio.Event`` / ``asyncio.Event``):
        ``set()``, ``is_set()``, ``await wait()``."""
        raise NotImplementedError

    async def shielded(
        self, fn: Callable[[], Coroutine[Any, Any, None]], timeout: float | None = None
    ) -> None:
        """Run ``fn()`` to its end even if the caller is cancelled meanwhile (cleanup
        that must reach the broker: a consumer's last acks, a handle's close), giving it
        up after ``timeout`` s (None: no limit). ``fn`` must catch its own errors:
        under asyncio a cancelled caller returns at once while ``fn`` finishes in a
        task of this bus, where nobody would see them.

        Raises:
            The caller's cancellation, once ``fn`` is done (trio) or at once (asyncio).
        """
        raise NotImplementedError

    def start_soon(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``fn()`` in a task of this bus: it is cancelled when the bus closes (for
        plugin clients' background work: acks, watchers).

        Raises:
            UsageError: the bus is not running (closed, or not yet started).
        """
        self._task(fn)
