"""The pipe client's logic, once for every asynchronous driver (docs/PIPES.md).

The named pipes of the pipe plugin are byte streams. Opening a handle, chunking writes
into a window of requests, read-ahead, the end-of-pipe count, persistent pipes'
``consumed`` and offsets, resending bounced chunks and closing are here, written against
the public API of :class:`~msgq_trio.client.async_bus.AsyncBus` (``start_request``,
``wait_call``, ``forget_call``, ``call``, ``current_time``, ``checkpoint``,
``shielded``); it imports no event loop (``tests/test_layering.py``). The faces add what
is the event loop's: :mod:`msgq_trio.client.pipe` makes the ends trio streams
(``trio.abc.ReceiveStream``/``SendStream``, trio's resource errors),
:mod:`msgq_trio.client.aio_pipe` the asyncio ones.

Persistent pipes (``persistent=True``, docs/PIPES.md): a reader tells the plugin how many
bytes it returned to its caller (``consumed``, with each read request and with the
close); bytes it received but did not return -- read-ahead, reads in flight, a crash --
go to the next reader. ``ReaderCore.offset`` gives each byte's place in the pipe, for an
application that wants exactly-once (it records the offset with what it did with the
bytes and drops bytes below it after a restart).

Why reads and writes survive cancellation: a read is one request to the plugin, which
takes the bytes out of the pipe when it answers. If the caller's task were cancelled and
the answer dropped, those bytes would be lost. So the request in flight belongs to the
reader object, not to the task: a cancelled ``read`` leaves it in flight, and the next
``read`` takes its answer (the bytes are kept). Writes likewise stay tracked until the
plugin answered them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import MsgqError, PipeBroken, PipeTimeout, RecipientGone, UsageError

if TYPE_CHECKING:
    from .async_bus import AsyncBus
    from .session import PendingCall

__all__ = [
    "CLOSE_WAIT",
    "DEFAULT_GROUP",
    "DEFAULT_READAHEAD",
    "DEFAULT_WINDOW",
    "READ_DEPTH",
    "PipeBase",
    "ReaderCore",
    "WriterCore",
]

#: The pipe plugin's group (its ``group`` setting's default).
DEFAULT_GROUP = "msgq-pipe"
#: A reader asks for at least this many bytes per request and keeps what the caller did
#: not take: small reads (``read(1)``) then cost one round trip per 64 KiB, not per byte.
#: 0 asks exactly what each read wants (share mode: other readers get the rest).
DEFAULT_READAHEAD = 64 * 1024
#: Reads a reader keeps in flight when reading ahead: the next answer is already on its
#: way while the caller works on this one (the round trip through the broker and the
#: plugin, not the copying, bounds a single outstanding read: the processes are idle
#: ~half the time with one); a second read keeps them busy, more add buffered bytes but
#: no overlap (the pipes benchmark, BENCHMARKS.md), and in share mode each read in
#: flight takes bytes for this reader only.
READ_DEPTH = 2
#: Chunks a writer keeps in flight (sent, not yet accepted): 4 x 256 KiB covers the round
#: trip through the broker and the plugin, so the pipe never idles waiting for the next
#: chunk; the plugin allows 16 per handle (``max_pending``).
DEFAULT_WINDOW = 4
#: Longest closing a handle waits for the plugin's answer (it answers at once when it
#: runs; one that is gone fails the call at once): a bound only for a plugin that is
#: stopped (SIGSTOP) or a broker that stopped reading.
CLOSE_WAIT = 5.0

R = TypeVar("R", bound="ReaderCore")
W = TypeVar("W", bound="WriterCore")


def _translate(exc: MsgqError, what: str) -> MsgqError:
    """The plugin vanishing mid-operation means the pipe is gone (its state was in it)."""
    if isinstance(exc, RecipientGone):
        return PipeBroken(f"{what}: the pipe service went away ({exc.message})", sender=exc.sender)
    return exc


class PipeBase(Generic[R, W]):
    """A named pipe of the pipe plugin; open it for reading or writing. The driver's
    face makes its ends (``_reader``, ``_writer``)."""

    def __init__(self, bus: AsyncBus, name: str, *, group: str = DEFAULT_GROUP) -> None:
        if not name:
            raise UsageError("a pipe needs a name")
        self.bus = bus
        self.name = name
        self.group = group

    async def _open(self, params: dict[str, Any]) -> dict[str, Any]:
        try:
            info = await self.bus.call(self.group, "pipe.open", {"pipe": self.name, **params})
        except MsgqError as exc:
            raise _translate(exc, f"open {self.name!r}") from exc
        return dict(info)

    async def open_reader(
        self,
        *,
        readers: str | None = None,
        readahead: int = DEFAULT_READAHEAD,
        persistent: bool | None = None,
    ) -> R:
        """Attach a reader.

        Args:
            readers: ``"share"`` (each byte to exactly one reader) or ``"broadcast"``
                (every reader gets every byte written after it attached); the pipe's
                creator chooses, later opens must agree (None: accept what exists,
                ``share`` for a new pipe).
            readahead: see ``DEFAULT_READAHEAD``.
            persistent: True/False: the pipe must be (or is created) persistent / plain;
                None: take it as it is (plain for a new pipe, unless configured).

        Raises:
            RemoteError(bad-request): the pipe exists in the other mode, or persistent
            pipes are not enabled (no ``dir``). PipeMismatch: the pipe exists (or is
            configured) with the other ``persistent``. NoRecipient: the pipe plugin is
            not running. LimitExceeded: too many pipes.
        """
        params: dict[str, Any] = {"mode": "r", "readers": readers}
        if persistent is not None:
            params["persistent"] = persistent
        info = await self._open(params)
        return self._reader(info, readahead)

    def _reader(self, info: dict[str, Any], readahead: int) -> R:
        """The face's reading end on the handle the plugin opened (``info``)."""
        raise NotImplementedError

    def _writer(self, info: dict[str, Any], window: int) -> W:
        """The face's writing end on the handle the plugin opened (``info``)."""
        raise NotImplementedError

    async def open_writer(
        self,
        *,
        readers: str | None = None,
        on_reader_gone: str = "fail",
        window: int = DEFAULT_WINDOW,
        persistent: bool | None = None,
    ) -> W:
        """Attach a writer.

        Args:
            readers: the readers' mode if this open creates the pipe (see open_reader).
            on_reader_gone: ``"fail"`` (default, like EPIPE): once every reader has
                left, writes fail :class:`PipeBroken`; ``"wait"``: writes wait for the
                next reader. Persistent pipes ignore it: their writes are stored
                whether a reader is attached or not.
            window: chunks in flight (see ``DEFAULT_WINDOW``).
            persistent: see :meth:`open_reader`. A write to a persistent pipe is
                answered once it is durable (committed to the plugin's store).
        """
        if window < 1:
            raise UsageError("window must be >= 1")
        params: dict[str, Any] = {"mode": "w", "readers": readers, "on_reader_gone": on_reader_gone}
        if persistent is not None:
            params["persistent"] = persistent
        info = await self._open(params)
        return self._writer(info, min(window, int(info.get("max_pending", 16)) - 1 or 1))


