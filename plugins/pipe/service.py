"""The pipe plugin's bus side: commands in, engine completions out, a deadline timer,
and membership events (a client that disconnects or crashes detaches its ends at once).

Commands (REQUEST to the plugin's group, docs/PIPES.md "Protocol"), all handled inline
in arrival order by the bus reader (no task per request):

* ``pipe.open {pipe, mode: "r"|"w", readers?: "share"|"broadcast", on_reader_gone?:
  "fail"|"wait", persistent?: bool}`` -> ``{"handle", "readers", "persistent",
  "max_chunk", "max_hold", "max_pending"}``
* ``pipe.write {h, seq, more, timeout}`` + the chunk as attachment -> ``{"n"}`` |
  ``{"timeout": true}`` | ``{"retry": true}``
* ``pipe.read {h, n, timeout, eofs, consumed?}`` -> ``{"n", "at"?}`` + the bytes as
  attachment | ``{"eof": true}`` | ``{"timeout": true}`` | ``{"retry": true}``
* ``pipe.close {h, consumed?}`` -> true; ``pipe.stats {pipe?}`` -> counters

Persistent pipes: the engine stages their accepted chunks; ``flush_loop`` commits them
(group commit: everything staged while the previous commit ran goes in one
``append_batch``, one fsync) on the store thread, with the consumed offsets
(``delete_batch(cursor=)``), and only then are the writes answered. No store call spans
an await or keeps a transaction open (``StoreThread``, as in the queue plugin).

Error handling: malformed params ``bad-request``; unknown handle or broken pipe
``pipe-broken``; quotas ``limit-exceeded``; persistence asked otherwise than the pipe is
``pipe-mismatch``. A bug in the engine is logged and answered ``internal-error``; the
plugin keeps serving. A store error (full map) makes persistent writes wait (logged at
WARNING, retried after ``STORE_RETRY``); nothing is dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from msgq_trio.storage.api import NewMessage, QueueStore, StorageError, StorageFull

from msgq_trio.client.bus import Bus, Message, connect
from msgq_trio.errors import ConnectionLost

# The queue plugin's store thread and directory lock serve this store the same way.
from ..queue.writer import StoreThread, open_store_dir
from .engine import BAD_REQUEST, Commit, Declared, Done, Engine, EngineError, Limits
from .peers import Federation
from .settings import PipeSettings

log = logging.getLogger("msgq_trio.plugins.pipe")

MEMBERSHIP = "msgq.membership"
#: The store's producer name of every chunk (its producer_seq is the chunk's end offset).
PRODUCER = "pipe"
#: Chunks read per ``read_range`` at recovery (one short read transaction each; with
#: 256 KiB chunks at most 256 MiB, but a pipe holds at most ``max_stored``).
RECOVER_CHUNK = 256
#: After a failed commit (store full), persistent writes wait this long before the plugin
#: tries again, unless a commit deleted consumed chunks first: a full map frees room only
#: when readers consume, and retrying at once would spin on the store.
STORE_RETRY = 1.0


def _param(params: Any, key: str, types: tuple[type, ...], default: Any = ...) -> Any:
    v = params.get(key, default) if isinstance(params, dict) else default
    if v is ... or not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise EngineError(BAD_REQUEST, f"params need {key!r} ({names})")
    return v


class Service:
    """Wires one bus connection to the engine."""

    def __init__(
        self,
        bus: Bus,
        settings: PipeSettings,
        store: QueueStore | None = None,
        thread: StoreThread | None = None,
        socket: Path | None = None,
    ) -> None:
        self.bus = bus
        declared = {
            name: Declared(o.persistent, o.max_stored or settings.max_stored)
            for name, o in settings.pipes.items()
        }
        self.engine = Engine(
            Limits(
                settings.max_buffer,
                settings.max_chunk,
                settings.max_hold,
                settings.max_pending,
                settings.max_pipes,
                settings.max_stored,
            ),
            declared=declared,
            can_persist=store is not None,
        )
        self.settings = settings
        self.store = store
        self.thread = thread
        self._rearm = trio.Event()
        self._armed_at = math.inf
        self._flush = trio.Event()
        self._retry = trio.Event()
        self._trace = log.info if settings.trace else log.debug
        self.fed = Federation(self, socket or Path("-"))

    def setup(self) -> None:
        handlers: dict[str, Callable[[Message, Any], list[Done]]] = {
            "pipe.open": self._open,
            "pipe.write": self._write,
            "pipe.read": self._read,
            "pipe.close": self._close,
            "pipe.stats": self._stats,
            "pipe.ls": self._ls,
            "pipe.peer.hello": self._hello,
        }
        for name, fn in handlers.items():
            self.bus.add_inline_command(name, self._inline(fn))

    def _inline(self, fn: Callable[[Message, Any], list[Done]]) -> Callable[[Message], None]:
        def handle(request: Message) -> None:
            try:
                done = fn(request, request.body)
            except EngineError as exc:
                self.bus.answer_error(request, exc.code, f"{request.command}: {exc.message}")
                return
            except Exception as exc:
                log.exception("pipe plugin: %s from %s failed", request.command, request.sender)
                self.bus.answer_error(request, "internal-error", f"{type(exc).__name__}: {exc}")
                return
            self._sent(done)

        return handle

    def _sent(self, done: list[Done]) -> None:
        """Send ``done``, then wake the timer and the committer if they have work."""
        self._send(done)
        if self.engine.next_deadline() < self._armed_at:
            self._rearm.set()
        if self.engine.dirty:
            self._flush.set()

    def _send(self, done: list[Done]) -> None:
        answer = self.bus.answer
        for d in done:
            req = d.token
            assert isinstance(req, Message)
            if d.kind == "data":
                answer(
                    req, {"n": d.n} if d.at < 0 else {"n": d.n, "at": d.at}, attachments=[d.data]
                )
            elif d.kind == "ok":
                answer(req, {"n": d.n})
            elif d.kind == "error":
                self.bus.answer_error(req, d.code, d.message)
            else:  # eof, timeout, retry
                answer(req, {d.kind: True})

    # -- commands ----------------------------------------------------------------------
    def _open(self, request: Message, p: Any) -> list[Done]:
        if self.fed.wants(p):
            self.fed.open(request, p, lambda: self._open_later(request, p))
            return []
        return self._open_local(request, p)

    def _open_later(self, request: Message, p: Any) -> None:
        """An open at home here decided after a wait (outside the inline handler)."""
        try:
            self._sent(self._open_local(request, p))
        except EngineError as exc:
            self.bus.answer_error(request, exc.code, f"{request.command}: {exc.message}")
        except Exception as exc:  # a bug: logged and answered, the plugin keeps serving
            log.exception("pipe plugin: %s from %s failed", request.command, request.sender)
            self.bus.answer_error(request, "internal-error", f"{type(exc).__name__}: {exc}")

    def _hello(self, request: Message, p: Any) -> list[Done]:
        self.fed.hello(request, p)
        return []

    def _ls(self, request: Message, p: Any) -> list[Done]:
        if isinstance(p, dict) and p.get("all"):
            self.fed.ls_all(request)
        else:
            self.bus.answer(request, self.fed.listing())
        return []

    def _open_local(self, request: Message, p: Any) -> list[Done]:
        name = _param(p, "pipe", (str,))
        if not name or len(name) > 255:
            raise EngineError(BAD_REQUEST, "pipe names are 1 to 255 characters")
        end, done = self.engine.open(
            request.sender,
            name,
            _param(p, "mode", (str,)),
            _param(p, "readers", (str, type(None)), None),
            _param(p, "on_reader_gone", (str,), "fail"),
            _param(p, "persistent", (bool, type(None)), None),
        )
        s = self.settings
        self.bus.answer(
            request,
            {
                "handle": end.handle,
                "readers": end.pipe.mode,
                "persistent": end.pipe.persistent,
                "max_chunk": s.max_chunk,
                "max_hold": s.max_hold,
                "max_pending": s.max_pending,
            },
        )
        self._trace(
            "pipe %r: %s (%s) opened handle %d for %s (%s%s, on_reader_gone=%s)",
            name,
            request.sender,
            request.sender_name,
            end.handle,
            "reading" if end.role == "r" else "writing",
            end.pipe.mode,
            ", persistent" if end.pipe.persistent else "",
            "fail" if end.fail_on_reader_gone else "wait",
        )
        return done

    def _write(self, request: Message, p: Any) -> list[Done]:
        if self.fed.forward(request, "pipe.write", p):
            return []
        blobs = request.attachments
        if len(blobs) != 1:
            raise EngineError(BAD_REQUEST, "a write carries its chunk as one attachment")
        h, seq = _param(p, "h", (int,)), _param(p, "seq", (int,))
        timeout = float(_param(p, "timeout", (int, float), math.inf))
        self._trace(
            "pipe %r: %s write handle %d chunk %d: %d bytes, timeout %.3g s",
            self._name(h),
            request.sender,
            h,
            seq,
            len(blobs[0]),
            timeout,
        )
        return self.engine.write(
            request.sender,
            h,
            request,
            blobs[0],
            seq,
            bool(_param(p, "more", (bool,), False)),
            timeout,
            trio.current_time(),
        )

    def _read(self, request: Message, p: Any) -> list[Done]:
        if self.fed.forward(request, "pipe.read", p):
            return []
        h, n = _param(p, "h", (int,)), _param(p, "n", (int,))
        timeout = float(_param(p, "timeout", (int, float), math.inf))
        self._trace(
            "pipe %r: %s read handle %d: up to %d bytes, timeout %.3g s",
            self._name(h),
            request.sender,
            h,
            n,
            timeout,
        )
        return self.engine.read(
            request.sender,
            h,
            request,
            n,
            timeout,
            trio.current_time(),
            _param(p, "eofs", (int,), 0),
            _param(p, "consumed", (int, type(None)), None),
        )

    def _name(self, handle: object) -> str | None:
        end = self.engine.ends.get(handle) if isinstance(handle, int) else None
        return end.pipe.name if end is not None else None

    def _close(self, request: Message, p: Any) -> list[Done]:
        if self.fed.forward(request, "pipe.close", p):
            return []
        h = _param(p, "h", (int,))
        self._trace("pipe %r: %s closed handle %d", self._name(h), request.sender, h)
        # The close's own pending operations are answered before the close itself, so the
        # client has every answer once its close returns (nothing stays registered).
        self._send(
            self.engine.close(request.sender, h, _param(p, "consumed", (int, type(None)), None))
        )
        self.bus.answer(request, True)
        return []

    def _stats(self, request: Message, p: Any) -> list[Done]:
        name = _param(p, "pipe", (str, type(None)), None)
        stats = self.engine.stats(name)
        if name is None:
            stats["federation"] = self.fed.status()
        self.bus.answer(request, stats)
        return []

    # -- persistence -------------------------------------------------------------------
    async def recover(self) -> None:
        """Load every persistent pipe the store holds (call once, before serving)."""
        assert self.store is not None and self.thread is not None
        store, run = self.store, self.thread.run
        for name in await run(store.queues):
            cursor = await run(store.cursor, name)
            high = await run(store.producer_state, name, PRODUCER)
            chunks: list[tuple[int, int, bytes]] = []
            start = 0
            while True:
                batch = await run(store.read_range, name, start, RECOVER_CHUNK)
                chunks += [(m.seq, m.producer_seq, m.body) for m in batch]
                if len(batch) < RECOVER_CHUNK:
                    break
                start = batch[-1].seq + 1
            self.engine.recover(name, cursor, high, chunks)
            pipe = self.engine.pipes.get(name)
            if pipe is not None:
                log.info(
                    "pipe %r: recovered %d stored bytes (offsets %d to %d)",
                    name,
                    pipe.end - pipe.base,
                    pipe.base,
                    pipe.end,
                )

    def _commit(
        self, work: list[Commit]
    ) -> tuple[dict[str, list[int]] | None, dict[str, bool], StorageError | None]:
        """On the store thread: the deletes and cursors (first: they make room in a full
        map), then every staged chunk in ONE append_batch (one fsync). Returns the seqs
        per pipe (None if the append failed), whether each pipe's deletes were written,
        and the append's error."""
        store = self.store
        assert store is not None
        deleted: dict[str, bool] = {}
        for w in work:
            deleted[w.name] = True
            if w.deletes or w.cursor is not None:
                try:
                    store.delete_batch(w.name, w.deletes, cursor=w.cursor)
                except StorageError as exc:
                    log.error(
                        "pipe %r: cannot record consumed bytes (retried with the next commit): %s",
                        w.name,
                        exc,
                    )
                    deleted[w.name] = False
        items = [NewMessage(w.name, PRODUCER, end, data) for w in work for end, data in w.chunks]
        if not items:
            return {}, deleted, None
        try:
            for w in work:
                if w.chunks:
                    store.declare_queue(w.name)
            result = store.append_batch(items)
        except StorageError as exc:
            return None, deleted, exc
        seqs: dict[str, list[int]] = {}
        for item, seq in zip(items, result, strict=True):
            if seq is None:  # an end offset not above the last stored one: a bug
                return (
                    None,
                    deleted,
                    StorageError(
                        f"pipe {item.queue!r}: chunk ending at {item.producer_seq} taken for "
                        "a resend by the store (offsets went back)"
                    ),
                )
            seqs.setdefault(item.queue, []).append(seq)
        return seqs, deleted, None

    async def flush_loop(self) -> None:
        """Commit persistent pipes forever: everything staged or consumed while the
        previous commit ran goes in the next one (group commit)."""
        assert self.thread is not None
        while True:
            if not self.engine.dirty:
                self._flush = trio.Event()
                await self._flush.wait()
            work = self.engine.take_commit()
            if not work:
                continue
            seqs, deleted, error = await self.thread.run(self._commit, work)
            if error is not None:
                staged = sum(len(c[1]) for w in work for c in w.chunks)
                level = logging.WARNING if isinstance(error, StorageFull) else logging.ERROR
                log.log(
                    level,
                    "pipe store: %d bytes of writes to pipes %s not stored, their "
                    "writers wait (retry in %.3g s or once readers consume): %s",
                    staged,
                    sorted(w.name for w in work if w.chunks),
                    STORE_RETRY,
                    error,
                )
            out: list[Done] = []
            for w in work:
                out += self.engine.committed(
                    w, None if seqs is None else seqs.get(w.name, []), deleted[w.name]
                )
            if self.engine.store_full and any(w.deletes and deleted[w.name] for w in work):
                self._retry.set()  # readers made room
            self._sent(out)

    async def store_retry(self) -> None:
        """Let persistent writes try again after a failed commit (``STORE_RETRY``)."""
        while True:
            self._retry = trio.Event()
            with trio.move_on_after(STORE_RETRY):
                await self._retry.wait()
            if self.engine.store_full:
                self._sent(self.engine.retry_store())

    # -- tasks -------------------------------------------------------------------------
    async def timer(self) -> None:
        """Answer ``timeout`` to reads and writes whose deadline passed."""
        while True:
            self._armed_at = self.engine.next_deadline()
            self._rearm = trio.Event()
            with trio.move_on_at(self._armed_at):
                await self._rearm.wait()
            self._sent(self.engine.expire(trio.current_time()))

    def _membership_event(self, msg: Message) -> None:
        """Detach the ends of every client that disconnects (its pending operations go
        with it; the other side learns: EOF, broken pipe, or a waiting writer).

        Called in the bus reader, in order with the pipe requests: a write that arrives
        after its pipe's last reader disconnected must find the reader gone."""
        if msg.event != "disconnected":
            return
        body = msg.body
        lname = body.get("lname") if isinstance(body, dict) else None
        if isinstance(lname, str):
            if self.fed.link_gone(lname):
                return
            self.fed.client_gone(lname)
            handles = sorted(self.engine.by_owner.get(lname, ()))
            if handles:
                self._trace(
                    "%s (%s) disconnected (%s): detaching handles %s of pipes %s",
                    lname,
                    body.get("name"),
                    body.get("reason"),
                    handles,
                    sorted({str(self._name(h)) for h in handles}),
                )
            self._sent(self.engine.peer_gone(lname))

    async def membership(self) -> None:
        """Serve until the bus connection ends (membership events are handled in the
        reader by :meth:`_membership_event`; nothing else is expected here)."""
        async for _msg in self.bus:
            pass


