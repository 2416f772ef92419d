"""Wildcard subscriptions in the broker core, driven with frames (no sockets): who a
one-way frame reaches, what calls and ``G[N]``/``G[?]`` do, targets that are patterns,
the pattern limits, membership events and the access policy per delivery."""

from __future__ import annotations

import random
from typing import Any

import pytest

from msgq_trio.config import AccessRule, AccessSettings, Limits
from msgq_trio.core.broker import Broker
from msgq_trio.core.peers import Peer
from msgq_trio.protocol.codes import ErrorCode, Flag, FrameType
from msgq_trio.protocol.errors import RemoteProtocolError
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame

T = FrameType


def _frame(ftype: int, **kw: Any) -> Frame:
    p = FrameParser()
    p.feed(b"".join(bytes(x) for x in encode_frame(ftype, **kw)))
    f = p.next_frame()
    assert f is not None
    return f


class Core:
    """A broker core and clients speaking frames to it."""

    def __init__(self, **limits: Any) -> None:
        self.broker = Broker(Limits(**limits), version="test", rng=random.Random(7))
        self.rid = 0

    def connect(self, name: str, principals: list[str] | None = None) -> Peer:
        n = len(self.broker.peers)
        return self.broker.connect(
            name, pid=4000 + n, uid=1000 + n, gid=1, now=0.0, principals=principals
        )

    def out(self, peer: Peer) -> list[Frame]:
        bufs, n = peer.take_outgoing()
        peer.sent(n)
        p = FrameParser()
        p.feed(b"".join(bytes(b) for b in bufs))
        frames = []
        while (f := p.next_frame()) is not None:
            frames.append(f)
        return frames

    def messages(self, peer: Peer) -> list[tuple[str, object]]:
        """(target, body) of the MESSAGEs and NOTIFYs queued for ``peer``."""
        return [
            (f.target, f.body())
            for f in self.out(peer)
            if f.type in (T.MESSAGE, T.NOTIFY) and f.target != "msgq.membership"
        ]

    def send(self, peer: Peer, target: str, body: object, ftype: int = T.MESSAGE) -> None:
        self.broker.handle(peer, _frame(ftype, target=target, body=encode_cbor(body)), 0.0)

    def request(
        self, peer: Peer, target: str, cmd: str, params: object = None, flags: int = 0
    ) -> Frame:
        """Send a REQUEST; returns the broker's answer if it gave one (else the REQUEST
        is pending at the callee: returns a dummy REPLY-less frame)."""
        self.rid += 1
        body = encode_cbor(params) if params is not None else b""
        f = _frame(
            T.REQUEST,
            target=target,
            request_id=self.rid,
            flags=flags,
            header=encode_cbor({"cmd": cmd}),
            body=body,
        )
        self.broker.handle(peer, f, 0.0)
        answers = [f for f in self.out(peer) if f.request_id == self.rid]
        assert len(answers) <= 1, answers
        return answers[0] if answers else f

    def subscribe(self, peer: Peer, group: str) -> Frame:
        return self.request(peer, "msgq", "subscribe", {"group": group})


def _error(answer: Frame) -> tuple[str, str]:
    assert answer.type == T.ERROR, answer
    h = answer.header()
    return str(h.get("code")), str(h.get("message"))


def test_one_delivery_per_client_whatever_matches() -> None:
    """A client subscribed to ``Zone.a``, ``Zone.*`` and ``Zone.>`` gets each message to
    ``Zone.a`` once; a pattern-only subscriber gets it too; the sender never gets its own
    (even through a pattern); a NOTIFY goes the same way."""
    c = Core()
    both, star, sender, other = (c.connect(n) for n in ("both", "star", "sender", "other"))
    for g in ("Zone.a", "Zone.*", "Zone.>"):
        assert c.subscribe(both, g).type == T.REPLY
    c.subscribe(star, "Zone.*")
    c.subscribe(sender, "Zone.>")
    c.subscribe(other, "Other.*")
    for p in (both, star, sender, other):
        c.out(p)
    c.send(sender, "Zone.a", 1)
    c.send(sender, "Zone.a.deep", 2)
    c.send(sender, "Zone.b", 3, T.NOTIFY)
    assert c.messages(both) == [("Zone.a", 1), ("Zone.a.deep", 2), ("Zone.b", 3)]
    assert c.messages(star) == [("Zone.a", 1), ("Zone.b", 3)]
    assert c.messages(sender) == []
    assert c.messages(other) == []
    c.send(both, "Zone.a", 4)
    assert c.messages(sender) == [("Zone.a", 4)]
    # Unsubscribing the patterns leaves the literal membership.
    for g in ("Zone.*", "Zone.>"):
        assert c.request(both, "msgq", "unsubscribe", {"group": g}).body() is True
    c.send(sender, "Zone.b", 5)
    c.send(sender, "Zone.a", 6)
    assert c.messages(both) == [("Zone.a", 6)]


