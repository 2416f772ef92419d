"""libmsgq against a fake broker that sends oversized, malformed and truncated input:
every case is a clear error naming what was wrong (exit 1, ``error: CODE: MESSAGE``),
never a crash, a hang or a sanitizer report (both builds, fixture ``cbuild``)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
from libmsgq_build import CBuild, check_clean
from libmsgq_py import Connection, load

PREFIX = struct.Struct(">IBBHHHHHQII")
WELCOME, MESSAGE, REPLY, ERROR, GOODBYE = 2, 3, 5, 6, 9
RUN_TIMEOUT = 60.0


def frame(
    ftype: int,
    *,
    rid: int = 0,
    target: bytes = b"",
    source: bytes = b"l.0\x00msgq",
    header: bytes = b"",
    body: bytes = b"",
    blob_table: bytes = b"",
    n_blobs: int = 0,
    n_fds: int = 0,
    reserved: int = 0,
    extra: int = 0,
) -> bytes:
    """A frame as the broker would write it; ``extra`` skews the length field and the
    other arguments may contradict each other, to make malformed frames."""
    tail = target + source + header + body + blob_table
    length = PREFIX.size - 4 + len(tail) + extra
    prefix = PREFIX.pack(
        length,
        ftype,
        0,
        len(target),
        len(source),
        n_blobs,
        n_fds,
        reserved,
        rid,
        len(header),
        len(body),
    )
    return prefix + tail


def welcome(lname: str = "l.7") -> bytes:
    return frame(
        WELCOME,
        header=cbor2.dumps({"version": 1, "lname": lname, "broker": "fake", "limits": {}}),
    )


class FakeConn:
    """The broker's side of one connection: read whole frames, write bytes."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.stream = trio.SocketStream(sock)
        self.buf = b""

    async def read_frame(self) -> tuple[int, int, bytes] | None:
        """(type, request id, raw frame), or None at EOF."""
        while True:
            if len(self.buf) >= 4:
                total = struct.unpack(">I", self.buf[:4])[0] + 4
                if len(self.buf) >= total:
                    raw, self.buf = self.buf[:total], self.buf[total:]
                    fields = PREFIX.unpack(raw[: PREFIX.size])
                    return fields[1], fields[8], raw
            try:
                chunk = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:  # reset by the client: its end too
                return None
            if not chunk:
                return None
            self.buf += chunk

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)


Script = Callable[[FakeConn], Awaitable[None]]


async def run_against_fake(
    build: CBuild, path: Path, script: Script, *args: str
) -> tuple[int, str]:
    """Serve one connection with ``script`` while ``msgq-c call`` runs against it;
    returns (exit status, stderr)."""
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen(1)
    result: list[Any] = []

    async def serve() -> None:
        sock, _ = await listener.accept()
        with sock:
            conn = FakeConn(sock)
            hello = await conn.read_frame()
            assert hello is not None and hello[0] == 1
            await script(conn)
            try:
                while await conn.read_frame() is not None:  # until the client hangs up
                    pass
            except trio.ClosedResourceError:  # the script closed it
                pass

    async def client() -> None:
        r = await trio.run_process(
            [build.msgq_c, "call", "-s", str(path), *(args or ("Svc", "cmd", "1"))],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=build.env,
        )
        result.append(r)

    with trio.fail_after(RUN_TIMEOUT), listener:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(client)
    (r,) = result
    stderr = r.stderr.decode(errors="replace")
    check_clean(stderr)
    return r.returncode, stderr


def after_request(make: Callable[[int], bytes], close: bool = False) -> Script:
    """WELCOME, then read the client's REQUEST and send ``make(request_id)``; then
    close the connection if ``close``, else wait for the client to."""

    async def script(conn: FakeConn) -> None:
        await conn.send(welcome())
        req = await conn.read_frame()
        assert req is not None and req[0] == 4
        await conn.send(make(req[1]))
        if close:
            await conn.stream.aclose()

    return script


def handshake(data: bytes) -> Script:
    """Answer HELLO with ``data`` instead of a WELCOME."""

    async def script(conn: FakeConn) -> None:
        await conn.send(data)

    return script


ok_header = cbor2.dumps({"code": "x", "message": "m"})

