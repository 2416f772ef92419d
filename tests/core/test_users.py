"""Per-user accounting and quotas in the core (core/users.py), driven with frames: no
sockets, no trio. Users are uids given at connect; the quotas are small so a few frames
reach them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from msgq_trio.config import Limits, QuotaSettings
from msgq_trio.core.broker import Broker
from msgq_trio.core.peers import Peer
from msgq_trio.core.users import UNLIMITED, Users
from msgq_trio.ops import config_file
from msgq_trio.ops.config_file import ConfigError
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame

T = FrameType
KiB = 1024
#: broker_memory_total x user_memory_share: 16 KiB per user.
QUOTA = 16 * KiB


def frame(ftype: int, **kw: Any) -> Frame:
    p = FrameParser()
    p.feed(b"".join(bytes(x) for x in encode_frame(ftype, **kw)))
    f = p.next_frame()
    assert f is not None
    return f


class Bus:
    """A broker core with quotas, and clients of chosen uids."""

    def __init__(self, **quotas: Any) -> None:
        settings = QuotaSettings(**({"broker_memory_total": 4 * QUOTA} | quotas))
        self.broker = Broker(
            Limits(), version="test", rng=random.Random(3), quotas=settings, memory_total=0
        )
        self.rid = 0

    def connect(self, uid: int, name: str = "c") -> Peer:
        return self.broker.connect(name, pid=100 + len(self.broker.peers), uid=uid, gid=uid, now=0)

    def message(self, peer: Peer, target: str, size: int) -> bool:
        """A one-way message of ``size`` body bytes; False if it was held."""
        f = frame(T.MESSAGE, target=target, body=b"x" * size)
        return self.broker.handle(peer, f, 0.0)

    def request(self, peer: Peer, target: str, cmd: str, params: object = None) -> int:
        self.rid += 1
        f = frame(
            T.REQUEST,
            target=target,
            request_id=self.rid,
            header=encode_cbor({"cmd": cmd}),
            body=encode_cbor(params) if params is not None else b"",
        )
        self.broker.handle(peer, f, 0.0)
        return self.rid

    def out(self, peer: Peer) -> list[Frame]:
        bufs, n = peer.take_outgoing()
        peer.sent(n)
        p = FrameParser()
        p.feed(b"".join(bytes(b) for b in bufs))
        frames = []
        while (f := p.next_frame()) is not None:
            frames.append(f)
        return frames

    def answer(self, peer: Peer, rid: int) -> Frame:
        [a] = [f for f in self.out(peer) if f.request_id == rid and f.type in (T.REPLY, T.ERROR)]
        return a


def test_memory_quota_holds_one_way_senders_and_spares_other_users() -> None:
    """The bytes queued for a user's connections are charged to that user (the owner):
    once they reach its quota a one-way message to any of its connections is held (the
    sender waits), while the same sender's messages to another user still go through."""
    bus = Bus(user_memory_share=0.25)
    r1, r2 = bus.connect(1000), bus.connect(1000)
    other = bus.connect(2000)
    sender = bus.connect(3000)
    acct = r1.account
    assert acct is r2.account and acct.limits["memory"] == QUOTA
    sent = 0
    while bus.message(sender, (r1, r2)[sent % 2].lname, 3 * KiB):
        sent += 1
        assert sent < 20
    # Held only once the user's sum (not one connection's queue) reached the quota.
    assert acct.memory() + 3 * KiB > QUOTA
    assert r1.outq_bytes < QUOTA and r2.outq_bytes < QUOTA
    hold = bus.broker.effects.take_hold()
    assert hold is not None and hold.receivers in ([r1], [r2])
    assert bus.message(sender, other.lname, 3 * KiB)
    # Draining one connection makes room for the user again.
    bus.out(r1)
    assert bus.message(sender, r2.lname, 3 * KiB)


