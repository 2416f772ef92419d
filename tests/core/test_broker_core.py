"""Unit tests of msgq_trio.core.broker.Broker driven directly with frames: no sockets, no
trio, time passed as an argument (request timeouts are tested without sleeping)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from msgq_trio.config import Limits
from msgq_trio.core.broker import Broker
from msgq_trio.core.peers import Peer
from msgq_trio.protocol.codes import ErrorCode, Flag, FrameType
from msgq_trio.protocol.errors import RemoteProtocolError
from msgq_trio.protocol.framing import Frame, FrameParser, Run, encode_cbor, encode_frame

T = FrameType
BROKER_STAMP = b"l.0\0msgq"


def frame(ftype: int, fds: tuple[int, ...] = (), **kw: Any) -> Frame:
    p = FrameParser()
    p.feed(b"".join(bytes(x) for x in encode_frame(ftype, n_fds=len(fds), **kw)))
    f = p.next_frame()
    assert f is not None
    return f._replace(fds=fds)


class Bench:
    """A broker core plus helpers to speak to it like clients do."""

    def __init__(self, **limits: Any) -> None:
        self.broker = Broker(Limits(**limits), version="test", rng=random.Random(7))
        self._rid: dict[int, int] = {}
        self._backlog: dict[int, list[Frame]] = {}

    def connect(self, name: str, now: float = 0.0) -> Peer:
        return self.broker.connect(name, pid=4000 + len(self.broker.peers), uid=1, gid=1, now=now)

    def handle(self, peer: Peer, ftype: int, now: float = 0.0, **kw: Any) -> None:
        self.broker.handle(peer, frame(ftype, **kw), now)

    def message(self, peer: Peer, target: str, body: object = None, **kw: Any) -> None:
        self.handle(
            peer,
            T.MESSAGE,
            target=target,
            body=encode_cbor(body) if body is not None else b"",
            **kw,
        )

    def request(
        self,
        peer: Peer,
        target: str,
        cmd: str,
        params: object = None,
        *,
        now: float = 0.0,
        rid: int | None = None,
        flags: int = 0,
        header: dict[str, object] | None = None,
        **kw: Any,
    ) -> int:
        if rid is None:
            rid = self._rid.get(peer.id, 0) + 1
            self._rid[peer.id] = rid
        h = {"cmd": cmd, **(header or {})}
        self.handle(
            peer,
            T.REQUEST,
            now=now,
            target=target,
            request_id=rid,
            flags=flags,
            header=encode_cbor(h),
            body=encode_cbor(params) if params is not None else b"",
            **kw,
        )
        return rid

    def reply(self, callee: Peer, req: Frame, result: object, now: float = 0.0) -> None:
        caller = req.source.split(b"\0")[0].decode()
        self.handle(
            callee,
            T.REPLY,
            now=now,
            target=caller,
            request_id=req.request_id,
            body=encode_cbor(result),
        )

    def out(self, peer: Peer) -> list[Frame]:
        """Take and parse everything queued for ``peer`` (after frames set aside earlier)."""
        bufs, n = peer.take_outgoing()
        peer.sent(n)
        p = FrameParser()
        p.feed(b"".join(bytes(b) for b in bufs))
        frames = self._backlog.pop(peer.id, [])
        while (f := p.next_frame()) is not None:
            frames.append(f)
        assert p.buffered == 0
        return frames

    def call_broker(self, peer: Peer, cmd: str, params: object = None) -> Frame:
        """Call a broker command; other frames queued meanwhile stay for the next out()."""
        rid = self.request(peer, "msgq", cmd, params)
        frames = self.out(peer)
        [answer] = [f for f in frames if f.request_id == rid and f.type in (T.REPLY, T.ERROR)]
        self._backlog[peer.id] = [f for f in frames if f is not answer]
        assert answer.source == BROKER_STAMP
        return answer

    def subscribe(self, peer: Peer, group: str) -> None:
        answer = self.call_broker(peer, "subscribe", {"group": group})
        assert answer.type == T.REPLY, answer.header()


@pytest.fixture
def bench() -> Bench:
    return Bench()


def error_code(f: Frame) -> str:
    assert f.type == T.ERROR, f
    return str(f.header()["code"])


# -- connections --------------------------------------------------------------------------------
def test_lnames_are_unique_and_never_reused(bench: Bench) -> None:
    """connect() assigns l.1, l.2, ... and never hands out an lname again after a disconnect."""
    seen = []
    for i in range(50):
        p = bench.connect(f"c{i}")
        seen.append(p.lname)
        if i % 2:
            bench.broker.disconnect(p, "closed")
    assert seen == [f"l.{i}" for i in range(1, 51)]
    assert bench.connect("late").lname == "l.51"


def test_welcome_header(bench: Bench) -> None:
    """WELCOME names the peer's lname, the protocol version and the limits."""
    p = bench.connect("x")
    w = bench.broker.welcome(p)
    assert w["lname"] == p.lname
    assert w["version"] == 1
    assert w["limits"]["request_timeout"] == 300.0  # type: ignore[index]


