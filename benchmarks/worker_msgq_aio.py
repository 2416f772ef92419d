"""msgq_trio benchmark clients on the asyncio client (``msgq_trio.aio.connect``, the
README's form): ``python -m benchmarks.worker_msgq_aio SPEC_JSON``.

The ``msgq_trio-asyncio`` systems. The roles and what they measure are
:mod:`benchmarks.worker_msgq`'s, the same calls on an :class:`~msgq_trio.aio.AioBus`
under ``asyncio.run``; only the event loop's part (:class:`AioRuntime`) differs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from msgq_trio.aio import connect

from .common import Deadline, Spec, wait_go, worker_main
from .worker_msgq import AnyBus, Role, Runtime, roles


class AioRuntime(Runtime):
    """:class:`~benchmarks.worker_msgq.Runtime` on asyncio."""

    connect: Callable[..., AbstractAsyncContextManager[AnyBus]] = staticmethod(connect)

    def run(self, role: Role, spec: Spec) -> dict[str, Any]:
        async def main() -> dict[str, Any]:
            return await role(self, spec)

        return asyncio.run(main())

    @asynccontextmanager
    async def within(self, seconds: float) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(seconds) as scope:
                yield
        except TimeoutError:
            if not scope.expired():
                raise  # a TimeoutError of the body's own, not the time bound

    async def wait_go(self, deadline: Deadline) -> None:
        await asyncio.to_thread(wait_go, deadline.left())

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def gather(self, fns: list[Callable[[], Awaitable[None]]]) -> None:
        await asyncio.gather(*(fn() for fn in fns))


ROLES = roles(AioRuntime())

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
