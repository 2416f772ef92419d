"""The client process of fault scenarios: ``python -m msgq_trio.scenario.clients ROLE ...``.

Every scenario client is a real process running one role (publisher, subscriber, caller,
responder, swarm, big-sender, subscribe-flood, stalled-reader, half-frame, garbage, storm,
hold; parameters in :data:`msgq_trio.scenario.model.ROLES`). Library roles use
:func:`msgq_trio.connect`; fault roles speak the wire protocol by hand on a raw socket so
they can stall, send half frames or garbage.

Control protocol with the runner (one JSON object per stdout line, commands on stdin):

* stdout ``{"event": "ready", "pid": N, "lnames": [...]}`` once set up (connected,
  subscribed, handlers registered); then the client waits for ``go`` on stdin.
* stdout ``{"event": "done"}`` when an active role has finished its work.
* stdin ``stop`` (or EOF, or SIGTERM): stop, drain what is in flight, close, then stdout
  ``{"event": "report", ...}`` with counts, timestamps, extreme values and latency
  samples, and exit 0 (1 if the role failed: the report says why).
* SIGUSR1 / SIGUSR2: role specific (stalled-reader: stop / resume reading; hold: release).

Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC is shared by every process on the
machine, so the runner can relate them to the moment it injected a fault).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import select
import signal
import struct
import sys
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import trio

from ..client.bus import Bus, Message, connect
from ..errors import ConnectError, ConnectionLost, LimitExceeded, MalformedMessage, RpcError
from ..protocol.codes import PROTOCOL_VERSION, FrameType
from ..protocol.errors import ProtocolError, RemoteProtocolError
from ..protocol.framing import (
    ABSOLUTE_MAX_FRAME_SIZE,
    PREFIX,
    Frame,
    FrameParser,
    encode_cbor,
    encode_frame,
)
from .model import GARBAGE_KINDS, ROLES

log = logging.getLogger("msgq_trio.scenario.clients")

#: How long a reconnecting client keeps trying before it gives up.
RECONNECT_FOR = 10.0
#: Latency samples kept per process (reservoir sampling beyond this): bounds the report.
MAX_SAMPLES = 20_000
#: Upper bound of the drain after ``stop`` (subscribers read what is still in flight).
DRAIN_MAX = 5.0


# -- shared state of one client process ----------------------------------------------------------
class Latency:
    """Latency samples in milliseconds: exact count and maximum, reservoir of samples."""

    def __init__(self) -> None:
        self.n = 0
        self.max_ms = 0.0
        self.samples: list[float] = []
        self._rng = random.Random(0)

    def add(self, ms: float) -> None:
        self.n += 1
        self.max_ms = max(ms, self.max_ms)
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(ms)
        else:
            j = self._rng.randrange(self.n)
            if j < MAX_SAMPLES:
                self.samples[j] = ms

    def as_json(self) -> dict[str, Any]:
        return {"n": self.n, "max_ms": self.max_ms, "samples": [round(x, 3) for x in self.samples]}


class Ctx:
    """Everything a role shares with the process: parameters, control events, figures."""

    def __init__(self, role: str, socket: str, name: str, index: int, params: dict[str, Any]):
        self.role = role
        self.socket = socket
        self.name = name
        self.index = index
        self.p = params
        self.go = trio.Event()
        self.stop = trio.Event()
        self.counts: Counter[str] = Counter()
        self.times: dict[str, float] = {}
        self.maxv: dict[str, float] = {}
        self.minv: dict[str, float] = {}
        self.lat = Latency()
        self.on_usr1: Callable[[], None] = lambda: None
        self.on_usr2: Callable[[], None] = lambda: None
        self._done = False
        self.error: str | None = None

    # figures
    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def mark(self, event: str) -> None:
        """Record the first and last time ``event`` happened."""
        now = time.monotonic()
        self.times.setdefault("first." + event, now)
        self.times["last." + event] = now

    def value(self, name: str, v: float) -> None:
        """Record an extreme value (both the largest and the smallest are reported)."""
        self.maxv[name] = max(v, self.maxv.get(name, v))
        self.minv[name] = min(v, self.minv.get(name, v))

    # control
    @staticmethod
    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def ready(self, lnames: Sequence[str]) -> None:
        self.emit({"event": "ready", "pid": os.getpid(), "lnames": list(lnames)})

    def done(self) -> None:
        if not self._done:
            self._done = True
            self.mark("done")
            self.emit({"event": "done"})

    async def wait_go(self) -> bool:
        """Wait for ``go``; False if ``stop`` came first (then do nothing)."""
        async with trio.open_nursery() as n:

            async def wait(ev: trio.Event) -> None:
                await ev.wait()
                n.cancel_scope.cancel()

            n.start_soon(wait, self.go)
            n.start_soon(wait, self.stop)
        if self.go.is_set():
            self.mark("go")
        return self.go.is_set() and not self.stop.is_set()

    def report(self) -> dict[str, Any]:
        return {
            "event": "report",
            "role": self.role,
            "name": self.name,
            "pid": os.getpid(),
            "counts": dict(self.counts),
            "times": self.times,
            "max": self.maxv,
            "min": self.minv,
            "latency": self.lat.as_json(),
            "error": self.error,
        }


def _code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return str(code) if code else "connection-lost"


# -- library roles -------------------------------------------------------------------------------
class LibraryRole:
    """A role on one :class:`msgq_trio.Bus`: ``prepare`` (subscribe, register handlers),
    ``activity`` (the traffic; active roles return when done, passive ones never), ``drain``
    (after stop). With ``reconnect`` the whole cycle restarts on a new connection after
    ConnectionLost; ``activity`` keeps its progress in ``self`` so it resumes."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p
        self.finished = False
        self.t_go = 0.0

    async def prepare(self, bus: Bus) -> None:
        """Called on every (re)connection before traffic."""

    async def activity(self, bus: Bus) -> None:
        await trio.sleep_forever()

    async def drain(self, bus: Bus) -> None:
        """Called after ``stop`` while the connection is still open."""

    async def run(self) -> None:
        ctx = self.ctx
        ready = False
        give_up_at: float | None = None
        while True:
            try:
                async with connect(
                    ctx.socket, name=ctx.name, max_frame_size=self.p["max_frame_size"]
                ) as bus:
                    give_up_at = None
                    # connections.tcp / .tls / .unix: the transport it really used
                    scheme, sep, _ = ctx.socket.partition("://")
                    ctx.count(f"connections.{scheme if sep else 'unix'}")
                    await self.prepare(bus)
                    if not ready:
                        ctx.ready([bus.lname])
                        ready = True
                    else:
                        ctx.count("reconnects")
                        ctx.mark("reconnected")
                    if not await ctx.wait_go():
                        return
                    if not self.t_go:
                        self.t_go = time.monotonic()
                    await self._run_until_stop(bus)
                    with trio.move_on_after(DRAIN_MAX):
                        await self.drain(bus)
                return
            except (ConnectionLost, ConnectError, RpcError) as exc:
                # RpcError: a prepare() call (subscribe) failed because the connection broke.
                if not ready and not self.p["reconnect"]:
                    raise
                if isinstance(exc, ConnectError):
                    ctx.count("connect_failed")  # e.g. while the broker restarts
                elif ready:
                    ctx.count(f"lost.{_code(exc)}")
                    ctx.mark(f"lost.{_code(exc)}")
                if not self.p["reconnect"] or ctx.stop.is_set():
                    break
                now = time.monotonic()
                give_up_at = give_up_at or now + RECONNECT_FOR
                if now > give_up_at:
                    ctx.count("reconnect_failed")
                    break
                await trio.sleep(0.05)
        # Lost for good: an active role is done (it can do no more); wait for the runner.
        if not ready:
            ctx.ready([])
        ctx.done()
        await ctx.stop.wait()

    async def _run_until_stop(self, bus: Bus) -> None:
        lost: BaseException | None = None
        async with trio.open_nursery() as n:

            async def act() -> None:
                nonlocal lost
                try:
                    if not self.finished:
                        await self.activity(bus)
                        self.finished = True
                        self.ctx.done()
                except ConnectionLost as exc:
                    lost = exc
                    n.cancel_scope.cancel()

            n.start_soon(act)
            await self.ctx.stop.wait()
            n.cancel_scope.cancel()
        if lost is not None:
            raise lost
        if bus.lost is not None:
            # The connection ended after the activity finished, while the role waited for
            # stop: the broker refused its last message (a flush can return before the
            # broker's ERROR arrives) or went away. Counted like a loss during activity.
            raise bus.lost


