"""A ctypes binding of libmsgq (clients/c) for the tests: one ``Connection`` whose native
handle (the ``msgq *``) can be handed to C code loaded into the same Python program, so
Python and that C code share one connection to the broker (docs/C-CLIENT.md, "One
connection for Python and C").

Blocking and single-threaded, as the library: every method runs on the calling thread
and dispatches callbacks (Python's and those C code registered on the handle) while it
waits. The library's threading rule applies to the whole program: one thread at a time
on a connection, so C code given ``handle`` runs on the thread that uses the
``Connection`` (or every use of the handle is under one lock).

Bodies are CBOR bytes (encoded and decoded with cbor2 here), sent and received through
the library's raw-bytes path (``msgq_call_async_raw``, ``msgq_message_body_raw``).
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

import cbor2

POLLOUT = 0x004
MSGQ_KIND_MESSAGE = 3
MSGQ_KIND_NOTIFY = 7


class _Error(ctypes.Structure):
    _fields_ = [
        ("code_id", ctypes.c_int),
        ("code", ctypes.c_char * 64),
        ("message", ctypes.c_char_p),
        ("data", ctypes.c_void_p),
    ]


class _Options(ctypes.Structure):
    _fields_ = [
        ("socket", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("max_frame_size", ctypes.c_uint32),
        ("max_out_bytes", ctypes.c_size_t),
        ("max_fds", ctypes.c_uint),
        ("max_cbor_depth", ctypes.c_uint),
        ("handshake_timeout", ctypes.c_double),
        ("close_timeout", ctypes.c_double),
        ("nonblocking", ctypes.c_int),
    ]


class _Result(ctypes.Structure):
    _fields_ = [
        ("ok", ctypes.c_int),
        ("status", ctypes.c_int),
        ("value", ctypes.c_void_p),
        ("answer", ctypes.c_void_p),
        ("error", _Error),
    ]


_CALL_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(_Result), ctypes.c_void_p)
_MESSAGE_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class MsgqError(Exception):
    """A libmsgq failure: ``status`` the negative errno, ``code`` the wire (or local)
    code, ``message`` the text the broker, the handler or the library gave."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code or errno.errorcode.get(-status, status)}: {message}")
        self.status = status
        self.code = code
        self.message = message


