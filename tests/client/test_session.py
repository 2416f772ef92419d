"""Unit tests of the client's sans-I/O session (msgq_trio/client/session.py) alone: the
broker's frames are built with the real codec and fed in as bytes, the frames the session
answers with are parsed back; no broker, no socket, no trio, time passed as an argument."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from msgq_trio.client.message import Message, Reply
from msgq_trio.client.session import (
    CLOSE_WAIT,
    LOCAL_GRACE,
    Closed,
    PendingCall,
    Request,
    Send,
    Session,
    as_handler,
    never_suspends,
)
from msgq_trio.errors import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    MalformedMessage,
    NoRecipient,
    RemoteError,
    RequestTimeout,
    UsageError,
)
from msgq_trio.protocol.codes import ErrorCode, Flag, FrameType
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame

T = FrameType
CALLER = b"l.3\0caller"


def wire(ftype: int, **kw: Any) -> bytes:
    """One frame as the broker would put it on the wire."""
    return b"".join(bytes(p) for p in encode_frame(ftype, **kw))


def receive(s: Session, *data: bytes, fds: Sequence[int] = ()) -> list[Frame]:
    """Feed ``data`` to the session's codec and take the frames out."""
    s.conn.receive_data(b"".join(data), fds)
    return [ev for ev in s.conn.events() if isinstance(ev, Frame)]


def parse(pieces: Sequence[bytes | bytearray | memoryview]) -> Frame:
    """The frame the session wants written, parsed back."""
    p = FrameParser()
    p.feed(b"".join(bytes(x) for x in pieces))
    f = p.next_frame()
    assert f is not None and p.next_frame() is None
    return f


def welcome(lname: str = "l.7", **header: Any) -> bytes:
    return wire(T.WELCOME, header=encode_cbor({"lname": lname, "version": 1, **header}))


def ready(name: str = "svc", woken: list[PendingCall] | None = None, **header: Any) -> Session:
    """A session past its handshake (WELCOME taken)."""
    s = Session(name, wake=woken.append if woken is not None else None)
    s.hello()
    [w] = receive(s, welcome(**header))
    s.receive_welcome(w)
    return s


def request_frame(
    s: Session, command: str, params: Any = None, rid: int = 11, source: bytes = CALLER
) -> Frame:
    [f] = receive(
        s,
        wire(
            T.REQUEST,
            target="Svc",
            request_id=rid,
            header=encode_cbor({"cmd": command}),
            body=encode_cbor(params) if params is not None else b"",
            source=source,
        ),
    )
    return f


@pytest.fixture
def pipe_fds() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# -- handshake -----------------------------------------------------------------------------
def test_welcome_gives_identity_stamp_and_limits() -> None:
    """WELCOME sets lname, the stamp our frames carry, the broker's version, its
    max_fds_per_message, the close patience (CLOSE_WAIT + slow_consumer_timeout) and the
    TCP heartbeat settings; the HELLO carried our name."""
    s = Session("svc")
    hello = parse(s.hello({"token": "t"}))
    assert hello.type == T.HELLO and hello.header()["name"] == "svc"
    assert hello.header()["token"] == "t" and hello.header()["pid"] == os.getpid()
    [w] = receive(
        s,
        welcome(
            "l.42",
            broker="9.9",
            limits={"max_fds_per_message": 7, "slow_consumer_timeout": 5, "request_timeout": 30},
            heartbeat={"interval": 2.5, "misses": 0},
        ),
    )
    s.receive_welcome(w)
    assert s.lname == "l.42" and s.stamp == b"l.42\0svc" and s.broker_version == "9.9"
    assert s.max_fds == 7
    assert s.close_patience == CLOSE_WAIT + 5
    assert s.limits["request_timeout"] == 30
    assert s.heartbeat_settings() == (2.5, 1)  # at least one miss


def test_welcome_for_an_empty_name_stamps_anonymous_and_keeps_defaults() -> None:
    """The broker names an empty HELLO name "anonymous"; our stamp says the same. Without
    limits in WELCOME the defaults stay."""
    s = ready(name="")
    assert s.stamp == b"l.7\0anonymous"
    assert s.max_fds == 253 and s.close_patience == CLOSE_WAIT and s.limits == {}
    assert s.heartbeat_settings() is None


def test_refusal_in_the_handshake_is_a_connect_error_with_the_brokers_code() -> None:
    s = Session("svc")
    s.hello()
    [err] = receive(
        s,
        wire(
            T.ERROR,
            header=encode_cbor({"code": "version-mismatch", "message": "speak version 1"}),
        ),
    )
    with pytest.raises(ConnectError, match="speak version 1") as info:
        s.receive_welcome(err)
    assert info.value.code == "version-mismatch"


