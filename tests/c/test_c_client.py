"""libmsgq and msgq-c against the real broker and the Python clients, both directions.

Every test runs with the plain and the sanitized (ASan+UBSan) build (fixture ``cbuild``):
a sanitizer report fails the process with status 86/87 and the test with it.
"""

from __future__ import annotations

import base64
import errno
import json
import math
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from libmsgq_build import CBuild, CProcess, check_clean
from libmsgq_py import Connection, MsgqError, load

import msgq_trio
from msgq_trio.protocol.codes import ErrorCode, FrameType
from msgq_trio.protocol.framing import encode_cbor

# The C client is another process: give it time on a loaded machine, never a hang.
RUN_TIMEOUT = 60.0


async def run_c(build: CBuild, *args: str, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    """Run msgq-c to completion while this test's trio tasks (the Python clients that
    answer it) keep running."""
    with trio.fail_after(RUN_TIMEOUT):
        r: subprocess.CompletedProcess[bytes] = await trio.run_process(
            [build.msgq_c, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=build.env,
            **kw,
        )
    check_clean(r.stderr.decode(errors="replace"))
    return r


def b64(data: bytes) -> dict[str, str]:
    return {"$bytes": base64.b64encode(data).decode()}


#: Python values of every CBOR kind a body can carry, as sent and as echoed back.
EVERY_KIND: dict[str, Any] = {
    "nested": {"a": {"b": {"c": [1, [2, [3, {"d": None}]]]}}, "empty": {}, "list": []},
    "array": [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32, 2**63 - 1, -1, -24, -25, -(2**63)],
    "bytes": b"\x00\x01\xfe\xff" * 10,
    "empty_bytes": b"",
    "big": 2**64 - 1,
    "bigger": 2**70,
    "negative_big": -(2**64),
    "negative_bigger": -(2**70) - 12345,
    "floats": [0.0, -0.0, 1.5, -2.25, 1e300, 5e-324, math.inf, -math.inf],
    "text": "naïve café — ünïcödé ☃ 日本語 \U0001f600",
    "bools": [True, False, None],
    "int_keys": {1: "one", -2: "minus two"},
}


async def test_error_codes_match_the_registry(c_plain: CBuild) -> None:
    """The C enum lists exactly the wire codes of codes.py, in order: they cannot drift."""
    r = await run_c(c_plain, "codes")
    assert r.returncode == 0
    assert r.stdout.decode().split() == [c.value for c in ErrorCode]


async def test_python_calls_c_echo_with_every_cbor_kind(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess]
) -> None:
    """msgq-c echo answers a Python call with the params as sent, for every CBOR kind,
    reached by group, G[0] and G[?]."""
    echo = c_process(cbuild, "echo", "-s", str(broker.path), "Echo")
    lname = await trio.to_thread.run_sync(echo.wait_ready)
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        for target in ("Echo", "Echo[0]", "Echo[?]", lname):
            assert await bus.call(target, "echo", EVERY_KIND) == EVERY_KIND
        for value in EVERY_KIND.values():
            assert await bus.call("Echo", "echo", value) == value
        nan = await bus.call("Echo", "echo", math.nan)
        assert math.isnan(nan)
        assert await bus.call("Echo", "echo") is None
        with pytest.raises(msgq_trio.RemoteError) as ei:
            await bus.call("Echo", "nope", 1)
        assert ei.value.code == "unknown-command"
        assert ei.value.data == ["echo"]
    assert echo.stop() == 0
    check_clean(echo.stderr())


async def test_c_echo_answers_attachments_and_fds(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess], short_tmp: Path
) -> None:
    """A request's attachments and descriptors come back in the C handler's answer."""
    echo = c_process(cbuild, "echo", "-s", str(broker.path), "Echo")
    await trio.to_thread.run_sync(echo.wait_ready)
    f = short_tmp / "data.txt"
    f.write_bytes(b"content of the file")
    fd = os.open(f, os.O_RDONLY)
    try:
        async with msgq_trio.connect(str(broker.path), name="py") as bus:
            answer = await bus.request(
                "Echo", "echo", {"x": 1}, attachments=[b"\x00blob\xff", b""], fds=[fd]
            )
            with answer:
                assert answer.body == {"x": 1}
                assert [bytes(a) for a in answer.attachments] == [b"\x00blob\xff", b""]
                (got,) = answer.take_fds()
            try:
                assert os.pread(got, 100, 0) == b"content of the file"
                assert os.fstat(got).st_ino == os.fstat(fd).st_ino
            finally:
                os.close(got)
    finally:
        os.close(fd)
    assert echo.stop() == 0
    check_clean(echo.stderr())


