"""The broker core's routing of a bound group (``bind``, transparent queue insertion),
driven with frames, without sockets: what goes to the binder, what is routed as without
the binding, and how descriptors to a bound group are refused (docs/PROTOCOL.md, ``bind``).
The same rules end to end, with the queue plugin: tests/plugins/test_queue_insertion.py."""

from __future__ import annotations

import random
from typing import Any

import pytest

from msgq_trio.config import Limits
from msgq_trio.core.broker import Broker
from msgq_trio.core.peers import Peer
from msgq_trio.protocol.codes import ErrorCode, Flag, FrameType
from msgq_trio.protocol.framing import FdBuffer, Frame, FrameParser, encode_cbor, encode_frame

T = FrameType


def frame(ftype: int, fds: tuple[int, ...] = (), **kw: Any) -> Frame:
    p = FrameParser()
    p.feed(b"".join(bytes(x) for x in encode_frame(ftype, n_fds=len(fds), **kw)))
    f = p.next_frame()
    assert f is not None
    return f._replace(fds=fds)


def out(peer: Peer) -> list[Frame]:
    """Take and parse everything queued for ``peer``."""
    bufs, n = peer.take_outgoing() if peer.outq else ([], 0)
    peer.sent(n)
    p = FrameParser()
    p.feed(b"".join(bytes(b) for b in bufs))
    frames = []
    while (f := p.next_frame()) is not None:
        frames.append(f)
    return frames


class Bound:
    """A broker core with group ``G`` (members m0, m1 in that order) bound to ``binder``,
    a producer, and the descriptors the broker closed."""

    def __init__(self) -> None:
        self.closed: list[int] = []
        self._rid = 0
        b = self.broker = Broker(
            Limits(),
            version="test",
            rng=random.Random(7),
            dup_fd=lambda fd: fd + 1000,
            close_fd=self.closed.append,
        )
        self.binder, self.m0, self.m1, self.producer = (
            b.connect(n, pid=1, uid=1, gid=1, now=0.0) for n in ("binder", "m0", "m1", "producer")
        )
        for m in (self.m0, self.m1):
            self.call(m, "msgq", "subscribe", {"group": "G"})
        bound = self.call(self.binder, "msgq", "bind", {"group": "G"})
        assert bound is not None and bound.body() is True

    def call(
        self,
        peer: Peer,
        target: str,
        cmd: str,
        params: object = None,
        flags: int = 0,
        fds: tuple[int, ...] = (),
    ) -> Frame | None:
        """Send a REQUEST; returns the first frame queued for ``peer`` at once (an
        answer or ROUTED), None if it went on without one."""
        self._rid += 1
        self.broker.handle(
            peer,
            frame(
                T.REQUEST,
                target=target,
                request_id=self._rid,
                flags=flags,
                header=encode_cbor({"cmd": cmd}),
                body=encode_cbor(params),
                fds=fds,
            ),
            0.0,
        )
        got = out(peer)
        return got[0] if got else None

    def send(
        self, peer: Peer, ftype: int, target: str, body: object, fds: tuple[int, ...] = ()
    ) -> None:
        header = encode_cbor({"event": "e"}) if ftype == T.NOTIFY else b""
        self.broker.handle(
            peer, frame(ftype, target=target, header=header, body=encode_cbor(body), fds=fds), 0.0
        )

    def received(self) -> dict[str, list[tuple[int, str, object]]]:
        """What the binder and each member got: (type, target, body) per frame."""
        return {
            p.name: [(f.type, f.target, f.body()) for f in out(p)]
            for p in (self.binder, self.m0, self.m1)
        }


@pytest.fixture
def g() -> Bound:
    return Bound()


def test_messages_and_requests_to_g_and_anycast_go_to_the_binder(g: Bound) -> None:
    g.send(g.producer, T.MESSAGE, "G", 1)
    g.send(g.producer, T.MESSAGE, "G[?]", 2)
    g.call(g.producer, "G", "x", 3)
    g.call(g.producer, "G[?]", "x", 4)
    assert g.received() == {
        "binder": [
            (T.MESSAGE, "G", 1),
            (T.MESSAGE, "G[?]", 2),
            (T.REQUEST, "G", 3),
            (T.REQUEST, "G[?]", 4),
        ],
        "m0": [],
        "m1": [],
    }


def test_notify_instances_and_call_all_are_not_redirected(g: Bound) -> None:
    """NOTIFY reaches the subscribers, ``G[N]`` that instance, an ALL request every
    member (ROUTED names the members, not the binder)."""
    g.send(g.producer, T.NOTIFY, "G", "n")
    g.send(g.producer, T.MESSAGE, "G[1]", "to-1")
    g.call(g.producer, "G[0]", "x", "call-0")
    routed = g.call(g.producer, "G", "x", "all", flags=int(Flag.ALL))
    assert routed is not None and routed.type == T.ROUTED
    assert routed.header()["to"] == [[g.m0.lname, "m0"], [g.m1.lname, "m1"]]
    assert g.received() == {
        "binder": [],
        "m0": [(T.NOTIFY, "G", "n"), (T.REQUEST, "G[0]", "call-0"), (T.REQUEST, "G", "all")],
        "m1": [(T.NOTIFY, "G", "n"), (T.MESSAGE, "G[1]", "to-1"), (T.REQUEST, "G", "all")],
    }