def test_request_to_a_full_user_is_refused_naming_quota_and_user() -> None:
    """A request is never held: to a user over its memory quota it is answered
    limit-exceeded, naming the quota, the user and the figures."""
    bus = Bus(user_memory_share=0.25)
    r = bus.connect(1000)
    caller = bus.connect(2000)
    for size in (4 * KiB, 64):  # filled to the last few bytes
        while bus.message(caller, r.lname, size):
            pass
        bus.broker.effects.take_hold()
    rid = bus.request(caller, r.lname, "work")
    err = bus.answer(caller, rid)
    assert err.type == T.ERROR
    h = err.header()
    assert h["code"] == "limit-exceeded"
    assert "quota 'memory' of user uid:1000" in str(h["message"])
    assert f"of {QUOTA}" in str(h["message"])
    assert bus.broker.stats["quota_refusals"] == 1
    # Another user's caller is not counted towards being dropped: not at fault.
    assert caller.quota_refusals == 0
    assert r.account.refused["memory"] == 1


def test_user_under_quota_is_never_refused() -> None:
    """Connections holding more than their even part of the user's quota are fine while
    the user's sum is under it: nothing held, nothing refused."""
    bus = Bus(user_memory_share=0.25)
    rs = [bus.connect(1000) for _ in range(8)]
    sender = bus.connect(3000)
    share = rs[0].account.memory_share
    assert share == QUOTA // 8
    # One connection takes three times its part; the user stays under its quota.
    for _ in range(3):
        assert bus.message(sender, rs[0].lname, share - 200)
    assert rs[0].outq_bytes > share and rs[0].account.memory() < QUOTA
    assert bus.broker.effects.take_hold() is None
    rid = bus.request(sender, rs[0].lname, "work")
    assert [f.request_id for f in bus.out(rs[0]) if f.type == T.REQUEST] == [rid]
    assert bus.broker.stats["quota_refusals"] == 0


def test_pending_requests_quota_counts_every_connection_of_the_user() -> None:
    """``pending_requests`` is the user's sum: two callers of one uid share it."""
    bus = Bus(pending_requests=3)
    callee = bus.connect(2000)
    a, b = bus.connect(1000), bus.connect(1000)
    bus.request(a, callee.lname, "slow")
    bus.request(a, callee.lname, "slow")
    bus.request(b, callee.lname, "slow")
    rid = bus.request(b, callee.lname, "slow")
    err = bus.answer(b, rid)
    assert err.header()["code"] == "limit-exceeded"
    assert "quota 'pending_requests' of user uid:1000 reached: 3 pending requests of 3" in str(
        err.header()["message"]
    )
    # Another user is not limited by uid 1000's use.
    c = bus.connect(1001)
    rid = bus.request(c, callee.lname, "slow")
    assert len(c.pending_out) == 1


def test_subscriptions_quota_and_drop_of_a_connection_that_keeps_pushing() -> None:
    """The ``subscriptions`` quota refuses limit-exceeded; the connection refused
    ``refusals_before_drop`` times is dropped, membership reason ``quota:subscriptions``;
    its user's other connection stays."""
    bus = Bus(subscriptions=2, refusals_before_drop=3)
    watcher = bus.connect(0, "watch")
    bus.request(watcher, "msgq", "subscribe", {"group": "msgq.membership"})
    a, b = bus.connect(1000), bus.connect(1000)
    for p, g in ((a, "A"), (b, "B")):
        rid = bus.request(p, "msgq", "subscribe", {"group": g})
        assert bus.answer(p, rid).type == T.REPLY
    for n in range(3):
        rid = bus.request(a, "msgq", "subscribe", {"group": f"More{n}"})
        if n < 2:
            err = bus.answer(a, rid)
            assert err.header()["code"] == "limit-exceeded"
            assert "quota 'subscriptions' of user uid:1000" in str(err.header()["message"])
    assert not a.alive and b.alive
    [(peer, code, message)] = bus.broker.effects.take_kicks()
    assert peer is a and code == "limit-exceeded" and "refused 3 times" in message
    gone = [
        f.body()
        for f in bus.out(watcher)
        if f.type == T.NOTIFY and f.header().get("event") == "disconnected"
    ]
    assert gone == [{"lname": a.lname, "name": "c", "reason": "quota:subscriptions"}]
    assert bus.broker.stats["quota_drops"] == 1