def test_a_welcome_without_lname_is_the_brokers_protocol_violation() -> None:
    s = Session("svc")
    s.hello()
    [w] = receive(s, wire(T.WELCOME, header=encode_cbor({"version": 1})))
    with pytest.raises(ConnectError, match="violated the protocol"):
        s.receive_welcome(w)


# -- calls ---------------------------------------------------------------------------------
def test_an_answer_completes_the_call_with_its_request_id() -> None:
    """Two calls in flight: the REPLY for the second completes exactly that one (its
    result decoded, the driver woken once for it); the first stays pending."""
    woken: list[PendingCall] = []
    s = ready(woken=woken)
    first, _ = s.start_call("Svc", "get", {"k": 1}, now=0.0)
    second, out2 = s.start_call("Svc", "get", {"k": 2}, now=0.0)
    req = parse(out2)
    assert req.type == T.REQUEST and req.request_id == second.request_id != first.request_id
    assert req.source == s.stamp and req.header() == {"cmd": "get"} and req.body() == {"k": 2}
    [ans] = receive(
        s,
        wire(
            T.REPLY,
            target="l.7",
            request_id=second.request_id,
            body=encode_cbor("two"),
            source=b"l.1\0svc",
        ),
    )
    assert s.handle(ans) is second
    assert second.done and second.result == "two" and second.error is None
    assert not first.done and woken == [second]
    assert s.call_result(second, "get") == "two"
    s.finish(second)
    assert list(s.calls) == [first.request_id]


def test_an_error_answer_becomes_the_exception_for_its_code() -> None:
    s = ready()
    call, _ = s.start_call("Nobody", "get", now=0.0)
    [ans] = receive(
        s,
        wire(
            T.ERROR,
            request_id=call.request_id,
            header=encode_cbor({"code": "no-recipient", "message": "nobody at Nobody"}),
            source=b"l.0\0msgq",
        ),
    )
    assert s.handle(ans) is call
    with pytest.raises(NoRecipient, match="nobody at Nobody"):
        s.call_result(call, "get")


def test_an_answer_for_an_unknown_request_id_is_dropped_and_its_fds_closed(
    pipe_fds: tuple[int, int],
) -> None:
    """A late answer (to a call given up on, or never made) changes no call, is no
    event, and the descriptors it carried are closed (none leak)."""
    s = ready()
    call, _ = s.start_call("Svc", "get", now=0.0)
    r, _w = pipe_fds
    dup = os.dup(r)
    [ans] = receive(
        s,
        wire(
            T.REPLY,
            request_id=call.request_id + 50,
            body=encode_cbor(1),
            n_fds=1,
            source=b"l.1\0svc",
        ),
        fds=[dup],
    )
    assert ans.fds == (dup,)
    assert s.handle(ans) is None
    assert not call.done and not is_open(dup)


def test_an_answer_after_finish_is_dropped() -> None:
    s = ready()
    call, _ = s.start_call("Svc", "get", now=0.0)
    s.finish(call)
    [ans] = receive(s, wire(T.REPLY, request_id=call.request_id, source=b"l.1\0svc"))
    assert s.handle(ans) is None and not call.done


def test_the_local_deadline_comes_from_the_time_argument() -> None:
    """A call with a timeout gives up locally LOCAL_GRACE after the broker's deadline,
    counted from ``now``; not a moment before. Without a timeout it never expires
    locally (the broker answers)."""
    s = ready()
    call, out = s.start_call("Svc", "slow", now=100.0, timeout=2.0)
    assert parse(out).header() == {"cmd": "slow", "timeout": 2.0}
    assert call.deadline == 100.0 + 2.0 + LOCAL_GRACE
    assert not call.expire(100.0 + 2.0 + LOCAL_GRACE - 0.001) and not call.done
    assert call.expire(100.0 + 2.0 + LOCAL_GRACE)
    with pytest.raises(RequestTimeout, match=r"within 2\.0 s"):
        s.call_result(call, "slow")
    forever, _ = s.start_call("Svc", "slow", now=100.0)
    assert forever.deadline is None and not forever.expire(1e12)


def test_bad_call_arguments_register_nothing() -> None:
    s = ready()
    with pytest.raises(UsageError, match="timeout must be positive"):
        s.start_call("Svc", "get", now=0.0, timeout=0)
    with pytest.raises(UsageError, match="cannot call"):
        s.start_call("Svc", "get", object(), now=0.0)
    assert s.calls == {}