class Publisher(LibraryRole):
    """Messages ``{"s": seq, "t": monotonic, "p": pad}`` to a group, paced or flat out."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.seq = 0

    async def activity(self, bus: Bus) -> None:
        p, ctx = self.p, self.ctx
        pad = b"x" * p["size"]
        end = self.t_go + p["duration"]
        interval = 1.0 / p["rate"] if p["rate"] else 0.0
        group = p["group"]
        while (not p["count"] or self.seq < p["count"]) and time.monotonic() < end:
            if interval:
                delay = self.t_go + self.seq * interval - time.monotonic()
                if delay > 0:
                    await trio.sleep(delay)
            await bus.send(group, {"s": self.seq, "t": time.monotonic(), "p": pad})
            self.seq += 1
            ctx.count("sent")
            if not interval and self.seq % 64 == 0:
                await trio.lowlevel.checkpoint()  # flat out, but let control tasks run
        await bus.flush()


class Subscriber(LibraryRole):
    """Counts messages and bytes, checks per-sender order, measures one-way latency."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.last_seq: dict[str, int] = {}
        self.last_rx = 0.0

    async def prepare(self, bus: Bus) -> None:
        await bus.subscribe(self.p["group"])

    def on_message(self, msg: Message) -> None:
        ctx = self.ctx
        now = time.monotonic()
        self.last_rx = now
        if msg.kind != "message":
            ctx.count(f"{msg.kind}s")
            return
        ctx.count("received")
        ctx.count("bytes", msg.size)
        try:
            body = msg.body
        except MalformedMessage as exc:
            ctx.count("bad_body")
            if exc.sender != f"{msg.sender} {msg.sender_name}":
                ctx.count("bad_body_unnamed")  # the error must name the sender
            return
        if not isinstance(body, dict):
            return
        t, s = body.get("t"), body.get("s")
        if isinstance(t, float):
            ctx.lat.add((now - t) * 1000)
        if isinstance(s, int):
            last = self.last_seq.get(msg.sender)
            if last is not None:
                if s <= last:
                    ctx.count("reorders")
                elif s > last + 1:
                    ctx.count("gaps", s - last - 1)
            self.last_seq[msg.sender] = s

    async def activity(self, bus: Bus) -> None:
        while True:
            self.on_message(await bus.receive())

    async def drain(self, bus: Bus) -> None:
        idle = self.p["drain_idle"]
        while True:
            try:
                self.on_message(await bus.receive(timeout=idle))
            except (trio.TooSlowError, ConnectionLost):
                return