def test_tightened_quota_keeps_existing_use_and_refuses_new() -> None:
    """configure() with a lower quota drops nothing held above it; new use is refused."""
    bus = Bus(subscriptions=10)
    a = bus.connect(1000)
    for g in ("A", "B", "C"):
        bus.request(a, "msgq", "subscribe", {"group": g})
    bus.out(a)
    bus.broker.users.configure(QuotaSettings(broker_memory_total=4 * QUOTA, subscriptions=1))
    assert a.alive and set(a.groups) == {"A", "B", "C"}
    rid = bus.request(a, "msgq", "subscribe", {"group": "D"})
    assert bus.answer(a, rid).header()["code"] == "limit-exceeded"
    # Loosened again: allowed at once.
    bus.broker.users.configure(QuotaSettings(broker_memory_total=4 * QUOTA, subscriptions=10))
    rid = bus.request(a, "msgq", "subscribe", {"group": "D"})
    assert bus.answer(a, rid).type == T.REPLY


def test_connections_quota_and_accounts_follow_connections() -> None:
    """admit() refuses the connection over ``connections``; an account lives while its
    user has a connection; per-user overrides replace the defaults for that user only."""
    users = Users(
        QuotaSettings(connections=2, users={"uid:0": {"connections": 3}}), memory_total=1 << 20
    )
    bus = Bus()
    bus.broker.users = users
    ps = [bus.connect(1000) for _ in range(2)]
    assert "quota 'connections' of user uid:1000 reached: 2 connections of 2" in users.admit(
        "uid:1000"
    )
    assert users.admit("uid:0") == ""
    assert users.limits_for("uid:0")["connections"] == 3
    for p in ps:
        bus.broker.disconnect(p, "closed")
    assert users.accounts == {}
    assert users.admit("uid:1000") == ""


def test_quotas_off_refuse_nothing() -> None:
    users = Users(QuotaSettings(enabled=False, connections=1), memory_total=1 << 20)
    assert users.limits_for("uid:5") == dict.fromkeys(users.limits_for("uid:5"), UNLIMITED)
    assert users.admit("uid:5") == ""


def test_rows_show_use_against_limits() -> None:
    bus = Bus(user_memory_share=0.25)
    r = bus.connect(1000)
    s = bus.connect(2000)
    while bus.message(s, r.lname, 4 * KiB):
        pass
    [top, *_] = bus.broker.users.rows()
    assert top["user"] == "uid:1000"
    assert top["at_limit"] == []  # one frame short of it: held, not over
    assert top["use"]["memory"] == r.outq_bytes  # type: ignore[index]
    assert top["limits"]["memory"] == QUOTA  # type: ignore[index]


def test_config_file_quotas_section() -> None:
    """``[quotas]`` with per-user tables; each error names the key."""
    cfg = config_file.build(
        {
            "quotas": {
                "broker_memory_total": 1 << 30,
                "connections": 10,
                "users": {"uid:0": {"connections": 100}, "tcp:svc": {"memory": 1 << 20}},
            }
        }
    )
    q = cfg.quotas
    assert q.for_user("uid:0", q.memory_total())["connections"] == 100
    assert q.for_user("uid:7", q.memory_total()) == {
        "memory": (1 << 30) // 16,
        "connections": 10,
        "fds": 4096,
        "subscriptions": 131_072,
        "pending_requests": 40000,
    }
    assert config_file.get_key(cfg, "quotas.connections") == 10
    with pytest.raises(ConfigError, match=r"quotas.users.uid:0.memroy: unknown quota"):
        config_file.build({"quotas": {"users": {"uid:0": {"memroy": 5}}}})
    with pytest.raises(ConfigError, match=r"'user:x' must be 'uid:N'"):
        config_file.build({"quotas": {"users": {"user:x": {"memory": 5}}}})
    with pytest.raises(ConfigError, match=r"quotas.user_memory_share = 2"):
        config_file.build({"quotas": {"user_memory_share": 2}})
    changed = config_file.with_key(cfg, "quotas.fds", 7)
    assert ("quotas.fds", 4096, 7) in config_file.diff(cfg, changed)