class _End:
    """What both ends share: the handle, its limits, one task at a time, closing."""

    #: What the face raises once the end is closed (trio: ``trio.ClosedResourceError``)
    #: and while another task uses it (``trio.BusyResourceError``).
    _closed_type: type[Exception] = UsageError
    _busy_type: type[Exception] = UsageError

    def __init__(self, pipe: PipeBase[Any, Any], info: dict[str, Any]) -> None:
        self._pipe = pipe
        self._bus = pipe.bus
        self.name = pipe.name
        self.handle = int(info["handle"])
        self.readers = str(info["readers"])
        self.persistent = bool(info.get("persistent", False))
        self.max_chunk = int(info["max_chunk"])
        self._max_hold = float(info["max_hold"])
        self._closed = False
        self._busy = False
        self._broken: MsgqError | None = None

    def _start(
        self, command: str, params: dict[str, Any], attachments: tuple[memoryview, ...] = ()
    ) -> tuple[int, PendingCall]:
        call = self._bus.start_request(self._pipe.group, command, params, attachments=attachments)
        return call.request_id, call

    async def _wait(self, inflight: tuple[int, PendingCall]) -> Any:
        """The answer of a request started with :meth:`_start`. Cancel-safe: cancelled,
        the request stays in flight and registered, to be waited for again."""
        _rid, call = inflight
        await self._bus.wait_call(call)
        self._bus.forget_call(call)
        if call.error is not None:
            raise _translate(call.error, f"pipe {self.name!r}")
        return call

    def _closed_error(self) -> Exception:
        return self._closed_type(f"pipe {self.name!r} handle {self.handle} is closed")

    def _enter(self) -> None:
        if self._closed:
            raise self._closed_error()
        if self._busy:
            raise self._busy_type(f"another task is using pipe {self.name!r} handle {self.handle}")
        if self._broken is not None:
            raise self._broken
        self._busy = True

    def _hold(self, deadline: float) -> float:
        return max(0.0, min(deadline - self._bus.current_time(), self._max_hold))

    async def _close_handle(
        self, inflight: list[tuple[int, PendingCall]], params: dict[str, Any] | None = None
    ) -> None:
        """Detach the handle (shielded, at most ``CLOSE_WAIT`` s); the plugin answers the
        requests still in ``inflight`` before the close, so their slots are freed here."""

        async def close() -> None:
            try:
                await self._bus.call(
                    self._pipe.group, "pipe.close", {"h": self.handle, **(params or {})}
                )
            except MsgqError:
                pass  # the handle is already gone with the plugin or the connection

        await self._bus.shielded(close, CLOSE_WAIT)
        for _rid, call in inflight:
            self._bus.forget_call(call)


