"""The pipe plugin's bus side: commands in, engine completions out, a deadline timer,
and membership events (a client that disconnects or crashes detaches its ends at once).

Commands (REQUEST to the plugin's group, docs/PIPES.md "Protocol"), all handled inline
in arrival order by the bus reader (no task per request):

* ``pipe.open {pipe, mode: "r"|"w", readers?: "share"|"broadcast", on_reader_gone?:
  "fail"|"wait"}`` -> ``{"handle", "readers", "max_chunk", "max_hold"}``
* ``pipe.write {h, seq, more, timeout}`` + the chunk as attachment -> ``{"n"}`` |
  ``{"timeout": true}`` | ``{"retry": true}``
* ``pipe.read {h, n, timeout, eofs}`` -> ``{"n"}`` + the bytes as attachment |
  ``{"eof": true}`` | ``{"timeout": true}`` | ``{"retry": true}``
* ``pipe.close {h}`` -> true; ``pipe.stats {pipe?}`` -> counters

Error handling: malformed params ``bad-request``; unknown handle or broken pipe
``pipe-broken``; quotas ``limit-exceeded``. A bug in the engine is logged and answered
``internal-error``; the plugin keeps serving.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from msgq_trio.client.bus import Bus, Message, connect
from msgq_trio.errors import ConnectionLost

from .engine import BAD_REQUEST, Done, Engine, EngineError, Limits
from .settings import PipeSettings

log = logging.getLogger("msgq_trio.plugins.pipe")

MEMBERSHIP = "msgq.membership"


def _param(params: Any, key: str, types: tuple[type, ...], default: Any = ...) -> Any:
    v = params.get(key, default) if isinstance(params, dict) else default
    if v is ... or not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise EngineError(BAD_REQUEST, f"params need {key!r} ({names})")
    return v


class Service:
    """Wires one bus connection to the engine."""

    def __init__(self, bus: Bus, settings: PipeSettings) -> None:
        self.bus = bus
        self.engine = Engine(Limits(settings.max_buffer, settings.max_chunk,
                                    settings.max_hold, settings.max_pending,
                                    settings.max_pipes))
        self.settings = settings
        self._rearm = trio.Event()
        self._armed_at = math.inf
        self._trace = log.info if settings.trace else log.debug

    def setup(self) -> None:
        handlers: dict[str, Callable[[Message, Any], list[Done]]] = {
            "pipe.open": self._open, "pipe.write": self._write, "pipe.read": self._read,
            "pipe.close": self._close, "pipe.stats": self._stats,
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
            self._send(done)
            if self.engine.next_deadline() < self._armed_at:
                self._rearm.set()

        return handle

    def _send(self, done: list[Done]) -> None:
        answer = self.bus.answer
        for d in done:
            req = d.token
            assert isinstance(req, Message)
            if d.kind == "data":
                answer(req, {"n": d.n}, attachments=[d.data])
            elif d.kind == "ok":
                answer(req, {"n": d.n})
            elif d.kind == "error":
                self.bus.answer_error(req, d.code, d.message)
            else:  # eof, timeout, retry
                answer(req, {d.kind: True})

    # -- commands ----------------------------------------------------------------------
    def _open(self, request: Message, p: Any) -> list[Done]:
        name = _param(p, "pipe", (str,))
        if not name or len(name) > 255:
            raise EngineError(BAD_REQUEST, "pipe names are 1 to 255 characters")
        end, done = self.engine.open(
            request.sender, name, _param(p, "mode", (str,)),
            _param(p, "readers", (str, type(None)), None),
            _param(p, "on_reader_gone", (str,), "fail"))
        s = self.settings
        self.bus.answer(request, {"handle": end.handle, "readers": end.pipe.mode,
                                  "max_chunk": s.max_chunk, "max_hold": s.max_hold,
                                  "max_pending": s.max_pending})
        self._trace("pipe %r: %s (%s) opened handle %d for %s (%s, on_reader_gone=%s)",
                    name, request.sender, request.sender_name, end.handle,
                    "reading" if end.role == "r" else "writing", end.pipe.mode,
                    "fail" if end.fail_on_reader_gone else "wait")
        return done

    def _write(self, request: Message, p: Any) -> list[Done]:
        blobs = request.attachments
        if len(blobs) != 1:
            raise EngineError(BAD_REQUEST, "a write carries its chunk as one attachment")
        h, seq = _param(p, "h", (int,)), _param(p, "seq", (int,))
        timeout = float(_param(p, "timeout", (int, float), math.inf))
        self._trace("pipe %r: %s write handle %d chunk %d: %d bytes, timeout %.3g s",
                    self._name(h), request.sender, h, seq, len(blobs[0]), timeout)
        return self.engine.write(request.sender, h, request, blobs[0], seq,
                                 bool(_param(p, "more", (bool,), False)), timeout,
                                 trio.current_time())

    def _read(self, request: Message, p: Any) -> list[Done]:
        h, n = _param(p, "h", (int,)), _param(p, "n", (int,))
        timeout = float(_param(p, "timeout", (int, float), math.inf))
        self._trace("pipe %r: %s read handle %d: up to %d bytes, timeout %.3g s",
                    self._name(h), request.sender, h, n, timeout)
        return self.engine.read(request.sender, h, request, n, timeout, trio.current_time(),
                                _param(p, "eofs", (int,), 0))

    def _name(self, handle: object) -> str | None:
        end = self.engine.ends.get(handle) if isinstance(handle, int) else None
        return end.pipe.name if end is not None else None

    def _close(self, request: Message, p: Any) -> list[Done]:
        h = _param(p, "h", (int,))
        self._trace("pipe %r: %s closed handle %d", self._name(h), request.sender, h)
        # The close's own pending operations are answered before the close itself, so the
        # client has every answer once its close returns (nothing stays registered).
        self._send(self.engine.close(request.sender, h))
        self.bus.answer(request, True)
        return []

    def _stats(self, request: Message, p: Any) -> list[Done]:
        self.bus.answer(request, self.engine.stats(_param(p, "pipe", (str, type(None)), None)))
        return []

    # -- tasks -------------------------------------------------------------------------
    async def timer(self) -> None:
        """Answer ``timeout`` to reads and writes whose deadline passed."""
        while True:
            self._armed_at = self.engine.next_deadline()
            self._rearm = trio.Event()
            with trio.move_on_at(self._armed_at):
                await self._rearm.wait()
            self._send(self.engine.expire(trio.current_time()))

    async def membership(self) -> None:
        """Detach the ends of every client that disconnects (its pending operations go
        with it; the other side learns: EOF, broken pipe, or a waiting writer)."""
        async for msg in self.bus:
            if msg.kind == "notification" and msg.event == "disconnected":
                body = msg.body
                lname = body.get("lname") if isinstance(body, dict) else None
                if isinstance(lname, str):
                    handles = sorted(self.engine.by_owner.get(lname, ()))
                    if handles:
                        self._trace("%s (%s) disconnected (%s): detaching handles %s of "
                                    "pipes %s", lname, body.get("name"), body.get("reason"),
                                    handles, sorted({str(self._name(h)) for h in handles}))
                    self._send(self.engine.peer_gone(lname))


async def serve(socket: Path, settings: PipeSettings, *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Connect as ``msgq-pipe``, serve until the bus connection ends (then return: the
    plugin process exits and the supervisor restarts it; its pipes are lost, and every
    client's next operation fails ``pipe-broken``)."""
    async with connect(socket, "msgq-pipe") as bus, trio.open_nursery() as nursery:
        service = Service(bus, settings)
        service.setup()
        await bus.subscribe(MEMBERSHIP)
        await bus.subscribe(settings.group)
        nursery.start_soon(service.timer)
        task_status.started()
        try:
            await service.membership()
        except ConnectionLost as exc:
            log.info("pipe plugin: connection ended: %s", exc)
        nursery.cancel_scope.cancel()
