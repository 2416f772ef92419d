"""Unit tests of the sans-I/O connection state machine (msgq_trio.protocol.connection).

The expected tables below are written from the rules in the module docstring (Rule 1-4),
not copied from the implementation's tables.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from msgq_trio.protocol.codes import PROTOCOL_VERSION, ErrorCode, FrameType
from msgq_trio.protocol.connection import (
    EOF,
    NEED_DATA,
    Connection,
    Role,
    State,
    connection_error_frame,
)
from msgq_trio.protocol.errors import LocalProtocolError, RemoteProtocolError
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame

T = FrameType
READY_BOTH = {T.MESSAGE, T.REQUEST, T.REPLY, T.ERROR, T.NOTIFY, T.GOODBYE}

#: (role, state) -> frame types that role may SEND -> state afterwards.
SEND_RULES: dict[tuple[Role, State], dict[FrameType, State]] = {
    (Role.CLIENT, State.IDLE): {T.HELLO: State.HELLO_SENT},
    (Role.CLIENT, State.HELLO_SENT): {},
    (Role.CLIENT, State.READY): {t: State.READY for t in READY_BOTH},
    (Role.CLIENT, State.CLOSED): {},
    (Role.BROKER, State.IDLE): {T.ERROR: State.CLOSED},
    (Role.BROKER, State.HELLO_RECEIVED): {T.WELCOME: State.READY, T.ERROR: State.CLOSED},
    (Role.BROKER, State.READY): {t: State.READY for t in READY_BOTH | {T.ROUTED}},
    (Role.BROKER, State.CLOSED): {},
}
#: (role, state) -> frame types that role may RECEIVE -> state afterwards.
RECV_RULES: dict[tuple[Role, State], dict[FrameType, State]] = {
    (Role.BROKER, State.IDLE): {T.HELLO: State.HELLO_RECEIVED},
    (Role.BROKER, State.READY): {t: State.READY for t in READY_BOTH},
    (Role.BROKER, State.CLOSED): {},
    (Role.CLIENT, State.HELLO_SENT): {T.WELCOME: State.READY, T.ERROR: State.CLOSED},
    (Role.CLIENT, State.READY): {t: State.READY for t in READY_BOTH | {T.ROUTED}},
    (Role.CLIENT, State.CLOSED): {},
}


def frame_bytes(ftype: int, **kw: object) -> bytes:
    if ftype == T.HELLO and "header" not in kw:
        kw["header"] = encode_cbor({"version": PROTOCOL_VERSION, "name": "x"})
    if ftype == T.REQUEST and "request_id" not in kw:
        kw["request_id"] = 1
    return b"".join(bytes(p) for p in encode_frame(ftype, **kw))  # type: ignore[arg-type]


def connection_in(role: Role, state: State) -> Connection:
    """A connection driven to ``state`` through the public API only."""
    c = Connection(role)
    if role is Role.CLIENT:
        if state is State.IDLE:
            return c
        c.hello("client")
        if state is State.HELLO_SENT:
            return c
        c.receive_data(frame_bytes(T.WELCOME if state is State.READY else T.ERROR))
        assert isinstance(c.next_event(), Frame)
    else:
        if state is State.IDLE:
            return c
        c.receive_data(frame_bytes(T.HELLO))
        assert isinstance(c.next_event(), Frame)
        if state is State.HELLO_RECEIVED:
            return c
        c.send(T.WELCOME if state is State.READY else T.ERROR)
    assert c.state is state
    return c


def _next_event(c: Connection) -> object:
    return c.next_event()


def _events_first(c: Connection) -> object:
    evs = c.events()
    assert len(evs) == 1
    return evs[0]


RECEIVE_METHODS: list[Callable[[Connection], object]] = [_next_event, _events_first]


def _rs_id(rs: tuple[Role, State]) -> str:
    return f"{rs[0].value}-{rs[1].value}"


@pytest.mark.parametrize("role_state", list(SEND_RULES), ids=_rs_id)
@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
def test_send_table(role_state: tuple[Role, State], ftype: FrameType) -> None:
    """Each (role, state) may send exactly the frame types the rules allow, moving to the
    documented next state; anything else raises LocalProtocolError."""
    role, state = role_state
    c = connection_in(role, state)
    allowed = SEND_RULES[role_state]
    if ftype in allowed:
        pieces = c.send(ftype, request_id=1 if ftype == T.REQUEST else 0)
        parser = FrameParser()
        parser.feed(b"".join(bytes(p) for p in pieces))
        sent = parser.next_frame()
        assert sent is not None and sent.type == ftype
        assert c.state is allowed[ftype]
    else:
        with pytest.raises(LocalProtocolError):
            c.send(ftype)


@pytest.mark.parametrize("role_state", list(RECV_RULES), ids=_rs_id)
@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
@pytest.mark.parametrize("receive", RECEIVE_METHODS, ids=lambda f: f.__name__.strip("_"))
def test_receive_table(
    role_state: tuple[Role, State], ftype: FrameType, receive: Callable[[Connection], object]
) -> None:
    """Each (role, state) accepts exactly the frame types the rules allow; any other frame
    is a RemoteProtocolError that puts the connection in ERROR, after which every call
    raises LocalProtocolError."""
    role, state = role_state
    c = connection_in(role, state)
    c.receive_data(frame_bytes(ftype))
    allowed = RECV_RULES[role_state]
    if ftype in allowed:
        ev = receive(c)
        assert isinstance(ev, Frame)
        assert ev.type == ftype
        assert c.state is allowed[ftype]
    else:
        with pytest.raises(RemoteProtocolError):
            receive(c)
        assert c.state is State.ERROR
        with pytest.raises(LocalProtocolError):
            c.next_event()


def test_full_handshake_and_exchange() -> None:
    """A client and a broker connection talk to each other: HELLO, WELCOME, then messages
    both ways and a broker-only ROUTED; both end READY."""
    client, broker = Connection(Role.CLIENT), Connection(Role.BROKER)
    broker.receive_data(b"".join(bytes(p) for p in client.hello("me", {"pid": 5})))
    hello = broker.next_event()
    assert isinstance(hello, Frame)
    assert hello.header() == {"version": PROTOCOL_VERSION, "name": "me", "pid": 5}
    assert broker.state is State.HELLO_RECEIVED
    client.receive_data(b"".join(bytes(p) for p in broker.send(T.WELCOME, header={"lname": "l.1"})))
    welcome = client.next_event()
    assert isinstance(welcome, Frame) and welcome.header()["lname"] == "l.1"
    assert client.state is broker.state is State.READY
    broker.receive_data(b"".join(bytes(p) for p in client.send(T.MESSAGE, target="G")))
    msg = broker.next_event()
    assert isinstance(msg, Frame) and msg.target == "G"
    client.receive_data(b"".join(bytes(p) for p in broker.send(T.ROUTED, request_id=3)))
    routed = client.next_event()
    assert isinstance(routed, Frame) and routed.type == T.ROUTED
    assert client.next_event() is NEED_DATA


def test_client_must_send_hello_first() -> None:
    """Rule 1: a client's first frame is HELLO; sending anything else first is refused."""
    for ftype in set(FrameType) - {T.HELLO}:
        with pytest.raises(LocalProtocolError):
            Connection(Role.CLIENT).send(ftype)
    c = Connection(Role.CLIENT)
    c.hello("x")
    with pytest.raises(LocalProtocolError):
        c.hello("again")


