"""The garbage client's verdicts on hostile frames (msgq_trio/scenario/clients.py), with
the exact frames the million-frame run (scenarios/hostile-frames-1m.toml) reported hung.

Those were `mutated` frames truncated exactly 46 bytes short of what their length prefix
announced: the ping probe sent after them (46 bytes) completed the truncated MESSAGE,
which is valid, to a group without members, so the broker rightly said nothing and kept
the connection. The client must see that from the bytes (``probe_fate``) and probe again,
not report a hang; and its ``wait`` must outlast the broker timeout a frame left open
takes (``_check_garbage_wait``). Real broker processes on temporary sockets.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame
from msgq_trio.scenario.clients import (
    Ctx,
    Garbage,
    RawConn,
    build_garbage,
    garbage_rng,
    probe_fate,
)
from msgq_trio.scenario.model import ROLES, ScenarioError, load_scenario, with_params

MAX = 64 << 20
#: The hung jobs of one garbage process of the recorded million-frame run (seed 11,
#: 20,834 rounds) and their bytes: a MESSAGE to "Void" announcing 84 bytes, sent 38.
HUNG = {
    77783: "00000050030000040000000000000000000000ed000000000000000000000030566f6964a261",
    113567: "0000005003000004000000000000000000000000000000000000000000000030566f6964a261",
    120263: "000000500300000400000000000000000000000000006f000000000000000030566f6974a261",
    206327: "0000005003000004000000000000000000000000000000000000000000000030566f6964a261",
    234551: "0000005003000004000000000000000000000000008000000000000000000030566f6964a261",
    381143: "0000005003000004000000000000000000000000000000000000000000000030566f6964a2f5",
    384935: "0000005003000004000000000000000000000000000000000000000000000030566f6964a261",
    451559: "0000005003000004000000000000000000000000000000000000000000000030566f6964a261",
}
HOSTILE = Path(__file__).resolve().parent.parent / "scenarios" / "hostile-frames-1m.toml"


class _StopWhenDone(Ctx):
    """The runner's part, in process: ``stop`` as soon as the role is done."""

    def done(self) -> None:
        super().done()
        self.stop.set()


def _ping(rid: int) -> bytes:
    return b"".join(
        bytes(b)
        for b in encode_frame(
            FrameType.REQUEST, target="msgq", request_id=rid, header=encode_cbor({"cmd": "ping"})
        )
    )


def test_the_hung_frames_replay_and_swallow_the_probe() -> None:
    """The printed (job, seed) rebuild the very bytes, and the broker's framing reads the
    probe that follows them as the rest of a frame (with one more probe, in sync)."""
    probe = _ping(1)
    assert len(probe) == 46
    for job, hexed in HUNG.items():
        sent = build_garbage("mutated", garbage_rng(11, job), MAX)
        assert sent.hex() == hexed, job
        assert probe_fate(sent, probe, MAX) == "swallowed", job
        assert probe_fate(sent + probe, _ping(2), MAX) == "frame", job


def test_probe_fate_tells_every_case() -> None:
    probe = _ping(7)
    message = b"".join(bytes(b) for b in encode_frame(FrameType.MESSAGE, target="Void", body=b"x"))
    assert probe_fate(b"", probe, MAX) == "frame"
    assert probe_fate(message, probe, MAX) == "frame"
    # Announces more than the probe brings: the broker waits (idle_in_frame_timeout).
    assert probe_fate(struct.pack(">I", 200) + message[4:], probe, MAX) == "partial"
    assert probe_fate(message[:2], probe[:1], MAX) == "partial"
    # Lengths the broker refuses at once.
    assert probe_fate(b"\xff\xff\xff\xff", probe, MAX) == "error"
    assert probe_fate(struct.pack(">I", 4), probe, MAX) == "error"
    # A message announcing exactly the probe's length more than it brings: the probe
    # completes it.
    swallowing = struct.pack(">I", len(message) - 4 + len(probe)) + message[4:]
    swallowing = swallowing[:28] + struct.pack(">I", 1 + len(probe)) + swallowing[32:]
    assert probe_fate(swallowing, probe, MAX) == "swallowed"


async def test_broker_owes_no_answer_to_the_swallowed_probe(
    broker_factory: Callable[..., Any],
) -> None:
    """The broker's side of the story, with the exact bytes: it routes the completed
    message (to nobody), is not left inside a frame (no idle_in_frame_timeout drop after
    three times that timeout), and answers the next ping at once."""
    b = broker_factory("--idle-in-frame-timeout", "0.5", "--handshake-timeout", "0.5")
    conn = await RawConn.open(str(b.path))
    try:
        w = await conn.hello("hostile")
        assert w is not None and w.type == FrameType.WELCOME
        await conn.send(bytes.fromhex(HUNG[77783]) + _ping(1))
        with trio.move_on_after(1.5) as silent:
            f = await conn.frame()
            pytest.fail(f"the broker answered the swallowed probe: {f}")
        assert silent.cancelled_caught
        await conn.send(_ping(2))
        with trio.fail_after(10):
            f = await conn.frame()
        assert f is not None and f.type == FrameType.REPLY and f.request_id == 2, f
    finally:
        await conn.aclose()