async def test_c_calls_python_handler(cbuild: CBuild, broker: Any) -> None:
    """msgq-c call prints a Python handler's result as one JSON line (bytes and integers
    beyond 64 bits in the documented form), exit 0."""
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        await bus.subscribe("Py")
        seen: list[Any] = []

        @bus.command("greet")
        def greet(params: Any) -> Any:
            seen.append(params)
            return {
                "hello": params["name"],
                "raw": b"\x00\xff",
                "big": 2**70,
                "neg": -(2**70),
                "edges": [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 1.5, math.inf],
            }

        r = await run_c(
            cbuild,
            "call",
            "-s",
            str(broker.path),
            "Py",
            "greet",
            '{"name": "wörld", "n": [1, 2.5]}',
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().count("\n") == 1
    assert json.loads(r.stdout) == {
        "hello": "wörld",
        "raw": b64(b"\x00\xff"),
        "big": {"$bigint": str(2**70)},
        "neg": {"$bigint": str(-(2**70))},
        "edges": [
            2**63 - 1,
            {"$bigint": str(2**63)},
            -(2**63),
            {"$bigint": str(-(2**63) - 1)},
            1.5,
            {"$float": "inf"},
        ],
    }
    assert seen == [{"name": "wörld", "n": [1, 2.5]}]


async def test_c_call_errors(cbuild: CBuild, broker: Any) -> None:
    """Failures print ``error: CODE: MESSAGE`` on stderr and exit 1: no-recipient, a
    handler's own code, unknown-command."""
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        await bus.subscribe("Py")

        @bus.command("fail")
        def fail(params: Any) -> Any:
            raise msgq_trio.CommandFailed("my-code", "it went wrong", {"why": params})

        r = await run_c(cbuild, "call", "-s", str(broker.path), "Nobody", "x")
        assert r.returncode == 1
        assert r.stderr.decode().startswith("error: no-recipient: ")
        assert r.stdout == b""
        r = await run_c(cbuild, "call", "-s", str(broker.path), "Py", "fail", "7")
        assert (r.returncode, r.stderr.decode()) == (1, "error: my-code: it went wrong\n")
        r = await run_c(cbuild, "call", "-s", str(broker.path), "Py", "nothing")
        assert r.returncode == 1
        assert r.stderr.decode().startswith("error: unknown-command: ")
    r = await run_c(cbuild, "call", "-s", str(broker.path) + ".none", "Py", "x")
    assert r.returncode == 1
    assert "cannot connect to the broker" in r.stderr.decode()


async def test_python_sends_to_c_listener(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess], short_tmp: Path
) -> None:
    """msgq-c listen prints one JSON line per message and notification, with the
    sender, attachments (base64) and descriptors (a regular file's content)."""
    listen = c_process(cbuild, "listen", "-s", str(broker.path), "G")
    await trio.to_thread.run_sync(listen.wait_ready)
    f = short_tmp / "f.txt"
    f.write_bytes(b"file body")
    fd = os.open(f, os.O_RDONLY)
    try:
        async with msgq_trio.connect(str(broker.path), name="sender") as bus:
            await bus.send("G", {"k": b"\x01\x02", "t": "ä"}, attachments=[b"att"], fds=[fd])
            await bus.notify("G", "changed", [1, None])
            first = json.loads(await trio.to_thread.run_sync(listen.readline))
            second = json.loads(await trio.to_thread.run_sync(listen.readline))
            lname = bus.lname
    finally:
        os.close(fd)
    assert first == {
        "kind": "message",
        "sender": lname,
        "sender_name": "sender",
        "target": "G",
        "body": {"k": b64(b"\x01\x02"), "t": "ä"},
        "attachments": [b64(b"att")],
        "fds": [b64(b"file body")],
    }
    assert second["kind"] == "notify"
    assert second["event"] == "changed"
    assert second["body"] == [1, None]
    assert listen.stop() == 0
    check_clean(listen.stderr())