def test_broker_must_receive_hello_first() -> None:
    """Rule 1: a broker receiving anything but HELLO first raises RemoteProtocolError."""
    for ftype in set(FrameType) - {T.HELLO}:
        b = Connection(Role.BROKER)
        b.receive_data(frame_bytes(ftype))
        with pytest.raises(RemoteProtocolError) as ei:
            b.next_event()
        assert ei.value.code == ErrorCode.PROTOCOL_ERROR
        assert b.state is State.ERROR


def test_broker_may_refuse_before_hello() -> None:
    """A broker may send a connection-level ERROR before any HELLO (e.g. garbage first),
    and nothing after it."""
    b = Connection(Role.BROKER)
    b.send(T.ERROR)
    assert b.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        b.send(T.WELCOME)


def test_refused_handshake_closes() -> None:
    """A client whose HELLO is answered with ERROR is CLOSED and may not send anything."""
    c = connection_in(Role.CLIENT, State.HELLO_SENT)
    c.receive_data(
        b"".join(bytes(p) for p in connection_error_frame(ErrorCode.VERSION_MISMATCH, "no"))
    )
    err = c.next_event()
    assert isinstance(err, Frame)
    assert err.header()["code"] == "version-mismatch"
    assert c.state is State.CLOSED
    for ftype in FrameType:
        with pytest.raises(LocalProtocolError):
            c.send(ftype)


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("receive", RECEIVE_METHODS, ids=lambda f: f.__name__.strip("_"))
def test_frames_after_peer_goodbye(role: Role, receive: Callable[[Connection], object]) -> None:
    """Rule 3: any frame received after the peer's GOODBYE is a protocol violation."""
    c = connection_in(role, State.READY)
    c.receive_data(frame_bytes(T.GOODBYE))
    ev = receive(c)
    assert isinstance(ev, Frame) and ev.type == T.GOODBYE
    assert c.received_goodbye
    c.receive_data(frame_bytes(T.MESSAGE))
    with pytest.raises(RemoteProtocolError):
        receive(c)
    assert c.state is State.ERROR