def test_a_call_to_every_member_collects_one_result_per_routed_member() -> None:
    """ROUTED names the members; the call is done when each answered, and the results
    come in the broker's order, an error answer as an error Result."""
    s = ready()
    call, out = s.start_call("G", "ping", now=0.0, multi=True)
    assert parse(out).flags & Flag.ALL
    rid = call.request_id
    [routed] = receive(
        s, wire(T.ROUTED, request_id=rid, header=encode_cbor({"to": [["l.1", "a"], ["l.2", "b"]]}))
    )
    assert (s.handle(routed), call.done) == (call, False)
    frames = receive(
        s,
        wire(
            T.ERROR,
            request_id=rid,
            header=encode_cbor({"code": "bad-request", "message": "no"}),
            source=b"l.2\0b",
        ),
        wire(T.REPLY, request_id=rid, body=encode_cbor("pong"), source=b"l.1\0a"),
    )
    for f in frames:
        s.handle(f)
    assert call.done
    a, b = call.member_results()
    assert (a.sender, a.ok, a.value) == ("l.1", True, "pong")
    assert (b.sender, b.ok) == ("l.2", False)
    assert isinstance(b.error, RemoteError) and b.error.code == "bad-request"


def test_a_refusal_before_routed_fails_the_whole_call_to_every_member() -> None:
    s = ready()
    call, _ = s.start_call("G", "ping", now=0.0, multi=True)
    [err] = receive(
        s,
        wire(
            T.ERROR,
            request_id=call.request_id,
            header=encode_cbor({"code": "no-recipient", "message": "empty"}),
            source=b"l.0\0msgq",
        ),
    )
    s.handle(err)
    assert call.done
    with pytest.raises(NoRecipient):
        call.member_results()


# -- the handler contract ------------------------------------------------------------------
@pytest.mark.parametrize(
    "error,code,message,data",
    [
        (CommandFailed("no-such-key", "no key k", {"k": 1}), "no-such-key", "no key k", {"k": 1}),
        (KeyError("k"), ErrorCode.BAD_REQUEST, "KeyError: 'k'", None),
        (TypeError("wrong"), ErrorCode.BAD_REQUEST, "TypeError: wrong", None),
        (
            MalformedMessage("request from l.3 has a malformed body", "l.3 caller"),
            ErrorCode.BAD_REQUEST,
            "request from l.3 has a malformed body",
            None,
        ),
        (
            UsageError("bad fd"),
            ErrorCode.INTERNAL_ERROR,
            "handler result cannot be encoded: bad fd",
            None,
        ),
        (
            RuntimeError("boom"),
            ErrorCode.INTERNAL_ERROR,
            "RuntimeError: boom",
            {"type": "RuntimeError"},
        ),
        (
            ConnectionLost("another bus is gone"),
            ErrorCode.INTERNAL_ERROR,
            "ConnectionLost: another bus is gone",
            {"type": "ConnectionLost"},
        ),
    ],
)
def test_a_handler_exception_answers_the_documented_code(
    error: Exception, code: str, message: str, data: object, caplog: pytest.LogCaptureFixture
) -> None:
    """Each exception a handler raises becomes the ERROR answer the contract documents,
    addressed to the caller with our stamp; only the handler's own bugs are logged."""
    s = ready()
    req = Message(request_frame(s, "get", {"k": 1}), s.sources)
    with caplog.at_level(logging.ERROR, logger="msgq_trio.client"):
        pieces = s.answer_for(req, None, error)
    assert pieces is not None
    f = parse(pieces)
    assert f.type == T.ERROR and f.request_id == 11 and f.target == "l.3" and f.source == s.stamp
    assert f.header() == {"code": str(code), "message": message}
    assert f.body() == data
    logged = any("handler for 'get' raised" in r.getMessage() for r in caplog.records)
    assert logged == (code == ErrorCode.INTERNAL_ERROR and data is not None)


def test_a_handler_result_is_the_answer_and_an_unencodable_one_an_internal_error() -> None:
    s = ready()
    req = Message(request_frame(s, "get"), s.sources)
    f = parse(s.answer_for(req, {"v": [1, 2]}, None) or [])
    assert (
        f.type == T.REPLY and f.request_id == 11 and f.target == "l.3" and f.body() == {"v": [1, 2]}
    )
    bad = parse(s.answer_for(req, object(), None) or [])
    assert bad.type == T.ERROR and bad.header()["code"] == ErrorCode.INTERNAL_ERROR
    assert str(bad.header()["message"]).startswith("handler result cannot be encoded")


