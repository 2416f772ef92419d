"""Named pipes as pure data: pipes, their ends, buffered bytes, pending reads and writes.

No trio, no sockets, time passed in (``now``): the plugin's service feeds it commands and
membership events and sends the completions it returns. docs/PIPES.md states the
semantics; the rules this file enforces:

Rule 1 (bound). A pipe retains at most ``max_buffer`` bytes not yet read by every reader
  that must read them. A write (one chunk, at most ``max_chunk`` bytes) is accepted only
  when it fits (or the pipe is empty); until then it waits as a pending write, and a
  handle has at most ``max_pending`` pending operations. So a pipe's memory is at most
  ``max_buffer + ends x max_pending x max_chunk``, whatever the speeds.
Rule 2 (readers first). A write is accepted only while at least one reader is attached.
Rule 3 (order). Each write handle numbers its chunks (``seq``); chunk s is accepted only
  after chunk s-1. A pending write that leaves unaccepted (timeout, error) takes every
  later pending write of its handle with it ("retry"), and a chunk arriving after a gap
  is bounced at once: the client resends from the first unaccepted chunk, so no byte is
  ever skipped or reordered.
Rule 4 (whole writes). A chunk sent with ``more`` locks the pipe for its handle until the
  write's last chunk: other writers' chunks wait. A stalled write (its pending chunk
  timed out) releases the lock.
Rule 5 (end of pipe). A reader that has seen a writer attached (``armed``) gets EOF once
  no writer is attached and it has read everything; a reader that never saw a writer
  waits for one. Each read says how many ends of pipe its client has seen; one that
  missed the latest is answered ``retry``, so one end of pipe is reported once.
Rule 6 (broken pipe). When the last reader leaves, writers opened with
  ``on_reader_gone="fail"`` become broken: every pending and later write fails
  ``pipe-broken``. With ``"wait"`` they wait for the next reader.
Rule 7 (flush). A pipe with no ends left is deleted with its contents: reopening its
  name starts empty.
Rule 8 (modes). ``share``: one read position, each byte goes to exactly one reader.
  ``broadcast``: each reader has its own position from the moment it attached; bytes
  are released when every reader has read them (the slowest reader paces the writers).

Rule 9 (torn). When an owner is lost without closing its ends in order -- the
  connection of a peer broker, through which remote ends were attached (docs/PIPES.md,
  "Pipes across brokers") -- every pipe with an end of that owner is broken as a whole
  (``break_owner``): each pending and later operation of each of its ends fails
  ``pipe-broken`` (readers too: an end of pipe would pass a gap off as the whole
  stream), and the pipe leaves ``pipes`` at once, so the next open of its name starts a
  new, empty pipe. Its ends stay known until closed.

Persistent pipes (``persistent`` on open or in the config) change Rules 1, 2, 5, 6 and 7
and add Rules P1-P5; the service commits them to a ``QueueStore`` (one queue per pipe,
one message per chunk, ``producer_seq`` = the chunk's end offset, the store's cursor =
the consumed offset):

Rule P1 (decided once). The first open decides whether a pipe is persistent (the config
  decides for a configured name); a later open asking otherwise is refused
  ``pipe-mismatch``. Persistent pipes are ``share`` mode only. A persistent open needs a
  store (the plugin's ``dir``).
Rule P2 (durable before visible). An accepted chunk of a persistent pipe is *staged*: it
  counts against the pipe's bound (``max_stored`` instead of ``max_buffer``) but readers
  do not see it and its writer gets no answer until the service committed it
  (``take_commit`` / ``committed``). If the commit fails (store full), every staged chunk
  goes back to waiting, in order, as if never accepted (Rule 3 still holds). Writes do
  not wait for a reader (Rule 2 off) and never break when readers leave (Rule 6 off).
Rule P3 (acked consumption). Bytes answered to a reader are *held* by it until its client
  acks them (``consumed``: bytes returned to the caller, sent with each read and with the
  close). Held bytes of a reader that leaves without acking them (crash, close) are
  served again first, in offset order (at-least-once). The consumed offset (the store's
  cursor) is the lowest offset not yet acked; chunks wholly below it are deleted.
Rule P4 (end of pipe). A reader attaching to a persistent pipe that holds unread bytes
  is armed (those bytes' writers have left or are attached): with no writer attached it
  gets the bytes, then end of pipe. A reader of an empty pipe waits for a writer (Rule 5).
Rule P5 (kept). A persistent pipe with no ends is kept while it holds bytes or has a
  commit to make; once empty and committed it is forgotten like a plain pipe (the next
  open decides again), and its end offset is remembered so offsets never go back (the
  store drops a chunk whose end offset is not above the last one stored).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Mapping
from typing import Literal

import attrs

__all__ = [
    "PIPE_BROKEN",
    "PIPE_MISMATCH",
    "Commit",
    "Declared",
    "Done",
    "Engine",
    "EngineError",
    "Limits",
]

#: Error code of a write to a pipe whose readers left (``on_reader_gone="fail"``) and of
#: any operation on a handle the plugin does not know (closed, or the plugin restarted).
PIPE_BROKEN = "pipe-broken"
BAD_REQUEST = "bad-request"
LIMIT_EXCEEDED = "limit-exceeded"
#: An open that asks a pipe to be persistent (or not) when it exists otherwise (Rule P1).
PIPE_MISMATCH = "pipe-mismatch"
#: Longest persistent pipe name in UTF-8 bytes: the store's queue name limit.
MAX_PERSISTENT_NAME = 255

#: Bytes charged per retained chunk on top of its length, so a flood of 1-byte writes
#: is bounded too (a Python bytes object and its list slots cost about this much).
CHUNK_OVERHEAD = 64

Buffer = bytes | memoryview


class EngineError(Exception):
    """A command the engine refuses; ``code`` is the wire error code to answer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@attrs.frozen
