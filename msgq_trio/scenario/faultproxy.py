"""A TCP fault proxy: network faults between two endpoints on any Linux kernel, as an
ordinary unprivileged process (no netem qdisc, no root, no namespaces).

:class:`FaultProxy` listens on 127.0.0.1 and forwards each accepted connection to one
target address, byte for byte, through the faults currently set:

* ``delay D [J]``: each chunk is held D seconds, plus or minus up to J (uniform). A TCP
  stream is in order, so a chunk never overtakes the one before it: jitter varies the
  gaps between chunks, it never reorders bytes.
* ``loss P%``: a proxied TCP stream cannot lose bytes (TCP would never deliver the rest),
  so loss is modelled as what it does to a TCP flow: a dropped segment is retransmitted
  after a retransmission timeout. Each chunk is, with probability P, stalled one ``rto``
  (default 200 ms, Linux's minimum RTO) before it goes through, and everything behind it
  waits too.
* ``rate R``: a bandwidth cap (``bit``/``kbit``/``mbit``/``gbit`` per second, or bytes
  per second with ``bps``/``kbps``/``mbps``): a chunk leaves no sooner than the bytes
  before it could have at that rate.
* ``blackhole``: both sockets stay open and everything from either side is read and
  thrown away, a close too (a peer that vanished without FIN or RST: only heartbeats
  can tell). A connection opened during a black hole is accepted and waits, unread,
  until it ends (a SYN retransmitted until the link is back): its first bytes are
  late, not lost.
* ``cut [N]``: every open connection is closed on both sides, at once or after N more
  bytes of the direction given (``cut 100`` on ``to_server``: mid-frame if N falls
  inside one). New connections are forwarded again as usual.
* ``clear``: no faults (what a new proxy starts with).

The same words, in one string, are what :func:`parse_setting` reads (a scenario's
``proxy`` setting, or a line on the standalone proxy's stdin: ``python -m
msgq_trio.scenario.faultproxy TARGET_HOST:PORT``).

Resource handling: each connection is two pump tasks per direction (a reader that times
the chunks and a writer that sends them when due) joined by a bounded channel, so a slow
or stalled receiver stops the reader too (backpressure reaches the sender, as on a real
link); memory per connection is bounded by :data:`QUEUE_CHUNKS` x :data:`CHUNK`.
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable
from typing import Literal

import attrs
import trio

#: Bytes read at once: a TCP receive window's worth is typical of one segment burst.
CHUNK = 65536
#: Chunks in flight per direction per connection: bounds memory to 4 MiB per direction
#: while leaving room for a 50 ms delay at loopback speeds.
QUEUE_CHUNKS = 64
#: Linux's minimum retransmission timeout (TCP_RTO_MIN), the stall one lost segment costs.
DEFAULT_RTO = 0.2

Direction = Literal["to_server", "to_client", "both"]

_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)?$")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|bps|kbps|mbps)$")
_RATE_UNITS = {
    "bit": 1 / 8,
    "kbit": 1000 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "bps": 1.0,
    "kbps": 1000.0,
    "mbps": 1e6,
}


class SettingError(ValueError):
    """A fault setting the caller gave cannot be read; says which word."""


@attrs.frozen
class Faults:
    """The faults applied to chunks as they pass (times in seconds, rate in bytes/s)."""

    delay: float = 0.0
    jitter: float = 0.0
    #: probability that a chunk stalls one ``rto`` (a lost segment, retransmitted)
    loss: float = 0.0
    rto: float = DEFAULT_RTO
    #: bytes per second; None: uncapped
    rate: float | None = None
    blackhole: bool = False


@attrs.frozen
class Cut:
    """Close every open connection, after ``after`` more bytes of ``direction`` (None:
    at once)."""

    after: int | None = None
    direction: Direction = "to_server"


def _time(word: str, what: str) -> float:
    m = _TIME_RE.match(word)
    if not m:
        raise SettingError(f"{what}: {word!r} is not a time (e.g. 50ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_setting(text: str, base: Faults | None = None) -> Faults | Cut:
    """Read ``text`` (words as in the module docstring): a :class:`Cut` for ``cut [N]
    [to_server|to_client|both]``, else the :class:`Faults` it describes, starting from
    ``base`` for ``delay``/``loss``/``rate``/``rto`` words (``clear`` and ``blackhole``
    start from none).

    Raises:
        SettingError: an unknown word or a bad value (the caller's fault), naming it.
    """
    words = text.split()
    if not words:
        raise SettingError("empty fault setting")
    if words[0] == "cut":
        if len(words) > 3:
            raise SettingError(f"cut takes [N] [direction], got {text!r}")
        after = None
        direction: Direction = "to_server"
        for w in words[1:]:
            if w.isdigit():
                after = int(w)
            elif w in ("to_server", "to_client", "both"):
                direction = w  # type: ignore[assignment]
            else:
                raise SettingError(f"cut: {w!r} is neither a byte count nor a direction")
        return Cut(after, direction)
    if words == ["clear"]:
        return Faults()
    if words == ["blackhole"]:
        return Faults(blackhole=True)
    f = base or Faults()
    i = 0
    while i < len(words):
        w = words[i]
        nxt = words[i + 1] if i + 1 < len(words) else None
        if w == "delay" and nxt is not None:
            f = attrs.evolve(f, delay=_time(nxt, "delay"), jitter=0.0)
            i += 2
            if i < len(words) and _TIME_RE.match(words[i]):
                f = attrs.evolve(f, jitter=_time(words[i], "delay jitter"))
                i += 1
        elif w == "loss" and nxt is not None:
            m = re.match(r"^(\d+(?:\.\d+)?)%$", nxt)
            if not m or float(m.group(1)) > 100:
                raise SettingError(f"loss: {nxt!r} is not a percentage (e.g. 5%)")
            f = attrs.evolve(f, loss=float(m.group(1)) / 100)
            i += 2
        elif w == "rto" and nxt is not None:
            f = attrs.evolve(f, rto=_time(nxt, "rto"))
            i += 2
        elif w == "rate" and nxt is not None:
            m = _RATE_RE.match(nxt)
            if not m or float(m.group(1)) <= 0:
                raise SettingError(f"rate: {nxt!r} is not a rate (e.g. 1mbit, 100kbps)")
            f = attrs.evolve(f, rate=float(m.group(1)) * _RATE_UNITS[m.group(2)])
            i += 2
        else:
            raise SettingError(
                f"{w!r}: expected delay D [J], loss P%, rto T, rate R, blackhole, cut [N] "
                f"or clear (in {text!r})"
            )
    return f


class _Conn:
    """One proxied connection: the two streams and the bytes each direction carried."""

    def __init__(self, client: trio.SocketStream, server: trio.SocketStream) -> None:
        self.client = client
        self.server = server
        self.sent = {"to_server": 0, "to_client": 0}
        #: bytes left before the cut, per direction (None: no cut pending)
        self.budget: dict[str, int | None] = {"to_server": None, "to_client": None}
        self.scope = trio.CancelScope()
        self.cut = False


class FaultProxy:
    """Forwards connections made to :attr:`port` (127.0.0.1) to ``target``, through the
    current faults (see the module docstring). Change them at any time with
    :meth:`set`, :meth:`apply` (a setting string) or :meth:`cut`; they apply to open
    connections from the next chunk on.

    ``seed`` makes the jitter and loss draws repeatable.
    """

    def __init__(self, target_host: str, target_port: int, *, seed: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.faults = Faults()
        self.port = 0
        self.conns: set[_Conn] = set()
        #: connections accepted, those closed by a cut, chunks stalled as lost
        #: (figures for reports)
        self.accepted = 0
        self.cuts = 0
        self.stalls = 0
        self._rng = random.Random(seed)
        self._changed = trio.Event()

    # -- control --------------------------------------------------------------------------------
    def set(self, faults: Faults) -> None:
        """Apply ``faults`` from now on (open connections too)."""
        self.faults = faults
        self._changed.set()
        self._changed = trio.Event()

    def apply(self, text: str) -> None:
        """Apply a setting string (:func:`parse_setting`; SettingError if bad)."""
        setting = parse_setting(text, self.faults)
        if isinstance(setting, Cut):
            self.cut(setting.after, setting.direction)
        else:
            self.set(setting)

    def cut(self, after: int | None = None, direction: Direction = "to_server") -> None:
        """Close every open connection on both sides: at once, or once ``after`` more
        bytes have gone ``direction`` (per connection; ``both``: either direction)."""
        for conn in list(self.conns):
            if after is None:
                self._close(conn, cut=True)
            else:
                dirs = ("to_server", "to_client") if direction == "both" else (direction,)
                for d in dirs:
                    conn.budget[d] = after
                if after == 0:
                    self._close(conn, cut=True)

    def _close(self, conn: _Conn, *, cut: bool = False) -> None:
        if cut and not conn.cut:
            conn.cut = True
            self.cuts += 1
        conn.scope.cancel()

    # -- serving --------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1 (an ephemeral port), report the port through
        ``task_status`` and forward connections until cancelled.

        Resource handling: cancelling it closes the listener and every connection.
        Error handling: a target that refuses or is unreachable closes the accepted
        connection (the client sees EOF, as if the remote end went away); nothing a
        peer does ends the proxy.
        """
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        while self.faults.blackhole:
            # A connection opened into a black hole waits, unread, until it ends: as
            # a SYN retransmitted until the link is back, its first bytes are late,
            # not lost.
            await self._changed.wait()
        try:
            server = await trio.open_tcp_stream(*self.target)
        except OSError:
            await trio.aclose_forcefully(client)
            return
        conn = _Conn(client, server)
        self.conns.add(conn)
        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    for src, dst, d in (
                        (client, server, "to_server"),
                        (server, client, "to_client"),
                    ):
                        send, recv = trio.open_memory_channel[tuple[float, bytes]](QUEUE_CHUNKS)
                        nursery.start_soon(self._reader, conn, src, send, d)
                        nursery.start_soon(self._writer, conn, dst, recv, d)
        finally:
            self.conns.discard(conn)
            # Each close checkpoints, and under an outer cancellation the first one
            # raises Cancelled: the second must not depend on it returning.
            try:
                await trio.aclose_forcefully(client)
            finally:
                await trio.aclose_forcefully(server)

    async def _reader(
        self,
        conn: _Conn,
        src: trio.SocketStream,
        send: trio.MemorySendChannel[tuple[float, bytes]],
        direction: str,
    ) -> None:
        """Read chunks and time them: due = arrival + delay ± jitter (+ rto if lost),
        never before the chunk ahead, never faster than the rate cap."""
        last_due = 0.0
        async with send:
            while True:
                try:
                    data = await src.receive_some(CHUNK)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    if self.faults.blackhole:
                        return  # the FIN is swallowed too: the other side stays open
                    # The peer closed its side: so does the proxy (both sides), as a
                    # relayed FIN followed by close would; queued chunks go first.
                    await send.send((-1.0, b""))
                    return
                f = self.faults
                if f.blackhole:
                    continue
                now = trio.current_time()
                due = now + f.delay
                if f.jitter:
                    due += self._rng.uniform(-f.jitter, f.jitter)
                if f.loss and self._rng.random() < f.loss:
                    self.stalls += 1
                    due += f.rto
                if f.rate is not None:
                    # The link is busy until the chunk ahead has gone out.
                    due = max(due, max(now, last_due) + len(data) / f.rate)
                due = max(due, now, last_due)
                last_due = due
                await send.send((due, data))

    async def _writer(
        self,
        conn: _Conn,
        dst: trio.SocketStream,
        recv: trio.MemoryReceiveChannel[tuple[float, bytes]],
        direction: str,
    ) -> None:
        async with recv:
            async for due, chunk in recv:
                data = chunk
                if not data:
                    self._close(conn)
                    return
                await trio.sleep_until(due)
                if self.faults.blackhole:
                    continue  # swallowed after it was read: the fault started meanwhile
                budget = conn.budget[direction]
                if budget is not None:
                    data = data[:budget]
                    conn.budget[direction] = budget - len(data)
                try:
                    if data:
                        await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._close(conn)
                    return
                conn.sent[direction] += len(data)
                if conn.budget[direction] == 0:
                    self._close(conn, cut=True)
                    return


async def _main_async(host: str, port: int, out: Callable[[str], None]) -> None:
    proxy = FaultProxy(host, port)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        out(f"listening tcp://127.0.0.1:{proxy.port}")
        stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
        buf = b""
        while True:
            data = await stdin.receive_some(4096)
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode("utf-8", "replace").strip()
                if not text:
                    continue
                try:
                    proxy.apply(text)
                except SettingError as exc:
                    out(f"error {exc}")
                else:
                    out(f"ok {text}")
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """``python -m msgq_trio.scenario.faultproxy HOST:PORT``: proxy to HOST:PORT, print
    ``listening tcp://127.0.0.1:PORT``, then read one setting per stdin line (answering
    ``ok ...`` or ``error ...``) until stdin closes."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or ":" not in args[0]:
        print("usage: python -m msgq_trio.scenario.faultproxy HOST:PORT", file=sys.stderr)
        return 2
    host, _, port = args[0].rpartition(":")
    if not port.isdigit():
        print(f"{args[0]!r}: the port must be a number", file=sys.stderr)
        return 2

    def out(line: str) -> None:
        print(line, flush=True)

    trio.run(_main_async, host, int(port), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["Cut", "FaultProxy", "Faults", "SettingError", "main", "parse_setting"]