class Caller(LibraryRole):
    """RPC from ``concurrency`` tasks; counts ``ok`` and ``err.<code>``, latency of ok calls."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.issued = 0
        self.lost: ConnectionLost | None = None

    async def activity(self, bus: Bus) -> None:
        self.lost = None
        async with trio.open_nursery() as n:
            for _ in range(self.p["concurrency"]):
                n.start_soon(self._worker, bus, n.cancel_scope)
        if self.lost is not None:
            raise self.lost

    async def _worker(self, bus: Bus, scope: trio.CancelScope) -> None:
        p, ctx = self.p, self.ctx
        end = self.t_go + p["duration"]
        params = {"p": b"x" * p["size"], "r": p["reply_size"]}
        timeout = p["timeout"] or None
        interval = 1.0 / p["rate"] if p["rate"] else 0.0
        while (not p["count"] or self.issued < p["count"]) and time.monotonic() < end:
            i = self.issued
            self.issued += 1
            # Counted so that checks can say "every call issued was answered" without
            # depending on how many calls a loaded machine gets through in the duration.
            ctx.count("issued")
            if interval:
                delay = self.t_go + i * interval - time.monotonic()
                if delay > 0:
                    await trio.sleep(delay)
            t = time.monotonic()
            try:
                await bus.call(p["target"], p["command"], params, timeout=timeout)
            except ConnectionLost as exc:
                self.lost = exc
                scope.cancel()
                return
            except RpcError as exc:
                ctx.count(f"err.{exc.code}")
                ctx.mark(f"err.{exc.code}")
                if exc.code == "connection-lost":
                    await trio.sleep(0.01)  # the next call raises ConnectionLost
            else:
                ctx.count("ok")
                ctx.lat.add((time.monotonic() - t) * 1000)


class Responder(LibraryRole):
    """Answers ``command`` with ``params["r"]`` bytes (or true); may delay or black-hole."""

    async def prepare(self, bus: Bus) -> None:
        await bus.subscribe(self.p["group"])
        bus.add_command(self.p["command"], self._handle)

    async def _handle(self, params: Any) -> Any:
        ctx = self.ctx
        ctx.count("requests")
        if not self.p["answer"]:
            await trio.sleep_forever()
        if self.p["delay"]:
            await trio.sleep(self.p["delay"])
        ctx.count("served")
        r = params.get("r", 0) if isinstance(params, dict) else 0
        return bytes(r) if isinstance(r, int) and r > 0 else True

    async def activity(self, bus: Bus) -> None:
        # Requests go to the handler; receiving is how a passive client learns that the
        # connection is gone (receive raises ConnectionLost), so it can reconnect.
        while True:
            msg = await bus.receive()
            self.ctx.count(f"stray.{msg.kind}")


class BigSender(LibraryRole):
    """Messages with one ``size``-byte attachment (the payload is never copied)."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.sent = 0

    async def activity(self, bus: Bus) -> None:
        p, ctx = self.p, self.ctx
        payload = bytearray(p["size"])
        while self.sent < p["count"]:
            t = time.monotonic()
            await bus.send(p["target"], {"s": self.sent, "t": t}, attachments=[payload])
            await bus.flush()
            self.sent += 1
            ctx.count("sent")
            ctx.count("bytes", p["size"])
            ctx.value("send_ms", (time.monotonic() - t) * 1000)
            if p["interval"]:
                await trio.sleep(p["interval"])


class SubscribeFlood(LibraryRole):
    """Subscribes to many groups: ``ok`` or ``err.<code>`` (limit-exceeded past the quota)."""

    async def activity(self, bus: Bus) -> None:
        for i in range(self.p["groups"]):
            try:
                await bus.subscribe(f"{self.p['prefix']}{i}")
            except LimitExceeded as exc:
                self.ctx.count(f"err.{exc.code}")
            else:
                self.ctx.count("ok")