def test_disconnect_is_idempotent(bench: Bench) -> None:
    """Disconnecting twice publishes one set of events and leaves no state behind."""
    w = bench.connect("watch")
    bench.subscribe(w, "msgq.membership")
    p = bench.connect("p")
    bench.subscribe(p, "G")
    bench.out(w)
    bench.broker.disconnect(p, "closed")
    bench.broker.disconnect(p, "closed")
    assert [f.header()["event"] for f in bench.out(w)] == ["unsubscribed", "disconnected"]
    bench.broker.disconnect(w, "closed")
    bench.broker.check_empty()


# -- one-way routing ------------------------------------------------------------------------------
def test_group_message_reaches_every_member_but_the_sender(bench: Bench) -> None:
    """A MESSAGE to a group is queued for every member except the sender, stamped with the
    sender's true lname and name, body untouched."""
    a, b, c = bench.connect("A"), bench.connect("B"), bench.connect("C")
    for p in (a, b, c):
        bench.subscribe(p, "G")
    bench.message(b, "G", {"n": 1})
    assert bench.out(b) == []
    for p in (a, c):
        [f] = bench.out(p)
        assert (f.type, f.target, f.source, f.body()) == (T.MESSAGE, "G", b"l.2\0B", {"n": 1})


def test_forged_source_is_replaced(bench: Bench) -> None:
    """Whatever source section a client writes, receivers see the broker's stamp."""
    a, b = bench.connect("honest"), bench.connect("forger")
    bench.subscribe(a, "G")
    bench.message(b, "G", "hi", source=b"l.1\0admin")
    [f] = bench.out(a)
    assert f.source == b"l.2\0forger"
    bench.request(b, "l.1", "cmd", source=b"l.0\0msgq")
    [req] = bench.out(a)
    assert req.source == b"l.2\0forger"


def test_direct_instance_and_anycast_messages(bench: Bench) -> None:
    """l.N, G[N] (join order; G[0] moves on when the first member leaves) and G[?]."""
    s = bench.connect("sender")
    ws = [bench.connect(f"w{i}") for i in range(3)]
    for w in ws:
        bench.subscribe(w, "W")
    bench.message(s, ws[2].lname, "direct")
    assert [f.body() for f in bench.out(ws[2])] == ["direct"]
    bench.message(s, "W[1]", "one")
    assert [f.body() for f in bench.out(ws[1])] == ["one"]
    assert bench.out(ws[0]) == [] and bench.out(ws[2]) == []
    bench.broker.disconnect(ws[0], "closed")
    bench.message(s, "W[0]", "zero")
    assert [f.body() for f in bench.out(ws[1])] == ["zero"]
    counts = {w.lname: 0 for w in ws[1:]}
    for i in range(200):
        bench.message(s, "W[?]", i)
    for w in ws[1:]:
        counts[w.lname] = len(bench.out(w))
    assert sum(counts.values()) == 200
    assert min(counts.values()) > 50, counts


def test_message_to_nobody_is_counted(bench: Bench) -> None:
    """A MESSAGE that resolves to nobody is dropped and counted as no_recipient."""
    s = bench.connect("s")
    for t in ("Empty", "l.99", "G[3]", "G[?]", "msgq"):
        bench.message(s, t, "x")
    assert bench.out(s) == []
    assert bench.broker.stats["no_recipient"] == 5