def test_goodbye_then_frame_in_one_batch() -> None:
    """GOODBYE followed by another frame in the same bytes: the GOODBYE is delivered and the
    next frame is a protocol violation (through next_event and through events())."""
    data = frame_bytes(T.GOODBYE) + frame_bytes(T.MESSAGE)
    c = connection_in(Role.BROKER, State.READY)
    c.receive_data(data)
    assert c.next_event().type == T.GOODBYE  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError):
        c.next_event()
    c = connection_in(Role.BROKER, State.READY)
    c.receive_data(data)
    evs = c.events()
    assert [e.type for e in evs] == [T.GOODBYE]  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError):
        c.events()
    assert c.state is State.ERROR
    with pytest.raises(LocalProtocolError):
        c.events()


@pytest.mark.parametrize("role", list(Role))
def test_nothing_sent_after_own_goodbye(role: Role) -> None:
    """Rule 3: after sending GOODBYE every send (GOODBYE included) is a LocalProtocolError."""
    c = connection_in(role, State.READY)
    c.send(T.GOODBYE)
    assert c.sent_goodbye
    for ftype in FrameType:
        with pytest.raises(LocalProtocolError):
            c.send(ftype)


def test_error_state_is_sticky() -> None:
    """Rule 4: once a protocol error happened, receive_data, next_event, events and send
    all raise LocalProtocolError."""
    c = connection_in(Role.BROKER, State.READY)
    c.receive_data(b"\x00\x00\x00\x1c" + b"\xff" * 28)  # unknown frame type 255
    with pytest.raises(RemoteProtocolError):
        c.next_event()
    assert c.state is State.ERROR
    with pytest.raises(LocalProtocolError):
        c.next_event()
    with pytest.raises(LocalProtocolError):
        c.receive_data(frame_bytes(T.MESSAGE))
    with pytest.raises(LocalProtocolError):
        c.send(T.MESSAGE)
    with pytest.raises(LocalProtocolError):
        c.events()


def test_fail_enters_error_state() -> None:
    """fail() (I/O failure) makes the connection refuse every later call."""
    c = connection_in(Role.CLIENT, State.READY)
    c.fail()
    with pytest.raises(LocalProtocolError):
        c.send(T.MESSAGE)
    with pytest.raises(LocalProtocolError):
        c.next_event()