class Swarm:
    """Many library connections in one process, each in ``group`` answering ``command``."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p
        self.last_rx = 0.0

    async def run(self) -> None:
        ctx, p = self.ctx, self.p
        async with AsyncExitStack() as stack:
            buses: list[Bus] = []
            for _ in range(p["connections"]):
                try:
                    bus = await stack.enter_async_context(
                        connect(ctx.socket, name=ctx.name, max_frame_size=p["max_frame_size"])
                    )
                    await bus.subscribe(p["group"])
                except (ConnectError, ConnectionLost, RpcError) as exc:
                    ctx.count(f"connect_failed.{_code(exc)}")
                    continue
                if p["command"]:
                    bus.add_command(p["command"], self._handle)
                buses.append(bus)
            ctx.count("connected", len(buses))
            ctx.ready([b.lname for b in buses])
            if not await ctx.wait_go():
                return
            async with trio.open_nursery() as n:
                for bus in buses:
                    n.start_soon(self._reader, bus)
                await ctx.stop.wait()
                await self._drain()
                n.cancel_scope.cancel()

    async def _drain(self) -> None:
        """Let the readers take what is in flight: until 0.3 s pass without a message."""
        deadline = time.monotonic() + DRAIN_MAX
        while time.monotonic() < deadline:
            idle = time.monotonic() - self.last_rx
            if idle >= 0.3:
                return
            await trio.sleep(0.3 - idle)

    def _handle(self, params: Any) -> Any:
        self.ctx.count("served")
        return True

    async def _reader(self, bus: Bus) -> None:
        ctx = self.ctx
        while True:
            try:
                msg = await bus.receive()
            except ConnectionLost as exc:
                ctx.count(f"lost.{_code(exc)}")
                return
            now = time.monotonic()
            self.last_rx = now
            if msg.kind != "message":
                continue
            ctx.count("received")
            body = msg.body
            if isinstance(body, dict) and isinstance(body.get("t"), float):
                ctx.lat.add((now - body["t"]) * 1000)


# -- raw-socket roles ----------------------------------------------------------------------------
class RawConn:
    """A hand-driven connection: send any bytes, parse whatever the broker answers."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = FrameParser(ABSOLUTE_MAX_FRAME_SIZE)
        self.eof = False
        self.lname = ""
        self.max_frame_size = 0
        self._rid = 0

    @classmethod
    async def open(cls, path: str) -> RawConn:
        return cls(await trio.open_unix_socket(path))

    async def send(self, data: bytes | bytearray) -> None:
        await self.stream.send_all(data)

    async def send_frame(self, ftype: int, **kw: Any) -> None:
        await self.stream.send_all(b"".join(bytes(b) for b in encode_frame(ftype, **kw)))

    async def hello(self, name: str) -> Frame | None:
        """Send HELLO; return the answer (WELCOME or ERROR) or None at EOF."""
        await self.send_frame(
            FrameType.HELLO,
            header=encode_cbor({"version": PROTOCOL_VERSION, "name": name, "pid": os.getpid()}),
        )
        f = await self.frame()
        if f is not None and f.type == FrameType.WELCOME:
            h = f.header()
            self.lname = str(h.get("lname", ""))
            limits = h.get("limits")
            if isinstance(limits, dict):
                self.max_frame_size = int(limits.get("max_frame_size", 0))
        return f

    async def frame(self) -> Frame | None:
        """The next frame, or None once the broker closed the connection."""
        while True:
            f = self.parser.next_frame()
            if f is not None:
                return f
            if self.eof:
                return None
            try:
                data = await self.stream.receive_some(1 << 20)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.eof = True
            else:
                self.parser.feed(data)

    def request_bytes(self, target: str, cmd: str, params: object = None) -> tuple[int, bytes]:
        self._rid += 1
        data = b"".join(
            bytes(b)
            for b in encode_frame(
                FrameType.REQUEST,
                target=target,
                request_id=self._rid,
                header=encode_cbor({"cmd": cmd}),
                body=encode_cbor(params) if params is not None else b"",
            )
        )
        return self._rid, data

    async def call(self, target: str, cmd: str, params: object = None) -> Frame | None:
        """Send a request and return its answer (other frames are skipped), None at EOF."""
        rid, data = self.request_bytes(target, cmd, params)
        await self.send(data)
        while True:
            f = await self.frame()
            if f is None or (f.request_id == rid and f.type in (FrameType.REPLY, FrameType.ERROR)):
                return f

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


def _hangup(fd: int) -> bool:
    """True if the peer closed the socket (checked without reading from it)."""
    p = select.poll()
    p.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _fd, ev in p.poll(0))


class StalledReader:
    """Subscribes (and optionally asks for answers), reads until SIGUSR1, then reads nothing
    at all: the broker sees a receiver that stopped reading. Detects being dropped by
    polling for hang-up, never by reading."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p
        self.reading = bool(self.p["reading"])
        self.dropped = False

    def _stop_reading(self) -> None:
        self.reading = False
        self.ctx.mark("stopped_reading")

    def _resume_reading(self) -> None:
        self.reading = True
        self.ctx.mark("resumed_reading")

    async def run(self) -> None:
        ctx, p = self.ctx, self.p
        ctx.on_usr1 = self._stop_reading
        ctx.on_usr2 = self._resume_reading
        conn = await RawConn.open(ctx.socket)
        try:
            w = await conn.hello(ctx.name)
            if w is None or w.type != FrameType.WELCOME:
                raise RuntimeError(f"handshake refused: {w}")
            for g in p["groups"]:
                f = await conn.call("msgq", "subscribe", {"group": g})
                if f is None or f.type != FrameType.REPLY:
                    raise RuntimeError(f"subscribe {g!r} failed: {f}")
            ctx.ready([conn.lname])
            if not await ctx.wait_go():
                return
            for i in range(p["requests"]):
                _rid, data = conn.request_bytes(
                    p["request_target"].format(i=i), "echo", {"p": b"", "r": p["reply_size"]}
                )
                await conn.send(data)
                ctx.count("requests")
            async with trio.open_nursery() as n:
                n.start_soon(self._loop, conn)
                await ctx.stop.wait()
                n.cancel_scope.cancel()
        finally:
            await conn.aclose()

    def _on_frame(self, f: Frame) -> None:
        ctx = self.ctx
        if f.type == FrameType.MESSAGE:
            ctx.count("received")
        elif f.type == FrameType.REPLY:
            ctx.count("ok")
        elif f.type == FrameType.ERROR:
            code = str(f.header().get("code", ""))
            ctx.count(f"err.{code}" if f.request_id else f"closed_with.{code}")
        ctx.count("bytes", len(f.raw))

    async def _loop(self, conn: RawConn) -> None:
        fd = conn.stream.socket.fileno()
        while not self.dropped:
            if self.reading:
                data = b""
                with trio.move_on_after(0.05) as cs:
                    try:
                        data = await conn.stream.receive_some(1 << 20)
                    except trio.BrokenResourceError:
                        data = b""
                if cs.cancelled_caught:
                    continue
                if not data:
                    self._dropped()
                    return
                conn.parser.feed(data)
                while (f := conn.parser.next_frame()) is not None:
                    self._on_frame(f)
            else:
                if _hangup(fd):
                    self._dropped()
                    # What the kernel buffered is still readable: look for a final ERROR.
                    with trio.move_on_after(1.0):
                        while (f := await conn.frame()) is not None:
                            self._on_frame(f)
                    return
                await trio.sleep(0.05)

    def _dropped(self) -> None:
        self.dropped = True
        self.ctx.count("dropped")
        self.ctx.mark("dropped")


class HalfFrame:
    """Connections that send a few good requests, then part of a frame, then stall."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p

    async def run(self) -> None:
        self.ctx.ready([])
        if not await self.ctx.wait_go():
            return
        async with trio.open_nursery() as n:
            for _ in range(self.p["count"]):
                n.start_soon(self._one)
        self.ctx.done()
        await self.ctx.stop.wait()

    async def _one(self) -> None:
        ctx, p = self.ctx, self.p
        conn = await RawConn.open(ctx.socket)
        try:
            w = await conn.hello(ctx.name)
            if w is None or w.type != FrameType.WELCOME:
                ctx.count("refused")
                return
            for _ in range(p["pings"]):
                f = await conn.call("msgq", "ping")
                ctx.count(
                    "pings_ok" if f is not None and f.type == FrameType.REPLY else "pings_bad"
                )
            # Only the bytes actually sent are built: the prefix claims `frame_size`
            # bytes (a MESSAGE to Void whose body is the rest), the stream stops at `cut`.
            size = max(PREFIX.size + 4, p["frame_size"])
            cut = max(1, int(size * p["fraction"]))
            head = PREFIX.pack(
                size - 4, FrameType.MESSAGE, 0, 4, 0, 0, 0, 0, 0, 0, size - PREFIX.size - 4
            )
            data = (head + b"Void" + bytes(max(0, cut - PREFIX.size - 4)))[:cut]
            await conn.send(data)
            t = time.monotonic()
            ctx.mark("stalled")
            limit = p["stall"] if p["stall"] > 0 else p["wait_max"]
            code = None
            closed = False
            with trio.move_on_after(limit):
                while True:
                    f = await conn.frame()
                    if f is None:
                        closed = True
                        break
                    if f.type == FrameType.ERROR and not f.request_id:
                        code = str(f.header().get("code", ""))
            if closed:
                ctx.count("dropped")
                ctx.count(f"closed_with.{code}" if code else "closed_silently")
                ctx.value("drop_after_ms", (time.monotonic() - t) * 1000)
                ctx.mark("dropped")
            else:
                ctx.count("disconnected")  # we give up first: close mid-frame
                ctx.mark("disconnected")
        except (trio.BrokenResourceError, OSError):
            ctx.count("io_error")
        finally:
            await conn.aclose()