async def test_c_listener_takes_a_burst_in_order(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess]
) -> None:
    """A burst of small messages that piles up while the listener is stopped (SIGSTOP)
    reaches it as reads of many frames each, several ending in a partial frame: every
    message is delivered once, in order, and the count is exact."""
    n = 20000
    listen = c_process(cbuild, "listen", "-s", str(broker.path), "G")
    await trio.to_thread.run_sync(listen.wait_ready)
    listen.proc.send_signal(signal.SIGSTOP)
    try:
        async with msgq_trio.connect(str(broker.path), name="burst") as bus:
            await bus.send_many("G", range(n))
            await bus.send("G", "end")
            await trio.sleep(0.5)  # let the broker fill the listener's socket
            listen.proc.send_signal(signal.SIGCONT)

            def read_all() -> list[Any]:
                out = []
                while not out or out[-1] != "end":
                    out.append(json.loads(listen.readline(timeout=30))["body"])
                return out

            bodies = await trio.to_thread.run_sync(read_all)
    finally:
        listen.proc.send_signal(signal.SIGCONT)
    assert bodies == [*range(n), "end"]
    assert listen.stop() == 0
    check_clean(listen.stderr())


async def test_c_hears_membership_events(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess]
) -> None:
    """Subscribed to msgq.membership, the C client sees a Python client come and go."""
    listen = c_process(cbuild, "listen", "-s", str(broker.path), "msgq.membership")
    await trio.to_thread.run_sync(listen.wait_ready)
    async with msgq_trio.connect(str(broker.path), name="visitor") as bus:
        lname = bus.lname
        await bus.subscribe("Room")
    events = []
    while len(events) < 4:
        ev = json.loads(await trio.to_thread.run_sync(listen.readline))
        if ev["body"].get("lname") == lname:
            events.append((ev["event"], ev["body"].get("group")))
    assert events == [
        ("connected", None),
        ("subscribed", "Room"),
        ("unsubscribed", "Room"),
        ("disconnected", None),
    ]
    assert listen.stop() == 0


async def test_c_sends_message_with_attachment_and_fd(
    cbuild: CBuild, broker: Any, short_tmp: Path
) -> None:
    """msgq-c send delivers the body, an attachment and a descriptor to a Python client;
    msgq-c notify delivers a notification."""
    f = short_tmp / "g.txt"
    f.write_bytes(b"passed along")
    fd = os.open(f, os.O_RDONLY)
    try:
        async with msgq_trio.connect(str(broker.path), name="py") as bus:
            await bus.subscribe("Sink")
            r = await run_c(
                cbuild,
                "send",
                "-s",
                str(broker.path),
                "-b",
                "blob!",
                "-f",
                str(fd),
                "Sink",
                '{"n": 1, "b": {"$bytes": "AP8="}}',
                pass_fds=(fd,),
            )
            assert r.returncode == 0, r.stderr
            r = await run_c(cbuild, "notify", "-s", str(broker.path), "Sink", "evt", "[true]")
            assert r.returncode == 0, r.stderr
            with trio.fail_after(10):
                msg = await bus.receive()
                with msg:
                    assert msg.body == {"n": 1, "b": b"\x00\xff"}
                    assert [bytes(a) for a in msg.attachments] == [b"blob!"]
                    assert msg.sender_name == "msgq-c"
                    (got,) = msg.take_fds()
                note = await bus.receive()
            assert (note.kind, note.event, note.body) == ("notification", "evt", [True])
            try:
                assert os.pread(got, 100, 0) == b"passed along"
            finally:
                os.close(got)
    finally:
        os.close(fd)


