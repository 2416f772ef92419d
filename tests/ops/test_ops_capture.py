"""Traffic capture against a real broker: filters, the record format, rotation bounds,
overflow accounting, capture from the configuration, and the live ``msgq-trio dump``."""

from __future__ import annotations

import base64
import json
import subprocess

import cbor2
import trio
from ops_helpers import PY, ctl, read_records, wait_for

import msgq_trio


async def stop_capture(bus: msgq_trio.Bus) -> dict:
    """capture-stop, then wait until the capture wrote its buffer and closed its file."""
    await bus.call("msgq", "capture-stop")

    async def stopped() -> dict | None:
        st = await bus.call("msgq", "capture-status")
        return st if st["state"] in ("stopped", "failed") else None

    return await wait_for(stopped)


async def test_capture_filtered_by_sender_holds_exactly_its_frames(broker, short_tmp) -> None:
    """A capture filtered on one client's name holds every frame that client sent while it
    ran (messages, a request, a notification, an answer) and nothing else; the records
    carry the documented fields; the tap is None again once the capture stops."""
    cap = short_tmp / "cap"
    async with (
        msgq_trio.connect(broker.path, name="alpha") as alpha,
        msgq_trio.connect(broker.path, name="beta") as beta,
        msgq_trio.connect(broker.path, name="gamma") as gamma,
    ):
        await beta.subscribe("G")
        await alpha.subscribe("Alpha")

        @alpha.command("double")
        def double(params: dict) -> int:
            return 2 * params["n"]

        @beta.command("echo")
        def echo(params: object) -> object:
            return params

        st = await gamma.call(
            "msgq", "capture-start", {"dir": str(cap), "senders": ["alpha"], "body": "json"}
        )
        assert st["state"] == "running"
        assert (await gamma.call("msgq", "stats"))["capture"]["tap"] is True
        for i in range(20):
            await alpha.send("G", {"i": i})
            await gamma.send("G", {"i": -i})
        assert await alpha.call("G", "echo", {"x": 1}) == {"x": 1}  # command by alpha
        assert await beta.call("Alpha", "double", {"n": 21}) == 42  # answer by alpha
        await alpha.notify("G", "changed", {"zone": "example."})
        await gamma.notify("G", "changed", {"zone": "other."})
        for _ in range(40):
            await beta.receive(timeout=10)  # 20 + 20 messages
        await beta.receive(timeout=10)
        await beta.receive(timeout=10)  # the two notifications
        st = await stop_capture(gamma)
        assert (await gamma.call("msgq", "stats"))["capture"]["tap"] is False

    records = read_records(cap)
    assert st["records_written"] == len(records) == 23
    assert st["records_dropped"] == 0
    assert {(r["sender"], r["sender_name"]) for r in records} == {(alpha.lname, "alpha")}
    kinds = [r["kind"] for r in records]
    assert kinds.count("message") == 20
    assert kinds.count("command") == kinds.count("answer") == kinds.count("notification") == 1
    assert [r["body"] for r in records if r["kind"] == "message"] == [{"i": i} for i in range(20)]
    assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)
    cmd = next(r for r in records if r["kind"] == "command")
    assert cmd["command"] == "echo" and cmd["target"] == "G" and cmd["request_id"]
    assert cmd["reply_to"] is None and cmd["outcome"] == "delivered" and cmd["recipients"] == 1
    ans = next(r for r in records if r["kind"] == "answer")
    assert ans["target"] == beta.lname and ans["reply_to"] == ans["request_id"]
    assert ans["body"] == 42 and ans["outcome"] == "forwarded"
    note = next(r for r in records if r["kind"] == "notification")
    assert note["event"] == "changed" and note["body"] == {"zone": "example."}
    msg = records[0]
    assert set(msg) >= {
        "ts",
        "seq",
        "kind",
        "sender",
        "sender_name",
        "target",
        "request_id",
        "reply_to",
        "size",
        "outcome",
        "recipients",
        "command",
        "event",
        "code",
        "body",
        "body_encoding",
    }
    assert msg["body_encoding"] == "json" and msg["size"] > 32 and msg["recipients"] == 1
    assert isinstance(msg["ts"], float)


