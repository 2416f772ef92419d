"""Client side of the named pipes of the pipe plugin for asyncio (docs/PIPES.md).

``aio_bus.pipe(name)`` returns an :class:`AioPipe`; ``await pipe.open_reader()`` gives an
:class:`AioPipeReader`, ``await pipe.open_writer()`` an :class:`AioPipeWriter`, with the
trio client's methods (``read``/``receive_some``, ``write``/``send_all``/``flush``,
``aclose``, ``async with``). The pipe logic is :mod:`msgq_trio.client.pipe_core`'s,
shared with the trio client; the pipe's errors (``PipeBroken``, ``PipeTimeout``...) are
the same. Where the trio ends raise trio's resource errors, these raise
:class:`~msgq_trio.errors.UsageError` (using a closed end, or one end from two tasks at
once, is the caller's mistake). Imports no trio (``tests/test_layering.py``).
"""

from __future__ import annotations

from typing import Any

from .pipe_core import PipeBase, ReaderCore, WriterCore

__all__ = ["AioPipe", "AioPipeReader", "AioPipeWriter"]


class AioPipeReader(ReaderCore):
    """The reading end on asyncio (see :class:`~msgq_trio.client.pipe_core.ReaderCore`).

    Resource handling: ``aclose()`` or leaving ``async with`` detaches it.
    """

    async def __aenter__(self) -> AioPipeReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AioPipeWriter(WriterCore):
    """The writing end on asyncio (see :class:`~msgq_trio.client.pipe_core.WriterCore`).

    Resource handling: ``aclose()`` or leaving ``async with`` waits until every chunk
    sent was accepted, then detaches it.
    """

    async def __aenter__(self) -> AioPipeWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AioPipe(PipeBase[AioPipeReader, AioPipeWriter]):
    """A named pipe of the pipe plugin (``aio_bus.pipe(name)``); its ends are
    :class:`AioPipeReader` and :class:`AioPipeWriter`."""

    def _reader(self, info: dict[str, Any], readahead: int) -> AioPipeReader:
        return AioPipeReader(self, info, readahead)

    def _writer(self, info: dict[str, Any], window: int) -> AioPipeWriter:
        return AioPipeWriter(self, info, window)
