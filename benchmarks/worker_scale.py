"""Clients of the scale workloads (:mod:`benchmarks.scale`), many connections per
process: ``python -m benchmarks.worker_scale SPEC_JSON`` with ``system`` one of
``msgq_trio`` (the trio client, the README's form: ``async for msg in bus``,
``@bus.command`` on an ``async def`` handler), ``nats`` (nats-py), ``redis``
(redis.asyncio; a call is a publish to the responder's channel and a reply on the
caller's own channel, Redis having no request/reply) or ``zeromq`` (pyzmq's asyncio
sockets through a ``zmq.proxy``: see :class:`ZmqAdapter`).

Roles (spec keys in brackets):

* ``members``: open ``conns`` connections (numbered from ``base``), print CONNECTED,
  wait for GO; then connection ``i`` subscribes to ``per`` names: ``s.{i}.{j}``, of
  which the first ``wild`` are patterns ``w.{i}.{j}.*`` instead (one token, in each
  system's syntax), or (``group``) all to that one name; READY once all are
  subscribed; then counts what arrives until ``expect`` messages in all (or the
  deadline). Result: per-connection counts and last arrival times, the time to set up.
* ``arrivals``: one connection subscribed to ``group``: the arrival time of each of
  ``expect`` messages; the minor page faults of this process and of the process
  ``watch`` (the broker) so far, when ready and at each arrival.
* ``publisher``: one connection; after GO sends ``n`` bodies of ``size`` bytes to the
  names ``targets`` (a list, cycled), then flushes. ZeroMQ: READY only once the
  ``subscribers`` members' subscriptions have reached it.
* ``responder``: one connection answering ``echo`` calls with their params.
* ``callers``: ``conns`` connections of which the first ``active`` make calls after GO,
  at ``rate`` calls/s in all, for ``seconds``; latencies in ns.
* ``idle``: ``conns`` bare sockets, each past the handshake where the protocol has one
  (msgq_trio: HELLO, WELCOME read; NATS: INFO read, CONNECT sent; Redis: none), held
  until the deadline or GO.

A pattern subscription the broker refuses makes ``members`` answer
``{"unsupported": why}``: the parent reports the cell as n/a.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .common import Deadline, Spec, payloads, ready, wait_go, worker_main

ECHO = "bench.echo"
#: What ``members`` prints once connected, before it subscribes (after GO).
CONNECTED = "CONNECTED"
#: What ``members`` prints once it has received all it expects (or the deadline passed).
RECEIVED = "RECEIVED"
#: What ``members`` prints (with the reason) when the broker refuses its patterns.
UNSUPPORTED = "UNSUPPORTED"
#: Connections opened at once while setting up (each a handshake).
OPEN_BATCH = 100


class Unsupported(Exception):
    """The system refuses something the workload needs (a wildcard subscription)."""


def names_of(i: int, per: int, wild: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Connection ``i``'s literal names and its (pattern, a name it matches) pairs."""
    literal = [f"s.{i}.{j}" for j in range(wild, per)]
    patterns = [(f"w.{i}.{j}.*", f"w.{i}.{j}.x") for j in range(wild)]
    return literal, patterns


def routing_targets(clients: int, per: int, wild: int) -> list[str]:
    """Every subscribed name once (a name each pattern matches for the patterns), name
    ``j`` of every connection before name ``j + 1``: message ``k`` goes to connection
    ``k % clients``."""
    # (the names of names_of, written out: 100,000 calls of it would take seconds)
    return [
        f"w.{i}.{j}.x" if j < wild else f"s.{i}.{j}" for j in range(per) for i in range(clients)
    ]


# -- one adapter per system ------------------------------------------------------------
class Adapter:
    """What a role needs from a system's client; ``Conn`` is whatever it opens."""

    def __init__(self, spec: Spec, stack: contextlib.AsyncExitStack) -> None:
        self.addr = spec["addr"]
        self.stack = stack
        #: Connect in open() even where the client would wait for first use (redis).
        self.eager = spec["role"] == "callers"

    async def open(self, name: str) -> Any:
        raise NotImplementedError

    async def subscribe(self, conn: Any, names: list[str], patterns: list[str]) -> None:
        raise NotImplementedError

    async def receive(self, conn: Any, on_message: Callable[[], None]) -> None:
        """Call ``on_message()`` for each message until cancelled."""
        raise NotImplementedError

    async def publish(self, conn: Any, name: str, body: bytes) -> None:
        raise NotImplementedError

    async def flush(self, conn: Any) -> None:
        raise NotImplementedError

    async def serve_echo(self, conn: Any) -> None:
        raise NotImplementedError

    async def call(self, conn: Any, body: bytes) -> bytes:
        raise NotImplementedError

    def idle_socket(self) -> socket.socket:
        raise NotImplementedError


