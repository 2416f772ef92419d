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
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from typing import Literal

import attrs

__all__ = ["PIPE_BROKEN", "Done", "Engine", "EngineError", "Limits"]

#: Error code of a write to a pipe whose readers left (``on_reader_gone="fail"``) and of
#: any operation on a handle the plugin does not know (closed, or the plugin restarted).
PIPE_BROKEN = "pipe-broken"
BAD_REQUEST = "bad-request"
LIMIT_EXCEEDED = "limit-exceeded"

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

    def retained(self) -> int:
        return self.end - self.base

    def has_ends(self) -> bool:
        return bool(self.readers or self.writers)


class Engine:
    """Every pipe of the plugin. Commands return the completions they caused."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.pipes: dict[str, Pipe] = {}
        self.ends: dict[int, End] = {}
        self.by_owner: dict[str, set[int]] = {}
        self._handles = itertools.count(1)
        self._deadlines: list[tuple[float, int, _Op]] = []
        self._tie = itertools.count()

    # -- opening and closing ---------------------------------------------------------------
    def open(self, owner: str, name: str, role: str, mode: str | None,
             on_reader_gone: str) -> tuple[End, list[Done]]:
        """Attach a reader (``role`` "r") or writer ("w") of pipe ``name`` for ``owner``.

        ``mode`` ("share"/"broadcast") creates the pipe that way; for an existing pipe it
        must match (None accepts what exists). Raises EngineError(bad-request /
        limit-exceeded).
        """
        if role not in ("r", "w"):
            raise EngineError(BAD_REQUEST, f"mode must be 'r' or 'w', not {role!r}")
        if mode not in (None, "share", "broadcast"):
            raise EngineError(BAD_REQUEST, f"readers must be 'share' or 'broadcast', not {mode!r}")
        if on_reader_gone not in ("fail", "wait"):
            raise EngineError(BAD_REQUEST,
                              f"on_reader_gone must be 'fail' or 'wait', not {on_reader_gone!r}")
        pipe = self.pipes.get(name)
        if pipe is None:
            if len(self.pipes) >= self.limits.max_pipes:
                raise EngineError(LIMIT_EXCEEDED, f"max_pipes ({self.limits.max_pipes}) reached")
            pipe = Pipe(name, mode or "share")  # type: ignore[arg-type]
            self.pipes[name] = pipe
        elif mode is not None and mode != pipe.mode:
            raise EngineError(BAD_REQUEST, f"pipe {name!r} is open in {pipe.mode} mode, "
                              f"not {mode}")
        end = End(next(self._handles), owner, pipe, role,  # type: ignore[arg-type]
                  fail_on_reader_gone=on_reader_gone == "fail")
        self.ends[end.handle] = end
        self.by_owner.setdefault(owner, set()).add(end.handle)
        out: list[Done] = []
        if role == "r":
            end.pos = pipe.end
            end.armed = bool(pipe.writers)
            pipe.readers.append(end)
            self._pump(pipe, out)  # Rule 2: waiting writers may go now
        else:
            pipe.writers.append(end)
            for r in pipe.readers:
                r.armed = True
        return end, out

    def close(self, owner: str, handle: int) -> list[Done]:
        """Detach one end (its own pending operations are answered ``pipe-broken``)."""
        end = self._end(owner, handle)
        out: list[Done] = []
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
                out.append(Done(op.token, "error", code=PIPE_BROKEN,
                                message=f"pipe {pipe.name!r}: handle {end.handle} closed"))
        end.pending.clear()
        if end.role == "r":
            pipe.readers.remove(end)
            if not pipe.readers:
                for w in pipe.writers:  # Rule 6
                    if w.fail_on_reader_gone:
                        w.broken = True
                        self._fail_writes(w, out, PIPE_BROKEN,
                                          f"pipe {pipe.name!r}: every reader left")
            self._release(pipe)
        else:
            pipe.writers.remove(end)
            pipe.wait_writes = deque(op for op in pipe.wait_writes if not op.done)
            if pipe.lock is end:
                pipe.lock = None
        if not pipe.has_ends():  # Rule 7
            del self.pipes[pipe.name]
            return
        self._pump(pipe, out)

    # -- reading and writing ---------------------------------------------------------------
    def write(self, owner: str, handle: int, token: object, data: Buffer, seq: int,
              more: bool, timeout: float, now: float) -> list[Done]:
        """Offer chunk ``seq`` of handle ``handle``; answered ``ok`` once accepted."""
        end = self._end(owner, handle, "w")
        if len(data) > self.limits.max_chunk:
            raise EngineError(BAD_REQUEST, f"chunk of {len(data)} bytes > max_chunk "
                              f"({self.limits.max_chunk})")
        if end.broken:
            return [Done(token, "error", code=PIPE_BROKEN,
                         message=f"pipe {end.pipe.name!r}: every reader left")]
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

    def read(self, owner: str, handle: int, token: object, n: int, timeout: float,
             now: float, eofs: int = 0) -> list[Done]:
        """Ask for up to ``n`` bytes; answered with data, EOF or timeout."""
        end = self._end(owner, handle, "r")
        if n < 1:
            raise EngineError(BAD_REQUEST, "n must be >= 1")
        self._check_pending(end)
        op = _Op(token, end, self._deadline(timeout, now), n=min(n, self.limits.max_chunk),
                 order=next(self._tie), eofs=eofs)
        end.pending.append(op)
        self._add_deadline(op)
        out: list[Done] = []
        self._pump(end.pipe, out)
        return out

    def _check_pending(self, end: End) -> None:
        if len(end.pending) >= self.limits.max_pending:
            raise EngineError(LIMIT_EXCEEDED, f"more than max_pending "
                              f"({self.limits.max_pending}) operations on one handle")

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

    def _fail_writes(self, end: End, out: list[Done], code: str, message: str,
                     first: str = "") -> None:
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
        if not pipe.readers or not pipe.wait_writes:
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
            if pipe.charged and pipe.charged + size + CHUNK_OVERHEAD > self.limits.max_buffer:
                break  # Rule 1
            pipe.wait_writes.remove(op)
            end = op.end
            end.pending.popleft()
            op.done = True
            end.next_seq = op.seq + 1
            pipe.lock = end if op.more else None
            if size:
                pipe.chunks.append(op.data if size >= 65536 or isinstance(op.data, bytes)
                                   else bytes(op.data))
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
                if pipe.share_pos < pipe.end:
                    op = r.pending.popleft()
                    data = self._take(pipe, pipe.share_pos, op.n)
                    pipe.share_pos += len(data)
                    op.done = True
                    out.append(Done(op.token, "data", data=data, n=len(data)))
                    served = True
                    continue
                if not pipe.writers:
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
            piece = memoryview(chunk)[off: off + want]
            pieces.append(piece)
            want -= len(piece)
            pos += len(piece)
            i += 1
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def _release(self, pipe: Pipe) -> None:
        """Drop the bytes every reader has read (Rule 8)."""
        if pipe.mode == "share":
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

    # -- queries ---------------------------------------------------------------------------
    def _end(self, owner: str, handle: int, role: str | None = None) -> End:
        end = self.ends.get(handle)
        if end is None or end.owner != owner:
            raise EngineError(PIPE_BROKEN, f"unknown pipe handle {handle} (closed, or the "
                              "pipe service restarted)")
        if role is not None and end.role != role:
            raise EngineError(BAD_REQUEST, f"handle {handle} is not open for "
                              f"{'reading' if role == 'r' else 'writing'}")
        return end

    def stats(self, name: str | None = None) -> dict[str, object]:
        """Counters of one pipe (``exists`` false if it has no ends) or of all."""
        if name is not None:
            p = self.pipes.get(name)
            if p is None:
                return {"name": name, "exists": False}
            return {"name": name, "exists": True, "mode": p.mode, "readers": len(p.readers),
                    "writers": len(p.writers), "buffered": p.retained(),
                    "charged": p.charged, "written": p.end,
                    "waiting_writes": len(p.wait_writes)}
        return {"pipes": len(self.pipes), "ends": len(self.ends),
                "buffered": sum(p.retained() for p in self.pipes.values())}

    def check_empty(self) -> None:
        """Assert nothing is left (tests: every end detached frees everything)."""
        assert not self.pipes and not self.ends and not self.by_owner, (
            self.pipes, self.ends, self.by_owner)
