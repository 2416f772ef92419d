"""Client side of the named pipes of the pipe plugin (docs/PIPES.md): trio byte streams.

``bus.pipe(name)`` returns a :class:`Pipe`; ``await pipe.open_reader()`` gives a
:class:`PipeReader` (a ``trio.abc.ReceiveStream``), ``await pipe.open_writer()`` a
:class:`PipeWriter` (a ``trio.abc.SendStream``). :class:`SyncPipeReader` /
:class:`SyncPipeWriter` are their file-like faces for the synchronous client
(``msgq-trio pipe read|write NAME`` is the command line's, msgq_trio/cli.py).

The pipe logic (chunking, windows, read-ahead, offsets, closing; why reads and writes
survive cancellation) is :mod:`msgq_trio.client.pipe_core`'s, shared with the asyncio
client (:mod:`msgq_trio.client.aio_pipe`); this module makes its ends trio streams that
raise trio's resource errors.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import trio

from ..errors import MsgqError
from .pipe_core import (
    DEFAULT_GROUP,
    DEFAULT_READAHEAD,
    DEFAULT_WINDOW,
    READ_DEPTH,
    PipeBase,
    ReaderCore,
    WriterCore,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "DEFAULT_GROUP",
    "DEFAULT_READAHEAD",
    "DEFAULT_WINDOW",
    "READ_DEPTH",
    "Pipe",
    "PipeReader",
    "PipeWriter",
    "SyncPipe",
    "SyncPipeReader",
    "SyncPipeWriter",
]


class PipeReader(ReaderCore, trio.abc.ReceiveStream):
    """The reading end as a ``trio.abc.ReceiveStream`` (see
    :class:`~msgq_trio.client.pipe_core.ReaderCore`): a closed reader raises
    ``trio.ClosedResourceError``, one another task is reading ``trio.BusyResourceError``.
    """

    _closed_type = trio.ClosedResourceError
    _busy_type = trio.BusyResourceError


class PipeWriter(WriterCore, trio.abc.SendStream):
    """The writing end as a ``trio.abc.SendStream`` (see
    :class:`~msgq_trio.client.pipe_core.WriterCore`): a closed writer raises
    ``trio.ClosedResourceError``, one another task is writing ``trio.BusyResourceError``.
    """

    _closed_type = trio.ClosedResourceError
    _busy_type = trio.BusyResourceError


class Pipe(PipeBase[PipeReader, PipeWriter]):
    """A named pipe of the pipe plugin (``bus.pipe(name)``); its ends are trio streams."""

    def _reader(self, info: dict[str, Any], readahead: int) -> PipeReader:
        return PipeReader(self, info, readahead)

    def _writer(self, info: dict[str, Any], window: int) -> PipeWriter:
        return PipeWriter(self, info, window)


# -- the synchronous client's file objects ------------------------------------------------
class SyncPipe:
    """A pipe for the synchronous client (``sync_bus.pipe(name)``)."""

    def __init__(self, run: Callable[..., Any], pipe: Pipe) -> None:
        self._run = run
        self._pipe = pipe

    def open_reader(
        self,
        *,
        readers: str | None = None,
        timeout: float | None = None,
        readahead: int = DEFAULT_READAHEAD,
        persistent: bool | None = None,
    ) -> SyncPipeReader:
        """A binary file open for reading (``read``, ``readinto``, ``readline``, iteration;
        b"" at end of pipe); every read waits at most ``timeout`` (then TimeoutError,
        the :class:`PipeTimeout`). ``persistent`` as in :meth:`Pipe.open_reader`."""
        r = self._run(
            self._pipe.open_reader, readers=readers, readahead=readahead, persistent=persistent
        )
        return SyncPipeReader(self._run, r, timeout)

    def open_writer(
        self,
        *,
        readers: str | None = None,
        on_reader_gone: str = "fail",
        timeout: float | None = None,
        persistent: bool | None = None,
    ) -> SyncPipeWriter:
        """A binary file open for writing; ``write`` returns once the pipe accepted the
        bytes (or raises PipeTimeout after ``timeout``); ``persistent`` as in
        :meth:`Pipe.open_writer` (then accepted means durable)."""
        w = self._run(
            self._pipe.open_writer,
            readers=readers,
            on_reader_gone=on_reader_gone,
            persistent=persistent,
        )
        return SyncPipeWriter(self._run, w, timeout)


class SyncPipeReader(io.RawIOBase):
    def __init__(self, run: Callable[..., Any], reader: PipeReader, timeout: float | None) -> None:
        super().__init__()
        self._runner = run
        self._reader = reader
        self.timeout = timeout

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        data: bytes = self._runner(self._reader.read, len(mv), self.timeout)
        mv[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._runner(self._reader.aclose)
            except MsgqError:
                pass
        super().close()


class SyncPipeWriter(io.RawIOBase):
    def __init__(self, run: Callable[..., Any], writer: PipeWriter, timeout: float | None) -> None:
        super().__init__()
        self._runner = run
        self._writer = writer
        self.timeout = timeout

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        return int(self._runner(self._writer.write, data, self.timeout))

    def close(self) -> None:
        if not self.closed:
            try:
                self._runner(self._writer.aclose)
            except MsgqError:
                pass
        super().close()
