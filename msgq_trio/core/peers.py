"""Per-connection broker state: identity, subscriptions, outgoing queue and its accounting.

Pure data: no trio, no sockets. The I/O layer drains ``outq``; the core fills it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol.framing import FdBuffer
from .users import UNACCOUNTED, UserAccount

if TYPE_CHECKING:
    from .access import Access

Buffer = bytes | bytearray | memoryview
#: Buffer types that hold nothing but bytes; anything else queued is a spliced rest
#: (``protocol.framing.SplicedRest``), whose pipes a dropped queue must release.
_PLAIN = frozenset({bytes, bytearray, memoryview})


class OutQueue(list[Buffer]):
    """A peer's outgoing buffers, oldest first.

    A list rather than a ``deque``: an empty deque holds a 64-slot block (760 bytes) from
    its creation, an empty list nothing beyond its 56-byte header, and most of a large
    broker's connections are idle with nothing queued. The queue is consumed from the
    front only by :meth:`Peer.take_outgoing`, a batch at a time (one slice deletion per
    batch, not one per buffer), so front removal stays cheap; ``appendleft`` puts back
    the unsent rest of a direct write.
    """

    __slots__ = ()

    def appendleft(self, b: Buffer) -> None:
        self.insert(0, b)


class Peer:
    """One client as the broker sees it.

    Ownership: the peer owns its outgoing queue and the keys of the RPC slots it takes
    part in (``pending_out`` as caller, ``pending_in`` as callee), so removing a peer frees
    everything it holds in O(its own entries).
    """

    __slots__ = (
        "account",
        "acl",
        "alive",
        "bytes_in",
        "bytes_out",
        "connected_at",
        "gid",
        "groups",
        "id",
        "lname",
        "msgs_in",
        "msgs_out",
        "name",
        "outq",
        "outq_bytes",
        "outq_fds",
        "outq_fds_taken",
        "pending_in",
        "pending_out",
        "pid",
        "quota_refusals",
        "remote",
        "sealed",
        "stamp",
        "uid",
        "where",
    )

    def __init__(self, pid_: int, name: str, *, pid: int, uid: int, gid: int, now: float) -> None:
        self.id = pid_
        self.lname = f"l.{pid_}"
        self.name = name
        self.pid = pid
        self.uid = uid
        self.gid = gid
        self.connected_at = now
        # The source section stamped into everything this peer sends (docs/PROTOCOL.md):
        # lname, NUL, client name. Computed once per connection, not per message.
        self.stamp = self.lname.encode() + b"\0" + name.encode()
        self.groups: dict[str, int] = {}
        self.outq = OutQueue()
        self.outq_bytes = 0
        #: Descriptors the broker holds for this peer: in FdBuffers in ``outq``, and in
        #: those ``take_outgoing`` handed to the writer until ``sent`` (the writer closes
        #: them only after the whole batch, which may wait on a full socket). This is what
        #: ``max_fds_queued`` bounds.
        self.outq_fds = 0
        #: Of ``outq_fds``: the descriptors in batches taken but not yet ``sent``.
        self.outq_fds_taken = 0
        self.pending_in: set[tuple[int, int]] = set()
        self.pending_out: set[tuple[int, int]] = set()
        self.alive = True
        #: The broker has queued its GOODBYE to this peer: nothing may follow it.
        self.sealed = False
        self.msgs_in = 0
        self.bytes_in = 0
        self.msgs_out = 0
        self.bytes_out = 0
        #: What this peer may do (core/access.py); None = everything (a Unix client no
        #: access rule names). Set by Broker.connect / set_policy.
        self.acl: Access | None = None
        #: A TCP client: no descriptor passing, identity from a token or certificate.
        self.remote = False
        #: For a TCP client: ``tcp:NAME@address`` (log lines name it).
        self.where = ""
        #: The user this connection is charged to (core/users.py; set by Broker.connect).
        self.account: UserAccount = UNACCOUNTED
        #: Operations refused to this connection for a quota (``quotas.refusals_before_drop``).
        self.quota_refusals = 0

    def __repr__(self) -> str:
        return f"<Peer {self.lname} name={self.name!r} pid={self.pid}>"

    def describe(self) -> str:
        """Identity for log lines: which client caused this."""
        if self.remote:
            return f"{self.lname} (name={self.name!r} pid={self.pid} {self.where})"
        return f"{self.lname} (name={self.name!r} pid={self.pid} uid={self.uid})"

    def take_outgoing(self, max_bytes: int = 1 << 62) -> tuple[list[Buffer], int]:
        """Remove and return queued buffers (at least one, then up to ``max_bytes``).

        The descriptors of taken FdBuffers still count in ``outq_fds`` until :meth:`sent`
        (or :meth:`drop_queue`): the taker closes them only once the batch is written, so
        until then the broker still holds them for this peer.
        """
        q = self.outq
        n = 0
        k = 0
        total = len(q)
        fds = 0
        while k < total:
            b = q[k]
            size = len(b)
            if k and n + size > max_bytes:
                break
            n += size
            k += 1
            if type(b) is FdBuffer:
                fds += len(b.fds)
        self.outq_fds_taken += fds
        if k == total:
            # All of it (the usual case): hand over the list itself, start a new one.
            self.outq = OutQueue()
            return q, n
        out = q[:k]
        del q[:k]
        return out, n

    def drop_queue(self) -> list[int]:
        """Empty the outgoing queue; returns the descriptors it held (to be closed).

        Descriptors of a batch already taken are not among them: their taker closes them.
        """
        fds: list[int] = []
        for b in self.outq:
            t = type(b)
            if t is FdBuffer:
                fds.extend(b.fds)  # type: ignore[union-attr]
            elif t not in _PLAIN:
                b.close()  # type: ignore[union-attr]  # a spliced rest: its pipes
        self.outq.clear()
        self.outq_bytes = 0
        self.outq_fds = 0
        self.outq_fds_taken = 0
        return fds

    def sent(self, nbytes: int) -> None:
        """Account for the batch (``nbytes``) last taken by ``take_outgoing``: it reached
        the socket and its descriptors are closed."""
        self.outq_bytes -= nbytes
        self.bytes_out += nbytes
        self.outq_fds -= self.outq_fds_taken
        self.outq_fds_taken = 0
