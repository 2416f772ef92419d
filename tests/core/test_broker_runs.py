"""Self-stamped frames and runs (docs/PROTOCOL.md "Source"): a frame whose source section
already holds the sender's stamp is forwarded as it is, one with any other source is
restamped, and runs of such MESSAGE frames are queued as one buffer per member with the
same order, stamps, bounds and counters as frame-by-frame handling."""

from __future__ import annotations

import random

import pytest

from msgq_trio.config import Limits
from msgq_trio.core.broker import Broker
from msgq_trio.core.peers import Peer
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.connection import Connection, Role
from msgq_trio.protocol.errors import RemoteProtocolError
from msgq_trio.protocol.framing import (
    Frame,
    FrameParser,
    Run,
    encode_cbor,
    encode_frame,
    encode_simple,
)

T = FrameType


def make(**limits: object) -> Broker:
    return Broker(Limits(**limits), version="test", rng=random.Random(7))  # type: ignore[arg-type]


def connect(b: Broker, name: str) -> Peer:
    return b.connect(name, pid=1, uid=1, gid=1, now=0.0)


def subscribe(b: Broker, p: Peer, group: str) -> None:
    b.router.subscribe(p, group)


def drain(p: Peer) -> list[Frame]:
    bufs, n = p.take_outgoing()
    p.sent(n)
    parser = FrameParser()
    parser.feed(b"".join(bytes(x) for x in bufs))
    out = parser.frames()
    assert parser.buffered == 0
    return out


def msg(target: str, body: object, source: bytes = b"") -> bytes:
    return encode_simple(T.MESSAGE, target.encode(), encode_cbor(body), source=source)


def ready_connection() -> Connection:
    conn = Connection(Role.BROKER)
    conn.receive_data(b"".join(bytes(x) for x in Connection(Role.CLIENT).hello("c")))
    assert conn.next_event() is not None
    conn.check_send(T.WELCOME)
    return conn


def test_self_stamped_frame_is_forwarded_unchanged() -> None:
    """A MESSAGE carrying exactly the sender's stamp is queued as the very bytes received."""
    b = make()
    rx, tx = connect(b, "rx"), connect(b, "tx")
    subscribe(b, rx, "G")
    data = msg("G", "hi", tx.stamp)
    parser = FrameParser()
    parser.feed(data)
    [f] = parser.frames()
    assert b.handle_many(tx, [f], 0.0) == 1
    assert list(rx.outq) == [data] and rx.outq[0] is f.raw
    [g] = drain(rx)
    assert (g.source, g.body()) == (b"l.2\0tx", "hi")


def test_wrong_or_missing_source_is_replaced() -> None:
    """Another client's stamp, a broker stamp, a stamp with another name or no source at all
    (an older client): the receiver sees the sender's true stamp, in runs and frames."""
    b = make()
    rx, tx = connect(b, "rx"), connect(b, "tx")
    subscribe(b, rx, "G")
    conn = ready_connection()
    sources = [rx.stamp, b"l.0\0msgq", b"l.2\0admin", b"", b"l.2", tx.stamp]
    conn.receive_data(b"".join(msg("G", i, s) for i, s in enumerate(sources)))
    items = conn.events_with_runs(tx.stamp)
    assert b.handle_many(tx, items, 0.0) == len(items)  # type: ignore[arg-type]
    got = drain(rx)
    assert [(f.source, f.body()) for f in got] == [(b"l.2\0tx", i) for i in range(6)]


def test_mixed_batch_keeps_order_and_stamps() -> None:
    """Random batches of self-stamped, forged and unstamped MESSAGEs to groups, lnames and
    nobody, with requests in between, cut at random points: every receiver gets the same
    frames in the same order as with frame-by-frame handle(), and the counters agree."""
    rng = random.Random(3)
    for _ in range(20):
        stream: list[bytes] = []
        for i in range(rng.randint(1, 80)):
            target = rng.choice(["G", "G", "H", "l.1", "Nobody", "G[0]"])
            k = rng.random()
            if k < 0.1:
                stream.append(
                    encode_simple(
                        T.REQUEST,
                        target.encode(),
                        b"",
                        encode_cbor({"cmd": "c"}),
                        request_id=i + 1,
                        source=rng.choice([b"", b"l.3\0tx"]),
                    )
                )
            else:
                source = b"l.3\0tx" if k < 0.8 else rng.choice([b"", b"l.1\0rx", b"x"])
                stream.append(msg(target, i, source))
        data = b"".join(stream)
        cuts = sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1)))

        def run(
            batched: bool, data: bytes = data, cuts: list[int] = cuts
        ) -> tuple[list[list[tuple[int, str, bytes, object]]], object]:
            b = make()
            rx1, rx2, tx = connect(b, "rx1"), connect(b, "rx2"), connect(b, "tx")
            for p, g in ((rx1, "G"), (rx2, "G"), (tx, "G"), (rx2, "H")):
                subscribe(b, p, g)
            conn = ready_connection()
            for a, z in zip([0, *cuts], [*cuts, len(data)], strict=True):
                conn.receive_data(data[a:z])
                if batched:
                    items = conn.events_with_runs(tx.stamp)
                    assert b.handle_many(tx, items, 0.0) == len(items)  # type: ignore[arg-type]
                else:
                    for f in conn.events():
                        assert b.handle(tx, f, 0.0)  # type: ignore[arg-type]
            queues = [
                [(f.type, f.target, f.source, f.body()) for f in drain(p)] for p in (rx1, rx2, tx)
            ]
            counts = (tx.msgs_in, rx1.msgs_out, rx2.msgs_out, b.stats["no_recipient"], len(b.rpc))
            return queues, counts

        assert run(batched=True) == run(batched=False)