async def test_many_async_calls_from_own_loop(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess]
) -> None:
    """N calls started at once and driven by the caller's own poll loop (get_fd,
    get_events, get_timeout, process) each get their answer."""
    echo = c_process(cbuild, "echo", "-s", str(broker.path), "Echo")
    await trio.to_thread.run_sync(echo.wait_ready)
    r = await run_c(
        cbuild, "pcall", "-s", str(broker.path), "50", "Echo", "echo", '{"v": [1, "x"]}'
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines() == ['{"v":[1,"x"]}'] * 50
    r = await run_c(cbuild, "pcall", "-s", str(broker.path), "3", "Nobody", "x")
    assert [json.loads(line)["error"] for line in r.stdout.decode().splitlines()] == [
        "no-recipient"
    ] * 3
    assert echo.stop() == 0


async def test_async_call_gets_the_structured_error(cbuild: CBuild, broker: Any) -> None:
    """An asynchronous call's callback gets the handler's code, message and CBOR data."""
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        await bus.subscribe("Py")

        @bus.command("fail")
        def fail(params: Any) -> Any:
            raise msgq_trio.CommandFailed("no-zone", "zone unknown", {"zone": params, "b": b"\x01"})

        r = await run_c(cbuild, "pcall", "-s", str(broker.path), "2", "Py", "fail", '"example."')
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.decode().splitlines()] == [
        {
            "error": "no-zone",
            "message": "zone unknown",
            "data": {"zone": "example.", "b": b64(b"\x01")},
        }
    ] * 2