# The outcomes the protocol promises for each kind of malformed input (docs/PROTOCOL.md):
# a final ERROR with this code, then close. "mutated" may be served (its probe answered),
# closed in order (a mutation into GOODBYE) or dropped with any ERROR; never a silent
# close or a hang (Garbage._one).
_ERR = "error."
_EXPECTED: dict[str, frozenset[str]] = {
    # A random length below the maximum waits for more bytes: handshake_timeout drops it
    # without an ERROR (nothing was said yet that could be answered).
    "random": frozenset({_ERR + "frame-too-large", _ERR + "protocol-error", "eof"}),
    "random-after-hello": frozenset({_ERR + "frame-too-large", _ERR + "protocol-error"}),
    "zero-length": frozenset({_ERR + "protocol-error"}),
    "short-length": frozenset({_ERR + "protocol-error"}),
    "huge-length": frozenset({_ERR + "frame-too-large"}),
    "max-plus-one": frozenset({_ERR + "frame-too-large"}),
    "huge-after-hello": frozenset({_ERR + "frame-too-large"}),
    "unknown-type": frozenset({_ERR + "protocol-error"}),
    "reserved-nonzero": frozenset({_ERR + "protocol-error"}),
    "bad-sections": frozenset({_ERR + "protocol-error"}),
    "bad-utf8-target": frozenset({_ERR + "protocol-error"}),
    "bad-cbor-header": frozenset({_ERR + "protocol-error"}),
    "trailing-cbor": frozenset({_ERR + "protocol-error"}),
    "no-hello": frozenset({_ERR + "protocol-error"}),
    "double-hello": frozenset({_ERR + "protocol-error"}),
    # GOODBYE first: the broker closes in order and never reads what follows.
    "after-goodbye": frozenset({"goodbye"}),
    "request-no-id": frozenset({_ERR + "protocol-error"}),
    "request-no-cmd": frozenset({_ERR + "protocol-error"}),
    "notify-broker-group": frozenset({_ERR + "forbidden"}),
    "routed-from-client": frozenset({_ERR + "protocol-error"}),
    "welcome-from-client": frozenset({_ERR + "protocol-error"}),
    "bad-hello-name": frozenset({_ERR + "protocol-error"}),
    # docs/PROTOCOL.md: the broker never decodes bodies; receivers get MalformedMessage.
    "bad-cbor-body": frozenset({"survived"}),
}
_PRE_HELLO = frozenset({"random", "huge-length", "no-hello", "bad-hello-name"})


def _raw_frame(
    ftype: int = FrameType.MESSAGE,
    *,
    target: bytes = b"Void",
    header: bytes = b"",
    body: bytes = b"",
    rid: int = 0,
    reserved: int = 0,
    length_delta: int = 0,
    header_len_delta: int = 0,
) -> bytes:
    length = PREFIX.size - 4 + len(target) + len(header) + len(body)
    return (
        PREFIX.pack(
            length + length_delta,
            ftype,
            0,
            len(target),
            0,
            0,
            0,
            reserved,
            rid,
            len(header) + header_len_delta,
            len(body),
        )
        + target
        + header
        + body
    )