async def test_capture_kinds_targets_errors_membership_and_base64(broker, short_tmp) -> None:
    """Kind and target filters; broker-originated records (sender l.0/msgq): an error with
    its code and reply_to, membership events; bodies in base64 are the CBOR bytes."""
    cap = short_tmp / "cap2"
    async with (
        msgq_trio.connect(broker.path, name="op") as op,
        msgq_trio.connect(broker.path, name="watcher") as watcher,
    ):
        await watcher.subscribe("msgq.membership")
        await op.call(
            "msgq",
            "capture-start",
            {
                "dir": str(cap),
                "kinds": ["error", "membership", "message"],
                "targets": ["Nobody", "msgq.membership", op.lname],
                "body": "base64",
            },
        )
        await op.send("Nobody", [1, 2, 3])
        await op.send("Elsewhere", "not captured: other target")
        try:
            await op.call("Nobody", "anything")
        except msgq_trio.NoRecipient:
            pass
        async with msgq_trio.connect(broker.path, name="passerby"):
            pass
        for _ in range(2):
            await watcher.receive(timeout=10)  # connected, disconnected
        await stop_capture(op)
    records = read_records(cap)
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    assert set(by_kind) == {"message", "error", "membership"}
    (m,) = by_kind["message"]
    assert m["target"] == "Nobody" and m["outcome"] == "no-recipient" and m["recipients"] == 0
    assert cbor2.loads(base64.b64decode(m["body"])) == [1, 2, 3]
    errors = [r for r in by_kind["error"] if r["code"] == "no-recipient"]
    assert errors and errors[0]["sender"] == "l.0" and errors[0]["sender_name"] == "msgq"
    assert errors[0]["reply_to"] == errors[0]["request_id"] is not None
    events = [r["event"] for r in by_kind["membership"] if r["target"] == "msgq.membership"]
    assert "connected" in events and "disconnected" in events


async def test_rotation_bounds_number_and_size_of_files(broker, short_tmp) -> None:
    """With 4 KiB files and 3 kept, a long capture leaves at most 3 files, none over 4 KiB,
    holding the newest records without gaps."""
    cap = short_tmp / "rot"
    async with msgq_trio.connect(broker.path, name="chatty") as bus:
        await bus.call(
            "msgq",
            "capture-start",
            {
                "dir": str(cap),
                "max_bytes": 4096,
                "max_files": 3,
                "body": "base64",
                "senders": ["chatty"],
            },
        )
        for i in range(400):
            await bus.send("Nobody", {"i": i, "pad": "x" * 50})
        st = await stop_capture(bus)
    files = sorted(cap.glob("capture-*.jsonl"))
    assert 1 < len(files) <= 3
    assert all(f.stat().st_size <= 4096 for f in files), [f.stat().st_size for f in files]
    # 400 messages plus the capture-start request itself (chatty sent it).
    assert st["rotations"] >= 10 and st["records_written"] == 401
    records = read_records(cap)
    seqs = [r["seq"] for r in records]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous, newest kept
    assert seqs[-1] == 401 and records[-1]["body_encoding"] == "base64"
    assert [int(f.stem.split("-")[1]) for f in files] == sorted(
        int(f.stem.split("-")[1]) for f in files
    )


async def test_overflow_is_counted_and_written(broker, short_tmp) -> None:
    """A burst larger than the capture buffer loses records, never silently: a
    ``capture-dropped`` record in the file, counts in capture-status and stats."""
    cap = short_tmp / "ovf"
    async with msgq_trio.connect(broker.path, name="burst") as bus:
        await bus.call(
            "msgq",
            "capture-start",
            {"dir": str(cap), "buffer_records": 16, "flush_interval": 5.0, "senders": ["burst"]},
        )
        for i in range(500):
            await bus.send("Nobody", i)
        await bus.flush()
        st = await stop_capture(bus)
        stats = await bus.call("msgq", "stats")
    records = read_records(cap)
    drops = [r for r in records if r["kind"] == "capture-dropped"]
    assert drops, "no capture-dropped record"
    dropped = sum(r["dropped"] for r in drops)
    assert dropped == st["records_dropped"] > 0
    assert stats["capture"]["records_dropped_total"] >= dropped
    assert len(records) - len(drops) + dropped == 501  # with the capture-start request
    assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)