def test_frame_too_large_code_through_connection() -> None:
    """The connection reports an oversized length prefix with code frame-too-large."""
    c = Connection(Role.BROKER, max_frame_size=1024)
    c.receive_data(b"\x7f\xff\xff\xff")
    with pytest.raises(RemoteProtocolError) as ei:
        c.next_event()
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE


def test_eof_and_need_data() -> None:
    """NEED_DATA while a frame is incomplete; EOF once the peer closed and all frames are
    out; data after EOF is a local error."""
    c = connection_in(Role.CLIENT, State.READY)
    data = frame_bytes(T.MESSAGE, target="x")
    c.receive_data(data[:10])
    assert c.next_event() is NEED_DATA
    assert c.in_frame
    c.receive_data(data[10:])
    assert isinstance(c.next_event(), Frame)
    assert not c.in_frame
    c.receive_data(frame_bytes(T.MESSAGE, target="y"))
    c.receive_data(b"")
    ev = c.next_event()
    assert isinstance(ev, Frame) and ev.target == "y"
    assert c.next_event() is EOF
    with pytest.raises(LocalProtocolError):
        c.receive_data(b"more")


def test_events_returns_batch_then_eof() -> None:
    """events() returns every complete frame in order, then EOF when the peer closed."""
    c = connection_in(Role.BROKER, State.READY)
    c.receive_data(b"".join(frame_bytes(T.MESSAGE, target=f"t{i}") for i in range(5)))
    c.receive_data(b"")
    evs = c.events()
    assert [e.target for e in evs[:-1]] == [f"t{i}" for i in range(5)]  # type: ignore[union-attr]
    assert evs[-1] is EOF


def test_events_delivers_valid_frames_before_a_violation() -> None:
    """events(): frames before an invalid one are delivered; the violation is raised by the
    next call, and the connection is then in ERROR."""
    c = connection_in(Role.BROKER, State.READY)
    c.receive_data(
        frame_bytes(T.MESSAGE, target="a")
        + frame_bytes(T.ROUTED)
        + frame_bytes(T.MESSAGE, target="b")
    )
    evs = c.events()
    assert [e.target for e in evs] == ["a"]  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError):
        c.events()
    assert c.state is State.ERROR


def _reference(role: Role, data: bytes) -> tuple[list[int], bool]:
    """Frame types next_event() delivers one by one, and whether a violation follows."""
    c = connection_in(role, State.READY)
    c.receive_data(data)
    types: list[int] = []
    while True:
        try:
            ev = c.next_event()
        except RemoteProtocolError:
            return types, True
        if not isinstance(ev, Frame):
            return types, False
        types.append(ev.type)


@pytest.mark.parametrize("role", list(Role))
@hyp_settings(max_examples=300, deadline=None)
@given(kinds=st.lists(st.sampled_from(list(FrameType)), max_size=8))
def test_events_batch_matches_next_event(role: Role, kinds: list[FrameType]) -> None:
    """events() on a batch of any frame types (its fast path skips the per-frame state
    check when every type is one READY takes as it is) delivers exactly what next_event()
    does frame by frame, and raises the same violation afterwards."""
    data = b"".join(
        frame_bytes(k, request_id=1 if k in (T.REQUEST, T.REPLY, T.ERROR, T.ROUTED) else 0)
        for k in kinds
    )
    want, violation = _reference(role, data)
    c = connection_in(role, State.READY)
    c.receive_data(data)
    got: list[int] = []
    raised = False
    for _ in range(len(kinds) + 1):
        try:
            evs = c.events()
        except RemoteProtocolError:
            raised = True
            break
        if not evs:
            break
        got.extend(e.type for e in evs if isinstance(e, Frame))
    assert got == want
    assert raised == violation


def _plain_burst(evs: list[object]) -> bool:
    return bool(evs) and all(
        isinstance(e, Frame) and e.type == T.MESSAGE and not e.n_fds for e in evs
    )