def build_garbage(
    kind: str, rng: random.Random, max_frame_size: int, target: str = "Void"
) -> bytes:
    """The bytes a garbage connection sends for ``kind`` (after HELLO unless pre-hello);
    messages go to ``target``."""
    ping_hdr = encode_cbor({"cmd": "ping"})
    tb = target.encode()
    if kind in ("random", "random-after-hello"):
        return rng.randbytes(64 if kind == "random" else 256)
    if kind == "zero-length":
        return bytes(32)
    if kind == "short-length":
        return struct.pack(">I", 10) + bytes(28)
    if kind in ("huge-length", "huge-after-hello"):
        return b"\xff\xff\xff\xff" + bytes(28)
    if kind == "max-plus-one":
        return struct.pack(">I", max_frame_size - 4 + 1) + bytes(28)
    if kind == "unknown-type":
        return _raw_frame(200)
    if kind == "reserved-nonzero":
        return _raw_frame(reserved=1)
    if kind == "bad-sections":
        return _raw_frame(body=b"\xf6", header_len_delta=5)
    if kind == "bad-utf8-target":
        return _raw_frame(target=b"\xff\xfe\xfd")
    if kind == "bad-cbor-header":
        return _raw_frame(FrameType.REQUEST, target=b"msgq", header=b"\xff\xff", rid=1)
    if kind == "trailing-cbor":
        return _raw_frame(FrameType.REQUEST, target=b"msgq", header=ping_hdr + b"\x00", rid=1)
    if kind == "no-hello":
        return _raw_frame()
    if kind == "double-hello":
        return _raw_frame(FrameType.HELLO, target=b"", header=encode_cbor({"version": 1}))
    if kind == "after-goodbye":
        return _raw_frame(FrameType.GOODBYE, target=b"") + _raw_frame()
    if kind == "request-no-id":
        return _raw_frame(FrameType.REQUEST, target=b"msgq", header=ping_hdr)
    if kind == "request-no-cmd":
        return _raw_frame(FrameType.REQUEST, target=b"Echo", header=encode_cbor({}), rid=1)
    if kind == "notify-broker-group":
        return _raw_frame(
            FrameType.NOTIFY, target=b"msgq.membership", header=encode_cbor({"event": "x"})
        )
    if kind == "routed-from-client":
        return _raw_frame(FrameType.ROUTED, target=b"l.1", rid=1)
    if kind == "welcome-from-client":
        return _raw_frame(FrameType.WELCOME, target=b"")
    if kind == "bad-hello-name":
        return _raw_frame(
            FrameType.HELLO,
            target=b"",
            header=encode_cbor({"version": PROTOCOL_VERSION, "name": "a\0b"}),
        )
    if kind == "bad-cbor-body":
        # A map announcing 3 items that holds one, then a stray break byte.
        return _raw_frame(target=tb, body=b"\xa3\x61s\x01\xff")
    if kind == "mutated":
        if rng.random() < 0.5:
            base = _raw_frame(FrameType.REQUEST, target=b"msgq", header=ping_hdr, rid=9)
        else:
            base = _raw_frame(target=tb, body=encode_cbor({"s": 1, "p": rng.randbytes(40)}))
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            if not data:
                break  # truncated to nothing: an empty write (one in a few hundred)
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.6:
                data[pos] ^= 1 << rng.randrange(8)
            elif op < 0.9:
                data[pos] = rng.randrange(256)
            elif len(data) > 1:
                del data[pos:]
        return bytes(data)
    raise ValueError(f"unknown garbage kind {kind!r}")


def garbage_rng(seed: int, job: int) -> random.Random:
    """The random source of garbage job ``job`` of a process whose seed is ``seed``
    (process ``i`` of a garbage client uses the client's ``seed`` + ``i``): what a
    printed (job, seed) replays with :func:`build_garbage`."""
    return random.Random(seed * 1_000_003 + job)


def probe_fate(sent: bytes | bytearray, probe: bytes, max_frame_size: int) -> str:
    """Where the broker's framing puts ``probe`` (a frame) when ``sent`` went just before
    it on a connection past HELLO. The broker cuts frames by their length prefix alone,
    with the parser used here, so this is exact:

    * ``"frame"``: the probe is a frame of its own: answered, unless something before it
      makes the broker drop the connection;
    * ``"error"``: the framing fails first (a length prefix outside 32..max_frame_size, a
      malformed fixed part): the broker drops the connection with an ERROR;
    * ``"swallowed"``: the probe's bytes completed a frame that began in ``sent``, and the
      stream ends on a frame boundary. If those frames are valid the broker owes no
      answer (a message to a group without members is delivered to nobody, silently) and
      the connection idles, still in sync: a further probe is a frame of its own;
    * ``"partial"``: the stream ends inside a frame: the broker waits for the rest and
      drops the connection once it has been idle for ``idle_in_frame_timeout`` (ERROR
      protocol-error).
    """
    parser = FrameParser(max_frame_size)
    parser.feed(bytes(sent) + probe)
    last: Frame | None = None
    try:
        while (f := parser.next_frame()) is not None:
            last = f
    except ProtocolError:
        return "error"
    if parser.in_frame:
        return "partial"
    if last is not None and len(last.raw) == len(probe) and bytes(last.raw) == probe:
        return "frame"
    return "swallowed"


#: Jobs between two progress lines of a garbage client (stderr).
PROGRESS_EVERY = 10_000