class Limits:
    max_buffer: int
    max_chunk: int
    max_hold: float
    max_pending: int
    max_pipes: int
    max_stored: int = 64 << 20  # persistent pipes' bound, unless the config sets one


@attrs.frozen
class Declared:
    """What the configuration says of one pipe name (``[plugins.pipe.pipes.NAME]``)."""

    persistent: bool
    max_stored: int


@attrs.frozen
class Done:
    """A completion for the service to send: ``token`` is the request it answers.

    ``kind``: ``data`` (``data`` holds the bytes), ``eof``, ``timeout``, ``retry``
    (a later chunk bounced by Rule 3), ``ok`` (a write accepted, ``n`` bytes) or
    ``error`` (``code``, ``message``).
    """

    token: object
    kind: str
    data: Buffer = b""
    n: int = 0
    code: str = ""
    message: str = ""
    at: int = -1  # data of a persistent pipe: the absolute offset of its first byte


@attrs.define(eq=False)
class Commit:
    """What one persistent pipe needs written (``Engine.take_commit``).

    ``chunks`` (end offset, bytes) are the staged chunks to append, in order (``ops`` are
    their writes; an empty chunk is answered but not stored); ``deletes`` the store seqs
    of chunks wholly consumed; ``cursor`` the consumed offset if it changed, else None.
    """

    name: str
    ops: list[_Op]
    chunks: list[tuple[int, bytes]]
    deletes: list[int]
    cursor: int | None


@attrs.define(eq=False)
class _Op:
    token: object
    end: End
    deadline: float
    n: int = 0  # read: at most this many bytes
    data: Buffer = b""  # write: the chunk
    seq: int = 0
    more: bool = False
    done: bool = False
    order: int = 0  # arrival order (share mode serves the oldest read first)
    eofs: int = 0  # read: ends of pipe its reader had reported when it asked


@attrs.define(eq=False)
class End:
    handle: int
    owner: str  # the connection's lname
    pipe: Pipe
    role: Literal["r", "w"]
    fail_on_reader_gone: bool = True
    broken: bool = False
    armed: bool = False  # reader: saw a writer attached (Rule 5)
    eofs: int = 0  # reader: ends of pipe answered so far (Rule 5)
    pos: int = 0  # broadcast reader: absolute position of its next byte
    next_seq: int = 1  # writer: the chunk it must send next (Rule 3)
    pending: deque[_Op] = attrs.field(factory=deque)
    held: deque[list[int]] = attrs.field(factory=deque)  # Rule P3: [start, end) answered
    consumed: int = 0  # Rule P3: bytes its client acked so far


@attrs.define(eq=False)
class Pipe:
    name: str
    mode: Literal["share", "broadcast"]
    readers: list[End] = attrs.field(factory=list)
    writers: list[End] = attrs.field(factory=list)
    # Retained bytes: chunks[i] starts at absolute offset starts[i]; live from index i0.
    chunks: list[Buffer] = attrs.field(factory=list)
    starts: list[int] = attrs.field(factory=list)
    i0: int = 0
    base: int = 0  # absolute offset of the first retained byte
    end: int = 0  # absolute offset after the last byte written
    charged: int = 0  # retained bytes + CHUNK_OVERHEAD per retained chunk (Rule 1)
    share_pos: int = 0  # share mode: the one read position
    wait_writes: deque[_Op] = attrs.field(factory=deque)  # pending writes, arrival order
    lock: End | None = None  # Rule 4
    total_in: int = 0
    broken: str = ""  # Rule 9: why every end fails (the pipe is no longer in Engine.pipes)
    # Persistent pipes (Rules P1-P5)
    persistent: bool = False
    bound: int = 0  # Rule 1: max_buffer, or max_stored when persistent
    staged: list[_Op] = attrs.field(factory=list)  # accepted, not yet committed
    staged_end: int = 0  # offset after the last staged byte
    committing: list[_Op] | None = None  # the staged chunks a running commit writes
    redo: list[list[int]] = attrs.field(factory=list)  # [start, end) to serve again
    stored: deque[tuple[int, int]] = attrs.field(factory=deque)  # (end offset, store seq)
    durable: int = 0  # the consumed offset the store has (its cursor)

    def retained(self) -> int:
        return self.end - self.base

    def has_ends(self) -> bool:
        return bool(self.readers or self.writers)