def test_the_answer_to_a_relayed_request_goes_to_the_binder() -> None:
    s = ready()
    relayed = b"l.9\0msgq-queue-binder\0l.3\0caller"
    req = Message(request_frame(s, "put", source=relayed), s.sources)
    assert (req.sender, req.via) == ("l.3", "l.9")
    assert parse(s.answer_for(req, 1, None) or []).target == "l.9"


def test_connection_lost_of_this_connection_sends_no_answer() -> None:
    """A handler that met this connection's own end gets no answer (nobody to send it
    to); the driver raises or drops it."""
    s = ready()
    s.fail(ConnectionLost("gone"))
    req = Message(request_frame(s, "get"), s.sources)
    assert s.answer_for(req, None, ConnectionLost("gone")) is None


def test_a_reply_with_fds_where_none_can_be_passed_is_refused_and_closes_them(
    pipe_fds: tuple[int, int],
) -> None:
    """The blocking driver cannot pass descriptors: a Reply carrying some answers
    internal-error, and the duplicates the Reply made are closed (none leak)."""
    s = ready()
    s.fd_passing = False
    req = Message(request_frame(s, "give"), s.sources)
    reply = Reply("ok", fds=[pipe_fds[0]])
    [dup] = reply.fds
    f = parse(s.answer_for(req, reply, None) or [])
    assert f.header()["code"] == ErrorCode.INTERNAL_ERROR
    assert "cannot pass descriptors" in str(f.header()["message"])
    assert not is_open(dup) and is_open(pipe_fds[0])


def test_one_handler_signature() -> None:
    """``fn(params)`` and ``fn(params, request)`` are handlers; anything else is refused."""
    assert as_handler(lambda p: p + 1)(1, None) == 2  # type: ignore[arg-type]
    assert as_handler(lambda p, r: (p, r))(1, "req") == (1, "req")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"\(params\) or \(params, request\)"):
        as_handler(lambda p, r, x: None)


# -- the one dispatch ----------------------------------------------------------------------
def test_requests_go_to_their_handler_inline_handler_or_unknown_command() -> None:
    s = ready()
    s.commands["get"] = as_handler(lambda p: p)
    s.inline["put"] = lambda m: None
    ev = s.handle(request_frame(s, "get", 5))
    assert isinstance(ev, Request) and ev.handler is s.commands["get"] and ev.inline is None
    assert ev.message.body == 5
    ev = s.handle(request_frame(s, "put"))
    assert isinstance(ev, Request) and ev.inline is s.inline["put"]
    ev = s.handle(request_frame(s, "nope"))
    assert isinstance(ev, Send)
    f = parse(ev.pieces)
    assert f.type == T.ERROR and f.header()["code"] == ErrorCode.UNKNOWN_COMMAND
    assert f.body() == ["get"] and "l.7" in str(f.header()["message"])


def test_a_request_with_a_malformed_header_is_answered_bad_request() -> None:
    s = ready()
    [f] = receive(s, wire(T.REQUEST, target="Svc", request_id=4, header=b"\xff", source=CALLER))
    ev = s.handle(f)
    assert isinstance(ev, Send)
    ans = parse(ev.pieces)
    assert ans.header()["code"] == ErrorCode.BAD_REQUEST and ans.target == "l.3"


def test_messages_and_notifications_are_messages() -> None:
    s = ready()
    m, n = receive(
        s,
        wire(T.MESSAGE, target="G", body=encode_cbor("hi"), source=CALLER),
        wire(T.NOTIFY, target="G", header=encode_cbor({"event": "up"}), source=CALLER),
    )
    ev_m, ev_n = s.handle(m), s.handle(n)
    assert isinstance(ev_m, Message) and ev_m.kind == "message" and ev_m.body == "hi"
    assert isinstance(ev_n, Message) and ev_n.kind == "notification" and ev_n.event == "up"


def test_goodbye_from_the_broker_fails_pending_calls_with_its_reason() -> None:
    s = ready()
    call, _ = s.start_call("Svc", "get", now=0.0)
    [bye] = receive(s, wire(T.GOODBYE, header=encode_cbor({"reason": "broker-shutdown"})))
    ev = s.handle(bye)
    assert isinstance(ev, Closed) and ev.goodbye and ev.error is s.lost
    assert ev.error is not None and ev.error.code == "broker-shutdown"
    assert isinstance(call.error, ConnectionLost) and call.error.code == "broker-shutdown"


def test_goodbye_after_ours_is_a_clean_end() -> None:
    s = ready()
    assert parse(s.goodbye()).type == T.GOODBYE
    [bye] = receive(s, wire(T.GOODBYE, header=encode_cbor({"reason": "goodbye"})))
    ev = s.handle(bye)
    assert isinstance(ev, Closed) and ev.goodbye and ev.error is None and s.lost is None