CASES: dict[str, tuple[Script, str, str]] = {
    # name: (script, expected code, a phrase of the message)
    "length prefix over max_frame_size": (
        after_request(lambda rid: struct.pack(">I", 0xFFFFFFF0) + b"\x05" * 40),
        "frame-too-large",
        "over max_frame_size",
    ),
    "length prefix under the prefix size": (
        after_request(lambda rid: struct.pack(">I", 3) + b"\x05\x00\x00"),
        "protocol-error",
        "less than the 32-byte prefix",
    ),
    "unknown frame type": (
        after_request(lambda rid: frame(77, rid=rid)),
        "protocol-error",
        "unknown type 77",
    ),
    "reserved bytes set": (
        after_request(lambda rid: frame(REPLY, rid=rid, reserved=1)),
        "protocol-error",
        "reserved",
    ),
    "sections longer than the frame": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x01", extra=-1)),
        "protocol-error",
        "exceed its length",
    ),
    "sections shorter than the frame": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x01", extra=1) + b"\x00"),
        "protocol-error",
        "add up",
    ),
    "blob table beyond the frame": (
        after_request(
            lambda rid: frame(REPLY, rid=rid, n_blobs=1, blob_table=struct.pack(">I", 1 << 31))
        ),
        "protocol-error",
        "add up",
    ),
    "target not UTF-8": (
        after_request(lambda rid: frame(REPLY, rid=rid, target=b"\xff\xfe")),
        "protocol-error",
        "not UTF-8",
    ),
    "descriptors declared that never came": (
        after_request(lambda rid: frame(REPLY, rid=rid, n_fds=2)),
        "protocol-error",
        "file descriptors",
    ),
    "reply body not CBOR": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\xff\x00")),
        "malformed-message",
        "from l.0 (msgq)",
    ),
    "reply body nested 100000 deep": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x81" * 100_000 + b"\x00")),
        "malformed-message",
        "not one well-formed CBOR item",
    ),
    "reply body claims 2**64 items": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x9b" + b"\xff" * 8)),
        "malformed-message",
        "not one well-formed CBOR item",
    ),
    "reply body claims 2**32 - 1 pairs in an indefinite string chunk": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x5f\x9a\x9a\x86\x65\x6e")),
        "malformed-message",
        "not one well-formed CBOR item",
    ),
    "error header claims 2**31 pairs": (
        after_request(lambda rid: frame(ERROR, rid=rid, header=b"\xba\x80\x00\x00\x00")),
        "",
        "malformed ERROR answer",
    ),
    "reply body with trailing bytes": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x01\x02")),
        "malformed-message",
        "not one well-formed CBOR item",
    ),
    "error answer without a code": (
        after_request(lambda rid: frame(ERROR, rid=rid, header=cbor2.dumps({"message": 1}))),
        "",
        "malformed ERROR answer from l.0",
    ),
    "error answer with a header that is not CBOR": (
        after_request(lambda rid: frame(ERROR, rid=rid, header=b"\xbf")),
        "",
        "malformed ERROR answer",
    ),
    "connection-level error": (
        after_request(
            lambda rid: frame(ERROR, header=cbor2.dumps({"code": "dropped", "message": "bye"}))
        ),
        "dropped",
        "bye",
    ),
    "closed in the middle of a frame": (
        after_request(lambda rid: frame(REPLY, rid=rid, body=b"\x01")[:20], close=True),
        "connection-lost",
        "without GOODBYE",
    ),
    "welcome without lname": (
        handshake(frame(WELCOME, header=cbor2.dumps({"version": 1}))),
        "protocol-error",
        "handshake",
    ),
    "welcome header not CBOR": (
        handshake(frame(WELCOME, header=b"\xa1\x01")),
        "protocol-error",
        "handshake",
    ),
    "refused at the handshake": (
        handshake(
            frame(ERROR, header=cbor2.dumps({"code": "version-mismatch", "message": "v2 only"}))
        ),
        "version-mismatch",
        "broker refused the connection: v2 only",
    ),
    "a reply before the welcome": (
        handshake(frame(REPLY, rid=1, body=b"\x01")),
        "protocol-error",
        "handshake",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_input_from_the_broker(cbuild: CBuild, short_tmp: Path, case: str) -> None:
    script, code, phrase = CASES[case]
    status, stderr = await run_against_fake(cbuild, short_tmp / "fake.sock", script)
    assert status == 1, stderr
    assert stderr.startswith(f"error: {code}: " if code else "error: "), stderr
    assert phrase in stderr, stderr
    assert stderr.count("\n") == 1, stderr


async def test_good_reply_from_the_fake_broker(cbuild: CBuild, short_tmp: Path) -> None:
    """The fake itself is right: a well-formed answer is printed (so the cases above fail
    for what they break, not for the fake)."""
    status, stderr = await run_against_fake(
        cbuild,
        short_tmp / "fake.sock",
        after_request(lambda rid: frame(REPLY, rid=rid, body=cbor2.dumps({"ok": [1]}))),
    )
    assert (status, stderr) == (0, "")


def source_of(raw: bytes) -> bytes:
    """The source section of the frame ``raw``."""
    fields = PREFIX.unpack(raw[: PREFIX.size])
    start = PREFIX.size + fields[3]
    return raw[start : start + fields[4]]


async def test_client_writes_its_stamp_once_welcomed(cbuild: CBuild, short_tmp: Path) -> None:
    """Frames after WELCOME carry the client's own stamp (``lname NUL name``) as their
    source, so the broker can forward them without rewriting (docs/PROTOCOL.md)."""

    async def script(conn: FakeConn) -> None:
        await conn.send(welcome("l.42"))
        req = await conn.read_frame()
        assert req is not None and req[0] == 4
        assert source_of(req[2]) == b"l.42\x00msgq-c"
        await conn.send(frame(REPLY, rid=req[1], body=cbor2.dumps(1)))

    status, stderr = await run_against_fake(cbuild, short_tmp / "fake.sock", script)
    assert (status, stderr) == (0, "")


async def test_empty_name_is_stamped_anonymous(c_plain: CBuild, short_tmp: Path) -> None:
    """A client with an empty name stamps its frames ``anonymous``, the name the broker
    gives it (else the broker would rewrite every frame). HELLO, before WELCOME, has no
    source. Loaded into this process, so the plain build only."""
    lib = load(str(c_plain.dir / "libmsgq.so"))
    path = short_tmp / "fake.sock"
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen(1)
    sources: list[bytes] = []

    async def serve() -> None:
        sock, _ = await listener.accept()
        with sock:
            conn = FakeConn(sock)
            for expect in (1, MESSAGE, GOODBYE):
                got = await conn.read_frame()
                assert got is not None and got[0] == expect, got
                sources.append(source_of(got[2]))
                if expect == 1:
                    await conn.send(welcome("l.9"))
            await conn.send(frame(GOODBYE))

    def client() -> None:
        c = Connection(lib, str(path), name="")
        c.send("G", 1)
        c.close()

    with trio.fail_after(RUN_TIMEOUT), listener:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            await trio.to_thread.run_sync(client)
    assert sources == [b"", b"l.9\x00anonymous", b"l.9\x00anonymous"]