class Engine:
    """Every pipe of the plugin. Commands return the completions they caused."""

    def __init__(
        self,
        limits: Limits,
        *,
        declared: Mapping[str, Declared] | None = None,
        can_persist: bool = False,
    ) -> None:
        self.limits = limits
        self.pipes: dict[str, Pipe] = {}
        self.ends: dict[int, End] = {}
        self.by_owner: dict[str, set[int]] = {}
        self._handles = itertools.count(1)
        self._deadlines: list[tuple[float, int, _Op]] = []
        self._tie = itertools.count()
        self.declared: dict[str, Declared] = dict(declared or {})
        self.can_persist = can_persist
        #: Rule P5: end offsets of forgotten persistent pipes (and of empty stored ones).
        self.offsets: dict[str, int] = {}
        #: Names of persistent pipes with something to commit (``take_commit``).
        self.dirty: set[str] = set()
        #: The last commit's append failed (store full): persistent writes wait.
        self.store_full = False

    # -- opening and closing ---------------------------------------------------------------
    def open(
        self,
        owner: str,
        name: str,
        role: str,
        mode: str | None,
        on_reader_gone: str,
        persistent: bool | None = None,
    ) -> tuple[End, list[Done]]:
        """Attach a reader (``role`` "r") or writer ("w") of pipe ``name`` for ``owner``.

        ``mode`` ("share"/"broadcast") creates the pipe that way; for an existing pipe it
        must match (None accepts what exists). ``persistent`` likewise (Rule P1). Raises
        EngineError(bad-request / limit-exceeded / pipe-mismatch).
        """
        if role not in ("r", "w"):
            raise EngineError(BAD_REQUEST, f"mode must be 'r' or 'w', not {role!r}")
        if mode not in (None, "share", "broadcast"):
            raise EngineError(BAD_REQUEST, f"readers must be 'share' or 'broadcast', not {mode!r}")
        if on_reader_gone not in ("fail", "wait"):
            raise EngineError(
                BAD_REQUEST, f"on_reader_gone must be 'fail' or 'wait', not {on_reader_gone!r}"
            )
        pipe = self.pipes.get(name)
        if pipe is None:
            if len(self.pipes) >= self.limits.max_pipes:
                raise EngineError(LIMIT_EXCEEDED, f"max_pipes ({self.limits.max_pipes}) reached")
            pipe = self._new_pipe(name, mode, persistent)
        else:
            if persistent is not None and persistent != pipe.persistent:
                raise EngineError(
                    PIPE_MISMATCH,
                    f"pipe {name!r} exists and is {'' if pipe.persistent else 'not '}persistent",
                )
            if mode is not None and mode != pipe.mode:
                raise EngineError(
                    BAD_REQUEST, f"pipe {name!r} is open in {pipe.mode} mode, not {mode}"
                )
        end = End(
            next(self._handles),
            owner,
            pipe,
            role,  # type: ignore[arg-type]
            fail_on_reader_gone=on_reader_gone == "fail",
        )
        self.ends[end.handle] = end
        self.by_owner.setdefault(owner, set()).add(end.handle)
        out: list[Done] = []
        if role == "r":
            end.pos = pipe.end
            end.armed = bool(pipe.writers) or (pipe.persistent and self._unread(pipe))  # P4
            pipe.readers.append(end)
            self._pump(pipe, out)  # Rule 2: waiting writers may go now
        else:
            pipe.writers.append(end)
            for r in pipe.readers:
                r.armed = True
        return end, out

    def _new_pipe(self, name: str, mode: str | None, persistent: bool | None) -> Pipe:
        declared = self.declared.get(name)
        if declared is not None and persistent is not None and persistent != declared.persistent:
            raise EngineError(
                PIPE_MISMATCH,
                f"pipe {name!r} is configured {'' if declared.persistent else 'not '}persistent",
            )
        if persistent is None:
            persistent = declared.persistent if declared is not None else False
        if persistent:
            if not self.can_persist:
                raise EngineError(
                    BAD_REQUEST,
                    f"pipe {name!r}: persistent pipes need the "
                    "pipe plugin's 'dir' setting (its store), which is not set",
                )
            if mode == "broadcast":
                raise EngineError(
                    BAD_REQUEST, f"pipe {name!r}: persistent pipes are share mode only"
                )
            if len(name.encode("utf-8", "surrogatepass")) > MAX_PERSISTENT_NAME:
                raise EngineError(
                    BAD_REQUEST,
                    f"persistent pipe names are at most {MAX_PERSISTENT_NAME} bytes of UTF-8",
                )
        pipe = Pipe(name, mode or "share", persistent=persistent)  # type: ignore[arg-type]
        if persistent:
            pipe.bound = declared.max_stored if declared is not None else self.limits.max_stored
            # Rule P5: offsets continue where the forgotten pipe (or the store) ended.
            start = self.offsets.pop(name, 0)
            pipe.base = pipe.end = pipe.share_pos = pipe.staged_end = pipe.durable = start
        else:
            pipe.bound = self.limits.max_buffer
        self.pipes[name] = pipe
        return pipe

    def recover(
        self, name: str, cursor: int, high: int, chunks: list[tuple[int, int, bytes]]
    ) -> None:
        """Load persistent pipe ``name`` from the store at start: its ``cursor`` (consumed
        offset), the highest end offset it ever stored (``high``) and its stored chunks
        (seq, end offset, bytes) in order. An empty one is only remembered (Rule P5)."""
        if not any(end > cursor for _seq, end, _data in chunks):
            self.offsets[name] = max(cursor, high)
            if chunks:  # wholly consumed but not deleted: nothing should leave these
                raise ValueError(f"pipe {name!r}: stored chunks below its cursor {cursor}")
            return
        declared = self.declared.get(name)
        pipe = Pipe(name, "share", persistent=True)
        pipe.bound = declared.max_stored if declared is not None else self.limits.max_stored
        for seq, end, data in chunks:
            pipe.chunks.append(data)
            pipe.starts.append(end - len(data))
            pipe.stored.append((end, seq))
            pipe.charged += len(data) + CHUNK_OVERHEAD
            pipe.total_in += len(data)
        pipe.base = pipe.share_pos = pipe.durable = max(cursor, pipe.starts[0])
        pipe.end = pipe.staged_end = chunks[-1][1]
        self.pipes[name] = pipe
        self._release(pipe)  # chunks wholly below the cursor (none, normally) are deleted

    def close(self, owner: str, handle: int, consumed: int | None = None) -> list[Done]:
        """Detach one end (its own pending operations are answered ``pipe-broken``);
        ``consumed`` acks a persistent pipe's reader's bytes first (Rule P3)."""
        end = self._end(owner, handle)
        out: list[Done] = []
        if consumed is not None and end.role == "r" and end.pipe.persistent:
            self._ack(end, consumed)
        self._detach(end, out, answer=True)
        return out

    def peer_gone(self, owner: str) -> list[Done]:
        """The connection ``owner`` is gone: detach all its ends (nothing to answer it)."""
        out: list[Done] = []
        for h in sorted(self.by_owner.pop(owner, ())):
            end = self.ends.get(h)
            if end is not None:
                self._detach(end, out, answer=False)
        return out

    def break_owner(self, owner: str, why: str) -> list[Done]:
        """Rule 9: ``owner`` is gone without closing (a peer broker's connection): detach
        its ends and break every pipe they were on; the others' pending operations are
        answered ``pipe-broken`` with ``why``."""
        out: list[Done] = []
        handles = sorted(self.by_owner.pop(owner, ()))
        pipes: dict[int, Pipe] = {}
        for h in handles:
            end = self.ends.pop(h, None)
            if end is not None:
                pipes[id(end.pipe)] = end.pipe
                end.pending.clear()
                if end.role == "r":
                    end.pipe.readers.remove(end)
                else:
                    end.pipe.writers.remove(end)
        for pipe in pipes.values():
            pipe.broken = f"pipe {pipe.name!r}: {why}"
            if self.pipes.get(pipe.name) is pipe:
                del self.pipes[pipe.name]
                self.dirty.discard(pipe.name)
            for end in pipe.readers + pipe.writers:
                for op in end.pending:
                    op.done = True
                    out.append(Done(op.token, "error", code=PIPE_BROKEN, message=pipe.broken))
                end.pending.clear()
                end.broken = True
            pipe.wait_writes.clear()
            # Its bytes go with it: nobody may read past the gap.
            pipe.chunks.clear()
            pipe.starts.clear()
            pipe.i0 = 0
            pipe.charged = 0
            pipe.base = pipe.end
        return out

    def _detach(self, end: End, out: list[Done], *, answer: bool) -> None:
        pipe = end.pipe
        del self.ends[end.handle]
        owned = self.by_owner.get(end.owner)
        if owned is not None:
            owned.discard(end.handle)
            if not owned:
                del self.by_owner[end.owner]
        for op in end.pending:
            op.done = True
            if answer:
                out.append(
                    Done(
                        op.token,
                        "error",
                        code=PIPE_BROKEN,
                        message=f"pipe {pipe.name!r}: handle {end.handle} closed",
                    )
                )
        end.pending.clear()
        if pipe.broken:  # Rule 9: nothing left to move
            (pipe.readers if end.role == "r" else pipe.writers).remove(end)
            return
        if end.role == "r":
            pipe.readers.remove(end)
            if end.held:  # Rule P3: what it did not ack is served again, first
                pipe.redo = sorted(pipe.redo + list(end.held))
                end.held.clear()
            if not pipe.readers and not pipe.persistent:
                for w in pipe.writers:  # Rule 6
                    if w.fail_on_reader_gone:
                        w.broken = True
                        self._fail_writes(
                            w, out, PIPE_BROKEN, f"pipe {pipe.name!r}: every reader left"
                        )
            self._release(pipe)
        else:
            pipe.writers.remove(end)
            pipe.wait_writes = deque(op for op in pipe.wait_writes if not op.done)
            if pipe.lock is end:
                pipe.lock = None
        if not pipe.has_ends() and self._forget(pipe):  # Rule 7, P5
            return
        self._pump(pipe, out)

    def _forget(self, pipe: Pipe) -> bool:
        """Delete a pipe with no ends (Rule 7); a persistent one only once it is empty and
        its store holds nothing more of it (Rule P5). Returns True if deleted."""
        if pipe.persistent:
            if (
                pipe.staged
                or pipe.committing is not None
                or pipe.redo
                or pipe.stored
                or self._unread(pipe)
                or pipe.durable != pipe.end
            ):
                return False
            self.offsets[pipe.name] = pipe.end
        del self.pipes[pipe.name]
        self.dirty.discard(pipe.name)
        return True

    @staticmethod
    def _staged(pipe: Pipe) -> bool:
        """Chunks accepted but not yet committed (Rule P2): no end of pipe before them."""
        return pipe.persistent and pipe.staged_end != pipe.end

    @staticmethod
    def _unread(pipe: Pipe) -> bool:
        return pipe.share_pos < pipe.end or bool(pipe.redo)

    # -- reading and writing ---------------------------------------------------------------
    def write(
        self,
        owner: str,
        handle: int,
        token: object,
        data: Buffer,
        seq: int,
        more: bool,
        timeout: float,
        now: float,
    ) -> list[Done]:
        """Offer chunk ``seq`` of handle ``handle``; answered ``ok`` once accepted."""
        end = self._end(owner, handle, "w")
        if len(data) > self.limits.max_chunk:
            raise EngineError(
                BAD_REQUEST, f"chunk of {len(data)} bytes > max_chunk ({self.limits.max_chunk})"
            )
        if end.broken:
            return [
                Done(
                    token,
                    "error",
                    code=PIPE_BROKEN,
                    message=end.pipe.broken or f"pipe {end.pipe.name!r}: every reader left",
                )
            ]
        expected = end.pending[-1].seq + 1 if end.pending else end.next_seq
        if seq != expected:
            if seq > expected:  # Rule 3: an earlier chunk left unaccepted
                return [Done(token, "retry")]
            raise EngineError(BAD_REQUEST, f"chunk {seq} already accepted (next {expected})")
        self._check_pending(end)
        op = _Op(token, end, self._deadline(timeout, now), data=data, seq=seq, more=more)
        end.pending.append(op)
        end.pipe.wait_writes.append(op)
        self._add_deadline(op)
        out: list[Done] = []
        self._pump(end.pipe, out)
        return out

    def read(
        self,
        owner: str,
        handle: int,
        token: object,
        n: int,
        timeout: float,
        now: float,
        eofs: int = 0,
        consumed: int | None = None,
    ) -> list[Done]:
        """Ask for up to ``n`` bytes; answered with data, EOF or timeout. ``consumed``
        acks a persistent pipe's bytes (Rule P3; ignored on other pipes)."""
        end = self._end(owner, handle, "r")
        if n < 1:
            raise EngineError(BAD_REQUEST, "n must be >= 1")
        if end.pipe.broken:  # Rule 9
            return [Done(token, "error", code=PIPE_BROKEN, message=end.pipe.broken)]
        self._check_pending(end)
        if consumed is not None and end.pipe.persistent:
            self._ack(end, consumed)
        op = _Op(
            token,
            end,
            self._deadline(timeout, now),
            n=min(n, self.limits.max_chunk),
            order=next(self._tie),
            eofs=eofs,
        )
        end.pending.append(op)
        self._add_deadline(op)
        out: list[Done] = []
        self._pump(end.pipe, out)
        return out

    def _ack(self, end: End, consumed: int) -> None:
        """Rule P3: the client of reader ``end`` returned ``consumed`` bytes in all to its
        caller: the oldest held ranges up to that count are consumed."""
        n = consumed - end.consumed
        if n < 0 or n > sum(e - s for s, e in end.held):
            raise EngineError(
                BAD_REQUEST,
                f"consumed {consumed}: handle {end.handle} acked "
                f"{end.consumed} and holds {sum(e - s for s, e in end.held)} "
                "more bytes",
            )
        end.consumed = consumed
        held = end.held
        while n:
            rng = held[0]
            k = min(n, rng[1] - rng[0])
            rng[0] += k
            n -= k
            if rng[0] == rng[1]:
                held.popleft()
        self._release(end.pipe)

    def _check_pending(self, end: End) -> None:
        if len(end.pending) >= self.limits.max_pending:
            raise EngineError(
                LIMIT_EXCEEDED,
                f"more than max_pending ({self.limits.max_pending}) operations on one handle",
            )

    def _deadline(self, timeout: float, now: float) -> float:
        return now + max(0.0, min(timeout, self.limits.max_hold))

    def _add_deadline(self, op: _Op) -> None:
        heapq.heappush(self._deadlines, (op.deadline, next(self._tie), op))

    # -- time ------------------------------------------------------------------------------
    def next_deadline(self) -> float:
        """When :meth:`expire` has something to do (inf if never)."""
        d = self._deadlines
        while d and d[0][2].done:
            heapq.heappop(d)
        return d[0][0] if d else float("inf")

    def expire(self, now: float) -> list[Done]:
        """Answer ``timeout`` to every pending operation whose deadline passed."""
        out: list[Done] = []
        d = self._deadlines
        while d and (d[0][2].done or d[0][0] <= now):
            op = heapq.heappop(d)[2]
            if op.done:
                continue
            end = op.end
            if end.role == "r":
                op.done = True
                end.pending.remove(op)
                out.append(Done(op.token, "timeout"))
            else:
                pipe = end.pipe
                if pipe.lock is end:  # Rule 4: a stalled write releases the lock
                    pipe.lock = None
                self._fail_writes(end, out, "", "", first="timeout")
                self._pump(pipe, out)
        return out

    def _fail_writes(
        self, end: End, out: list[Done], code: str, message: str, first: str = ""
    ) -> None:
        """Answer every pending write of ``end``: the first ``first`` (or the error),
        the later ones ``retry`` (or the error) -- Rule 3."""
        for i, op in enumerate(end.pending):
            op.done = True
            if code:
                out.append(Done(op.token, "error", code=code, message=message))
            else:
                out.append(Done(op.token, first if i == 0 else "retry"))
        end.pending.clear()
        pipe = end.pipe
        pipe.wait_writes = deque(op for op in pipe.wait_writes if not op.done)

    # -- moving bytes ----------------------------------------------------------------------
    def _pump(self, pipe: Pipe, out: list[Done]) -> None:
        """Accept every write that may go, serve every read that can be served."""
        progress = True
        while progress:
            progress = self._accept_writes(pipe, out)
            progress = self._serve_reads(pipe, out) or progress

    def _accept_writes(self, pipe: Pipe, out: list[Done]) -> bool:
        if not pipe.wait_writes or not (pipe.readers or pipe.persistent):  # Rule 2, P2
            return False
        if pipe.persistent and self.store_full:
            return False
        moved = False
        while pipe.wait_writes:
            op = None
            for cand in pipe.wait_writes:
                if pipe.lock is None or cand.end is pipe.lock:
                    op = cand
                    break
            if op is None:
                break
            size = len(op.data)
            if pipe.charged and pipe.charged + size + CHUNK_OVERHEAD > pipe.bound:
                break  # Rule 1
            pipe.wait_writes.remove(op)
            end = op.end
            end.pending.popleft()
            op.done = True
            end.next_seq = op.seq + 1
            pipe.lock = end if op.more else None
            if pipe.persistent:  # Rule P2: staged, answered once committed
                if size:
                    pipe.charged += size + CHUNK_OVERHEAD
                pipe.staged_end += size
                pipe.staged.append(op)
                self.dirty.add(pipe.name)
                continue
            if size:
                pipe.chunks.append(
                    op.data if size >= 65536 or isinstance(op.data, bytes) else bytes(op.data)
                )
                pipe.starts.append(pipe.end)
                pipe.end += size
                pipe.charged += size + CHUNK_OVERHEAD
                pipe.total_in += size
            out.append(Done(op.token, "ok", n=size))
            moved = True
        return moved

    def _serve_reads(self, pipe: Pipe, out: list[Done]) -> bool:
        served = False
        if pipe.mode == "share":
            # FIFO over readers: the reader whose oldest read is oldest goes first.
            while True:
                waiting = [r for r in pipe.readers if r.pending]
                if not waiting:
                    break
                r = min(waiting, key=lambda e: e.pending[0].order)
                if pipe.redo:  # Rule P3: bytes a reader left unacked go first
                    op = r.pending.popleft()
                    rng = pipe.redo[0]
                    at = rng[0]
                    data = self._take(pipe, at, min(op.n, rng[1] - at))
                    rng[0] += len(data)
                    if rng[0] == rng[1]:
                        del pipe.redo[0]
                    self._hand(r, op, at, data, out)
                    served = True
                    continue
                if pipe.share_pos < pipe.end:
                    op = r.pending.popleft()
                    at = pipe.share_pos
                    data = self._take(pipe, at, op.n)
                    pipe.share_pos += len(data)
                    self._hand(r, op, at, data, out)
                    served = True
                    continue
                if not pipe.writers and not self._staged(pipe):
                    for rr in waiting:  # Rule 5
                        if rr.armed:
                            self._eof(rr, out)
                break
        else:
            for r in pipe.readers:
                while r.pending and r.pos < pipe.end:
                    op = r.pending.popleft()
                    data = self._take(pipe, r.pos, op.n)
                    r.pos += len(data)
                    op.done = True
                    out.append(Done(op.token, "data", data=data, n=len(data)))
                    served = True
                if r.pending and not pipe.writers and r.armed and r.pos >= pipe.end:
                    self._eof(r, out)
        if served:
            self._release(pipe)
        return served

    @staticmethod
    def _hand(reader: End, op: _Op, at: int, data: Buffer, out: list[Done]) -> None:
        """Answer ``op`` with ``data`` (from offset ``at``); a persistent pipe's reader
        holds it until acked (Rule P3)."""
        op.done = True
        if reader.pipe.persistent:
            held = reader.held
            if held and held[-1][1] == at:
                held[-1][1] += len(data)
            else:
                held.append([at, at + len(data)])
            out.append(Done(op.token, "data", data=data, n=len(data), at=at))
        else:
            out.append(Done(op.token, "data", data=data, n=len(data)))

    @staticmethod
    def _eof(reader: End, out: list[Done]) -> None:
        """End of pipe goes to a read whose client had seen every earlier end of pipe
        (``eofs``); reads it sent before it saw the latest one are answered ``retry``
        (ask again): one end of pipe is reported once, and a read asked after it sees
        whatever comes next (a new writer's bytes), never a stale end of pipe."""
        for op in reader.pending:
            op.done = True
            if op.eofs >= reader.eofs:
                reader.eofs += 1
                out.append(Done(op.token, "eof"))
            else:
                out.append(Done(op.token, "retry"))
        reader.pending.clear()

    def _take(self, pipe: Pipe, pos: int, n: int) -> Buffer:
        """Up to ``n`` bytes from absolute offset ``pos`` (views, joined if several)."""
        i = bisect.bisect_right(pipe.starts, pos, pipe.i0) - 1
        pieces: list[Buffer] = []
        want = min(n, pipe.end - pos)
        while want > 0:
            chunk = pipe.chunks[i]
            off = pos - pipe.starts[i]
            piece = memoryview(chunk)[off : off + want]
            pieces.append(piece)
            want -= len(piece)
            pos += len(piece)
            i += 1
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def _release(self, pipe: Pipe) -> None:
        """Drop the bytes every reader has read (Rule 8)."""
        if pipe.persistent:  # Rule P3: the lowest byte not acked
            low = self._low(pipe)
        elif pipe.mode == "share":
            low = pipe.share_pos
        elif pipe.readers:
            low = min(r.pos for r in pipe.readers)
        else:
            low = pipe.end  # nobody will ever read these
        i = pipe.i0
        starts, chunks = pipe.starts, pipe.chunks
        while i < len(chunks) and starts[i] + len(chunks[i]) <= low:
            pipe.charged -= len(chunks[i]) + CHUNK_OVERHEAD
            chunks[i] = b""
            i += 1
        pipe.i0 = i
        pipe.base = max(pipe.base, low) if i < len(chunks) else pipe.end
        if pipe.mode == "share" and pipe.share_pos < pipe.base:
            pipe.share_pos = pipe.base
        if i and (i == len(chunks) or (i > 1024 and i * 2 > len(chunks))):
            del chunks[:i], starts[:i]
            pipe.i0 = 0
        if pipe.persistent and (low != pipe.durable or (pipe.stored and pipe.stored[0][0] <= low)):
            self.dirty.add(pipe.name)

    # -- persistence (Rules P2, P3, P5) ----------------------------------------------------
    def take_commit(self) -> list[Commit]:
        """What every dirty persistent pipe needs written, for ONE commit. Call again only
        after :meth:`committed` or :meth:`commit_failed` of the previous result."""
        work: list[Commit] = []
        dirty, self.dirty = self.dirty, set()
        for name in sorted(dirty):
            pipe = self.pipes.get(name)
            if pipe is None:
                continue
            if pipe.committing is not None:
                self.dirty.add(name)  # after the running commit
                continue
            low = self._low(pipe)
            cursor = low if low != pipe.durable else None
            if (
                not pipe.staged
                and cursor is None
                and not (pipe.stored and pipe.stored[0][0] <= low)
            ):
                continue
            ops, pipe.staged = pipe.staged, []
            pipe.committing = ops
            chunks: list[tuple[int, bytes]] = []
            off = pipe.end
            for op in ops:
                if len(op.data):
                    off += len(op.data)
                    chunks.append((off, bytes(op.data)))
            deletes: list[int] = []
            for end, seq in pipe.stored:
                if end > low:
                    break
                deletes.append(seq)
            work.append(Commit(name, ops, chunks, deletes, cursor))
        return work

    @staticmethod
    def _low(pipe: Pipe) -> int:
        """A persistent pipe's consumed offset: its lowest byte not acked (Rule P3)."""
        return min(
            [pipe.share_pos]
            + [r[0] for r in pipe.redo]
            + [e.held[0][0] for e in pipe.readers if e.held]
        )

    def committed(self, work: Commit, seqs: list[int] | None, deleted: bool) -> list[Done]:
        """The commit of ``work`` ended: ``seqs`` the store seqs of its chunks (None: the
        append failed, e.g. store full: its writes go back to waiting, Rule P2),
        ``deleted`` whether its deletes and cursor were written."""
        pipe = self.pipes[work.name]
        out: list[Done] = []
        ops, pipe.committing = pipe.committing or [], None
        if deleted:
            for _ in work.deletes:
                pipe.stored.popleft()
            if work.cursor is not None:
                pipe.durable = work.cursor
        if seqs is None:
            self.store_full = True  # no staging until the service says to retry
            self._unstage(pipe, ops + pipe.staged, out)
        else:
            stored = zip(work.chunks, seqs, strict=True)
            for op in ops:
                size = len(op.data)
                if size:
                    (end, data), seq = next(stored)
                    pipe.chunks.append(data)  # the copy made for the store
                    pipe.starts.append(pipe.end)
                    pipe.end += size
                    assert pipe.end == end, (pipe.end, end)
                    pipe.total_in += size
                    pipe.stored.append((end, seq))
                out.append(Done(op.token, "ok", n=size))
        low = self._low(pipe)
        if pipe.staged or low != pipe.durable or (pipe.stored and pipe.stored[0][0] <= low):
            self.dirty.add(pipe.name)  # what came meanwhile, or a failed delete: next commit
        if not pipe.has_ends() and self._forget(pipe):
            return out
        self._pump(pipe, out)
        return out

    def retry_store(self) -> list[Done]:
        """After a failed commit (store full), accept persistent writes again (the
        service calls this once deletes made room, or after a pause)."""
        self.store_full = False
        out: list[Done] = []
        for pipe in list(self.pipes.values()):
            if pipe.persistent and pipe.wait_writes:
                self._pump(pipe, out)
        return out

    def _unstage(self, pipe: Pipe, ops: list[_Op], out: list[Done]) -> None:
        """Rule P2: staged writes whose commit failed wait again, first, in order; a write
        of an end that left meanwhile is answered ``pipe-broken``."""
        pipe.staged = []
        pipe.staged_end = pipe.end
        back: list[_Op] = []
        for op in ops:
            if len(op.data):
                pipe.charged -= len(op.data) + CHUNK_OVERHEAD
            end = op.end
            if self.ends.get(end.handle) is not end:
                out.append(
                    Done(
                        op.token,
                        "error",
                        code=PIPE_BROKEN,
                        message=f"pipe {pipe.name!r}: handle {end.handle} closed",
                    )
                )
                continue
            op.done = False
            back.append(op)
        # Each end's own staged chunks go before its pending ones, in seq order.
        for op in reversed(back):
            end = op.end
            end.pending.appendleft(op)
            end.next_seq = op.seq
            self._add_deadline(op)
        pipe.wait_writes.extendleft(reversed(back))

    # -- queries ---------------------------------------------------------------------------
    def _end(self, owner: str, handle: int, role: str | None = None) -> End:
        end = self.ends.get(handle)
        if end is None or end.owner != owner:
            raise EngineError(
                PIPE_BROKEN, f"unknown pipe handle {handle} (closed, or the pipe service restarted)"
            )
        if role is not None and end.role != role:
            raise EngineError(
                BAD_REQUEST,
                f"handle {handle} is not open for {'reading' if role == 'r' else 'writing'}",
            )
        return end

    def stats(self, name: str | None = None) -> dict[str, object]:
        """Counters of one pipe (``exists`` false if it has no ends) or of all."""
        if name is not None:
            p = self.pipes.get(name)
            if p is None:
                return {"name": name, "exists": False}
            return {
                "name": name,
                "exists": True,
                "mode": p.mode,
                "readers": len(p.readers),
                "writers": len(p.writers),
                "buffered": p.retained(),
                "charged": p.charged,
                "written": p.end,
                "waiting_writes": len(p.wait_writes),
                "persistent": p.persistent,
                "staged": p.staged_end - p.end if p.persistent else 0,
                "consumed": p.durable,
                "redo": sum(e - s for s, e in p.redo),
            }
        return {
            "pipes": len(self.pipes),
            "ends": len(self.ends),
            "buffered": sum(p.retained() for p in self.pipes.values()),
        }

    def listing(self) -> list[dict[str, object]]:
        """Every pipe with its ends (``pipe.ls``): name, mode, buffered bytes, and per
        end its handle, role ("r"/"w") and owner (the connection's lname)."""
        return [
            {
                "name": p.name,
                "mode": p.mode,
                "persistent": p.persistent,
                "buffered": p.retained(),
                "ends": [
                    {"handle": e.handle, "role": e.role, "owner": e.owner}
                    for e in p.readers + p.writers
                ],
            }
            for p in self.pipes.values()
        ]

    def check_empty(self) -> None:
        """Assert nothing is left (tests: every end detached frees everything)."""
        assert not self.pipes and not self.ends and not self.by_owner, (
            self.pipes,
            self.ends,
            self.by_owner,
        )