class MsgqAdapter(Adapter):
    #: A nursery of the role's main task holding every connection's task: a Bus's
    #: context (its nursery) must be entered and left in one task, and connections are
    #: opened from several at once.
    holder: Any = None

    async def open(self, name: str) -> Any:
        import trio

        from msgq_trio import connect

        async def hold(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with connect(self.addr["socket"], name=name) as bus:
                task_status.started(bus)
                await trio.sleep_forever()

        return await self.holder.start(hold)

    probed = False

    async def probe_patterns(self) -> None:
        """Raise Unsupported unless a pattern subscription receives what is sent to a
        name it matches: a broker without wildcards may refuse the pattern, or take it
        as a literal name (then nothing would ever arrive). Two connections of its own,
        held to the end."""
        import trio

        from msgq_trio.errors import MsgqError

        a, b = await self.open("probe-rx"), await self.open("probe-tx")
        try:
            await a.subscribe("scaleprobe.*")
            await b.send("scaleprobe.x", b"")
            with trio.move_on_after(2):
                await a.receive()
                return
        except (MsgqError, ValueError) as exc:
            raise Unsupported(f"pattern subscription refused: {exc}") from exc
        raise Unsupported("a pattern subscription received nothing: no wildcards")

    async def subscribe(self, conn: Any, names: list[str], patterns: list[str]) -> None:
        from msgq_trio.errors import MsgqError

        if patterns and not self.probed:
            await self.probe_patterns()
            self.probed = True
        for n in names:
            await conn.subscribe(n)
        for p in patterns:
            try:
                await conn.subscribe(p)
            except (MsgqError, ValueError) as exc:
                raise Unsupported(f"subscribe({p!r}) refused: {exc}") from exc

    async def receive(self, conn: Any, on_message: Callable[[], None]) -> None:
        async for _msg in conn:
            on_message()

    async def publish(self, conn: Any, name: str, body: bytes) -> None:
        await conn.send(name, body)

    async def flush(self, conn: Any) -> None:
        await conn.flush()

    async def serve_echo(self, conn: Any) -> None:
        async def echo(params: Any) -> Any:
            return params

        conn.command("echo")(echo)

        await conn.subscribe(ECHO)

    async def call(self, conn: Any, body: bytes) -> bytes:
        reply: bytes = await conn.call(ECHO, "echo", body)
        return reply

    def idle_socket(self) -> socket.socket:
        from msgq_trio.protocol.codes import PROTOCOL_VERSION, FrameType
        from msgq_trio.protocol.framing import encode_cbor, encode_frame

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.addr["socket"])
        hello = encode_frame(
            FrameType.HELLO,
            header=encode_cbor({"version": PROTOCOL_VERSION, "name": "idle", "pid": os.getpid()}),
        )
        s.sendall(b"".join(bytes(p) for p in hello))
        s.recv(65536)  # WELCOME (or the refusal, which the test of the count shows)
        return s