def test_calls_choose_among_literal_members_only() -> None:
    """A group reached only through a pattern answers no-recipient to a call, to
    ``G[0]``, ``G[?]`` and to a call to every member; with a literal member, the
    wildcard subscriber is not among the callees."""
    c = Core()
    caller, watcher, server = c.connect("caller"), c.connect("watcher"), c.connect("server")
    c.subscribe(watcher, "Svc.*")
    for target in ("Svc.x", "Svc.x[0]", "Svc.x[?]"):
        code, _ = _error(c.request(caller, target, "do"))
        assert code == "no-recipient", target
    code, _ = _error(c.request(caller, "Svc.x", "do", flags=int(Flag.ALL)))
    assert code == "no-recipient"
    c.subscribe(server, "Svc.x")
    c.out(watcher), c.out(server)
    c.request(caller, "Svc.x", "do", flags=int(Flag.ALL))
    assert [f.type for f in c.out(server)] == [T.REQUEST]
    assert c.out(watcher) == []


@pytest.mark.parametrize("target", ["Zone.*", "Zone.>", "msgq.*", "Zone.*[0]", "Zone.>[?]"])
def test_pattern_target_is_bad_request(target: str) -> None:
    """Wildcards are for subscribing: a request to a pattern is answered bad-request; a
    one-way frame to one ends the sender's connection with bad-request (it cannot be
    answered)."""
    c = Core()
    p = c.connect("p")
    code, message = _error(c.request(p, target, "do"))
    assert code == "bad-request" and "wildcards" in message
    with pytest.raises(RemoteProtocolError) as exc:
        c.send(p, target, 1)
    assert exc.value.code == ErrorCode.BAD_REQUEST


def test_subscribe_pattern_rules_and_limits() -> None:
    """Invalid patterns are bad-request; a pattern over max_pattern_bytes or
    max_pattern_tokens is limit-exceeded naming the limit; a pattern counts against
    max_subscriptions."""
    c = Core(max_pattern_bytes=16, max_pattern_tokens=3, max_subscriptions=2)
    p = c.connect("p")
    code, message = _error(c.subscribe(p, "a.>.b"))
    assert code == "bad-request" and "last token" in message
    code, message = _error(c.subscribe(p, "Zone.*." + "x" * 20))
    assert code == "limit-exceeded" and "max_pattern_bytes=16" in message
    code, message = _error(c.subscribe(p, "a.b.c.*"))
    assert code == "limit-exceeded" and "max_pattern_tokens=3" in message
    code, message = _error(c.subscribe(p, "x>" * 300))  # a long name, not a pattern
    assert code == "bad-request" and "1..255" in message
    assert c.subscribe(p, "a.b.*").body() is True
    assert c.subscribe(p, "plain").body() is True
    code, message = _error(c.subscribe(p, "c.*"))
    assert code == "limit-exceeded" and "max_subscriptions=2" in message


def test_membership_events_and_members_of_a_pattern() -> None:
    """``subscribed``/``unsubscribed`` events carry the pattern as the group; ``members``
    of a pattern lists its subscribers; ``>`` does not see the broker's groups, while
    ``msgq.*`` does."""
    c = Core()
    watcher, all_, p = c.connect("watcher"), c.connect("all"), c.connect("p")
    c.subscribe(watcher, "msgq.*")
    c.subscribe(all_, ">")
    c.out(watcher), c.out(all_)
    c.subscribe(p, "Zone.*")
    events = [(f.header()["event"], f.body()) for f in c.out(watcher) if f.type == T.NOTIFY]
    assert events == [("subscribed", {"lname": p.lname, "name": "p", "group": "Zone.*"})]
    assert c.out(all_) == []
    members = c.request(p, "msgq", "members", {"group": "Zone.*"}).body()
    assert [m["lname"] for m in members] == [p.lname]
    assert c.request(p, "msgq", "members", {"group": "Zone.a"}).body() == []
    c.broker.disconnect(p, "gone")
    events = [(f.header()["event"], f.body()) for f in c.out(watcher) if f.type == T.NOTIFY]
    assert ("unsubscribed", "Zone.*") in [(e, b.get("group")) for e, b in events]
    c.broker.disconnect(watcher, "gone")
    c.broker.disconnect(all_, "gone")
    c.broker.check_empty()


def test_policy_filters_each_delivery() -> None:
    """A subscriber allowed the pattern ``Zone.*`` (granted by the glob ``Zone.[*]``) and
    ``Zone.public``, but not ``Zone.secret``, never receives ``Zone.secret``; after a
    reload that grants it, it does."""
    rules = [
        AccessRule(who=["uid:1000"], subscribe=["Zone.[*]", "Zone.public"]),
        AccessRule(who=["uid:1001"], send=["*"]),
    ]
    c = Core()
    c.broker.set_policy(AccessSettings(rules=rules), {})
    watcher = c.connect("watcher", ["uid:1000"])
    sender = c.connect("sender", ["uid:1001"])
    member = c.connect("member")  # no rule names it: unrestricted
    assert c.subscribe(watcher, "Zone.*").body() is True
    assert _error(c.subscribe(watcher, "Zone.>"))[0] == "forbidden"
    c.send(sender, "Zone.public", 1)
    c.send(sender, "Zone.secret", 2)
    c.subscribe(member, "Zone.secret")  # a group with literal members, too
    c.send(sender, "Zone.secret", 2)
    assert c.messages(watcher) == [("Zone.public", 1)]
    assert c.messages(member) == [("Zone.secret", 2)]
    rules[0] = AccessRule(who=["uid:1000"], subscribe=["Zone.*"])
    c.broker.set_policy(AccessSettings(rules=rules), {watcher: ["uid:1000"], sender: ["uid:1001"]})
    c.send(sender, "Zone.secret", 3)
    assert c.messages(watcher) == [("Zone.secret", 3)]