def test_clients_cannot_publish_to_broker_groups(bench: Bench) -> None:
    """Groups starting with 'msgq.' are published by the broker only (docs/PROTOCOL.md): a
    client's MESSAGE to msgq.membership must not reach its subscribers."""
    watcher, forger = bench.connect("watcher"), bench.connect("forger")
    bench.subscribe(watcher, "msgq.membership")
    bench.out(watcher)
    try:
        bench.message(
            forger,
            "msgq.membership",
            {"lname": "l.1", "name": "fake"},
            header=encode_cbor({"event": "disconnected"}),
        )
    except RemoteProtocolError as exc:
        assert exc.code == ErrorCode.FORBIDDEN
    assert [f for f in bench.out(watcher) if f.source != BROKER_STAMP] == []


def test_notify_routing_and_forbidden_targets(bench: Bench) -> None:
    """NOTIFY goes to client groups (sender skipped); to an lname, an instance or a msgq.*
    group it is a FORBIDDEN protocol violation."""
    a, b = bench.connect("a"), bench.connect("b")
    bench.subscribe(a, "Events")
    bench.subscribe(b, "Events")
    bench.handle(
        a,
        T.NOTIFY,
        target="Events",
        header=encode_cbor({"event": "zone-added"}),
        body=encode_cbor({"zone": "x"}),
    )
    [n] = bench.out(b)
    assert (n.type, n.header(), n.body(), n.source) == (
        T.NOTIFY,
        {"event": "zone-added"},
        {"zone": "x"},
        b"l.1\0a",
    )
    assert bench.out(a) == []
    for target in ("msgq.membership", "l.2", "Events[0]", "Events[?]", "msgq"):
        with pytest.raises(RemoteProtocolError) as ei:
            bench.handle(a, T.NOTIFY, target=target, header=encode_cbor({"event": "e"}))
        assert ei.value.code == ErrorCode.FORBIDDEN, target


# -- requests -----------------------------------------------------------------------------------
def test_request_and_reply(bench: Bench) -> None:
    """A REQUEST to a one-member group reaches it stamped; its REPLY reaches the caller
    stamped with the callee; the slot is freed."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    bench.subscribe(callee, "Svc")
    rid = bench.request(caller, "Svc", "add", [1, 2])
    [req] = bench.out(callee)
    assert (req.type, req.request_id, req.source, req.header()["cmd"], req.body()) == (
        T.REQUEST,
        rid,
        b"l.1\0caller",
        "add",
        [1, 2],
    )
    bench.reply(callee, req, 3)
    [rep] = bench.out(caller)
    assert (rep.type, rep.request_id, rep.source, rep.body()) == (T.REPLY, rid, b"l.2\0callee", 3)
    assert len(bench.broker.rpc) == 0


def test_handler_error_answer_is_forwarded(bench: Bench) -> None:
    """An ERROR answer from the callee (code, message, data) reaches the caller unchanged."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    rid = bench.request(caller, callee.lname, "x")
    assert len(bench.out(callee)) == 1
    bench.handle(
        callee,
        T.ERROR,
        target="l.1",
        request_id=rid,
        header=encode_cbor({"code": "zone-missing", "message": "no"}),
        body=encode_cbor({"zone": "x"}),
    )
    [err] = bench.out(caller)
    assert err.header() == {"code": "zone-missing", "message": "no"}
    assert err.body() == {"zone": "x"}
    assert err.source == b"l.2\0callee"