async def test_garbage_client_judges_the_hung_frames_served(
    broker_factory: Callable[..., Any],
) -> None:
    """The garbage client, on the frames it once reported hung and on ones its probe
    follows normally or leaves inside a frame: each is served or dropped with an ERROR,
    within the client's wait; none is unexpected."""
    b = broker_factory("--idle-in-frame-timeout", "0.5", "--handshake-timeout", "0.5")
    params = {**ROLES["garbage"].params, "kinds": ["mutated"], "seed": 11, "wait": 5.0}
    ctx = Ctx("garbage", str(b.path), "garbage", 0, params)
    client = Garbage(ctx)
    probe = _ping(1)
    fates: dict[str, list[int]] = {"frame": [], "partial": [], "error": []}
    for r in range(2000):
        job = r * 24 + 23
        fate = probe_fate(build_garbage("mutated", garbage_rng(11, job), MAX), probe, MAX)
        if fate in fates and len(fates[fate]) < 4:
            fates[fate].append(job)
    jobs = [*HUNG, *(j for js in fates.values() for j in js)]
    assert len(jobs) == 8 + 12
    limiter = trio.CapacityLimiter(len(jobs))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            for job in jobs:
                n.start_soon(client._one, "mutated", garbage_rng(11, job), limiter, job, 11)
    counts = ctx.counts
    assert counts["sent"] == len(jobs)
    assert counts["unexpected"] == 0 and counts["hung"] == 0, dict(counts)
    assert counts["probe_swallowed"] == len(HUNG)
    # The once-hung ones are valid messages: served (the others may be invalid frames).
    assert counts["survived"] >= len(HUNG), dict(counts)
    # A frame left open is dropped by the broker's idle_in_frame_timeout, with an ERROR.
    assert counts["error.protocol-error"] >= len(fates["partial"]), dict(counts)


def test_wait_must_outlast_the_broker_timeout_it_may_need(tmp_path: Path) -> None:
    sc = load_scenario(HOSTILE)
    assert with_params(sc, ["garbage.wait=1.5"]).client("garbage").params["wait"] == 1.5
    for wait in ("1", "0.5"):
        with pytest.raises(ScenarioError, match="must exceed the broker's"):
            with_params(sc, [f"garbage.wait={wait}"])
    # Kinds the broker answers at once need no such wait.
    fast = with_params(sc, ["garbage.kinds=['huge-length']", "garbage.wait=0.5"])
    assert fast.client("garbage").params["wait"] == 0.5
    # Without flags, the defaults apply (idle_in_frame_timeout 30 s).
    f = tmp_path / "s.toml"
    f.write_text(
        'summary = "s"\nfault = "f"\nbroker_does = "b"\n'
        '[[clients]]\nname = "g"\nrole = "garbage"\n'
        'params = { kinds = ["mutated"], wait = 10.0 }\n'
    )
    with pytest.raises(ScenarioError, match=r"idle-in-frame-timeout \(30.0 s\)"):
        load_scenario(f)


async def test_each_process_sends_its_own_frames(broker_factory: Callable[..., Any]) -> None:
    """Process ``i`` of a garbage client uses ``seed + i``: with seed 330, process 1's
    first mutation is the one of seed 331, a message its probe completes, and process
    0's (seed 330) is another. The same seed in both would send the same frames twice."""
    b = broker_factory("--idle-in-frame-timeout", "0.5", "--handshake-timeout", "0.5")
    probe = _ping(1)
    assert probe_fate(build_garbage("mutated", garbage_rng(331, 0), MAX), probe, MAX) == "swallowed"
    assert probe_fate(build_garbage("mutated", garbage_rng(330, 0), MAX), probe, MAX) != "swallowed"
    params = {
        **ROLES["garbage"].params,
        "kinds": ["mutated"],
        "repeat": 1,
        "concurrency": 1,
        "seed": 330,
        "wait": 5.0,
    }
    ctxs = [_StopWhenDone("garbage", str(b.path), "garbage", i, dict(params)) for i in (0, 1)]
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            for ctx in ctxs:
                ctx.go.set()
                n.start_soon(Garbage(ctx).run)
    assert [c.counts["sent"] for c in ctxs] == [1, 1]
    assert [c.counts["probe_swallowed"] for c in ctxs] == [0, 1]
    assert [c.counts["unexpected"] for c in ctxs] == [0, 0]


@pytest.mark.parametrize(("behaviour", "outcome"), [("close", "eof"), ("stall", "hung")])
async def test_a_broker_breaking_its_promise_is_reported(
    short_tmp: Path, behaviour: str, outcome: str
) -> None:
    """The other side of the verdict: a peer that welcomes the garbage client and then
    closes without an ERROR, or neither answers nor closes, is reported (``unexpected``,
    with the outcome), also for a mutated frame, whatever the mutation."""
    path = str(short_tmp / "fake.sock")
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(path)
    listener.listen(8)
    welcome = b"".join(
        bytes(x)
        for x in encode_frame(
            FrameType.WELCOME, header=encode_cbor({"version": 1, "lname": "g.1", "limits": {}})
        )
    )

    async def serve() -> None:
        while True:
            sock, _ = await listener.accept()
            stream = trio.SocketStream(sock)
            await stream.receive_some(1 << 16)  # HELLO
            await stream.send_all(welcome)
            if behaviour == "close":
                await stream.aclose()
            else:
                held.append(stream)

    held: list[trio.SocketStream] = []
    params = {**ROLES["garbage"].params, "kinds": ["mutated"], "seed": 11, "wait": 1.0}
    ctx = Ctx("garbage", path, "garbage", 0, params)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            n.start_soon(serve)
            await Garbage(ctx)._one("mutated", garbage_rng(11, 23), trio.CapacityLimiter(1), 23, 11)
            n.cancel_scope.cancel()
    for s in held:
        await s.aclose()
    listener.close()
    assert ctx.counts[outcome] == 1 and ctx.counts["unexpected"] == 1, dict(ctx.counts)