def test_the_binder_reaches_the_members(g: Bound) -> None:
    g.send(g.binder, T.MESSAGE, "G", "fwd")
    g.call(g.binder, g.m1.lname, "x", "req")
    assert g.received() == {
        "binder": [],
        "m0": [(T.MESSAGE, "G", "fwd")],
        "m1": [(T.MESSAGE, "G", "fwd"), (T.REQUEST, g.m1.lname, "req")],
    }


def test_request_with_fds_to_a_bound_group_is_refused(g: Bound) -> None:
    """bad-request naming the binding; nobody gets it, the broker's copy is closed.
    To ``G[N]`` the descriptor goes through."""
    err = g.call(g.producer, "G[?]", "x", 1, fds=(7,))
    assert err is not None and err.type == T.ERROR and err.header()["code"] == ErrorCode.BAD_REQUEST
    assert "'G[?]' is bound to l.1" in str(err.header()["message"])
    assert g.closed == [7]
    g.call(g.producer, "G[1]", "x", 2, fds=(8,))
    assert [fd for b in g.m1.outq if isinstance(b, FdBuffer) for fd in b.fds] == [1008]
    assert [f.body() for f in out(g.m1)] == [2] and g.closed == [7, 8]
    assert out(g.binder) == out(g.m0) == []


def test_message_with_fds_to_a_bound_group_drops_the_sender(g: Bound) -> None:
    """A one-way message cannot be answered: refused like a forbidden one, the sender is
    dropped with ERROR forbidden naming the binding; nobody gets it."""
    g.send(g.producer, T.MESSAGE, "G", "x", fds=(9,))
    [(peer, code, message)] = g.broker.effects.kicks
    assert (peer, code) == (g.producer, ErrorCode.FORBIDDEN) and not peer.alive
    assert "'G' is bound to l.1" in message and "file descriptors" in message
    assert g.closed == [9]
    assert g.received() == {"binder": [], "m0": [], "m1": []}


def relayed(by: Peer, origin: bytes = b"l.99\0radius") -> bytes:
    return by.stamp + b"\0" + origin


@pytest.mark.parametrize("target", ["G", "G[?]", "G[1]", "m1"])
def test_the_binder_may_relay_on_behalf_of_a_producer(g: Bound, target: str) -> None:
    """A relayed stamp (binder's stamp, NUL, origin lname, NUL, origin name) from the
    binder to its group, to an instance or anycast of it, or to a member's lname is
    forwarded as written: members see the producer, via the binder."""
    to = g.m1.lname if target == "m1" else target
    g.broker.handle(
        g.binder, frame(T.MESSAGE, target=to, body=encode_cbor("m"), source=relayed(g.binder)), 0.0
    )
    if target != "G":  # a single-answer request to G with two members is refused
        g.broker.handle(
            g.binder,
            frame(
                T.REQUEST,
                target=to,
                request_id=5,
                header=encode_cbor({"cmd": "x"}),
                body=encode_cbor("r"),
                source=relayed(g.binder),
            ),
            0.0,
        )
    got = {p: out(p) for p in (g.m0, g.m1)}
    frames = [f for fs in got.values() for f in fs]
    assert len(frames) == 2  # G: the message to each member; else message and request
    assert all(f.source == relayed(g.binder) for f in frames)
    if target != "G":
        # The answer goes to the binder (the first lname), which has the call pending.
        [callee] = [p for p, fs in got.items() if any(f.type == T.REQUEST for f in fs)]
        g.broker.handle(
            callee, frame(T.REPLY, target=g.binder.lname, request_id=5, body=encode_cbor("ok")), 0.0
        )
        [answer] = out(g.binder)
        assert (answer.type, answer.body()) == (T.REPLY, "ok")


@pytest.mark.parametrize(
    "case",
    ["not-a-binder", "other-group", "non-member-lname", "not-its-stamp", "bad-origin", "bad-utf8"],
)
def test_relayed_stamps_are_replaced_where_not_allowed(g: Bound, case: str) -> None:
    """Anyone but the binder of the target's group, or a malformed origin, gets its own
    stamp, as with any source a client writes that is not its own (receivers can trust
    the sender): a relay gives a binder no say over traffic it could not see anyway."""
    sender, target, source = g.binder, "G", relayed(g.binder)
    if case == "not-a-binder":
        sender, source = g.producer, relayed(g.producer)
    elif case == "other-group":
        g.call(g.m0, "msgq", "subscribe", {"group": "H"})
        target = "H"
    elif case == "non-member-lname":
        target = g.producer.lname
    elif case == "not-its-stamp":
        source = relayed(g.m0)
    elif case == "bad-origin":
        source = relayed(g.binder, b"x.99\0radius")
    else:
        source = relayed(g.binder, b"l.99\0\xff")
    g.broker.handle(
        sender, frame(T.MESSAGE, target=target, body=encode_cbor("m"), source=source), 0.0
    )
    got = [f for p in (g.m0, g.m1, g.producer, g.binder) for f in out(p)]
    assert got and all(f.source == sender.stamp for f in got)
