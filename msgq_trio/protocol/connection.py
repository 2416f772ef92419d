"""The connection state machine: one table decides which frames each side may send or receive.

Rules (read these before changing the table):

Rule 1. A connection starts IDLE. The client's first frame is HELLO; the broker's first
        frame is WELCOME (accepted) or ERROR (refused, e.g. version-mismatch). Anything
        else first is a protocol violation.
Rule 2. In READY both sides may send MESSAGE, REQUEST, REPLY, ERROR, NOTIFY and GOODBYE;
        only the broker sends ROUTED.
Rule 3. GOODBYE is a side's last frame. Receiving anything after the peer's GOODBYE is a
        protocol violation; sending anything after our own GOODBYE is a local error.
Rule 4. ERROR is a real state: after any protocol error every later call raises, so a
        caller that ignores an error fails predictably instead of carrying on.

The connection is sans-I/O: ``receive_data(bytes)`` / ``next_event()`` / ``send(...)``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final

from .codes import PROTOCOL_VERSION, ErrorCode, FrameType
from .errors import LocalProtocolError, RemoteProtocolError
from .framing import (
    DEFAULT_MAX_FRAME_SIZE,
    SEEN_FDS,
    Frame,
    FrameParser,
    Run,
    SplicedRest,
    encode_cbor,
    encode_frame,
)


class Role(enum.Enum):
    CLIENT = "client"
    BROKER = "broker"


class State(enum.Enum):
    IDLE = "IDLE"
    HELLO_SENT = "HELLO_SENT"  # client: waiting for WELCOME
    HELLO_RECEIVED = "HELLO_RECEIVED"  # broker: must answer WELCOME or ERROR
    READY = "READY"
    CLOSED = "CLOSED"  # handshake refused, or both GOODBYEs exchanged
    ERROR = "ERROR"


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    EOF = "EOF"


#: next_event() result: no complete frame buffered yet.
NEED_DATA: Final = _Sentinel.NEED_DATA
#: next_event() result: the peer closed its sending side (receive_data(b"") was called).
EOF: Final = _Sentinel.EOF

_T = FrameType
_MESSAGE_BIT = 1 << _T.MESSAGE
_READY_SEND_CLIENT = frozenset({_T.MESSAGE, _T.REQUEST, _T.REPLY, _T.ERROR, _T.NOTIFY, _T.GOODBYE})
_READY_SEND_BROKER = _READY_SEND_CLIENT | {_T.ROUTED}

# (role, state) -> {frame type the role SENDS: next state}
_SEND: dict[tuple[Role, State], dict[int, State]] = {
    (Role.CLIENT, State.IDLE): {_T.HELLO: State.HELLO_SENT},
    (Role.BROKER, State.HELLO_RECEIVED): {_T.WELCOME: State.READY, _T.ERROR: State.CLOSED},
    (Role.CLIENT, State.READY): {t: State.READY for t in _READY_SEND_CLIENT},
    (Role.BROKER, State.READY): {t: State.READY for t in _READY_SEND_BROKER},
    # A refused client may still say GOODBYE-less nothing; a broker may report a
    # connection-level ERROR before a client ever sent HELLO (e.g. garbage first bytes).
    (Role.BROKER, State.IDLE): {_T.ERROR: State.CLOSED},
}
# (role, state) -> {frame type the role RECEIVES: next state}
_RECV: dict[tuple[Role, State], dict[int, State]] = {
    (Role.BROKER, State.IDLE): {_T.HELLO: State.HELLO_RECEIVED},
    (Role.CLIENT, State.HELLO_SENT): {_T.WELCOME: State.READY, _T.ERROR: State.CLOSED},
    (Role.BROKER, State.READY): {t: State.READY for t in _READY_SEND_CLIENT},
    (Role.CLIENT, State.READY): {t: State.READY for t in _READY_SEND_BROKER},
}


class Connection:
    """One side of a msgq_trio connection, without any I/O.

    Args:
        role: which side we are.
        max_frame_size: largest frame accepted from the peer (checked on the prefix).
    """

    def __init__(self, role: Role, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.role = role
        self.state = State.IDLE
        # A client's peer is the broker, which sends only whole frames: its large
        # byte-string bodies can be received straight into their own bytes.
        self._parser = FrameParser(max_frame_size, own_bodies=role is Role.CLIENT)
        self._eof = False
        self.sent_goodbye = False
        self.received_goodbye = False
        self._pending_error: RemoteProtocolError | None = None
        self._burst = -1  # see message_burst
        # Descriptors received but not yet attached to a frame: [start, end, fds] per
        # receive, where [start, end) is the byte range of the stream that came with them.
        # A list, not a deque: an empty deque takes 760 bytes per connection, and few
        # connections ever pass descriptors (a handful of batches at a time when they do).
        self._fd_batches: list[list[Any]] = []
        self._rx_offset = 0  # stream bytes received so far
        #: Descriptors no frame will own (after a violation or at close): the I/O layer
        #: closes them (see :meth:`take_orphan_fds`).
        self._orphans: list[int] = []
        self._recv_ready: frozenset[int] = (
            _READY_SEND_BROKER if role is Role.CLIENT else _READY_SEND_CLIENT
        )
        # The frame types that READY accepts without a transition, as FrameParser.seen
        # bits; GOODBYE (a transition) and SEEN_FDS are not among them.
        self._ready_bits = sum(1 << t for t in self._recv_ready if t != FrameType.GOODBYE)

    @property
    def error_pending(self) -> bool:
        """True when :meth:`events` returned valid frames that preceded a protocol error;
        the next call raises it. Callers check this after handling those frames instead of
        waiting for more data that may never come."""
        return self._pending_error is not None or self._parser.error is not None

    @property
    def message_burst(self) -> int:
        """After :meth:`events`: if it returned plain MESSAGE frames only (at least one,
        none with descriptors, no EOF), the bytes of those frames (prefixes included);
        otherwise -1. Such a burst needs no per-frame look: a client queues it whole."""
        return self._burst

    @property
    def received_bytes(self) -> int:
        """Stream bytes received so far (heartbeats: did the peer say anything lately?)."""
        return self._rx_offset

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned in frames (a partial frame, or whole ones)."""
        return self._parser.buffered

    @property
    def in_frame(self) -> bool:
        """True while a frame has started arriving and is not complete."""
        return self._parser.in_frame

    @property
    def in_large_frame(self) -> bool:
        """True while a large frame has started arriving and is not complete."""
        return self._parser.in_large_frame

    def splice_rest(self, min_rest: int) -> int:
        """See :meth:`FrameParser.splice_rest` (0 after an error or EOF)."""
        if self.state is State.ERROR or self._eof or self._pending_error is not None:
            return 0
        return self._parser.splice_rest(min_rest)

    def complete_spliced(self, rest: SplicedRest) -> None:
        """See :meth:`FrameParser.complete_spliced`: the rest's bytes count as received."""
        self._parser.complete_spliced(rest)
        self._rx_offset += len(rest)

    def unsplice(self, data: bytes | bytearray | memoryview) -> None:
        """See :meth:`FrameParser.unsplice`: ``data`` counts as received."""
        self._parser.unsplice(data)
        self._rx_offset += len(data)

    # -- receiving ------------------------------------------------------------------------
    def receive_data(self, data: bytes | bytearray | memoryview, fds: Sequence[int] = ()) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its side (EOF).

        ``fds`` are descriptors that arrived with these bytes (SCM_RIGHTS). They belong to
        frames that start within these bytes; the connection owns them until it attaches
        them to a frame (``Frame.fds``) or hands them back via :meth:`take_orphan_fds`.
        """
        if fds:
            self._fd_batches.append([self._rx_offset, self._rx_offset + len(data), list(fds)])
        if self.state is State.ERROR:
            self._orphan_all()
            raise LocalProtocolError("connection is in the ERROR state")
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("data received after EOF")
        self._rx_offset += len(data)
        self._parser.feed(data)

    def receive_buffer(self) -> memoryview | None:
        """Where to receive the next bytes in place, or None (receive anywhere and call
        :meth:`receive_data`): a view of the rest of a large frame in progress (see
        :meth:`FrameParser.receive_buffer`). After receiving into it, release the view and
        call :meth:`received_into` before anything else."""
        if self.state is State.ERROR or self._eof or self._pending_error is not None:
            return None
        return self._parser.receive_buffer()

    def received_into(self, n: int, fds: Sequence[int] = ()) -> None:
        """``n`` bytes (and ``fds``) arrived in the view :meth:`receive_buffer` lent;
        ``n == 0`` means EOF. The same contract as :meth:`receive_data` otherwise."""
        self._parser.advance(n)
        if fds:
            self._fd_batches.append([self._rx_offset, self._rx_offset + n, list(fds)])
        if self.state is State.ERROR:
            self._orphan_all()
            raise LocalProtocolError("connection is in the ERROR state")
        if n == 0:
            self._eof = True
            return
        self._rx_offset += n

    def return_buffer(self) -> None:
        """Give back the view :meth:`receive_buffer` lent, with nothing received (the
        receive failed or was cancelled). Idempotent."""
        if self._parser.lent:
            self._parser.advance(0)

    def take_orphan_fds(self) -> list[int]:
        """Descriptors that no frame owns (to be closed by the caller). After an error or
        EOF this includes every descriptor still held."""
        if self.state is State.ERROR or self._eof:
            self._orphan_all()
        out, self._orphans = self._orphans, []
        return out

    def _orphan_all(self) -> None:
        for batch in self._fd_batches:
            self._orphans.extend(batch[2])
        self._fd_batches.clear()

    def _attach_all(self, frames: list[Frame]) -> list[Frame]:
        """Give every frame the descriptors it declares; check none is missing or extra.

        A descriptor arrives with the bytes of the sendmsg that carried it, and senders
        start that sendmsg at the frame that declares it, so it belongs to a frame that
        starts within the byte range received with it. Frames' stream offsets are derived
        from the bytes fed minus the bytes still buffered, so nothing is tracked per frame
        while no descriptors are around.
        """
        start = self._rx_offset - self._parser.buffered
        for f in frames:
            start -= f.wire_size
        out: list[Frame] = []
        try:
            for f in frames:
                out.append(self._attach_fds(f, start))
                start += f.wire_size
            self._check_leftover_fds(start)
        except RemoteProtocolError:
            # None of these frames will be handled: their descriptors are orphans too.
            for f in out:
                self._orphans.extend(f.fds)
            raise
        return out

    def _attach_fds(self, frame: Frame, start: int) -> Frame:
        batches = self._fd_batches
        self._check_leftover_fds(start)
        need = frame.n_fds
        if not need:
            return frame
        taken: list[int] = []
        for batch in batches:
            if batch[0] > start:
                break
            k = min(need - len(taken), len(batch[2]))
            taken.extend(batch[2][:k])
            del batch[2][:k]
            if len(taken) == need:
                break
        if len(taken) < need:
            self._orphans.extend(taken)
            self._orphan_all()
            raise RemoteProtocolError(
                f"frame declares {need} file descriptors, {len(taken)} arrived with it"
            )
        return frame._replace(fds=tuple(taken))

    def _check_leftover_fds(self, next_start: int) -> None:
        """A batch whose byte range ends at or before ``next_start`` can have no further
        claimant: descriptors left in it were sent without a frame declaring them."""
        batches = self._fd_batches
        while batches and batches[0][1] <= next_start:
            if batches[0][2]:
                self._orphan_all()
                raise RemoteProtocolError(
                    "received file descriptors that no frame declared", ErrorCode.PROTOCOL_ERROR
                )
            del batches[0]

    def next_event(self) -> Frame | _Sentinel:
        """Return the next frame, NEED_DATA, or EOF once the peer closed and all frames are out.

        Raises:
            RemoteProtocolError: the peer violated the framing or the state table; the
                connection enters ERROR and ``exc.code`` says what to send back.
            LocalProtocolError: called again after an error.
        """
        if self.state is State.ERROR:
            raise LocalProtocolError("connection is in the ERROR state")
        if self._pending_error is not None:
            self.state = State.ERROR
            raise self._pending_error
        try:
            frame = self._parser.next_frame()
            if frame is not None and (self._fd_batches or frame.n_fds):
                frame = self._attach_all([frame])[0]
        except RemoteProtocolError:
            self.state = State.ERROR
            self._orphan_all()
            raise
        if frame is None:
            return EOF if self._eof else NEED_DATA
        if (
            self.state is State.READY
            and frame.type in self._recv_ready
            and not self.received_goodbye
        ):
            if frame.type == FrameType.GOODBYE:
                self.received_goodbye = True
            return frame
        return self._slow_transition(frame)

    def events(self) -> list[Frame | _Sentinel]:
        """All events available now: complete frames, then EOF if the peer closed.

        Equivalent to calling :meth:`next_event` until NEED_DATA, but one call per
        receive (the hot path parses thousands of small frames per receive). If a frame
        is invalid, the valid frames before it are returned first and the error is
        raised by the next call.

        Raises:
            RemoteProtocolError / LocalProtocolError: as :meth:`next_event`.
        """
        return self._events(None)  # type: ignore[return-value]  # no source: no Runs

    def events_with_runs(self, source: bytes | None) -> list[Frame | Run | _Sentinel]:
        """:meth:`events` for the broker: consecutive MESSAGE frames that already carry
        ``source`` (the sender's stamp) come as one :class:`Run` (see
        :meth:`FrameParser.frames_and_runs`). Each run passes the state table like the
        frames it holds. ``None`` means plain frames only. While descriptors
        are waiting for their frame, plain frames only, so each gets its own.
        """
        return self._events(source)

    def _events(self, source: bytes | None) -> list[Frame | Run | _Sentinel]:
        if self.state is State.ERROR:
            raise LocalProtocolError("connection is in the ERROR state")
        if self._pending_error is not None:
            self.state = State.ERROR
            raise self._pending_error
        self._burst = -1
        parser = self._parser
        try:
            if source is None or self._fd_batches:
                frames: list[Frame | Run] = parser.frames()  # type: ignore[assignment]
            else:
                frames = parser.frames_and_runs(source)
            if self._fd_batches or parser.seen & SEEN_FDS:
                frames = self._attach_all(frames)  # type: ignore[arg-type,assignment]
        except RemoteProtocolError:
            self.state = State.ERROR
            self._orphan_all()
            raise
        if (
            not parser.seen & ~self._ready_bits
            and self.state is State.READY
            and not self.received_goodbye
        ):
            # Every frame is of a type READY takes as it is (the common case): no
            # per-frame check needed.
            out: list[Frame | Run | _Sentinel] = frames  # type: ignore[assignment]
            if self._eof and not parser.in_frame:
                out.append(EOF)
            elif parser.seen == _MESSAGE_BIT and source is None:
                self._burst = parser.returned_bytes
            return out
        out = []
        ready = self._recv_ready
        for i, frame in enumerate(frames):
            if self.state is State.READY and frame.type in ready and not self.received_goodbye:
                if frame.type == FrameType.GOODBYE:
                    self.received_goodbye = True
                out.append(frame)
                continue
            before = self.state
            try:
                out.append(self._slow_transition(frame))  # type: ignore[arg-type]
            except RemoteProtocolError as exc:
                if i == 0:
                    raise
                # Deliver the valid frames first; the error surfaces on the next call.
                self.state = before
                self._pending_error = exc
                return out
        if self._eof and not self._parser.in_frame:
            out.append(EOF)
        return out

    def _slow_transition(self, frame: Frame) -> Frame:
        if self.received_goodbye:
            self.state = State.ERROR
            raise RemoteProtocolError(f"frame type {frame.type} after GOODBYE")
        nxt = _RECV.get((self.role, self.state), {}).get(frame.type)
        if nxt is None:
            self.state = State.ERROR
            raise RemoteProtocolError(
                f"frame type {FrameType(frame.type).name} not allowed in state {self.state.value}"
            )
        self.state = nxt
        if frame.type == FrameType.GOODBYE:
            self.received_goodbye = True
        return frame

    # -- sending --------------------------------------------------------------------------
    def check_send(self, ftype: int) -> None:
        """Validate that we may send a frame of this type now and advance the state.

        Raises:
            LocalProtocolError: the state table forbids it (Rule 1-4).
        """
        if self.sent_goodbye:
            raise LocalProtocolError("cannot send after GOODBYE")
        if self.state is State.READY and ftype != FrameType.GOODBYE:
            ready = _READY_SEND_CLIENT if self.role is Role.CLIENT else _READY_SEND_BROKER
            if ftype in ready:
                return
        nxt = _SEND.get((self.role, self.state), {}).get(ftype)
        if nxt is None:
            raise LocalProtocolError(
                f"{self.role.value} may not send {FrameType(ftype).name} "
                f"in state {self.state.value}"
            )
        self.state = nxt
        if ftype == FrameType.GOODBYE:
            self.sent_goodbye = True

    def send(
        self,
        ftype: int,
        *,
        target: str = "",
        request_id: int = 0,
        flags: int = 0,
        header: dict[str, object] | None = None,
        body: bytes = b"",
        blobs: Sequence[bytes | bytearray | memoryview] = (),
        source: bytes = b"",
        n_fds: int = 0,
    ) -> list[bytes | bytearray | memoryview]:
        """Encode a frame after checking the state table; returns the buffers to write."""
        self.check_send(ftype)
        return encode_frame(
            ftype,
            target=target,
            request_id=request_id,
            flags=flags,
            header=encode_cbor(header) if header else b"",
            body=body,
            blobs=blobs,
            source=source,
            n_fds=n_fds,
        )

    def hello(
        self, name: str, extra: dict[str, object] | None = None
    ) -> list[bytes | bytearray | memoryview]:
        header: dict[str, object] = {"version": PROTOCOL_VERSION, "name": name}
        if extra:
            header.update(extra)
        return self.send(FrameType.HELLO, header=header)

    def fail(self) -> None:
        """Mark the connection broken (after an I/O failure or our own protocol error)."""
        self.state = State.ERROR

    def close(self) -> list[int]:
        """The socket is closed: drop every buffered byte now and return the descriptors
        received but never handed out (the caller closes them). Idempotent.

        Also forgets a pending error, whose traceback would otherwise keep this object
        and its buffers alive in a reference cycle until the garbage collector runs.
        """
        self.state = State.ERROR
        self._pending_error = None
        self._parser.release()
        return self.take_orphan_fds()


def connection_error_frame(code: ErrorCode, message: str) -> list[bytes | bytearray | memoryview]:
    """An ERROR frame with request id 0, sent just before closing a connection."""
    return encode_frame(
        FrameType.ERROR, header=encode_cbor({"code": str(code), "message": message})
    )