def test_metrics_and_ctl_users_table_bound_the_users_shown() -> None:
    """The per-user series name the ``top`` users and sum the rest as ``other``, so the
    label set stays bounded; ``ctl users`` marks quotas at their limit with ``*``."""
    from msgq_trio.exposition import Exposition
    from msgq_trio.ops.ctl_client import format_users
    from msgq_trio.ops.metrics import user_series

    bus = Bus(connections=1)
    for uid in range(5):
        bus.connect(1000 + uid)
    rows = bus.broker.users.rows()
    e = Exposition()
    user_series(e, rows, 2)
    text = e.text()
    users = {
        line.split('user="')[1].split('"')[0] for line in text.splitlines() if 'user="' in line
    }
    assert len(users) == 3 and "other" in users
    assert 'msgq_user_use{quota="connections",user="other"} 3' in text
    table = format_users(rows)
    assert "uid:1000" in table and "1/1*" in table


def test_tcp_clients_are_charged_to_their_authenticated_identity() -> None:
    """A TCP client's user is its ``tcp:NAME`` identity, whatever pid it claims; two
    connections of one identity share one account, another identity has its own."""
    bus = Bus(connections=2)
    b = bus.broker

    def tcp(identity: str) -> Peer:
        return b.connect(
            "remote",
            pid=7,
            uid=-1,
            gid=-1,
            now=0,
            principals=[f"tcp:{identity}"],
            where=f"tcp:{identity}@127.0.0.1:1",
        )

    a1, a2, other = tcp("svc"), tcp("svc"), tcp("other")
    assert a1.account is a2.account and a1.account.key == "tcp:svc"
    assert other.account.key == "tcp:other"
    assert "quota 'connections' of user tcp:svc" in b.users.admit("tcp:svc")
    assert b.users.admit("tcp:other") == ""


def test_fds_quota_holds_a_message_with_descriptors() -> None:
    """Descriptors queued for a user's connections count against its ``fds`` quota: past
    it a message carrying descriptors is held; one without goes through."""
    closed: list[int] = []
    broker = Broker(
        Limits(),
        version="test",
        quotas=QuotaSettings(broker_memory_total=1 << 30, fds=3),
        dup_fd=lambda fd: fd + 1000,
        close_fd=closed.append,
    )
    r1 = broker.connect("r1", pid=1, uid=1000, gid=1000, now=0)
    r2 = broker.connect("r2", pid=2, uid=1000, gid=1000, now=0)
    s = broker.connect("s", pid=3, uid=2000, gid=2000, now=0)

    def send(to: Peer, nfds: int) -> bool:
        p = FrameParser()
        p.feed(b"".join(bytes(x) for x in encode_frame(T.MESSAGE, target=to.lname, n_fds=nfds)))
        f = p.next_frame()
        assert f is not None
        return broker.handle(s, f._replace(fds=tuple(range(nfds))), 0.0)

    assert send(r1, 2) and send(r2, 1)
    assert r1.account.fds() == 3
    assert not send(r2, 1)
    hold = broker.effects.take_hold()
    assert hold is not None and hold.receivers == [r2] and hold.fds == 1
    assert r1.account.held["fds"] == 1
    assert send(r2, 0)