@pytest.mark.parametrize("target", ["Empty", "l.999", "Svc[5]", "Empty[?]", "l.bogus"])
def test_request_to_nobody(bench: Bench, target: str) -> None:
    """A REQUEST that resolves to nobody is answered at once with no-recipient by the broker."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    bench.subscribe(callee, "Svc")
    rid = bench.request(caller, target, "x")
    [err] = bench.out(caller)
    assert error_code(err) == "no-recipient"
    assert err.request_id == rid
    assert err.header()["broker"] is True
    assert err.source == BROKER_STAMP
    assert len(bench.broker.rpc) == 0


def test_request_to_own_group_only_member(bench: Bench) -> None:
    """A caller that is the only member of the group it calls gets no-recipient."""
    caller = bench.connect("caller")
    bench.subscribe(caller, "Svc")
    bench.request(caller, "Svc", "x")
    [err] = bench.out(caller)
    assert error_code(err) == "no-recipient"


def test_request_to_group_of_two(bench: Bench) -> None:
    """A single-answer REQUEST to a group with two members is refused with
    multiple-recipients and delivered to nobody."""
    caller, a, b = bench.connect("caller"), bench.connect("a"), bench.connect("b")
    bench.subscribe(a, "Svc")
    bench.subscribe(b, "Svc")
    bench.request(caller, "Svc", "x")
    [err] = bench.out(caller)
    assert error_code(err) == "multiple-recipients"
    assert bench.out(a) == [] and bench.out(b) == []
    assert len(bench.broker.rpc) == 0


def test_call_all_routed_then_answers(bench: Bench) -> None:
    """An ALL request: ROUTED names the members (join order, caller excluded) before any
    answer; each member's answer is forwarded; the slot is freed after the last one."""
    caller = bench.connect("caller")
    members = [bench.connect(f"m{i}") for i in range(3)]
    bench.subscribe(members[1], "G")
    bench.subscribe(caller, "G")
    bench.subscribe(members[0], "G")
    bench.subscribe(members[2], "G")
    rid = bench.request(caller, "G", "status", flags=int(Flag.ALL))
    [routed] = bench.out(caller)
    assert routed.type == T.ROUTED and routed.request_id == rid
    assert routed.header()["to"] == [["l.3", "m1"], ["l.2", "m0"], ["l.4", "m2"]]
    reqs = {m.lname: bench.out(m) for m in members}
    for m in members:
        [req] = reqs[m.lname]
        bench.reply(m, req, m.lname)
    answers = bench.out(caller)
    assert sorted(f.body() for f in answers) == ["l.2", "l.3", "l.4"]
    assert len(bench.broker.rpc) == 0


def test_call_all_member_gone(bench: Bench) -> None:
    """In an ALL call a member that disconnects is answered for with recipient-gone (its
    lname as source), the others' answers still arrive."""
    caller, a, b = bench.connect("caller"), bench.connect("a"), bench.connect("b")
    bench.subscribe(a, "G")
    bench.subscribe(b, "G")
    bench.request(caller, "G", "x", flags=int(Flag.ALL))
    bench.out(caller)
    [req_b] = bench.out(b)
    bench.broker.disconnect(a, "connection-lost")
    bench.reply(b, req_b, "ok")
    frames = bench.out(caller)
    assert [(f.type, f.source) for f in frames] == [(T.ERROR, b"l.2\0a"), (T.REPLY, b"l.3\0b")]
    assert error_code(frames[0]) == "recipient-gone"
    assert len(bench.broker.rpc) == 0


def test_request_timeout_is_deterministic(bench: Bench) -> None:
    """With request_timeout 5 s a call made at t=100 has deadline 105: nothing at 104.9,
    a timeout ERROR (callee as source, broker: true) at 105; the late reply is discarded."""
    b = Bench(request_timeout=5.0)
    caller, callee = b.connect("caller"), b.connect("blackhole")
    b.subscribe(callee, "Svc")
    rid = b.request(caller, "Svc", "slow", now=100.0)
    [req] = b.out(callee)
    assert b.broker.next_deadline() == 105.0
    b.broker.expire(104.9)
    assert b.out(caller) == []
    b.broker.expire(105.0)
    [err] = b.out(caller)
    assert error_code(err) == "timeout"
    assert err.request_id == rid
    assert err.source == b"l.2\0blackhole"
    assert err.header()["broker"] is True
    assert b.broker.stats["timeouts"] == 1
    assert b.broker.next_deadline() is None
    b.reply(callee, req, "too late", now=106.0)
    assert b.out(caller) == []
    assert b.broker.stats["late_answers"] == 1


@pytest.mark.parametrize(
    "timeout,deadline",
    [
        (0.5, 10.5),  # shorter than the broker's: used
        (2, 12.0),  # an int works too
        (500.0, 310.0),  # longer than the broker's: the broker's wins
        (-1.0, 310.0),  # nonsense: ignored
        (0, 310.0),
        (True, 310.0),  # a bool is not a number of seconds
        ("1", 310.0),
    ],
)
def test_caller_timeout_header(bench: Bench, timeout: object, deadline: float) -> None:
    """The REQUEST header's 'timeout' shortens the broker's deadline, never lengthens it,
    and invalid values are ignored."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    bench.request(caller, callee.lname, "x", now=10.0, header={"timeout": timeout})
    assert bench.broker.next_deadline() == deadline


def test_callee_gone_answers_recipient_gone_at_once(bench: Bench) -> None:
    """When the callee disconnects, every caller waiting on it gets recipient-gone
    immediately (no timer), with the callee's stamp as source."""
    c1, c2, callee = bench.connect("c1"), bench.connect("c2"), bench.connect("callee")
    rids = [bench.request(c1, "l.3", "x") for _ in range(3)]
    rid2 = bench.request(c2, "l.3", "y")
    bench.broker.disconnect(callee, "connection-lost")
    errs = bench.out(c1)
    assert sorted(f.request_id for f in errs) == rids
    assert {error_code(f) for f in errs} == {"recipient-gone"}
    assert {f.source for f in errs} == {b"l.3\0callee"}
    [e2] = bench.out(c2)
    assert (error_code(e2), e2.request_id) == ("recipient-gone", rid2)
    assert len(bench.broker.rpc) == 0