async def test_c_component_api(cbuild: CBuild, broker: Any, short_tmp: Path) -> None:
    """Through the C API (clients/c/tests/api_check.c): subscribe/unsubscribe report
    whether they changed anything, a request kept and answered later, a handler that
    does not answer (internal-error), blocking calls from inside a handler (to Python,
    and unsubscribe), the error of a nested call passed on with its data, a descriptor
    and an attachment taken from a call's answer."""
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        await bus.subscribe("Py")

        @bus.command("ping")
        def ping(params: Any) -> Any:
            if params == "fail":
                raise msgq_trio.CommandFailed("nope", "asked to fail", [1, 2])
            return {"pong": params}

        shared = short_tmp / "shared.txt"
        shared.write_bytes(b"read through the descriptor")

        @bus.command("file")
        def file(params: Any) -> msgq_trio.Reply:
            fd = os.open(shared, os.O_RDONLY)
            try:
                return msgq_trio.Reply(None, fds=[fd], attachments=[b"\x00att"])
            finally:
                os.close(fd)  # Reply sends a duplicate

        err = os.open(short_tmp / "api.err", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            proc = await trio.lowlevel.open_process(
                [str(cbuild.dir / "api-check"), str(broker.path)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=cbuild.env,
            )
        finally:
            os.close(err)
        try:
            assert proc.stdout is not None
            with trio.fail_after(RUN_TIMEOUT):
                out = b""
                while b"\n" not in out:
                    chunk = await proc.stdout.receive_some()
                    assert chunk, (short_tmp / "api.err").read_text()
                    out += chunk
            assert out == b"subscribe 1 0\n"
            assert await bus.call("ApiC", "later") == "later-done"
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await bus.call("ApiC", "silent")
            assert (ei.value.code, ei.value.message) == ("internal-error", "handler did not answer")
            assert await bus.call("ApiC", "callback", [1, "ü"]) == {"pong": [1, "ü"]}
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await bus.call("ApiC", "callback", "fail")
            assert (ei.value.code, ei.value.data) == ("nope", [1, 2])
            assert await bus.call("ApiC", "fetch") == [b"read through the descriptor", b"\x00att"]
            assert await bus.call("ApiC", "leave") == [True, False]
            with pytest.raises(msgq_trio.NoRecipient):
                await bus.call("ApiC", "later")
        finally:
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(RUN_TIMEOUT):
                status = await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
    stderr = (short_tmp / "api.err").read_text()
    assert status == 0, stderr
    check_clean(stderr)


async def test_recipient_gone_when_python_callee_is_killed(
    cbuild: CBuild, broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """A C call to a Python handler fails recipient-gone when the callee is SIGKILLed
    while the call is pending."""
    helper = spawn_client(broker.path, name="hanger", groups=["Hang"], commands={"work": "hang"})
    async with trio.open_nursery() as nursery:
        result: list[subprocess.CompletedProcess[bytes]] = []

        async def call() -> None:
            result.append(await run_c(cbuild, "call", "-s", str(broker.path), "Hang", "work", "{}"))

        nursery.start_soon(call)
        assert (await helper.areadline(30)).startswith("got ")
        helper.sigkill()
    (r,) = result
    assert r.returncode == 1
    assert r.stderr.decode().startswith("error: recipient-gone: ")


async def test_broker_killed_under_a_blocking_call(
    cbuild: CBuild, broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """SIGKILL of the broker under a blocking call: the call fails connection-lost at
    once (never a hang)."""
    helper = spawn_client(broker.path, name="hanger", groups=["Hang"], commands={"work": "hang"})
    async with trio.open_nursery() as nursery:
        result: list[subprocess.CompletedProcess[bytes]] = []

        async def call() -> None:
            result.append(await run_c(cbuild, "call", "-s", str(broker.path), "Hang", "work", "{}"))

        nursery.start_soon(call)
        assert (await helper.areadline(30)).startswith("got ")
        broker.kill()
    (r,) = result
    assert r.returncode == 1
    assert r.stderr.decode().startswith("error: connection-lost: ")
    assert "without GOODBYE" in r.stderr.decode()


async def test_broker_shutdown_under_a_blocking_call(
    cbuild: CBuild, broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """A broker that shuts down (SIGTERM) under a call: the call fails with its reason."""
    helper = spawn_client(broker.path, name="hanger", groups=["Hang"], commands={"work": "hang"})
    async with trio.open_nursery() as nursery:
        result: list[subprocess.CompletedProcess[bytes]] = []

        async def call() -> None:
            result.append(await run_c(cbuild, "call", "-s", str(broker.path), "Hang", "work", "{}"))

        nursery.start_soon(call)
        assert (await helper.areadline(30)).startswith("got ")
        helper.sigkill()  # so the broker is not waiting on the handler
        broker.send_signal(signal.SIGTERM)
    (r,) = result
    assert r.returncode == 1
    assert r.stderr.decode().split(":")[1].strip() in ("recipient-gone", "broker-shutdown")


async def test_malformed_request_from_a_sender_is_answered_bad_request(
    cbuild: CBuild, broker: Any, c_process: Callable[..., CProcess], raw_peer: Any
) -> None:
    """A request whose params are not CBOR reaches the C handler's library as the
    sender's bug: answered bad-request, the C client carries on."""
    from msgq_trio.protocol.codes import FrameType
    from msgq_trio.protocol.framing import encode_cbor

    echo = c_process(cbuild, "echo", "-s", str(broker.path), "Echo")
    await trio.to_thread.run_sync(echo.wait_ready)
    async with raw_peer(broker.path) as peer:
        await peer.hello()
        for rid, (header, body) in enumerate(
            [
                (encode_cbor({"cmd": "echo"}), b"\xff\xff"),  # not CBOR
                (encode_cbor({"cmd": "echo"}), b"\x01\x02"),  # trailing bytes
            ],
            start=1,
        ):
            await peer.send_frame(
                FrameType.REQUEST, target="Echo", request_id=rid, header=header, body=body
            )
            answer = await peer.receive_frame()
            assert answer is not None and answer.type == FrameType.ERROR
            assert answer.request_id == rid
            assert answer.header()["code"] == "bad-request"
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        assert await bus.call("Echo", "echo", [1]) == [1]
    assert echo.stop() == 0
    check_clean(echo.stderr())


async def test_cxx_example_answers_and_calls_python(
    cbuild: CBuild, broker: Any, short_tmp: Path
) -> None:
    """The C++ example of docs/C-CLIENT.md calls a Python component and answers one."""
    async with msgq_trio.connect(str(broker.path), name="py") as bus:
        await bus.subscribe("PyDemo")

        @bus.command("greet")
        def greet(params: Any) -> str:
            return "hello " + params["name"]

        log = short_tmp / "cxx.err"
        err = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            proc = await trio.lowlevel.open_process(
                [cbuild.example, str(broker.path)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=cbuild.env,
            )
        finally:
            os.close(err)
        try:
            assert proc.stdout is not None
            with trio.fail_after(RUN_TIMEOUT):
                out = b""
                while b"\n" not in out:
                    chunk = await proc.stdout.receive_some()
                    assert chunk, log.read_text()
                    out += chunk
            assert out.decode() == "PyDemo says: hello C++\n"
            assert await bus.call("CxxDemo", "sum", [1, 2, 3, 2**40]) == 6 + 2**40
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await bus.call("CxxDemo", "sum", "no")
            assert ei.value.code == "bad-request"
        finally:
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(RUN_TIMEOUT):
                status = await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
    assert status == 0, log.read_text()
    check_clean(log.read_text())


#: Broker bounds for the backpressure tests: a receiver over 64 KiB stops the broker
#: reading its senders at once, and a receiver that reads nothing is not dropped during
#: the test (slow_consumer_timeout).
SMALL_BOUNDS = ("--out-soft-limit", "65536", "--slow-consumer-timeout", "120")
#: 200 x 64 KiB: far more than the broker's bound, the socket buffers and the library's
#: own 1 MiB bound (max_out_bytes) together.
FLOOD = ("-n", "200", "-z", "65536")


async def test_nonblocking_send_reports_eagain_at_the_bound(
    cbuild: CBuild, broker_factory: Any, raw_peer: Any
) -> None:
    """In nonblocking mode a send over max_out_bytes fails EAGAIN: what the library
    holds never exceeds the bound by more than one frame."""
    broker = broker_factory(*SMALL_BOUNDS)
    async with raw_peer(broker.path) as peer:
        await peer.hello()
        await peer.subscribe("Stuck")  # and never reads again
        r = await run_c(cbuild, "send", "-s", str(broker.path), "-N", *FLOOD, "Stuck", "null")
    assert r.returncode == 3, r.stderr
    words = r.stderr.decode().split()
    sent, queued = int(words[3]), int(words[5])
    assert 0 < sent < 200
    assert 1024 * 1024 <= queued <= 1024 * 1024 + 65536 + 64


async def test_blocking_send_waits_for_the_receiver(
    cbuild: CBuild, broker_factory: Any, raw_peer: Any, c_process: Callable[..., CProcess]
) -> None:
    """In blocking mode a send over the bound waits (the process neither finishes nor
    fails while the receiver reads nothing) and completes once it reads: every message
    arrives, in order."""
    broker = broker_factory(*SMALL_BOUNDS)
    async with raw_peer(broker.path) as peer:
        await peer.hello()
        await peer.subscribe("Stuck")
        sender = c_process(cbuild, "send", "-s", str(broker.path), *FLOOD, "Stuck", "7")
        await trio.sleep(1.5)
        assert sender.proc.poll() is None, sender.stderr()
        for _ in range(200):
            f = await peer.receive_frame(timeout=30)
            assert f is not None
            assert f.n_blobs == 1 and f.body() == 7
        status = await trio.to_thread.run_sync(sender.proc.wait, 60)
    assert status == 0, sender.stderr()
    check_clean(sender.stderr())


async def test_call_with_a_timeout_gets_the_brokers_timeout(
    cbuild: CBuild, broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """``-t`` sends the broker a deadline: a handler that never answers yields the
    broker's ``timeout`` error, exit 1."""
    spawn_client(broker.path, name="hanger", groups=["Hang"], commands={"work": "hang"})
    r = await run_c(cbuild, "call", "-s", str(broker.path), "-t", "0.5", "Hang", "work", "{}")
    assert r.returncode == 1
    assert r.stderr.decode().startswith("error: timeout: ")


async def test_socket_from_the_environment_then_the_per_user_default(
    cbuild: CBuild, broker_factory: Any, short_tmp: Path
) -> None:
    """Without -s: $MSGQ_TRIO_SOCKET, else $XDG_RUNTIME_DIR/msgq-trio/bus.sock (the
    Python clients' rule, msgq_trio.config.default_socket_path)."""
    (short_tmp / "msgq-trio").mkdir()
    default = broker_factory(path=short_tmp / "msgq-trio" / "bus.sock")
    other = broker_factory()
    env = {k: v for k, v in cbuild.env.items() if k != "MSGQ_TRIO_SOCKET"}
    for extra, broker in (
        ({"XDG_RUNTIME_DIR": str(short_tmp)}, default),
        ({"XDG_RUNTIME_DIR": str(short_tmp), "MSGQ_TRIO_SOCKET": str(other.path)}, other),
    ):
        async with msgq_trio.connect(str(broker.path), name="py") as bus:
            await bus.subscribe("Here")
            path = str(broker.path)

            @bus.command("where")
            def where(params: Any) -> str:
                return path  # noqa: B023 (used before the loop moves on)

            with trio.fail_after(RUN_TIMEOUT):
                r = await trio.run_process(
                    [cbuild.msgq_c, "call", "Here", "where"],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env={**env, **extra},
                )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == str(broker.path)


async def test_handlers_that_block_in_a_send_take_further_requests(
    cbuild: CBuild, broker_factory: Any, raw_peer: Any, c_process: Callable[..., CProcess]
) -> None:
    """A caller that sends many large requests and reads no answer for a while makes
    the C responder's replies wait at its send bound inside the handler; meanwhile the
    library reads and dispatches the following requests from within that handler
    (nested msgq_process). Each request is still answered exactly once, with its own
    body."""
    n = 100
    broker = broker_factory(*SMALL_BOUNDS)
    echo = c_process(cbuild, "echo", "-s", str(broker.path), "E")
    await trio.to_thread.run_sync(echo.wait_ready)
    bodies = {rid: bytes([rid]) * 65536 for rid in range(1, n + 1)}
    async with raw_peer(broker.path) as peer:
        await peer.hello()

        async def call_all() -> None:
            for rid, body in bodies.items():
                await peer.send_frame(
                    FrameType.REQUEST,
                    target="E",
                    request_id=rid,
                    header=encode_cbor({"cmd": "echo"}),
                    body=encode_cbor(body),
                )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call_all)
            await trio.sleep(2)  # read nothing: the answers back up into the responder
            answers: dict[int, Any] = {}
            for _ in range(n):
                f = await peer.receive_frame(timeout=30)
                assert f is not None and f.type == FrameType.REPLY, f
                assert f.request_id not in answers
                answers[f.request_id] = f.body()
    assert answers == bodies
    assert echo.proc.poll() is None, echo.stderr()
    assert echo.stop() == 0
    check_clean(echo.stderr())


async def test_a_refusal_sent_before_our_hello_arrived_is_what_connect_reports(
    c_plain: CBuild, broker_factory: Any
) -> None:
    """As tests/client/test_behaviour.py's test of that name for the Python drivers: the
    broker refuses (max_connections) and closes before the HELLO, far larger than its
    lingering close reads, was all written. msgq_connect fails ECONNREFUSED with the
    broker's code and reason, not with EPIPE. Loaded into this process (the ctypes
    binding), so the plain build only."""
    lib = load(str(c_plain.dir / "libmsgq.so"))
    b = broker_factory("--max-connections", "1")
    async with msgq_trio.connect(b.path, name="first"):

        def connect() -> MsgqError:
            with pytest.raises(MsgqError) as refused:
                Connection(lib, str(b.path), name="n" * (8 * 1024 * 1024))
            return refused.value

        err = await trio.to_thread.run_sync(connect)
    assert (err.status, err.code) == (-errno.ECONNREFUSED, ErrorCode.LIMIT_EXCEEDED), err
    assert "max_connections=1" in err.message, err
