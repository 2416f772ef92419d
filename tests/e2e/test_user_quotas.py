"""Per-user quotas on a real broker: one uid floods, another keeps its round trips.

The flood runs in a child that imports msgq_trio as root and then drops to ``nobody``
(as tests/e2e/test_access_groups.py does), so the broker charges it to another user than
the test's own connections (root). Its shape is the one that took the broker to
gigabytes before per-user quotas: pairs of connections, a receiver that never reads and
a sender that fills it, and a new pair whenever one is dropped. The broker is given a
small memory total so the quota is reached in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio.errors import RpcError

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the flood runs as another uid (nobody)"
)

NOBODY = pwd.getpwnam("nobody").pw_uid
MiB = 1024 * 1024
#: broker_memory_total x user_memory_share.
USER_MEMORY = 16 * MiB
#: What the broker may hold beyond the flooding user's queued bytes: the interpreter's
#: heap growth, the flood's connections and refused handshakes, the test's own clients.
OVERHEAD = 48 * MiB

CONFIG = """
[limits]
max_frame_size = 1048576
slow_consumer_timeout = 1.0

[quotas]
broker_memory_total = {total}
user_memory_share = 0.25
connections = {connections}
refusals_before_drop = 20
"""

#: argv: socket, uid, pairs, seconds, body size. Prints one JSON line once its pairs are
#: set up ({"admitted", "refused", "refusal"}), then floods for ``seconds``, connecting
#: a new pair for every connection the broker drops, and prints {"reconnects"}.
FLOOD = textwrap.dedent("""
    import json, os, socket, sys, time
    from msgq_trio.protocol.codes import FrameType
    from msgq_trio.protocol.framing import FrameParser, encode_cbor, encode_frame
    path, uid, pairs, seconds, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
        float(sys.argv[4]), int(sys.argv[5])
    os.setgroups([])
    os.setgid(65534)
    os.setuid(uid)

    def raw(ftype, **kw):
        return b"".join(bytes(x) for x in encode_frame(ftype, **kw))

    HELLO = raw(FrameType.HELLO, header=encode_cbor({"version": 1, "name": "flood"}))
    refusal = ""

    def join():
        global refusal
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(HELLO)
        p = FrameParser()
        f = None
        while f is None:
            data = s.recv(65536)
            if not data:
                break
            p.feed(data)
            f = p.next_frame()
        if f is not None and f.type == FrameType.WELCOME:
            return s, f.header()["lname"]
        if f is not None:
            refusal = str(f.header().get("message"))
        s.close()
        return None, None

    def pair():
        r, lname = join()
        if r is None:
            return None
        s, _ = join()
        if s is None:
            r.close()
            return None
        s.setblocking(False)
        frame = raw(FrameType.MESSAGE, target=lname, body=bytes(size))
        return [r, s, memoryview(frame), 0]

    live, refused = [], 0
    for _ in range(pairs):
        p = pair()
        if p is None:
            refused += 1
        else:
            live.append(p)
    print(json.dumps({"admitted": len(live), "refused": refused, "refusal": refusal}), flush=True)
    end = time.monotonic() + seconds
    reconnects = 0
    while time.monotonic() < end:
        moved = False
        for p in list(live):
            try:
                n = p[1].send(p[2][p[3]:])
            except BlockingIOError:
                continue
            except OSError:  # dropped by the broker: push on with a new pair
                live.remove(p)
                p[0].close()
                p[1].close()
                q = pair()
                reconnects += 1
                if q is not None:
                    live.append(q)
                continue
            p[3] = (p[3] + n) % len(p[2])
            moved = True
        if not moved:
            time.sleep(0.01)
    print(json.dumps({"reconnects": reconnects}), flush=True)