def test_caller_gone_late_answer_discarded(bench: Bench) -> None:
    """When the caller disconnects with calls pending, the callee's later answers are
    discarded and nothing leaks."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    bench.request(caller, callee.lname, "x")
    bench.request(caller, callee.lname, "y")
    reqs = bench.out(callee)
    bench.broker.disconnect(caller, "connection-lost")
    for req in reqs:
        bench.reply(callee, req, "late")
    assert bench.broker.stats["late_answers"] == 2
    assert caller.outq_bytes == 0 and not caller.outq
    bench.broker.disconnect(callee, "closed")
    bench.broker.check_empty()


def test_forged_answer_is_not_forwarded(bench: Bench) -> None:
    """A REPLY from a peer that was not asked (same caller lname and request id) is dropped;
    the real callee's answer is still forwarded."""
    caller, callee, intruder = (
        bench.connect("caller"),
        bench.connect("callee"),
        bench.connect("intruder"),
    )
    rid = bench.request(caller, callee.lname, "x")
    [req] = bench.out(callee)
    bench.handle(intruder, T.REPLY, target="l.1", request_id=rid, body=encode_cbor("forged"))
    bench.handle(
        intruder,
        T.ERROR,
        target="l.1",
        request_id=rid,
        header=encode_cbor({"code": "timeout", "message": "forged"}),
    )
    assert bench.out(caller) == []
    bench.reply(callee, req, "real")
    [rep] = bench.out(caller)
    assert rep.body() == "real"


def test_duplicate_pending_request_id(bench: Bench) -> None:
    """A request id still pending for this caller is refused with bad-request; the first
    call is unaffected."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    bench.request(caller, callee.lname, "x", rid=42)
    bench.request(caller, callee.lname, "x", rid=42)
    [err] = bench.out(caller)
    assert (error_code(err), err.request_id) == ("bad-request", 42)
    assert len(bench.out(callee)) == 1
    assert bench.broker.rpc.is_pending(caller, 42)


def test_max_pending_requests() -> None:
    """Past max_pending_requests a caller's REQUEST is refused with limit-exceeded."""
    b = Bench(max_pending_requests=2)
    caller, callee = b.connect("caller"), b.connect("callee")
    b.request(caller, callee.lname, "x")
    b.request(caller, callee.lname, "x")
    rid = b.request(caller, callee.lname, "x")
    [err] = b.out(caller)
    assert (error_code(err), err.request_id) == ("limit-exceeded", rid)
    assert len(b.out(callee)) == 2


@pytest.mark.parametrize(
    "kw",
    [
        {"request_id": 0, "header": encode_cbor({"cmd": "x"})},  # no request id
        {"request_id": 1, "header": b""},  # no cmd
        {"request_id": 1, "header": encode_cbor({"cmd": 5})},  # cmd not a string
        {"request_id": 1, "header": b"\xa1\x61"},  # malformed header
    ],
)
def test_malformed_requests_are_protocol_errors(bench: Bench, kw: dict[str, Any]) -> None:
    """A REQUEST without request id, without a string cmd, or with a malformed header is a
    RemoteProtocolError (the I/O layer drops the client)."""
    caller, callee = bench.connect("caller"), bench.connect("callee")
    with pytest.raises(RemoteProtocolError):
        bench.handle(caller, T.REQUEST, target=callee.lname, **kw)
    assert bench.out(callee) == []