async def serve(
    socket: Path,
    settings: PipeSettings,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open the store if ``dir`` is set (locked against another plugin process, recovered
    before serving), connect as ``msgq-pipe``, serve until the bus connection ends (then
    return: the plugin process exits and the supervisor restarts it; plain pipes are
    lost, persistent ones are recovered, and every client's next operation on a handle
    fails ``pipe-broken``).

    Resource handling: the store, its thread and the directory lock are released on
    every exit; a write answered to its writer was committed before, so an exit at any
    point loses none.
    """
    if not settings.dir:
        await _serve(socket, settings, None, None, task_status)
        return
    async with open_store_dir(
        Path(settings.dir),
        map_size=settings.map_size,
        max_map_size=settings.max_map_size,
        sync=settings.sync,
        thread_name="msgq-pipe-store",
    ) as (store, thread):
        await _serve(socket, settings, store, thread, task_status)


async def _serve(
    socket: Path,
    settings: PipeSettings,
    store: QueueStore | None,
    thread: StoreThread | None,
    task_status: trio.TaskStatus[None],
) -> None:
    async with connect(socket, "msgq-pipe") as bus, trio.open_nursery() as nursery:
        service = Service(bus, settings, store, thread, socket)
        if store is not None:
            await service.recover()
            nursery.start_soon(service.flush_loop)
            nursery.start_soon(service.store_retry)
        service.setup()
        bus.on_notification_inline(MEMBERSHIP, service._membership_event)
        await bus.subscribe(MEMBERSHIP)
        await bus.subscribe(settings.group)
        nursery.start_soon(service.timer)
        await service.fed.run(nursery)
        task_status.started()
        try:
            await service.membership()
        except ConnectionLost as exc:
            log.info("pipe plugin: connection ended: %s", exc)
        nursery.cancel_scope.cancel()
