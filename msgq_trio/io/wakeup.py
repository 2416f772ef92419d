"""A level-triggered wake-up flag for one waiting task (writers, timers, the poller)."""

from __future__ import annotations

import trio


class Wakeup:
    """A level-triggered flag a single task waits on (cheaper than a new Event per wait)."""

    __slots__ = ("_lot", "flag")

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()
        self.flag = False

    def set(self) -> None:
        if not self.flag:
            self.flag = True
            self._lot.unpark_all()

    async def wait(self) -> None:
        """Wait until set, then clear. Always a checkpoint, so a waker cannot starve others."""
        if self.flag:
            self.flag = False
            await trio.lowlevel.checkpoint()
            return
        await self._lot.park()
        self.flag = False
