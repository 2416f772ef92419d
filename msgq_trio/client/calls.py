"""The pending-call table's entries: one :class:`PendingCall` per call in flight
(PENDING until ``done``, then ANSWERED, FAILED or COLLECTED), and the REQUEST header
encoder. No I/O: the session registers calls (``Session.start_call``) and routes
answers to them (``Session.handle``); the drivers wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import (
    MalformedMessage,
    MsgqError,
    RequestTimeout,
    UsageError,
    rpc_error_from_wire,
)
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import (
    Frame,
    close_fds,
    encode_cbor,
)
from .message import (
    Result,
)
from .wire import REPLY as _REPLY

log = logging.getLogger("msgq_trio.client")

__all__ = ["LOCAL_GRACE", "PendingCall", "request_header"]

#: A call with a ``timeout`` gives up locally this long after it: the broker enforces the
#: deadline and answers ``timeout`` itself; the local limit only covers a broker that
#: stopped answering at all.
LOCAL_GRACE = 1.0
#: Encoded ``{"cmd": name}`` request headers by command name; stops growing at the cap.
_CMD_HEADERS: dict[str, bytes] = {}
_CMD_HEADERS_MAX = 256


def request_header(command: str, timeout: float | None) -> bytes:
    """The CBOR header of a REQUEST for ``command`` (and the caller's ``timeout``).

    Raises:
        UsageError: ``command`` is not a str, or ``timeout`` is not positive.
        LocalProtocolError: ``timeout`` cannot be encoded.
    """
    if type(command) is not str:
        raise UsageError(f"command must be a str, not {type(command).__name__}")
    if timeout is None:
        # Encoded once per command name: a CBOR encode per call costs more than the lookup.
        head = _CMD_HEADERS.get(command)
        if head is None:
            head = encode_cbor({"cmd": command})
            if len(_CMD_HEADERS) < _CMD_HEADERS_MAX:
                _CMD_HEADERS[command] = head
        return head
    if timeout <= 0:
        raise UsageError("timeout must be positive")
    return encode_cbor({"cmd": command, "timeout": float(timeout)})


class PendingCall:
    """One call in flight: PENDING until ``done``, then ANSWERED (``result``/``frame``),
    FAILED (``error``) or, for a call to every member, COLLECTED (``answers`` for the
    members the broker said it routed to, ``expected``).

    The first outcome wins: an answer after a local timeout or the connection's loss is
    dropped (its descriptors closed).
    """

    __slots__ = (
        "_wake",
        "answers",
        "deadline",
        "done",
        "error",
        "expected",
        "frame",
        "multi",
        "request_id",
        "result",
        "target",
        "timeout",
        "waiter",
    )

    def __init__(
        self,
        request_id: int,
        target: str,
        multi: bool,
        timeout: float | None,
        deadline: float | None,
        wake: Callable[[PendingCall], None] | None,
    ) -> None:
        self.request_id = request_id
        self.target = target
        self.multi = multi
        self.timeout = timeout
        #: When the caller gives up locally (``now`` + timeout + LOCAL_GRACE), or None.
        self.deadline = deadline
        self.done = False
        self.result: Any = None
        self.error: MsgqError | None = None
        self.expected: list[tuple[str, str]] | None = None  # ROUTED (multi only)
        self.answers: dict[str, Result] = {}
        self.frame: Frame | None = None  # the REPLY of a single call (for request())
        #: The driver's object to wake (a trio.Event...); the session does not touch it.
        self.waiter: Any = None
        self._wake = wake

    def _finish(self) -> None:
        self.done = True
        if self._wake is not None:
            self._wake(self)

    def answer(self, frame: Frame, sender: str) -> None:
        """A REPLY or ERROR for this call from ``sender``. A malformed answer fails the
        call with MalformedMessage (the callee's bug: the broker does not decode bodies);
        the connection carries on."""
        try:
            self._answer(frame, sender)
        except RemoteProtocolError as exc:
            close_fds(frame.fds)
            err = MalformedMessage(
                f"answer from {sender} to a call to {self.target!r} is malformed: {exc}", sender
            )
            res = Result(self.target, False, None, err, sender)
            self._answer_result(frame._replace(fds=()), res, sender)

    def _answer(self, frame: Frame, sender: str) -> None:
        if frame.type == _REPLY and not self.multi:
            # The common case, without a Result: _answer_result's single-call branch.
            if self.done:  # already failed (timeout, connection lost)
                close_fds(frame.fds)
                return
            self.result = frame.body()
            self.frame = frame
            self._finish()
            return
        if frame.type == _REPLY:
            res = Result(self.target, True, frame.body(), None, sender)
        else:
            close_fds(frame.fds)
            h = frame.header()
            res = Result(
                self.target,
                False,
                None,
                rpc_error_from_wire(
                    str(h.get("code", "")), str(h.get("message", "")), frame.body(), sender
                ),
                sender,
            )
        self._answer_result(frame, res, sender)

    def _answer_result(self, frame: Frame, res: Result, sender: str) -> None:
        if not self.multi:
            if self.done:
                close_fds(frame.fds)
                return
            self.result, self.error = res.value, res.error
            self.frame = frame
            self._finish()
            return
        close_fds(frame.fds)  # call_all answers carry no descriptors to the caller
        if self.done:
            return
        if self.expected is None:
            # ROUTED always precedes the members' answers on the same connection, so an
            # answer before it is the broker refusing the whole call (e.g. no-recipient).
            self.error = res.error
            self._finish()
            return
        self.answers[sender] = res
        self._maybe_done()

    def routed(self, to: list[tuple[str, str]]) -> None:
        """The broker's ROUTED: the members this call to every member went to."""
        if self.done:
            return
        self.expected = to
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.expected is not None and len(self.answers) >= len(self.expected):
            self._finish()

    def fail(self, error: MsgqError) -> None:
        """Fail the call with ``error`` unless it already has its outcome."""
        if not self.done:
            self.error = error
            self._finish()

    def expire(self, now: float) -> bool:
        """Fail the call with RequestTimeout if ``now`` is past its local deadline and
        it is still pending; True if it did."""
        if self.done or self.deadline is None or now < self.deadline:
            return False
        self.fail(
            RequestTimeout(
                f"no answer from {self.target!r} within {self.timeout} s "
                "(and none from the broker)",
                sender=None,
            )
        )
        return True

    def member_results(self) -> list[Result]:
        """The outcome of a call to every member: one Result per member routed to, in the
        broker's (join) order; a member without an answer yields an error Result.

        Raises:
            MsgqError: the broker refused the whole call (e.g. NoRecipient), or the call
                failed before the broker routed it.
        """
        if self.error is not None and self.expected is None:
            raise self.error
        out = []
        for lname, _name in self.expected or []:
            res = self.answers.get(lname)
            if res is None:
                err = self.error or RequestTimeout(f"{lname} did not answer", sender=lname)
                res = Result(self.target, False, None, err, lname)
            out.append(res)
        return out