def load(path: str) -> ctypes.CDLL:
    """Load libmsgq from ``path`` and declare the functions this binding uses."""
    lib = ctypes.CDLL(path)
    p, i, s, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "msgq_options_init": (None, [ctypes.POINTER(_Options)]),
        "msgq_connect": (i, [ctypes.POINTER(p), ctypes.POINTER(_Options), ctypes.POINTER(_Error)]),
        "msgq_close": (None, [p]),
        "msgq_error_clear": (None, [ctypes.POINTER(_Error)]),
        "msgq_lname": (s, [p]),
        "msgq_status": (i, [p, ctypes.POINTER(_Error)]),
        "msgq_process": (i, [p]),
        "msgq_wait": (i, [p, ctypes.c_int64]),
        "msgq_subscribe": (i, [p, s, ctypes.POINTER(i), ctypes.POINTER(_Error)]),
        "msgq_send_raw": (i, [p, s, p, sz, p]),
        "msgq_call_async_raw": (
            i,
            [p, s, s, p, sz, p, ctypes.c_double, _CALL_CB, p, ctypes.POINTER(ctypes.c_uint64)],
        ),
        "msgq_set_message_handler": (None, [p, _MESSAGE_CB, p]),
        "msgq_message_kind": (i, [p]),
        "msgq_message_sender": (s, [p]),
        "msgq_message_target": (s, [p]),
        "msgq_message_body_raw": (ctypes.POINTER(ctypes.c_uint8), [p, ctypes.POINTER(sz)]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _error(status: int, err: _Error) -> MsgqError:
    return MsgqError(
        status, err.code.decode(errors="replace"), (err.message or b"").decode(errors="replace")
    )


class Message:
    """A received MESSAGE or NOTIFY, copied out of the library's frame."""

    def __init__(self, kind: int, sender: str, target: str, body: Any) -> None:
        self.kind = kind
        self.sender = sender
        self.target = target
        self.body = body


class Connection:
    """One libmsgq connection (``msgq_connect``); ``close()`` ends it.

    ``handle`` is the native ``msgq *`` as an integer, for C code in this process: it
    borrows the connection (calls, registers commands) and must not close it.
    """

    def __init__(self, lib: ctypes.CDLL, socket: str, name: str = "msgq-py") -> None:
        self._lib = lib
        opts = _Options()
        lib.msgq_options_init(ctypes.byref(opts))
        self._socket = socket.encode()
        self._name = name.encode()
        opts.socket = self._socket
        opts.name = self._name
        err = _Error()
        m = ctypes.c_void_p()
        rc = lib.msgq_connect(ctypes.byref(m), ctypes.byref(opts), ctypes.byref(err))
        if rc < 0:
            e = _error(rc, err)
            lib.msgq_error_clear(ctypes.byref(err))
            raise e
        self._m: int | None = m.value
        self.messages: list[Message] = []
        # ctypes frees a callback trampoline with its Python object: keep it as long as
        # the library may call it (the connection's lifetime).
        self._on_message = _MESSAGE_CB(self._message)
        lib.msgq_set_message_handler(self._m, self._on_message, None)

    @property
    def handle(self) -> int:
        """The native ``msgq *`` (an int), valid until ``close()``."""
        if self._m is None:
            raise MsgqError(-errno.ENOTCONN, "connection-lost", "connection closed")
        return self._m

    @property
    def lname(self) -> str:
        return str(self._lib.msgq_lname(self.handle).decode())

    def _message(self, _m: int | None, msg: int | None, _ud: int | None) -> None:
        n = ctypes.c_size_t()
        raw = self._lib.msgq_message_body_raw(msg, ctypes.byref(n))
        data = ctypes.string_at(raw, n.value) if n.value else b""
        self.messages.append(
            Message(
                self._lib.msgq_message_kind(msg),
                (self._lib.msgq_message_sender(msg) or b"").decode(),
                (self._lib.msgq_message_target(msg) or b"").decode(),
                cbor2.loads(data) if data else None,
            )
        )

    def subscribe(self, group: str) -> bool:
        """Join ``group`` (blocking); True if newly joined."""
        changed = ctypes.c_int()
        err = _Error()
        rc = self._lib.msgq_subscribe(
            self.handle, group.encode(), ctypes.byref(changed), ctypes.byref(err)
        )
        if rc < 0:
            e = _error(rc, err)
            self._lib.msgq_error_clear(ctypes.byref(err))
            raise e
        return bool(changed.value)

    def send(self, target: str, body: Any) -> None:
        """One-way MESSAGE with ``body`` encoded as CBOR."""
        data = cbor2.dumps(body)
        rc = self._lib.msgq_send_raw(self.handle, target.encode(), data, len(data), None)
        if rc < 0:
            raise MsgqError(rc, "", os.strerror(-rc))

    def call(self, target: str, command: str, params: Any = None, timeout: float = 10.0) -> Any:
        """Blocking call: ``params`` go out as CBOR bytes (``msgq_call_async_raw``); the
        answer's raw body is decoded here. Raises MsgqError with the error's code."""
        data = cbor2.dumps(params)
        outcome: list[Any] = []

        def done(_m: int | None, res: Any, _ud: int | None) -> None:
            r = res.contents
            if r.ok:
                n = ctypes.c_size_t()
                raw = self._lib.msgq_message_body_raw(r.answer, ctypes.byref(n))
                body = ctypes.string_at(raw, n.value) if n.value else b""
                outcome.append(("ok", cbor2.loads(body) if body else None))
            else:
                outcome.append(("error", _error(r.status, r.error)))

        cb = _CALL_CB(done)
        rc = self._lib.msgq_call_async_raw(
            self.handle, target.encode(), command.encode(), data, len(data), None,
            timeout, cb, None, None,
        )  # fmt: skip
        if rc < 0:
            raise MsgqError(rc, "", os.strerror(-rc))
        # The library answers every started call exactly once (locally with
        # connection-lost or timeout if the broker does not), so this loop ends.
        while not outcome:
            if self._lib.msgq_process(self.handle) == 0:
                self._lib.msgq_wait(self.handle, -1)
        kind, value = outcome[0]
        if kind == "error":
            raise value
        return value

    def process(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for activity and process it (callbacks run,
        C code's commands on this connection are answered). Returns msgq_process's
        value; raises MsgqError once the connection is gone."""
        m = self.handle
        if self._lib.msgq_process(m) == 0:
            self._lib.msgq_wait(m, int(timeout * 1e6))
        rc = int(self._lib.msgq_process(m))
        if rc < 0:
            err = _Error()
            self._lib.msgq_status(m, ctypes.byref(err))
            e = _error(rc, err)
            self._lib.msgq_error_clear(ctypes.byref(err))
            raise e
        return rc

    def close(self) -> None:
        """GOODBYE and free (``msgq_close``); ``handle`` is invalid afterwards."""
        if self._m is not None:
            self._lib.msgq_close(self._m)
            self._m = None