# -- broker commands ----------------------------------------------------------------------------
def test_broker_commands(bench: Bench) -> None:
    """subscribe/unsubscribe (true only when it changed something), members in join order
    with names and pids, version, ping, on both 'msgq' and 'l.0'."""
    a, b = bench.connect("Alpha"), bench.connect("Beta")
    assert bench.call_broker(b, "subscribe", {"group": "G"}).body() is True
    assert bench.call_broker(b, "subscribe", {"group": "G"}).body() is False
    assert bench.call_broker(a, "subscribe", {"group": "G"}).body() is True
    members = bench.call_broker(a, "members", {"group": "G"}).body()
    assert members == [
        {"lname": "l.2", "name": "Beta", "pid": b.pid},
        {"lname": "l.1", "name": "Alpha", "pid": a.pid},
    ]
    assert bench.call_broker(a, "unsubscribe", {"group": "G"}).body() is True
    assert bench.call_broker(a, "unsubscribe", {"group": "G"}).body() is False
    assert bench.call_broker(a, "version").body() == {"broker": "test", "protocol": 1}
    assert bench.call_broker(a, "ping").body() == "pong"
    bench.request(a, "l.0", "ping")
    [pong] = bench.out(a)
    assert pong.body() == "pong"


@pytest.mark.parametrize("group", ["l.7", "msgq", "", "G[0]", "a]", "x" * 256])
def test_subscribe_refuses_reserved_names(bench: Bench, group: str) -> None:
    """Subscribing to a reserved or invalid group name is answered with bad-request."""
    a = bench.connect("a")
    err = bench.call_broker(a, "subscribe", {"group": group})
    assert error_code(err) == "bad-request"
    assert a.groups == {}


@pytest.mark.parametrize("params", [None, "G", {"grp": "G"}, {"group": 5}])
def test_broker_command_bad_params(bench: Bench, params: object) -> None:
    """Broker commands with malformed params answer bad-request."""
    a = bench.connect("a")
    assert error_code(bench.call_broker(a, "subscribe", params)) == "bad-request"


def test_unknown_broker_command(bench: Bench) -> None:
    """An unknown broker command answers unknown-command listing the known ones."""
    a = bench.connect("a")
    err = bench.call_broker(a, "reboot")
    assert error_code(err) == "unknown-command"
    assert "subscribe" in err.body()  # type: ignore[operator]


def test_max_subscriptions() -> None:
    """Past max_subscriptions a subscribe is refused with limit-exceeded; re-subscribing to
    a group already joined is still fine."""
    b = Bench(max_subscriptions=2)
    a = b.connect("a")
    b.subscribe(a, "G1")
    b.subscribe(a, "G2")
    assert error_code(b.call_broker(a, "subscribe", {"group": "G3"})) == "limit-exceeded"
    assert b.call_broker(a, "subscribe", {"group": "G1"}).body() is False


# -- membership notifications ------------------------------------------------------------------
def test_membership_events_in_order(bench: Bench) -> None:
    """msgq.membership subscribers see connected, subscribed, unsubscribed (request),
    then for a dropped client its unsubscriptions (reason disconnect, join order) before
    disconnected."""
    w = bench.connect("watcher")
    bench.subscribe(w, "msgq.membership")
    bench.out(w)
    p = bench.connect("P")
    bench.subscribe(p, "B")
    bench.subscribe(p, "A")
    bench.subscribe(p, "C")
    bench.call_broker(p, "unsubscribe", {"group": "C"})
    bench.broker.disconnect(p, "connection-lost")
    events = [(f.header()["event"], f.body()) for f in bench.out(w)]
    assert events == [
        ("connected", {"lname": "l.2", "name": "P", "pid": p.pid, "uid": 1}),
        ("subscribed", {"lname": "l.2", "name": "P", "group": "B"}),
        ("subscribed", {"lname": "l.2", "name": "P", "group": "A"}),
        ("subscribed", {"lname": "l.2", "name": "P", "group": "C"}),
        ("unsubscribed", {"lname": "l.2", "name": "P", "group": "C", "reason": "request"}),
        ("unsubscribed", {"lname": "l.2", "name": "P", "group": "B", "reason": "disconnect"}),
        ("unsubscribed", {"lname": "l.2", "name": "P", "group": "A", "reason": "disconnect"}),
        ("disconnected", {"lname": "l.2", "name": "P", "reason": "connection-lost"}),
    ]


# -- bounded queues -----------------------------------------------------------------------------
SMALL = {"max_frame_size": 1024, "out_soft_limit": 1500, "out_hard_limit": 2048}


