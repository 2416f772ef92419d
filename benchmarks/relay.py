"""The ``py-relay`` ceiling: the least a Python broker hop can do, as one process.

``python -m benchmarks.relay SPEC_JSON`` listens on ``spec["addr"]["socket"]`` and
forwards ``u32 BE length | payload`` frames between connections, single-threaded with
``selectors`` and blocking ``sendall`` (a slow receiver simply stalls the relay, which is
backpressure). A client's first frame is its role, answered by ``K``:

* ``P`` publisher: every complete frame it sends goes to every ``S`` connection; a received
  chunk is cut at the last complete frame and forwarded in one ``sendall`` per subscriber;
* ``S`` subscriber: only receives;
* ``C`` caller: its frames start with a 4-byte caller id, which the relay overwrites with
  this connection's id and forwards to the ``R`` connection;
* ``R`` responder: its frames are routed to the caller whose id they carry.

No decoding, no per-message objects: whatever msgq_trio's broker does on top of this
(routing by name, sender stamping, RPC tracking, limits) is its own cost.
"""

from __future__ import annotations

import selectors
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from .common import LEN, Deadline, FrameReader, Spec, ready, worker_main

_ID = struct.Struct(">I")
_ACK = LEN.pack(1) + b"K"


class _Client:
    __slots__ = ("id", "reader", "role", "sock")

    def __init__(self, sock: socket.socket, cid: int) -> None:
        self.sock = sock
        self.reader = FrameReader(sock)
        self.role = b""
        self.id = cid


class Relay:
    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(128)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.subs: list[_Client] = []
        self.responder: _Client | None = None
        self.callers: dict[int, _Client] = {}
        self.next_id = 0
        self.forwarded = 0

    def serve(self, deadline: Deadline) -> None:
        while not deadline.expired():
            for key, _ in self.sel.select(timeout=0.5):
                if key.data is None:
                    sock, _ = self.listener.accept()
                    sock.setblocking(True)
                    self.next_id += 1
                    self.sel.register(sock, selectors.EVENT_READ, _Client(sock, self.next_id))
                else:
                    self._readable(key.data)

    def _drop(self, c: _Client) -> None:
        self.sel.unregister(c.sock)
        c.sock.close()
        if c in self.subs:
            self.subs.remove(c)
        if self.responder is c:
            self.responder = None
        self.callers.pop(c.id, None)

    def _readable(self, c: _Client) -> None:
        r = c.reader
        try:
            got = r.fill()
        except OSError:
            got = 0
        if not got:
            self._drop(c)
            return
        start, stop, count, _ = r.complete()
        if not count:
            return
        if not c.role:
            c.role = bytes(r.buf[start + 4 : start + 5])
            if c.role == b"S":
                self.subs.append(c)
            elif c.role == b"R":
                self.responder = c
            elif c.role == b"C":
                self.callers[c.id] = c
            c.sock.sendall(_ACK)
            start += 5
            if start == stop:
                return
        view = memoryview(r.buf)[start:stop]
        if c.role == b"P":
            for s in self.subs:
                s.sock.sendall(view)
            self.forwarded += count
        elif c.role == b"C":
            if self.responder is None:
                return
            cid = _ID.pack(c.id)
            buf = r.buf
            for off, _n in r.frames(start, stop):
                buf[off + 4 : off + 8] = cid
            self.responder.sock.sendall(view)
            self.forwarded += count
        elif c.role == b"R":
            # Route each answer by caller id, one sendall per run of frames to one caller.
            buf = r.buf
            run_start, run_id = start, -1
            for off, _n in r.frames(start, stop):
                cid = _ID.unpack_from(buf, off + 4)[0]
                if cid != run_id:
                    self._to_caller(run_id, buf, run_start, off)
                    run_start, run_id = off, cid
                self.forwarded += 1
            self._to_caller(run_id, buf, run_start, stop)

    def _to_caller(self, cid: int, buf: bytearray, start: int, stop: int) -> None:
        caller = self.callers.get(cid)
        if caller is not None and stop > start:
            caller.sock.sendall(memoryview(buf)[start:stop])


def _relay(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    relay = Relay(Path(spec["addr"]["socket"]))
    ready()
    relay.serve(deadline)
    return {"forwarded": relay.forwarded}


ROLES = {"relay": _relay}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