""")


@pytest.fixture
def quota_broker(short_tmp: Path, broker_factory: Callable[..., Any]) -> Callable[..., Path]:
    """A broker whose socket anyone may open, with :data:`CONFIG`; returns its socket."""
    short_tmp.chmod(0o755)

    def start(total: int = 4 * USER_MEMORY, connections: int = 64) -> Path:
        conf = short_tmp / "quotas.toml"
        conf.write_text(CONFIG.format(total=total, connections=connections))
        sock = short_tmp / "q.sock"
        broker_factory("--config", str(conf), "--socket-mode", "0666", path=sock)
        return sock

    return start


def flood(sock: Path, pairs: int, seconds: float, size: int = 256 * 1024) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(sock), str(NOBODY), str(pairs), str(seconds), str(size)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def round_trips_during(
    sock: Path, proc: subprocess.Popen[str]
) -> tuple[list[float], list[int], list[dict[str, Any]]]:
    """While ``proc`` runs: a request/reply pair of the test's own user (root) calls
    without pause, and the broker's RSS and ``users`` rows are sampled. Returns the
    round-trip times, the RSS samples and the ``users`` rows that showed nobody."""
    times: list[float] = []
    rss: list[int] = []
    flooder_rows: list[dict[str, Any]] = []
    async with (
        msgq_trio.connect(sock, name="responder") as responder,
        msgq_trio.connect(sock, name="caller") as caller,
    ):
        responder.add_command("echo", lambda params: params)
        n = 0
        next_sample = 0.0
        while proc.poll() is None:
            t0 = trio.current_time()
            n += 1
            assert await caller.call(responder.lname, "echo", n, timeout=10) == n
            times.append(trio.current_time() - t0)
            if t0 >= next_sample:
                next_sample = t0 + 0.1
                stats = await caller.call("msgq", "stats", timeout=10)
                rss.append(stats["rss_bytes"])
                rows = await caller.call("msgq", "users", timeout=10)
                flooder_rows += [r for r in rows if r["user"] == f"uid:{NOBODY}"]
            await trio.sleep(0.005)
    return times, rss, flooder_rows


@needs_root
@pytest.mark.parametrize("pairs", [400, 2000])
def test_one_user_flooding_stays_within_its_share(
    quota_broker: Callable[..., Path], pairs: int
) -> None:
    """``pairs`` pairs from nobody: the broker admits the ``connections`` quota and
    refuses the rest naming the quota; nobody's queued bytes stop at its share (its
    senders held, then its fullest connections dropped, reason ``quota:memory``); the
    broker's RSS stays under the share plus a fixed overhead; and root's request/reply
    pair keeps answering throughout."""
    sock = quota_broker()

    async def main() -> tuple[list[float], list[int], list[dict[str, Any]], int]:
        async with msgq_trio.connect(sock, name="probe") as probe:
            base = (await probe.call("msgq", "stats"))["rss_bytes"]
        proc = flood(sock, pairs, seconds=3.0)
        try:
            times, rss, rows = await round_trips_during(sock, proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        lines = [json.loads(x) for x in out.splitlines()]
        setup = lines[0]
        assert setup["admitted"] == 32  # 64 connections: 32 pairs
        assert setup["refused"] == pairs - 32
        assert (
            f"quota 'connections' of user uid:{NOBODY} reached: 64 connections of 64"
            in (setup["refusal"])
        )
        return times, rss, rows, base

    times, rss, rows, base = trio.run(main)
    # The figures docs/SECURITY.md records (seen with pytest -s).
    print(
        f"\n{pairs} pairs: broker RSS {base / MiB:.1f} MiB before, at most "
        f"{max(rss) / MiB:.1f} MiB during; {len(times)} round trips, slowest "
        f"{max(times) * 1000:.1f} ms; nobody's highest queued bytes: "
        f"{max(r['use']['memory'] for r in rows) / MiB:.1f} MiB"
    )
    assert times and max(times) < 5.0  # every call answered, none waited on the flood
    assert max(rss) < base + USER_MEMORY + OVERHEAD, (base, max(rss))
    # ctl users showed nobody at its limits (not always both at once: the broker drops
    # its fullest connections, and it reconnects).
    assert {"connections", "memory"} <= {q for r in rows for q in r["at_limit"]}
    assert any(r["held"].get("memory") for r in rows)
    # Over its quota by one frame per receiver at most.
    assert max(r["use"]["memory"] for r in rows) <= USER_MEMORY + 32 * 300 * 1024


@needs_root
def test_flood_drop_names_the_quota(
    quota_broker: Callable[..., Path], short_tmp: Path, broker_factory: Callable[..., Any]
) -> None:
    """A sender held on a full user for ``slow_consumer_timeout`` gets that user's fullest
    connection dropped: membership ``disconnected`` with reason ``quota:memory``, and a
    log line with the uid and the figures."""
    sock = quota_broker()

    async def main() -> list[dict[str, Any]]:
        gone: list[dict[str, Any]] = []
        async with msgq_trio.connect(sock, name="watch") as watch:
            await watch.subscribe("msgq.membership")
            proc = flood(sock, 40, seconds=3.0)
            with trio.move_on_after(20):
                async for note in watch:
                    if note.header.get("event") == "disconnected":
                        gone.append(note.body)
                        if note.body["reason"] == "quota:memory":
                            break
            proc.kill()
            proc.communicate(timeout=30)
        return gone

    gone = trio.run(main)
    assert any(g["reason"] == "quota:memory" for g in gone), gone
    log = (sock.parent / "q.sock.log").read_text()
    assert f"quota 'memory' of user uid:{NOBODY} full" in log
    assert f"uid={NOBODY}" in log


def test_tightened_quota_keeps_use_and_refuses_new(quota_broker: Callable[..., Path]) -> None:
    """A reload that lowers ``quotas.subscriptions`` below a user's use drops none of its
    subscriptions; its next subscribe is refused limit-exceeded naming the quota; the
    quota in force shows in ``ctl users`` and ``ctl stats``."""
    sock = quota_broker()
    conf = sock.parent / "quotas.toml"

    async def main() -> None:
        async with (
            msgq_trio.connect(sock, name="subscriber") as sub,
            msgq_trio.connect(sock, name="ctl") as ctl,
        ):
            for g in ("A", "B", "C"):
                await sub.subscribe(g)
            conf.write_text(conf.read_text() + "subscriptions = 2\n")
            result = await ctl.call("msgq", "config-reload")
            assert {c["key"] for c in result["changed"]} == {"quotas.subscriptions"}
            assert sorted(await sub.call("msgq", "members", {"group": "A"}), key=str)
            with pytest.raises(RpcError) as exc:
                await sub.subscribe("D")
            assert exc.value.code == "limit-exceeded"
            assert f"quota 'subscriptions' of user uid:{os.geteuid()}" in str(exc.value)
            [row] = [r for r in await ctl.call("msgq", "users") if r["user"] == "uid:0"]
            assert row["use"]["subscriptions"] == 3 and row["limits"]["subscriptions"] == 2
            assert row["refused"] == {"subscriptions": 1}
            stats = await ctl.call("msgq", "stats")
            assert stats["quotas"]["users_at_limit"] == ["uid:0"]
            assert stats["counters"]["quota_refusals"] == 1

    trio.run(main)