def test_message_to_full_receiver_is_held_not_dropped() -> None:
    """A subscriber that does not drain is marked blocked over the soft limit. A message
    that would push it over the hard limit is *held*: delivered to nobody (not even the
    fast member), handle() says so, ``held`` names the full receiver; once it has drained
    the same frame goes to both. Nobody is dropped by the core for it."""
    b = Bench(**SMALL)
    sender, slow, fast = b.connect("sender"), b.connect("slow"), b.connect("fast")
    b.subscribe(slow, "G")
    b.subscribe(fast, "G")
    payload = "x" * 500
    for _ in range(3):
        b.message(sender, "G", payload)
        b.out(fast)
    assert slow in b.broker.effects.pause
    f = frame(T.MESSAGE, target="G", body=encode_cbor(payload))
    assert b.broker.handle_many(sender, [f], 0.0) == 0
    assert b.broker.effects.hold.receivers == [slow]
    assert b.broker.effects.hold.size > 500
    assert slow.alive and not b.broker.effects.kicks
    assert b.out(fast) == []
    before = len(b.out(slow))  # drains slow's queue
    assert before == 3
    assert b.broker.handle_many(sender, [f], 0.0) == 1
    assert [m.body() for m in b.out(slow)] == [payload]
    assert [m.body() for m in b.out(fast)] == [payload]
    assert b.broker.stats["dropped_peers"] == 0


def test_held_frame_keeps_its_descriptors_and_later_frames() -> None:
    """handle_many() stops at a held frame and reports its index; the frames after it are
    untouched and the held frame's descriptors are not closed (they travel with it later)."""
    closed: list[int] = []
    b = Bench(**SMALL)
    b.broker = Broker(
        Limits(**SMALL),
        version="test",
        dup_fd=lambda fd: fd + 1000,
        close_fd=closed.append,
    )
    sender, full = b.connect("sender"), b.connect("full")
    for _ in range(3):
        b.message(sender, full.lname, "x" * 500)
    frames = [
        frame(T.MESSAGE, target="Nobody", body=encode_cbor(1)),
        frame(T.MESSAGE, target=full.lname, body=encode_cbor("y" * 400), fds=(7,)),
        frame(T.MESSAGE, target="Nobody", body=encode_cbor(2), fds=(8,)),
    ]
    assert b.broker.handle_many(sender, frames, 0.0) == 1
    assert closed == [] and b.broker.effects.hold.receivers == [full]
    b.out(full)
    assert b.broker.handle_many(sender, frames[1:], 0.0) == 2
    assert sorted(closed) == [7, 8]
    [m] = b.out(full)
    assert m.body() == "y" * 400


def test_broker_notification_to_full_subscriber_drops_it() -> None:
    """What the broker itself publishes (membership events) cannot be held: a subscriber
    over the hard limit is dropped (slow-consumer) rather than silently missing it."""
    b = Bench(**SMALL)
    sender, watcher = b.connect("sender"), b.connect("watcher")
    b.subscribe(watcher, "msgq.membership")
    b.out(watcher)
    for _ in range(3):
        b.message(sender, watcher.lname, "x" * 500)
    while watcher.alive and len(b.broker.effects.kicks) == 0:
        b.connect("newcomer")
    assert not watcher.alive
    assert [(p, c) for p, c, _ in b.broker.effects.kicks] == [(watcher, ErrorCode.SLOW_CONSUMER)]


def test_request_to_full_receiver() -> None:
    """A REQUEST to a receiver whose queue is full is refused with receiver-full (the
    receiver's stamp as source) and the receiver is not dropped."""
    b = Bench(**SMALL)
    sender, caller, full = b.connect("sender"), b.connect("caller"), b.connect("full")
    for _ in range(3):
        b.message(sender, full.lname, "x" * 500)
    rid = b.request(caller, full.lname, "x", "y" * 600)
    [err] = b.out(caller)
    assert (error_code(err), err.request_id, err.source) == ("receiver-full", rid, b"l.3\0full")
    assert full.alive
    assert len(b.broker.rpc) == 0