class Garbage:
    """One connection per malformed input; each must be dropped (with the promised ERROR)
    or, for mutations that happen to be valid, still answer a ping. Never hang.

    The ping probe follows the garbage on the same connection. Where the garbage leaves
    a frame open that the probe's bytes complete, the probe is no frame of its own and
    may legitimately get no answer; :func:`probe_fate` tells this from the bytes (with
    the broker's own framing) and a second probe follows, which must be answered.
    Process ``i`` uses seed ``seed + i``; each unexpected outcome is printed with its
    job number and that seed (:func:`garbage_rng` replays it)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p

    async def run(self) -> None:
        ctx, p = self.ctx, self.p
        ctx.ready([])
        if not await ctx.wait_go():
            return
        kinds = list(GARBAGE_KINDS) if "all" in p["kinds"] else list(p["kinds"])
        # `concurrency` workers take the jobs in turn: memory stays bounded by the
        # workers however many jobs there are (a million-frame run).
        jobs = enumerate(k for _ in range(p["repeat"]) for k in kinds)
        limiter = trio.CapacityLimiter(p["concurrency"])

        # Each process of the client sends its own frames (the same seed in every process
        # would send the same frames procs times over).
        seed = p["seed"] + ctx.index

        async def worker() -> None:
            for j, kind in jobs:
                if ctx.stop.is_set():
                    # Stopped early (SIGTERM, or the runner's stop): report what was sent.
                    return
                await self._one(kind, garbage_rng(seed, j), limiter, j, seed)
                if j % PROGRESS_EVERY == PROGRESS_EVERY - 1:
                    # A long run's progress in the client's log (kept with run --keep):
                    # an interrupted run still tells how far it got and how it went.
                    print(json.dumps({"progress": dict(ctx.counts)}), file=sys.stderr)

        async with trio.open_nursery() as n:
            for _ in range(p["concurrency"]):
                n.start_soon(worker)
        ctx.done()
        await ctx.stop.wait()

    async def _one(
        self,
        kind: str,
        rng: random.Random,
        limiter: trio.CapacityLimiter,
        job: int = 0,
        seed: int = 0,
    ) -> None:
        ctx = self.ctx
        async with limiter:
            ctx.count("sent")
            ctx.count(f"kind.{kind}")
            outcome = await self._attempt(kind, rng)
        ctx.count(outcome)
        if outcome.startswith(_ERR):
            ctx.count("dropped")
        expected = _EXPECTED.get(kind)
        if expected is None:  # mutated: served, closed in order, or dropped with an ERROR
            ok = outcome in ("survived", "goodbye") or outcome.startswith(_ERR)
        else:
            ok = outcome in expected
        if not ok:
            ctx.count("unexpected")
            # The job number replays it: its bytes come from garbage_rng(seed, job).
            print(
                f"garbage kind {kind}: unexpected outcome {outcome} (job {job}, seed {seed})",
                file=sys.stderr,
            )

    async def _attempt(self, kind: str, rng: random.Random) -> str:
        ctx, p = self.ctx, self.p
        try:
            conn = await RawConn.open(ctx.socket)
        except OSError as exc:
            return f"connect_failed.{exc.errno}"
        try:
            max_frame = p["max_frame_size"]
            ready = kind not in _PRE_HELLO
            if ready:
                w = await conn.hello(ctx.name)
                if w is None or w.type != FrameType.WELCOME:
                    return "refused"
                max_frame = conn.max_frame_size or max_frame
            payload = build_garbage(kind, rng, max_frame, p["target"])
            rid = 0
            probe = b""
            if ready:
                # A probe: if the connection still works, a ping is answered.
                rid, probe = conn.request_bytes("msgq", "ping")
                if probe_fate(payload, probe, max_frame) == "swallowed":
                    # The probe only completed a frame the garbage began (a truncated
                    # message, say), which may be valid and owed no answer: the
                    # connection then idles, in sync, and a second probe is answered.
                    ctx.count("probe_swallowed")
                    rid, again = conn.request_bytes("msgq", "ping")
                    probe += again
            try:
                await conn.send(payload)
                if probe:
                    await conn.send(probe)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the broker may close before we finish writing; read what it said
            code = None
            goodbye = False
            with trio.move_on_after(p["wait"]):
                while True:
                    try:
                        f = await conn.frame()
                    except RemoteProtocolError:
                        return "broker-sent-garbage"
                    if f is None:
                        if code:
                            return _ERR + code
                        return "goodbye" if goodbye else "eof"
                    if f.type == FrameType.ERROR and not f.request_id:
                        code = str(f.header().get("code", ""))
                    elif f.type == FrameType.GOODBYE:
                        goodbye = True
                    elif rid and f.request_id == rid and f.type == FrameType.REPLY:
                        return "survived"
            return "hung"
        finally:
            await conn.aclose()


class Storm:
    """Connect/disconnect cycles: clean (library, GOODBYE), abrupt (HELLO, then close),
    no-hello (connect, close at once), or mixed."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p
        self.next = 0

    async def run(self) -> None:
        ctx = self.ctx
        ctx.ready([])
        if not await ctx.wait_go():
            return
        async with trio.open_nursery() as n:
            # stop ends the storm early (the runner's deadline); the cycle count otherwise.
            n.start_soon(self._stopper, n.cancel_scope)
            async with trio.open_nursery() as workers:
                for _ in range(self.p["concurrency"]):
                    workers.start_soon(self._worker)
            n.cancel_scope.cancel()
        ctx.done()
        await ctx.stop.wait()

    async def _stopper(self, scope: trio.CancelScope) -> None:
        await self.ctx.stop.wait()
        scope.cancel()

    async def _worker(self) -> None:
        ctx, p = self.ctx, self.p
        modes = ("clean", "abrupt", "no-hello")
        while self.next < p["cycles"]:
            i = self.next
            self.next += 1
            mode = modes[i % 3] if p["mode"] == "mixed" else p["mode"]
            t = time.monotonic()
            try:
                await self._cycle(mode)
            except (ConnectError, ConnectionLost, RpcError) as exc:
                ctx.count(f"failed.{_code(exc)}")
            except (OSError, trio.BrokenResourceError) as exc:
                ctx.count(f"failed.{type(exc).__name__}")
            else:
                ctx.count("ok")
                ctx.count(f"ok.{mode}")
                ctx.lat.add((time.monotonic() - t) * 1000)
            ctx.count("cycles")

    async def _cycle(self, mode: str) -> None:
        ctx = self.ctx
        if mode == "clean":
            async with connect(ctx.socket, name=ctx.name) as bus:
                if self.p["ping"]:
                    await bus.call("msgq", "ping")
            return
        conn = await RawConn.open(ctx.socket)
        try:
            if mode == "abrupt":
                w = await conn.hello(ctx.name)
                if w is None or w.type != FrameType.WELCOME:
                    raise ConnectError("refused", code="refused")
        finally:
            await conn.aclose()