def test_run_that_does_not_fit_is_held_at_the_exact_frame() -> None:
    """A run one member has no room for is handled frame by frame: the frames that fit are
    delivered, the sender is held at the first that does not, and once the member drained
    the rest follows, each frame once and in order."""
    b = make(max_frame_size=1024, out_soft_limit=1500, out_hard_limit=2048)
    rx, tx = connect(b, "rx"), connect(b, "tx")
    subscribe(b, rx, "G")
    conn = ready_connection()
    conn.receive_data(b"".join(msg("G", [i, "x" * 300], tx.stamp) for i in range(12)))
    items: list[Frame | Run] = conn.events_with_runs(tx.stamp)  # type: ignore[assignment]
    assert len(items) == 1 and isinstance(items[0], Run) and items[0].count == 12
    got: list[int] = []
    while items:
        done = b.handle_many(tx, items, 0.0)
        assert 0 < done <= len(items) or got  # progress whenever rx was drained
        if done < len(items):
            assert b.effects.hold.receivers == [rx]
            assert rx.outq_bytes + b.effects.hold.size > 2048
        items = items[done:]
        got.extend(f.body()[0] for f in drain(rx))  # type: ignore[index]
    assert got == list(range(12))
    assert tx.msgs_in == 12 and rx.msgs_out == 12 and rx.alive


def test_capture_sees_every_frame_of_a_run() -> None:
    """With the capture tap on, a run is still delivered as one buffer per member, and
    the tap sees each of its messages in order (also a run that reaches no one)."""
    b = make()
    rx, tx = connect(b, "rx"), connect(b, "tx")
    subscribe(b, rx, "G")
    seen: list[object] = []
    conn = ready_connection()
    conn.receive_data(
        b"".join(msg("G", i, tx.stamp) for i in range(5))
        + b"".join(msg("Nobody", i, tx.stamp) for i in range(5, 8))
    )
    items = conn.events_with_runs(tx.stamp)
    assert [type(i).__name__ for i in items] == ["Run", "Run"]
    b.tap = lambda _p, f, outcome, n: seen.append((f.target, f.body(), outcome, n))
    assert b.handle_many(tx, items, 0.0) == len(items)  # type: ignore[arg-type]
    assert seen == (
        [("G", i, "delivered", 1) for i in range(5)]
        + [("Nobody", i, "no-recipient", 0) for i in range(5, 8)]
    )
    assert len(rx.outq) == 1  # the run, as one buffer
    assert [f.body() for f in drain(rx)] == list(range(5))
    assert tx.msgs_in == 8 and rx.msgs_out == 5


def test_large_self_stamped_frame_is_not_copied() -> None:
    """A self-stamped frame of 256 KiB or more is queued as its small head plus a view of
    the received buffer (no copy of the payload, also per recipient when it has fds)."""
    b = Broker(Limits(), version="test", dup_fd=lambda fd: fd + 100, close_fd=lambda fd: None)
    r1, r2, tx = connect(b, "r1"), connect(b, "r2"), connect(b, "tx")
    subscribe(b, r1, "G")
    subscribe(b, r2, "G")
    payload = bytes(300 * 1024)
    parser = FrameParser()
    parser.feed(
        b"".join(
            bytes(x)
            for x in encode_frame(
                T.MESSAGE, target="G", body=encode_cbor(payload), source=tx.stamp, n_fds=1
            )
        )
    )
    [f] = parser.frames()
    f = f._replace(fds=(7,))
    assert b.handle_many(tx, [f], 0.0) == 1
    for r in (r1, r2):
        head, rest = r.outq
        assert len(head) == f.tail and type(rest) is memoryview
        assert head.fds == (107,)  # type: ignore[union-attr]
        [g] = drain(r)
        assert (g.source, g.body()) == (tx.stamp, payload)


def test_a_run_beside_a_frame_declaring_descriptors() -> None:
    """Runs go through the descriptor matching when a frame of the same receive declares
    descriptors: a run carries none (and no body received apart), so a descriptor that
    never came is the frame's protocol error, not a fault in the matching."""
    conn = ready_connection()
    stamp = b"l.2\0tx"
    with_fd = b"".join(
        bytes(x) for x in encode_frame(T.MESSAGE, target="G", body=encode_cbor(9), n_fds=1)
    )
    conn.receive_data(b"".join(msg("G", i, stamp) for i in range(3)) + with_fd)
    with pytest.raises(RemoteProtocolError, match="descriptor"):
        conn.events_with_runs(stamp)


def test_a_run_before_a_frame_too_large() -> None:
    """Frames before a malformed one are returned first (the error comes with the next
    call), and the parser then makes no claim about them, descriptors included: a run
    among them goes through the descriptor matching and comes out whole."""
    conn = Connection(Role.BROKER, max_frame_size=4096)
    conn.receive_data(b"".join(bytes(x) for x in Connection(Role.CLIENT).hello("c")))
    assert conn.next_event() is not None
    conn.check_send(T.WELCOME)
    stamp = b"l.2\0tx"
    too_large = (8192).to_bytes(4, "big") + bytes(28)
    conn.receive_data(b"".join(msg("G", i, stamp) for i in range(3)) + too_large)
    items = conn.events_with_runs(stamp)
    assert [type(i).__name__ for i in items] == ["Run"] and items[0].count == 3  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError, match="frame length"):
        conn.events_with_runs(stamp)