# -- batches --------------------------------------------------------------------------------------
def test_handle_many_matches_handle() -> None:
    """handle_many() on a batch (group messages, a request, direct and instance messages)
    queues exactly what handle() queues frame by frame."""

    def scenario(batch: bool) -> dict[str, list[tuple[int, str, bytes, object]]]:
        b = Bench()
        s = b.connect("s")
        ms = [b.connect(f"m{i}") for i in range(3)]
        b.subscribe(s, "G")
        for m in ms:
            b.subscribe(m, "G")
        frames = [frame(T.MESSAGE, target="G", body=encode_cbor(i)) for i in range(5)]
        frames.insert(2, frame(T.MESSAGE, target="l.3", body=encode_cbor("direct")))
        frames.insert(4, frame(T.MESSAGE, target="G[1]", body=encode_cbor("inst")))
        frames.append(
            frame(T.REQUEST, target="G[0]", request_id=9, header=encode_cbor({"cmd": "c"}))
        )
        frames.append(frame(T.MESSAGE, target="Nobody", body=encode_cbor("lost")))
        if batch:
            b.broker.handle_many(s, frames, 0.0)
        else:
            for f in frames:
                b.broker.handle(s, f, 0.0)
        out = {
            p.lname: [(f.type, f.target, f.source, f.body()) for f in b.out(p)] for p in [s, *ms]
        }
        out["stats"] = [(0, k, b"", v) for k, v in sorted(b.broker.stats.items())]
        out["counts"] = [(0, "", b"", (s.msgs_in, s.bytes_in))]
        return out

    assert scenario(batch=True) == scenario(batch=False)


def test_goodbye_disconnect_keeps_queue(bench: Bench) -> None:
    """disconnect(keep_queue=True) (an orderly GOODBYE) keeps what was queued for the peer
    so it can still be flushed; a plain disconnect drops it."""
    s, a, c = bench.connect("s"), bench.connect("a"), bench.connect("c")
    bench.message(s, a.lname, "keep")
    bench.message(s, c.lname, "drop")
    bench.broker.disconnect(a, "closed", keep_queue=True)
    bench.broker.disconnect(c, "connection-lost")
    assert [f.body() for f in bench.out(a)] == ["keep"]
    assert bench.out(c) == []


def test_a_command_that_turns_capture_on_is_captured_itself() -> None:
    """The tap in force once a request was handled sees that request: a capture started by
    a request to the broker records the request that started it (and the answer)."""
    b = Bench()
    seen: list[tuple[int, str]] = []

    def start(_peer: Peer, _params: object) -> bool:
        b.broker.tap = lambda _sender, f, outcome, _n: seen.append((f.type, outcome))
        return True

    b.broker.commands["start"] = start
    p = b.connect("p")
    b.call_broker(p, "start")
    assert seen == [(T.REPLY, "delivered"), (T.REQUEST, "broker")]


def test_a_request_and_the_frames_before_it_are_counted_before_it_is_handled() -> None:
    """A broker command sees its own request, and the messages its sender sent before it
    in the same batch, in the sender's counters (``stats`` reports them)."""
    b = Bench()
    seen: list[int] = []
    b.broker.commands["count"] = lambda peer, _params: seen.append(peer.msgs_in)
    p = b.connect("p")
    frames: list[Frame | Run] = [
        frame(T.MESSAGE, target="Nobody", body=encode_cbor(i)) for i in range(3)
    ]
    frames.append(
        frame(T.REQUEST, target="msgq", request_id=1, header=encode_cbor({"cmd": "count"}))
    )
    assert b.broker.handle_many(p, frames, 0.0) == 4
    assert seen == [4] and p.msgs_in == 4


def test_effects_name_the_writers_to_wake_and_the_peers_to_drop() -> None:
    """What the core decides reaches the I/O layer as ``Broker.effects``: the peers whose
    queues got frames (to wake), and the peers it dropped with the final error (to close);
    taking them leaves nothing behind for the next batch."""
    b = Bench()
    rx, tx = b.connect("rx"), b.connect("tx")
    b.call_broker(rx, "subscribe", {"group": "G"})
    fx = b.broker.effects
    fx.wake.clear()
    b.message(tx, "G", "hi")
    assert fx.wake == {rx} and not fx.kicks and fx.hold is None
    b.broker.kick(rx, ErrorCode.DROPPED, "by the operator")
    assert fx.wake == set()  # its queue was dropped: nothing left to write
    assert fx.take_kicks() == [(rx, ErrorCode.DROPPED, "by the operator")]
    assert fx.take_kicks() == []