def test_a_connection_level_error_ends_the_session_and_the_first_reason_stays() -> None:
    s = ready()
    call, _ = s.start_call("Svc", "get", now=0.0)
    [err] = receive(
        s, wire(T.ERROR, header=encode_cbor({"code": "slow-consumer", "message": "too slow"}))
    )
    ev = s.handle(err)
    assert isinstance(ev, Closed) and not ev.goodbye
    assert s.lost is not None and s.lost.code == "slow-consumer"
    assert isinstance(call.error, ConnectionLost) and call.error.code == "slow-consumer"
    assert s.fail(ConnectionLost("the bus was closed")).code == "slow-consumer"


def test_a_batch_of_messages_is_each_message_in_order_small_ones_joined() -> None:
    """``encode_messages`` writes exactly the frames ``encode_message`` would, in order;
    consecutive small frames come as one buffer, a large binary body as its own pieces
    (not copied); a body that cannot be encoded fails the batch with its index and
    nothing to send."""
    s = ready("pub")
    s._no_join = 1024 * 1024  # as the trio driver makes its session (NO_JOIN)
    big = os.urandom(2 * 1024 * 1024)
    bodies: list[Any] = [b"a", {"k": 1}, None, big, b"b" * 300, "text"]
    pieces = s.encode_messages("G", bodies)
    expected = b"".join(
        bytes(p) if not isinstance(p, list) else b"".join(bytes(x) for x in p)
        for p in (s.encode_message("G", b) for b in bodies)
    )
    assert b"".join(bytes(p) for p in pieces) == expected
    assert len(pieces) == 4 and any(p is big for p in pieces)  # 3 small, big (2), 2 small
    p = FrameParser()
    p.feed(expected)
    got = []
    while (f := p.next_frame()) is not None:
        assert f.target == "G" and f.source == s.stamp
        got.append(f.body())
    assert got == bodies
    with pytest.raises(UsageError, match="body 1 of the batch"):
        s.encode_messages("G", [b"ok", object()])


def test_a_bytes_body_alone_encodes_as_through_encode_message() -> None:
    """encode_bytes_message (the drivers' way for a message that is a bytes body and
    nothing else) makes the frame encode_message makes: small bodies joined into one
    bytes, a large one kept as its own piece; a target too long is the caller's error."""
    s = ready("pub")
    s._no_join = 1024 * 1024
    for body in (b"", b"x", os.urandom(300), os.urandom(2 * 1024 * 1024)):
        fast = s.encode_bytes_message("G", body)
        general = s.encode_message("G", body)
        assert type(fast) is type(general)
        if isinstance(fast, bytes):
            assert fast == general
        else:
            assert isinstance(general, list)
            assert [bytes(p) for p in fast] == [bytes(p) for p in general]
            assert any(p is body for p in fast)  # not copied
    for encode in (s.encode_bytes_message, s.encode_message):
        with pytest.raises(UsageError, match="cannot send to"):
            encode("G" * 70_000, b"x")


def test_never_suspends_tells_an_async_function_without_await() -> None:
    """Only a coroutine whose code has no await, async with or async for counts; a plain
    value, a coroutine that awaits (also in a branch never taken) does not."""

    async def plain(x: int) -> int:
        return x * 2

    async def awaits(x: int) -> int:
        if x < 0:
            await asyncio.sleep(0)
        return x

    async def iterates(xs: Any) -> int:
        async for _ in xs:
            pass
        return 0

    async def enters(cm: Any) -> int:
        async with cm:
            return 1

    coros = [plain(1), awaits(1), iterates(None), enters(None)]
    try:
        assert [never_suspends(c) for c in coros] == [True, False, False, False]
        assert not never_suspends(42) and not never_suspends(lambda: 1)
    finally:
        for c in coros:
            c.close()


def test_new_message_is_message_init() -> None:
    """``new_message`` (made in C with the compiled fast paths) gives exactly what
    ``Message(frame, sources)`` gives, slot by slot; without them it is Message."""
    from msgq_trio.client.message import new_message
    from msgq_trio.protocol.framing import SPEEDUPS

    p = FrameParser()
    p.feed(wire(T.MESSAGE, target="g", source=CALLER, body=encode_cbor([1, "x"])))
    frame = p.next_frame()
    assert frame is not None
    sources: dict[bytes, Any] = {}
    made, ref = new_message(frame, sources), Message(frame, sources)
    assert type(made) is Message
    assert (new_message is Message) is not SPEEDUPS
    for name in Message.__slots__:
        assert getattr(made, name) is getattr(ref, name), name
    assert made.body == [1, "x"] and made.sender == "l.3"