@hyp_settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from([T.MESSAGE, T.MESSAGE, T.MESSAGE, T.NOTIFY, T.REPLY, T.ROUTED, T.GOODBYE]),
        max_size=10,
    ),
    cuts=st.lists(st.integers(0, 2000), max_size=4),
    eof=st.booleans(),
)
def test_message_burst_is_the_bytes_of_plain_messages_only(
    kinds: list[FrameType], cuts: list[int], eof: bool
) -> None:
    """After each events() call, ``message_burst`` is the total size of the frames it
    returned when they are plain MESSAGE frames (at least one, no EOF among them), and -1
    for any other batch: a client queues such a batch whole on that claim."""
    data = b"".join(
        frame_bytes(k, target="g" * (i % 3 + 1), request_id=1 if k != T.MESSAGE else 0)
        for i, k in enumerate(kinds)
    )
    c = connection_in(Role.CLIENT, State.READY)
    points = [*sorted({x % (len(data) + 1) for x in cuts}), len(data)]
    prev = 0
    for i, point in enumerate(points):
        if point > prev:  # (an empty piece would be EOF)
            c.receive_data(data[prev:point])
        prev = point
        if eof and i == len(points) - 1:
            c.receive_data(b"")
        try:
            evs: list[object] = list(c.events())
        except RemoteProtocolError:
            return  # a frame after GOODBYE: no batch to claim anything about
        if _plain_burst(evs):
            assert c.message_burst == sum(len(e.raw) for e in evs)  # type: ignore[attr-defined]
        else:
            assert c.message_burst == -1


def test_descriptors_after_a_body_received_apart() -> None:
    """A client receives a large byte-string body into its own bytes (Frame.large_body);
    the frame still counts all its bytes where descriptors are matched to frames by
    stream offset, so the descriptor behind it reaches its own frame."""
    big = frame_bytes(T.MESSAGE, target="g", body=encode_cbor(b"x" * 400_000))
    with_fd = frame_bytes(T.MESSAGE, target="fd", n_fds=1)
    c = connection_in(Role.CLIENT, State.READY)
    r, w = os.pipe()
    try:
        c.receive_data(big[:5000])
        assert c.events() == []
        c.receive_data(big[5000:])
        c.receive_data(with_fd, [r])
        evs = c.events()
        assert [type(e).__name__ for e in evs] == ["Frame", "Frame"]
        first, second = evs
        assert first.large_body and first.body() == b"x" * 400_000  # type: ignore[union-attr]
        assert second.target == "fd" and len(second.fds) == 1  # type: ignore[union-attr]
        os.close(second.fds[0])  # type: ignore[union-attr]
    finally:
        os.close(w)


def test_message_burst_of_large_frames_and_descriptors() -> None:
    """A message of the large-frame path or with attachments counts with the small ones
    around it; a batch with a descriptor-carrying message is no burst."""
    big = frame_bytes(T.MESSAGE, target="g", body=encode_cbor(b"x" * 400_000))
    small = frame_bytes(T.MESSAGE, target="g", body=encode_cbor(b"y"))
    c = connection_in(Role.CLIENT, State.READY)
    c.receive_data(big[:5000])
    assert c.events() == [] and c.message_burst == -1
    c.receive_data(big[5000:] + small * 3)
    evs = c.events()
    assert len(evs) == 4 and c.message_burst == len(big) + 3 * len(small)
    # Attachments take the parser's careful path; the frames behind them count too.
    blobs = frame_bytes(T.MESSAGE, target="g", blobs=[b"a" * 10, b"b"])
    c.receive_data(small + blobs + small)
    evs = c.events()
    assert len(evs) == 3 and c.message_burst == 2 * len(small) + len(blobs)
    r, w = os.pipe()
    try:
        c.receive_data(small + frame_bytes(T.MESSAGE, target="g", n_fds=1), [r])
        evs = c.events()
        assert len(evs) == 2 and c.message_burst == -1
        fds = evs[1].fds  # type: ignore[union-attr]
        assert len(fds) == 1
        os.close(fds[0])
    finally:
        os.close(w)