async def test_capture_from_configuration(broker_factory, short_tmp, write_config) -> None:
    """``[capture] enabled = true`` starts capturing at start with the file's filter; the
    ctl table shows it; an unusable directory refuses to start the broker."""
    cap = short_tmp / "fromconf"
    conf = write_config(
        f"[capture]\nenabled = true\ndir = '{cap}'\nkinds = ['message']\nflush_interval = 0.05\n"
    )
    b = broker_factory("--config", str(conf))
    async with msgq_trio.connect(b.path, name="x") as bus:
        await bus.send("Nobody", "hello")
        await bus.flush()
        await wait_for(lambda: any(r["kind"] == "message" for r in read_records(cap)))
        assert all(r["kind"] == "message" for r in read_records(cap))
    out = await ctl(b.path, "capture", "status", json_out=False)
    assert out.returncode == 0 and "capture: running" in out.stdout
    stopped = await ctl(b.path, "capture", "stop")
    assert stopped["state"] == "stopped"

    blocker = short_tmp / "file-not-dir"
    blocker.write_text("")
    conf2 = short_tmp / "bad-capture.toml"
    conf2.write_text(f"[capture]\nenabled = true\ndir = '{blocker}/sub'\n")
    r = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [
                PY,
                "-m",
                "msgq_trio",
                "serve",
                "--socket",
                str(short_tmp / "nc.sock"),
                "--config",
                str(conf2),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    )
    assert r.returncode == 1, r.stderr
    assert "cannot start" in r.stderr and "Traceback" not in r.stderr


async def test_dump_streams_matching_traffic_live(broker, short_tmp) -> None:
    """``msgq-trio dump --sender alpha --json`` prints alpha's frames as they pass, and
    only those; the text form names kind, sender and target."""

    def start(*flags: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [PY, "-m", "msgq_trio", "dump", "--socket", str(broker.path), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    proc = await trio.to_thread.run_sync(start, "--sender", "alpha", "--json", "--count", "5")
    text = await trio.to_thread.run_sync(start, "--kind", "notification", "--count", "1")
    try:
        async with (
            msgq_trio.connect(broker.path, name="alpha") as alpha,
            msgq_trio.connect(broker.path, name="beta") as beta,
        ):

            async def dumping() -> bool:
                return (await beta.call("msgq", "stats"))["capture"]["dump_clients"] == 2

            await wait_for(dumping)
            for i in range(5):
                await beta.send("G", {"beta": i})
                await alpha.send("G", {"alpha": i})
            await alpha.notify("G", "ping", {})
            out, err = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=20))
            out2, _ = await trio.to_thread.run_sync(lambda: text.communicate(timeout=20))
    finally:
        for p in (proc, text):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert proc.returncode == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    assert len(recs) == 5
    assert all(r["sender_name"] == "alpha" and r["kind"] == "message" for r in recs)
    assert text.returncode == 0
    assert "notification" in out2 and "(alpha) -> G" in out2 and "event=ping" in out2


async def test_capture_errors_are_clear(broker, short_tmp) -> None:
    """Bad capture parameters are refused with bad-request naming the key."""
    async with msgq_trio.connect(broker.path, name="op") as bus:
        for params, words in [
            ({"dir": str(short_tmp / "c"), "kinds": ["gossip"]}, "capture.kinds"),
            ({"dir": str(short_tmp / "c"), "max_files": 0}, "capture.max_files"),
            ({}, "capture.dir"),
            ({"dir": str(short_tmp / "c"), "body": "xml"}, "capture.body"),
        ]:
            try:
                await bus.call("msgq", "capture-start", params)
            except msgq_trio.errors.RemoteError as exc:
                assert exc.code == "bad-request" and words in exc.message, exc.message
            else:
                raise AssertionError(f"accepted {params}")
        assert (await bus.call("msgq", "capture-status"))["state"] == "off"


async def test_a_captured_large_message_holds_its_whole_body(broker, short_tmp) -> None:
    """A 4 MiB message is spliced through the broker (limits.splice_min_size), but with a
    capture on the core reads its rest back first: the record holds the whole body and
    the frame's full size, and the receiver gets the same bytes."""
    cap = short_tmp / "cap"
    body = bytes(range(256)) * (4 * 4096)
    async with (
        msgq_trio.connect(broker.path, name="big") as big,
        msgq_trio.connect(broker.path, name="sub") as sub,
    ):
        await sub.subscribe("G")
        await sub.call(
            "msgq", "capture-start", {"dir": str(cap), "senders": ["big"], "body": "base64"}
        )
        await big.send("G", body)
        assert (await sub.receive(timeout=10)).body == body
        await stop_capture(sub)
        st = await sub.call("msgq", "stats")
    assert st["spliced_frames"] == 1 and st["splice_pipes"] == 0
    (rec,) = read_records(cap)
    assert cbor2.loads(base64.b64decode(rec["body"])) == body
    assert rec["size"] > len(body)