class Hold:
    """Opens many connections at once and keeps them (max-connections, EMFILE); after the
    release fault (SIGUSR1) or ``hold`` seconds closes them and checks the broker serves.

    All sockets are connected first and only then does each send HELLO (many components
    starting together): the broker sees every connection before any handshake is done.
    """

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.p = ctx.p
        self.release = trio.Event()
        self.conns: list[RawConn] = []

    async def run(self) -> None:
        ctx, p = self.ctx, self.p
        ctx.on_usr1 = self.release.set
        ctx.ready([])
        if not await ctx.wait_go():
            return
        try:
            async with trio.open_nursery() as n:
                for _ in range(p["connections"]):
                    n.start_soon(self._connect_one)
            ctx.mark("connected")
            # Let the broker accept every socket before any HELLO arrives (a burst of
            # components starting at once), so admission is decided for all of them.
            await trio.sleep(0.2)
            async with trio.open_nursery() as n:
                for conn in self.conns:
                    n.start_soon(self._hello, conn)
            ctx.mark("opened")
            with trio.move_on_after(p["hold"] if p["hold"] > 0 else 600):
                await self.release.wait()
        finally:
            for c in self.conns:
                await c.aclose()
        ctx.mark("released")
        if p["verify"]:
            await self._verify()
        ctx.done()
        await ctx.stop.wait()

    async def _connect_one(self) -> None:
        try:
            self.conns.append(await RawConn.open(self.ctx.socket))
        except OSError as exc:
            self.ctx.count(f"connect_failed.{exc.errno}")

    async def _hello(self, conn: RawConn) -> None:
        ctx = self.ctx
        with trio.move_on_after(self.p["handshake_timeout"]):
            try:
                w = await conn.hello(ctx.name)
            except (trio.BrokenResourceError, OSError):
                w = None
            if w is not None and w.type == FrameType.WELCOME:
                ctx.count("connected")
            elif w is not None and w.type == FrameType.ERROR:
                ctx.count(f"refused.{w.header().get('code')}")
            else:
                ctx.count("closed")
            return
        ctx.count("no_answer")  # accepted by the kernel, not (yet) by the broker

    async def _verify(self) -> None:
        ctx = self.ctx
        t = time.monotonic()
        deadline = t + self.p["verify_timeout"]
        while time.monotonic() < deadline:
            try:
                with trio.fail_after(2.0):
                    async with connect(ctx.socket, name=ctx.name) as bus:
                        await bus.call("msgq", "ping")
            except (ConnectError, ConnectionLost, RpcError, trio.TooSlowError, OSError):
                ctx.count("verify_retries")
                await trio.sleep(0.1)
                continue
            ctx.count("verify_ok")
            ctx.value("verify_ms", (time.monotonic() - t) * 1000)
            return
        ctx.count("verify_failed")


# -- process main ----------------------------------------------------------------------------------
ROLE_CLASSES: dict[str, Callable[[Ctx], Any]] = {
    "publisher": Publisher,
    "subscriber": Subscriber,
    "caller": Caller,
    "responder": Responder,
    "swarm": Swarm,
    "big-sender": BigSender,
    "subscribe-flood": SubscribeFlood,
    "stalled-reader": StalledReader,
    "half-frame": HalfFrame,
    "garbage": Garbage,
    "storm": Storm,
    "hold": Hold,
}


async def _watch_stdin(ctx: Ctx) -> None:
    """``go`` / ``stop`` lines from the runner; EOF (the runner is gone) means stop."""
    buf = b""
    async with trio.lowlevel.FdStream(os.dup(0)) as stream:
        while True:
            try:
                data = await stream.receive_some(4096)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                ctx.stop.set()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip() == b"go":
                    ctx.go.set()
                elif line.strip() == b"stop":
                    ctx.stop.set()


async def _watch_signals(ctx: Ctx) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2) as signals:
        async for sig in signals:
            if sig == signal.SIGTERM:
                ctx.stop.set()
            elif sig == signal.SIGUSR1:
                ctx.on_usr1()
            else:
                ctx.on_usr2()


async def _amain(ctx: Ctx) -> int:
    role = ROLE_CLASSES[ctx.role](ctx)
    status = 0
    async with trio.open_nursery() as n:
        n.start_soon(_watch_stdin, ctx)
        n.start_soon(_watch_signals, ctx)
        try:
            run: Callable[[], Awaitable[None]] = role.run
            await run()
        except Exception as exc:  # reported, not hidden: the runner fails the scenario
            traceback.print_exc()
            ctx.error = f"{type(exc).__name__}: {exc}"
            status = 1
        finally:
            n.cancel_scope.cancel()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run one client role until stopped; prints the JSON report last. Exit status 0 ok,
    1 the role failed (its report carries ``error``), 2 bad arguments."""
    ap = argparse.ArgumentParser(prog="python -m msgq_trio.scenario.clients")
    ap.add_argument("role", choices=sorted(ROLES))
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--params", default="{}", help="JSON object of resolved role parameters")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    ctx = Ctx(args.role, args.socket, args.name, args.index, json.loads(args.params))
    try:
        status = trio.run(_amain, ctx)
    except (ProtocolError, KeyboardInterrupt) as exc:
        ctx.error = f"{type(exc).__name__}: {exc}"
        status = 1
    ctx.emit(ctx.report())
    return status


if __name__ == "__main__":
    sys.exit(main())