class ReaderCore(_End):
    """The reading end: ``read(n)`` / ``receive_some(n)`` return up to n bytes.

    Returns b"" at end of pipe (every writer that was attached closed and everything was
    read); blocks until data, end of pipe or the timeout. Bytes received but not asked
    for are kept for the next read; nothing is ever dropped.

    Resource handling: ``aclose()`` (or ``async with``) detaches the reader; bytes it had
    taken but not returned are discarded with it (a persistent pipe's go to the next
    reader: only the bytes ``read`` returned count as consumed).
    """

    def __init__(self, pipe: PipeBase[Any, Any], info: dict[str, Any], readahead: int) -> None:
        super().__init__(pipe, info)
        self._readahead = max(0, readahead)
        self._depth = READ_DEPTH if self._readahead else 1
        self._buf = memoryview(b"")
        self._inflight: deque[tuple[int, PendingCall]] = deque()
        self._eofs = 0  # ends of pipe returned so far (the plugin's Rule 5)
        self._consumed = 0  # persistent pipes: bytes returned to the caller (Rule P3)
        self._next_at: int | None = None  # persistent pipes: offset of _buf's next byte

    @property
    def offset(self) -> int | None:
        """Persistent pipes: the offset in the pipe just after the last byte ``read``
        returned (so that read's bytes were ``[offset - len(data), offset)``); None before
        the first byte and on plain pipes. Offsets count every byte ever written to the
        pipe; bytes served again after a reader crashed come with their first offsets.
        """
        return self._next_at

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The stream API (trio's ``ReceiveStream``): :meth:`read` without a timeout."""
        return await self.read(max_bytes)

    async def read(self, n: int | None = None, timeout: float | None = None) -> bytes:
        """Up to ``n`` bytes (default: up to ``max_chunk``).

        Raises:
            PipeTimeout: nothing arrived within ``timeout`` seconds (the pipe stays open).
            PipeBroken: the pipe service lost this handle. ConnectionLost: the bus went
            away. The face's closed error (trio.ClosedResourceError; UsageError on
            asyncio): this reader is closed, also when another task closes it while
            this call waits (its answer is discarded with the reader). The face's busy
            error (trio.BusyResourceError; UsageError on asyncio): another task is
            reading.
        """
        if n is not None and n < 1:
            raise ValueError("n must be >= 1")
        want = self.max_chunk if n is None else n
        self._enter()
        try:
            if self._buf:
                await self._bus.checkpoint()
                return self._take(want)
            deadline = self._bus.current_time() + (math.inf if timeout is None else timeout)
            inflight = self._inflight
            while True:
                ask = min(max(want, self._readahead), self.max_chunk)
                while len(inflight) < self._depth:
                    params = {
                        "h": self.handle,
                        "n": ask,
                        "timeout": self._hold(deadline),
                        "eofs": self._eofs,
                    }
                    if self.persistent:
                        params["consumed"] = self._consumed
                    inflight.append(self._start("pipe.read", params))
                try:
                    call = await self._wait(inflight[0])
                except MsgqError as exc:
                    if self._closed:  # the close answered or failed our read
                        raise self._closed_error() from exc
                    raise
                finally:
                    # aclose() from another task may have emptied ``inflight`` meanwhile.
                    if inflight and inflight[0][1].done:
                        inflight.popleft()
                if self._closed:
                    # Closed by another task while we waited: whatever the answer says,
                    # the stream contract is the closed error.
                    raise self._closed_error()
                body = call.result
                if "n" in body:
                    assert call.frame is not None
                    self._buf = call.frame.blobs()[0]
                    if "at" in body:
                        self._next_at = int(body["at"])
                    return self._take(want)
                if body.get("eof"):
                    self._eofs += 1
                    return b""
                if body.get("retry"):  # sent before the latest end of pipe: ask again
                    continue
                if self._bus.current_time() >= deadline:  # a timeout answer
                    raise PipeTimeout(f"read from pipe {self.name!r}: nothing within {timeout} s")
        except PipeBroken as exc:
            self._broken = exc
            raise
        finally:
            self._busy = False

    def _take(self, n: int) -> bytes:
        data = bytes(self._buf[:n])
        self._buf = self._buf[n:]
        if self.persistent:
            self._consumed += len(data)
            if self._next_at is not None:
                self._next_at += len(data)
        return data

    async def aclose(self) -> None:
        if self._closed:
            await self._bus.checkpoint()
            return
        self._closed = True
        self._buf = memoryview(b"")
        await self._close_handle(
            list(self._inflight), {"consumed": self._consumed} if self.persistent else None
        )
        self._inflight.clear()


class _Chunk:
    __slots__ = ("data", "inflight", "more", "seq")

    def __init__(self, seq: int, data: memoryview, more: bool) -> None:
        self.seq = seq
        self.data = data
        self.more = more
        self.inflight: tuple[int, PendingCall] | None = None


class WriterCore(_End):
    """The writing end. ``send_all`` returns once the data is handed to the plugin with
    at most ``window`` chunks not yet accepted (their failure surfaces on the next call);
    ``write`` returns once all of it was accepted into the pipe.

    Writes wait while no reader is attached (or until their timeout). A write of at most
    ``max_chunk`` bytes, and any larger write that does not stall, reaches readers whole:
    other writers' bytes never land inside it.

    Resource handling: ``aclose()`` waits until every chunk sent was accepted (a writer
    closing before any reader attached waits for one, as a fifo writer would block), then
    detaches; the readers see end of pipe once the last writer left and they read
    everything. Cancel ``aclose`` (``trio.move_on_after``, ``asyncio.timeout``) to
    abandon those chunks.
    """

    def __init__(self, pipe: PipeBase[Any, Any], info: dict[str, Any], window: int) -> None:
        super().__init__(pipe, info)
        self._window = window
        self._seq = 0
        self._inflight: deque[_Chunk] = deque()
        self._accepted = 0  # bytes accepted so far
        self._mid_write = False  # the last chunk sent has more=True

    @property
    def accepted(self) -> int:
        """Bytes of this writer the pipe accepted in all (after :class:`PipeBroken`: how
        much of the stream went before the break; ``send_all`` chunks still in flight
        then are not counted)."""
        return self._accepted

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """The stream API (trio's ``SendStream``; no timeout). Raises PipeBroken,
        ConnectionLost, the face's closed and busy errors (see :meth:`write`)."""
        await self._write(data, math.inf, flush=False)

    async def write(
        self, data: bytes | bytearray | memoryview, timeout: float | None = None
    ) -> int:
        """Write all of ``data``; returns ``len(data)`` once the pipe accepted it.

        Raises:
            PipeTimeout: not all accepted within ``timeout`` (no reader, or a full pipe);
                ``.written`` bytes of it were (a prefix), the rest was not.
            PipeBroken: every reader left (``on_reader_gone="fail"``), or the pipe broke
                (docs/PIPES.md); ``.written`` bytes of this write were accepted before.
            ConnectionLost, the face's closed and busy errors (trio's
            ClosedResourceError and BusyResourceError; UsageError on asyncio).
        """
        deadline = self._bus.current_time() + (math.inf if timeout is None else timeout)
        return await self._write(data, deadline, flush=True)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every chunk sent so far was accepted (raises like :meth:`write`)."""
        deadline = self._bus.current_time() + (math.inf if timeout is None else timeout)
        await self._write(b"", deadline, flush=True)

    async def wait_send_all_might_not_block(self) -> None:
        self._enter()
        try:
            while len(self._inflight) >= self._window:
                await self._settle(math.inf, 0)
        finally:
            self._busy = False

    async def _write(
        self, data: bytes | bytearray | memoryview, deadline: float, *, flush: bool
    ) -> int:
        self._enter()
        try:
            view = memoryview(bytes(data) if not isinstance(data, bytes) else data)
            start = self._accepted + sum(len(c.data) for c in self._inflight)
            size, step = len(view), self.max_chunk
            for off in range(0, size, step):
                while len(self._inflight) >= self._window:
                    await self._settle(deadline, start)
                self._seq += 1
                chunk = _Chunk(self._seq, view[off : off + step], off + step < size)
                self._send(chunk, deadline)
                self._inflight.append(chunk)
                self._mid_write = chunk.more
            if size == 0:
                await self._bus.checkpoint()
            if flush:
                while self._inflight:
                    await self._settle(deadline, start)
            return size
        except PipeBroken as exc:
            # The partial transfer, as PipeTimeout reports it: the prefix of this write
            # the pipe accepted before it broke.
            exc.written = max(0, self._accepted - start)  # type: ignore[attr-defined]
            self._broken = exc
            raise
        finally:
            self._busy = False
            if self._mid_write and self._broken is None:
                self._end_write()

    def _end_write(self) -> None:
        """A write cut short (cancelled mid-way) still holds the pipe for this writer
        (Rule 4 of plugins/pipe/engine.py): send an empty last chunk that ends it, so
        other writers go on. What was sent of the write stays in the pipe."""
        self._mid_write = False
        self._seq += 1
        chunk = _Chunk(self._seq, memoryview(b""), False)
        try:
            self._send(chunk, math.inf)
        except MsgqError:
            return  # the connection is gone, and the plugin released the lock with it
        self._inflight.append(chunk)

    def _send(self, chunk: _Chunk, deadline: float) -> None:
        chunk.inflight = self._start(
            "pipe.write",
            {
                "h": self.handle,
                "seq": chunk.seq,
                "more": chunk.more,
                "timeout": self._hold(deadline),
            },
            (chunk.data,),
        )

    async def _settle(self, deadline: float, start: int) -> None:
        """Wait for the oldest chunk's answer. A chunk the plugin did not accept (its
        hold or our deadline passed; Rule 3 of plugins/pipe/engine.py) is resent with
        every later one once all their answers are in, or, past ``deadline``, dropped
        with them: PipeTimeout says how much of the write starting at ``start`` went."""
        chunk = self._inflight[0]
        assert chunk.inflight is not None
        try:
            call = await self._wait(chunk.inflight)
        except MsgqError:
            await self._drain()
            raise
        body = call.result
        if "n" in body:
            self._inflight.popleft()
            self._accepted += len(chunk.data)
            return
        # timeout or retry: every later chunk is bounced too; collect their answers.
        await self._drain(skip_first=True)
        if self._bus.current_time() >= deadline:
            lost = list(self._inflight)
            self._inflight.clear()
            self._seq = lost[0].seq - 1  # the plugin expects this chunk next
            self._mid_write = False  # the plugin released the pipe when it timed out
            raise PipeTimeout(
                f"write to pipe {self.name!r}: {sum(len(c.data) for c in lost)} bytes not "
                "accepted in time (no reader, or the readers are slow)",
                written=max(0, self._accepted - start),
            )
        for c in self._inflight:
            self._send(c, deadline)

    async def _drain(self, skip_first: bool = False) -> None:
        """Wait for the answers of every chunk in flight (all bounced or failed)."""
        for i, c in enumerate(self._inflight):
            if (skip_first and i == 0) or c.inflight is None:
                continue
            try:
                call = await self._wait(c.inflight)
            except MsgqError:
                continue
            # Cannot be accepted after an earlier chunk was bounced (Rule 3).
            assert "n" not in call.result, call.result

    async def aclose(self) -> None:
        if self._closed:
            await self._bus.checkpoint()
            return
        try:
            if self._broken is None and self._inflight and not self._busy:
                await self.flush()
        except (MsgqError, PipeTimeout):
            pass
        finally:
            self._closed = True
            await self._close_handle([c.inflight for c in self._inflight if c.inflight])
            self._inflight.clear()