class NatsAdapter(Adapter):
    async def open(self, name: str) -> Any:
        import nats

        nc = await nats.connect(
            self.addr["url"], name=name, max_reconnect_attempts=0, pending_size=1 << 30
        )
        self.stack.push_async_callback(nc.close)
        return nc

    async def subscribe(self, conn: Any, names: list[str], patterns: list[str]) -> None:
        handler = conn._scale_handler  # set by receive() before subscribing

        for n in [*names, *patterns]:
            await conn.subscribe(n, cb=handler, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await conn.flush()

    async def receive(self, conn: Any, on_message: Callable[[], None]) -> None:
        await asyncio.Event().wait()  # callbacks do the work

    def bind(self, conn: Any, on_message: Callable[[], None]) -> None:
        async def cb(_msg: Any) -> None:
            on_message()

        conn._scale_handler = cb

    async def publish(self, conn: Any, name: str, body: bytes) -> None:
        await conn.publish(name, body)

    async def flush(self, conn: Any) -> None:
        await conn.flush(timeout=60)

    async def serve_echo(self, conn: Any) -> None:
        async def echo(msg: Any) -> None:
            await conn.publish(msg.reply, msg.data)

        await conn.subscribe(ECHO, cb=echo)
        await conn.flush()

    async def call(self, conn: Any, body: bytes) -> bytes:
        msg = await conn.request(ECHO, body, timeout=30)
        data: bytes = msg.data
        return data

    def idle_socket(self) -> socket.socket:
        host, port = self.addr["url"].removeprefix("nats://").rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.recv(65536)  # INFO
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        return s


class RedisAdapter(Adapter):
    """A connection is a client with its pub/sub object (one socket for subscribing,
    one more once it publishes)."""

    async def open(self, name: str) -> Any:
        import redis.asyncio as aredis

        r = aredis.Redis(unix_socket_path=self.addr["socket"], client_name=name)
        self.stack.push_async_callback(r.aclose)
        if self.eager:
            await r.ping()  # connected now, not on first use
        ps = r.pubsub()
        self.stack.push_async_callback(ps.aclose)
        return {"r": r, "ps": ps, "pipe": None, "n": 0}

    async def subscribe(self, conn: Any, names: list[str], patterns: list[str]) -> None:
        ps = conn["ps"]
        for k in range(0, len(names), 500):
            await ps.subscribe(*names[k : k + 500])
        for k in range(0, len(patterns), 500):
            await ps.psubscribe(*patterns[k : k + 500])
        # Confirmations: so READY means subscribed.
        want = len(names) + len(patterns)
        got = 0
        while got < want:
            m = await ps.get_message(timeout=30)
            if m is None:
                raise RuntimeError(f"redis confirmed {got} of {want} subscriptions")
            if m["type"] in ("subscribe", "psubscribe"):
                got += 1

    async def receive(self, conn: Any, on_message: Callable[[], None]) -> None:
        async for m in conn["ps"].listen():
            if m["type"] in ("message", "pmessage"):
                on_message()

    async def publish(self, conn: Any, name: str, body: bytes) -> None:
        # Pipelined in batches of 100, as a producer that cares writes it: one round
        # trip per PUBLISH would measure the client's latency, not the server.
        if conn["pipe"] is None:
            conn["pipe"] = conn["r"].pipeline(transaction=False)
        conn["pipe"].publish(name, body)
        conn["n"] += 1
        if conn["n"] % 100 == 0:
            await self.flush(conn)

    async def flush(self, conn: Any) -> None:
        if conn["pipe"] is not None:
            await conn["pipe"].execute()
            conn["pipe"] = None

    async def serve_echo(self, conn: Any) -> None:
        ps, r = conn["ps"], conn["r"]
        await ps.subscribe(ECHO)

        async def loop() -> None:
            async for m in ps.listen():
                if m["type"] == "message":
                    reply, _, body = m["data"].partition(b"|")
                    await r.publish(reply, body)

        self._own(asyncio.get_running_loop().create_task(loop()))

    def _own(self, task: asyncio.Task[None]) -> None:
        """Cancel ``task`` (a pub/sub reader) before its connection closes: closing a
        pub/sub object under a reader can hang."""

        async def cancel() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self.stack.push_async_callback(cancel)

    async def call(self, conn: Any, body: bytes) -> bytes:
        if "reply" not in conn:
            conn["reply"] = f"reply.{id(conn)}"
            conn["waiting"] = None
            await conn["ps"].subscribe(conn["reply"])

            async def loop() -> None:
                async for m in conn["ps"].listen():
                    if m["type"] == "message" and conn["waiting"] is not None:
                        conn["waiting"].set_result(m["data"])

            self._own(asyncio.get_running_loop().create_task(loop()))
            await asyncio.sleep(0.05)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        conn["waiting"] = fut
        await conn["r"].publish(ECHO, conn["reply"].encode() + b"|" + body)
        data = await asyncio.wait_for(fut, 30)
        conn["waiting"] = None
        return data

    def idle_socket(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.addr["socket"])
        return s


class ZmqAdapter(Adapter):
    """ZeroMQ through a ``zmq.proxy`` process (``benchmarks/worker_zmq.py``, role
    ``proxy``): XSUB/XPUB for the publish-subscribe workloads, ROUTER/DEALER for calls.
    A connection is a socket (pyzmq's asyncio sockets): ``SUB`` for members and
    arrivals, ``XPUB`` for the publisher (it sees the subscriptions arrive), ``REP`` for
    the responder, ``DEALER`` for callers (a REQ envelope, one call at a time).

    Names are prefix filters: a message is [topic + NUL, body], a literal name is
    subscribed as ``name + NUL`` (so ``s.1.2`` does not match ``s.1.20``) and a pattern
    ``w.I.J.*`` as the prefix ``w.I.J.`` (any depth: ZeroMQ has no one-token wildcard).
    Each subscriber also subscribes to a marker ``\\xffready-<id>``; the publisher sends
    nothing before it has seen ``subscribers`` markers (each follows its subscriber's
    real subscriptions on the same pipe)."""

    def __init__(self, spec: Spec, stack: contextlib.AsyncExitStack) -> None:
        super().__init__(spec, stack)
        import zmq
        import zmq.asyncio

        self.zmq = zmq
        self.role = spec["role"]
        self.subscribers = spec.get("subscribers", 0)
        self.ctx = zmq.asyncio.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        stack.callback(self.ctx.term)
        self.marks = 0

    def _endpoint(self, name: str) -> str:
        return f"ipc://{self.addr['dir']}/{name}"

    async def open(self, name: str) -> Any:
        zmq = self.zmq
        kind, where = {
            "members": (zmq.SUB, "sub.ipc"),
            "arrivals": (zmq.SUB, "sub.ipc"),
            "publisher": (zmq.XPUB, "pub.ipc"),
            "responder": (zmq.REP, "rep.ipc"),
            "callers": (zmq.DEALER, "req.ipc"),
        }[self.role]
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        # A publisher's messages may still be queued when it is done sending (ZeroMQ has
        # no flush): closing waits for them; other sockets drop what is left at once.
        s.setsockopt(zmq.LINGER, 30_000 if self.role == "publisher" else 0)
        self.stack.callback(s.close)
        s.connect(self._endpoint(where))
        return s

    async def subscribe(self, conn: Any, names: list[str], patterns: list[str]) -> None:
        zmq = self.zmq
        for n in names:
            conn.setsockopt(zmq.SUBSCRIBE, n.encode() + b"\0")
        for p in patterns:
            conn.setsockopt(zmq.SUBSCRIBE, p.removesuffix("*").encode())
        self.marks += 1
        conn.setsockopt(zmq.SUBSCRIBE, b"\xffready-%d-%d" % (os.getpid(), self.marks))

    async def receive(self, conn: Any, on_message: Callable[[], None]) -> None:
        while True:
            await conn.recv_multipart(copy=False)
            on_message()

    async def wait_subscribers(self, conn: Any, deadline: Any) -> None:
        """Until ``subscribers`` markers have reached this XPUB socket."""
        seen: set[bytes] = set()
        while len(seen) < self.subscribers:
            if deadline.expired():
                raise TimeoutError(f"{len(seen)} of {self.subscribers} subscribers seen")
            try:
                msg = await asyncio.wait_for(conn.recv(), 1.0)
            except TimeoutError:
                continue
            if msg[:1] == b"\x01" and msg[1:].startswith(b"\xffready-"):
                seen.add(msg)

    async def publish(self, conn: Any, name: str, body: bytes) -> None:
        await conn.send_multipart((name.encode() + b"\0", body))

    async def flush(self, conn: Any) -> None:
        pass  # no such operation: the publisher's linger delivers what is queued on close

    async def serve_echo(self, conn: Any) -> None:
        async def loop() -> None:
            while True:
                await conn.send(await conn.recv())

        task = asyncio.get_running_loop().create_task(loop())

        async def cancel() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self.stack.push_async_callback(cancel)

    async def call(self, conn: Any, body: bytes) -> bytes:
        await conn.send_multipart((b"", body))
        _empty, reply = await conn.recv_multipart()
        return bytes(reply)

    def idle_socket(self) -> socket.socket:
        """A Unix socket past the ZMTP 3.0 handshake with the proxy's ROUTER (greetings
        exchanged, READY sent as a DEALER), then silent."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(f"{self.addr['dir']}/req.ipc")
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
        s.sendall(greeting + b"\0" * 32)
        got = b""
        while len(got) < 64:
            more = s.recv(64 - len(got))
            if not more:
                raise ConnectionError("the ZeroMQ proxy closed during the greeting")
            got += more
        prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        ready_body = b"\x05READY" + prop
        s.sendall(b"\x04" + bytes([len(ready_body)]) + ready_body)
        return s


ADAPTERS: dict[str, type[Adapter]] = {
    "msgq_trio": MsgqAdapter,
    "nats": NatsAdapter,
    "redis": RedisAdapter,
    "zeromq": ZmqAdapter,
}


# -- the event loop: trio for msgq_trio, asyncio for the peers' clients ------------------
class Loop:
    """The few event-loop operations the roles use, on trio or asyncio."""

    def __init__(self, trio_loop: bool) -> None:
        self.trio = trio_loop

    def run(self, fn: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        if self.trio:
            import trio

            return trio.run(fn)
        return asyncio.run(fn())  # type: ignore[arg-type]

    async def sleep(self, seconds: float) -> None:
        if self.trio:
            import trio

            await trio.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    async def gather(self, fns: list[Callable[[], Awaitable[Any]]]) -> None:
        if self.trio:
            import trio

            async with trio.open_nursery() as n:
                for fn in fns:
                    n.start_soon(fn)
        else:
            await asyncio.gather(*(fn() for fn in fns))

    async def race(
        self, fns: list[Callable[[], Awaitable[Any]]], until: Callable[[], bool], deadline: Deadline
    ) -> None:
        """Run ``fns`` until ``until()`` holds (checked every 10 ms) or the deadline."""

        async def stop() -> None:
            while not until() and not deadline.expired():
                await self.sleep(0.01)

        if self.trio:
            import trio

            async with trio.open_nursery() as n:
                for fn in fns:
                    n.start_soon(fn)
                await stop()
                n.cancel_scope.cancel()
        else:
            tasks = [asyncio.ensure_future(fn()) for fn in fns]
            await stop()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_go(self, deadline: Deadline) -> None:
        if self.trio:
            import trio

            await trio.to_thread.run_sync(wait_go, deadline.left())
        else:
            await asyncio.to_thread(wait_go, deadline.left())


async def _open_all(loop: Loop, ad: Adapter, names: list[str]) -> list[Any]:
    conns: list[Any] = [None] * len(names)
    for k in range(0, len(names), OPEN_BATCH):

        def opener(i: int) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                conns[i] = await ad.open(names[i])

            return run

        await loop.gather([opener(i) for i in range(k, min(len(names), k + OPEN_BATCH))])
    return conns


# -- roles -------------------------------------------------------------------------------
async def _members(loop: Loop, ad: Adapter, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, base, per, wild = spec["conns"], spec["base"], spec["per"], spec.get("wild", 0)
    t0 = time.monotonic()
    conns = await _open_all(loop, ad, [f"m{base + i}" for i in range(n)])
    connected = time.monotonic() - t0
    # The parent reads the broker's memory with connections only, then says GO.
    print(CONNECTED, flush=True)
    await loop.wait_go(deadline)
    t0 = time.monotonic()
    counts = [0] * n
    last = [0.0] * n
    total = 0

    def counter(i: int) -> Callable[[], None]:
        def on_message() -> None:
            nonlocal total
            counts[i] += 1
            total += 1
            last[i] = time.monotonic()

        return on_message

    def subscriber(i: int) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            literal, patterns = names_of(base + i, per, wild)
            if spec.get("group"):
                literal, patterns = [spec["group"]], []
            await ad.subscribe(conns[i], literal, [p for p, _ in patterns])

        return run

    for i, c in enumerate(conns):
        if isinstance(ad, NatsAdapter):
            ad.bind(c, counter(i))
    try:
        if wild and isinstance(ad, MsgqAdapter):
            await ad.probe_patterns()
            ad.probed = True
        # Connections subscribe side by side (each its names in turn), a batch at a time.
        for k in range(0, n, OPEN_BATCH):
            await loop.gather([subscriber(i) for i in range(k, min(n, k + OPEN_BATCH))])
    except Unsupported as exc:
        # Before READY, so the parent knows when it sees READY (closing the connections
        # before the RESULT line takes a while).
        print(f"{UNSUPPORTED} {exc}", flush=True)
        ready()
        return {"unsupported": str(exc)}
    subscribed = time.monotonic() - t0
    ready()
    expect = spec["expect"]

    def receiver(i: int) -> Callable[[], Awaitable[None]]:
        return lambda: ad.receive(conns[i], counter(i))

    await loop.race([receiver(i) for i in range(n)], lambda: total >= expect, deadline)
    # Before the connections close: the parent reads the broker's CPU time here, so that
    # tearing thousands of connections down is not counted as routing.
    print(RECEIVED, flush=True)
    return {
        "counts": counts,
        "last": last,
        "total": total,
        "connect_s": connected,
        "subscribe_s": subscribed,
        "timeout": total < expect,
    }


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (0 if it is gone): pages it touched
    for the first time, a load-independent measure of fresh memory."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


async def _arrivals(loop: Loop, ad: Adapter, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    (conn,) = await _open_all(loop, ad, ["arrivals"])
    times: list[float] = []
    faults: list[tuple[int, int]] = []
    me, watch = os.getpid(), spec.get("watch", 0)

    def on_message() -> None:
        times.append(time.monotonic())
        faults.append((minor_faults(me), minor_faults(watch) if watch else 0))

    if isinstance(ad, NatsAdapter):
        ad.bind(conn, on_message)
    await ad.subscribe(conn, [spec["group"]], [])
    faults.append((minor_faults(me), minor_faults(watch) if watch else 0))  # the baseline
    ready()
    expect = spec["expect"]
    await loop.race([lambda: ad.receive(conn, on_message)], lambda: len(times) >= expect, deadline)
    return {"times": times, "faults": faults, "timeout": len(times) < expect}


async def _publisher(loop: Loop, ad: Adapter, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    targets: list[str] = spec.get("targets") or routing_targets(**spec["layout"])
    bodies = payloads(spec["size"], 0)
    mask = len(bodies) - 1
    (conn,) = await _open_all(loop, ad, ["publisher"])
    if isinstance(ad, ZmqAdapter):
        await ad.wait_subscribers(conn, deadline)
    ready()
    await loop.wait_go(deadline)
    start = time.monotonic()
    nt = len(targets)
    for i in range(spec["n"]):
        await ad.publish(conn, targets[i % nt], bodies[i & mask])
    await ad.flush(conn)
    return {"start": start, "end": time.monotonic(), "sent": spec["n"]}


async def _responder(loop: Loop, ad: Adapter, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    (conn,) = await _open_all(loop, ad, ["responder"])
    await ad.serve_echo(conn)
    ready()
    await loop.wait_go(deadline)  # GO: stop
    return {}


async def _callers(loop: Loop, ad: Adapter, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, active, rate, seconds = spec["conns"], spec["active"], spec["rate"], spec["seconds"]
    conns = await _open_all(loop, ad, [f"c{spec['base'] + i}" for i in range(n)])
    body = payloads(spec["size"], 0)[0]
    lat: list[int] = []
    errors = 0
    ready()
    await loop.wait_go(deadline)
    interval = active / rate  # each active connection's period
    start = time.monotonic()
    end = start + seconds

    def caller(k: int) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            nonlocal errors
            due = start + interval * k / active  # spread the callers over one period
            while due < end and not deadline.expired():
                wait = due - time.monotonic()
                if wait > 0:
                    await loop.sleep(wait)
                t = time.perf_counter_ns()
                if await ad.call(conns[k], body) != body:
                    errors += 1
                lat.append(time.perf_counter_ns() - t)
                due += interval

        return run

    await loop.gather([caller(k) for k in range(active)])
    return {"lat_ns": lat, "errors": errors, "start": start, "end": time.monotonic()}


async def _idle(loop: Loop, ad: Adapter, spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    socks = [ad.idle_socket() for _ in range(spec["conns"])]
    ready()
    await loop.wait_go(deadline)
    for s in socks:
        s.close()
    return {"held": len(socks)}


ROLE_FNS = {
    "members": _members,
    "arrivals": _arrivals,
    "publisher": _publisher,
    "responder": _responder,
    "callers": _callers,
    "idle": _idle,
}


def _role(name: str) -> Callable[[Spec], dict[str, Any]]:
    def run(spec: Spec) -> dict[str, Any]:
        from msgq_trio._procs import raise_nofile

        raise_nofile()
        loop = Loop(spec["system"] == "msgq_trio")

        async def main() -> dict[str, Any]:
            async with contextlib.AsyncExitStack() as stack:
                ad = ADAPTERS[spec["system"]](spec, stack)
                if isinstance(ad, MsgqAdapter):
                    import trio

                    ad.holder = await stack.enter_async_context(trio.open_nursery())
                    stack.callback(ad.holder.cancel_scope.cancel)
                return await ROLE_FNS[name](loop, ad, spec)

        return loop.run(main)

    return run


ROLES = {name: _role(name) for name in ROLE_FNS}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
