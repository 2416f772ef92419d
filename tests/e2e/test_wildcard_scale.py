"""5,000 clients on one broker process, 20 subscriptions each with wildcards among them:
one message to each group reaches exactly the clients whose subscriptions match it,
each once.

The clients are the lightest there are: plain blocking Unix sockets in this one process,
speaking frames by hand (HELLO and the 20 ``subscribe`` requests pipelined in one write),
so the test measures the broker's routing, not 5,000 event loops.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgq_trio._procs import raise_nofile
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame
from msgq_trio.protocol.names import pattern_matches

CLIENTS = 5000
#: Literal groups ``Z.a.b``: 50 x 20.
A, B = 50, 20
GROUPS = [f"Z.{a}.{b}" for a in range(A) for b in range(B)]
LITERALS = 18
HANG = 60.0


def subscriptions(i: int) -> list[str]:
    """Client ``i``'s 20: 18 literal groups (90 members a group), and two patterns. The
    first is ``Z.>`` for 10 clients, ``Z.a.>`` for 500, else ``Z.a.b.>`` (matches no
    group: a pattern must not over-match); the second ``Z.a.*`` for 1,000 clients, else
    ``*.a.b``, often a group the client also joined literally (one delivery still)."""
    subs = [GROUPS[(i * LITERALS + k) % len(GROUPS)] for k in range(LITERALS)]
    a, b = i % A, (i // A) % B
    if i % 500 == 0:
        subs.append("Z.>")
    elif i % 10 == 1:
        subs.append(f"Z.{a}.>")
    else:
        subs.append(f"Z.{a}.{b}.>")
    subs.append(f"Z.{a}.*" if i % 5 == 0 else f"*.{a}.{(i * LITERALS) % B}")
    return subs


def frames_of(*pieces_list: list[Any]) -> bytes:
    return b"".join(bytes(p) for pieces in pieces_list for p in pieces)


def read_until(
    sock: socket.socket, parser: FrameParser, done: Callable[[Frame], bool]
) -> list[Frame]:
    """Frames from ``sock`` up to and including the first that ``done`` accepts."""
    out: list[Frame] = []
    while True:
        while (f := parser.next_frame()) is not None:
            out.append(f)
            if done(f):
                return out
        data = sock.recv(1 << 16)
        assert data, f"the broker closed a connection: {out[-3:]}"
        parser.feed(data)


def test_5000_clients_with_wildcards_get_every_delivery_once(
    broker_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """Every client gets, before a marker sent to it last, one copy of each message to
    a group that one of its 20 subscriptions matches (the reference matcher decides),
    and nothing else."""
    soft, _ = raise_nofile()
    assert soft > CLIENTS + 100, f"RLIMIT_NOFILE {soft} is too low for {CLIENTS} clients"
    # One uid runs all 5,000: the per-user connection quota (half of max_connections)
    # is raised for it, as a deployment of that size would (docs/SECURITY.md).
    config = tmp_path / "broker.toml"
    config.write_text("[quotas]\nconnections = 6000\n")
    broker = broker_factory("--config", str(config))  # inherits the raised limit
    start = time.monotonic()
    # Who expects what, by the brute-force reference (each distinct pattern once).
    matches: dict[str, set[str]] = {}
    expected: list[set[str]] = []
    for i in range(CLIENTS):
        want: set[str] = set()
        for s in subscriptions(i):
            if s not in matches:
                is_literal = "*" not in s and ">" not in s
                matches[s] = {s} if is_literal else {g for g in GROUPS if pattern_matches(s, g)}
            want |= matches[s]
        expected.append(want)

    socks: list[socket.socket] = []
    parsers: list[FrameParser] = []
    try:
        for i in range(CLIENTS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(s)
            # Blocking: a Unix connect then waits for room in the listen backlog (with a
            # timeout it would fail with EAGAIN while the broker is accepting).
            s.connect(str(broker.path))
            s.settimeout(HANG)
            hello = encode_frame(
                FrameType.HELLO, header=encode_cbor({"version": 1, "name": f"c{i}"})
            )
            subs = [
                encode_frame(
                    FrameType.REQUEST,
                    target="msgq",
                    request_id=n + 1,
                    header=encode_cbor({"cmd": "subscribe"}),
                    body=encode_cbor({"group": g}),
                )
                for n, g in enumerate(subscriptions(i))
            ]
            s.sendall(frames_of(hello, *subs))
            parsers.append(FrameParser(1 << 24))
        lnames: list[str] = []
        for s, p in zip(socks, parsers, strict=True):
            got = read_until(s, p, lambda f: f.request_id == 20)
            assert got[0].type == FrameType.WELCOME, got[0]
            lnames.append(str(got[0].header()["lname"]))
            assert [f.type for f in got[1:]] == [FrameType.REPLY] * 20, got[1:3]
            assert all(f.body() is True for f in got[1:])
        subscribed = time.monotonic()

        sender = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks.append(sender)
        sender.settimeout(HANG)
        sender.connect(str(broker.path))
        sender.sendall(
            frames_of(
                encode_frame(FrameType.HELLO, header=encode_cbor({"version": 1, "name": "tx"}))
            )
        )
        read_until(sender, FrameParser(1 << 24), lambda f: f.type == FrameType.WELCOME)
        batch = [encode_frame(FrameType.MESSAGE, target=g, body=encode_cbor(g)) for g in GROUPS]
        batch += [encode_frame(FrameType.MESSAGE, target=ln, body=b"") for ln in lnames]
        sender.sendall(frames_of(*batch))

        deliveries = 0
        for i, (s, p) in enumerate(zip(socks[:CLIENTS], parsers, strict=True)):
            got = read_until(s, p, lambda f, ln=lnames[i]: f.target == ln)  # type: ignore[misc]
            targets = Counter(f.target for f in got[:-1])
            assert all(f.type == FrameType.MESSAGE for f in got), (i, got[:3])
            dup = [t for t, n in targets.items() if n > 1]
            assert not dup, f"client {i} got {dup[:3]} more than once"
            assert set(targets) == expected[i], (
                i,
                sorted(set(targets) ^ expected[i])[:5],
            )
            deliveries += len(targets)
        assert deliveries == sum(len(e) for e in expected)
        print(
            f"{CLIENTS} clients: subscribed in {subscribed - start:.1f} s, "
            f"{deliveries} deliveries checked in {time.monotonic() - subscribed:.1f} s"
        )
    finally:
        for s in socks:
            s.close()
