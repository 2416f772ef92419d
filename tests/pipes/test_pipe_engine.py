"""The pipe engine as pure data (plugins/pipe/engine.py): its rules, without processes."""

from __future__ import annotations

import pytest
from msgq_trio.plugins.pipe.engine import (
    PIPE_BROKEN,
    PIPE_MISMATCH,
    Commit,
    Declared,
    Done,
    Engine,
    EngineError,
    Limits,
)


def engine(max_buffer: int = 1000, max_chunk: int = 100) -> Engine:
    return Engine(
        Limits(
            max_buffer=max_buffer, max_chunk=max_chunk, max_hold=20.0, max_pending=16, max_pipes=100
        )
    )


def kinds(done: list[Done]) -> list[tuple[object, str]]:
    return [(d.token, d.kind) for d in done]


def test_writes_wait_for_a_reader_and_bytes_are_never_split_lost() -> None:
    """Rule 2: a write waits until a reader attaches; a small read takes part of a chunk
    and the rest stays for the next read."""
    e = engine()
    w, _ = e.open("l.1", "p", "w", None, "fail")
    assert e.write("l.1", w.handle, "w1", b"hello world", 1, False, 10, 0.0) == []
    r, done = e.open("l.2", "p", "r", None, "fail")
    assert kinds(done) == [("w1", "ok")]
    got = b""
    for i in range(11):
        (d,) = e.read("l.2", r.handle, f"r{i}", 1, 10, 0.0)
        got += bytes(d.data)
    assert got == b"hello world"


def test_bound_holds_writes_until_readers_drain() -> None:
    """Rule 1: the pipe never retains more than max_buffer; the next write waits."""
    e = engine(max_buffer=400, max_chunk=100)
    r, _ = e.open("l.2", "p", "r", None, "fail")
    w, _ = e.open("l.1", "p", "w", None, "fail")
    out = []
    for s in range(1, 6):
        out += e.write("l.1", w.handle, s, b"x" * 100, s, False, 10, 0.0)
    assert [t for t, k in kinds(out)] == [1, 2]  # 2 x (100 + 64 overhead) <= 400 < 3 x 164
    assert e.pipes["p"].charged <= 400
    out = e.read("l.2", r.handle, "r", 100, 10, 0.0)
    assert ("r", "data") in kinds(out) and (3, "ok") in kinds(out)


def test_timed_out_chunk_bounces_later_ones() -> None:
    """Rule 3: when chunk 1 times out, chunk 2 (pending or arriving later) is bounced,
    so the pipe never gets chunk 2 without chunk 1."""
    e = engine()
    w, _ = e.open("l.1", "p", "w", None, "fail")
    e.write("l.1", w.handle, "c1", b"a", 1, False, 1.0, 0.0)
    e.write("l.1", w.handle, "c2", b"b", 2, False, 5.0, 0.0)
    assert e.next_deadline() == 1.0
    assert kinds(e.expire(1.0)) == [("c1", "timeout"), ("c2", "retry")]
    assert kinds(e.write("l.1", w.handle, "c3", b"c", 3, False, 5.0, 1.0)) == [("c3", "retry")]
    e.open("l.2", "p", "r", None, "fail")
    assert kinds(e.write("l.1", w.handle, "c1b", b"a", 1, False, 5.0, 1.0)) == [("c1b", "ok")]


def test_eof_after_buffered_data_and_broken_pipe() -> None:
    """Rule 5 and 6: the writer leaving gives EOF after the data; the last reader leaving
    breaks a 'fail' writer at once, a 'wait' writer keeps waiting."""
    e = engine()
    r, _ = e.open("l.2", "p", "r", None, "fail")
    w, _ = e.open("l.1", "p", "w", None, "fail")
    e.write("l.1", w.handle, "w", b"abc", 1, False, 10, 0.0)
    assert kinds(e.read("l.2", r.handle, "r1", 10, 10, 0.0)) == [("r1", "data")]
    assert e.read("l.2", r.handle, "r2", 10, 10, 0.0) == []
    assert kinds(e.peer_gone("l.1")) == [("r2", "eof")]
    # broken pipe
    r, _ = e.open("l.2", "q", "r", None, "fail")
    w1, _ = e.open("l.3", "q", "w", None, "fail")
    w2, _ = e.open("l.4", "q", "w", None, "wait")
    e.write("l.3", w1.handle, "a", b"x" * 100, 1, False, 10, 0.0)
    e.write("l.3", w1.handle, "b", b"x" * 100, 2, False, 10, 0.0)
    e.close("l.2", r.handle)
    out = e.write("l.3", w1.handle, "c", b"x", 3, False, 10, 0.0)
    assert out[0].kind == "error" and out[0].code == PIPE_BROKEN
    assert e.write("l.4", w2.handle, "d", b"y", 1, False, 10, 0.0) == []


def test_flushed_when_both_ends_left() -> None:
    """Rule 7: no end left deletes the pipe and its bytes; reopening starts empty."""
    e = engine()
    r, _ = e.open("l.2", "p", "r", None, "fail")
    w, _ = e.open("l.1", "p", "w", None, "fail")
    e.write("l.1", w.handle, "w", b"old", 1, False, 10, 0.0)
    e.peer_gone("l.1")
    e.close("l.2", r.handle)
    e.check_empty()
    r, _ = e.open("l.2", "p", "r", None, "fail")
    assert e.read("l.2", r.handle, "r", 10, 10, 0.0) == []  # waits: no old data, no writer


def test_broadcast_every_reader_gets_everything_and_slowest_paces() -> None:
    """Rule 8: broadcast readers each read every byte; bytes are released when all did."""
    e = engine(max_buffer=400, max_chunk=100)
    r1, _ = e.open("l.2", "p", "r", "broadcast", "fail")
    r2, _ = e.open("l.3", "p", "r", "broadcast", "fail")
    w, _ = e.open("l.1", "p", "w", None, "fail")
    e.write("l.1", w.handle, "w", b"abc", 1, False, 10, 0.0)
    assert bytes(e.read("l.2", r1.handle, "a", 10, 10, 0.0)[0].data) == b"abc"
    assert e.pipes["p"].retained() == 3  # r2 has not read it yet
    assert bytes(e.read("l.3", r2.handle, "b", 10, 10, 0.0)[0].data) == b"abc"
    assert e.pipes["p"].retained() == 0


def test_whole_writes_do_not_interleave() -> None:
    """Rule 4: a write split in chunks (more=True) keeps other writers out until its end."""
    e = engine(max_buffer=10_000, max_chunk=100)
    r, _ = e.open("l.9", "p", "r", None, "fail")
    a, _ = e.open("l.1", "p", "w", None, "fail")
    b, _ = e.open("l.2", "p", "w", None, "fail")
    e.write("l.1", a.handle, "a1", b"A" * 100, 1, True, 10, 0.0)
    assert e.write("l.2", b.handle, "b1", b"B" * 10, 1, False, 10, 0.0) == []
    out = e.write("l.1", a.handle, "a2", b"A" * 5, 2, False, 10, 0.0)
    assert kinds(out) == [("a2", "ok"), ("b1", "ok")]
    data = b"".join(
        bytes(d.data)
        for d in e.read("l.9", r.handle, "r", 100, 10, 0.0)
        + e.read("l.9", r.handle, "r", 100, 10, 0.0)
    )
    assert data == b"A" * 105 + b"B" * 10


def test_engine_is_pure() -> None:
    """plugins/pipe/engine.py imports neither trio nor msgq_trio.io (STYLE.md 1): the
    pipe rules are testable as plain data, as above."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "plugins" / "pipe" / "engine.py"
    names = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert not {n for n in names if n.split(".")[0] == "trio" or n.startswith("msgq_trio.io")}


# -- persistent pipes (Rules P1-P5) --------------------------------------------------------
def pengine(max_stored: int = 1000, **declared: Declared) -> Engine:
    return Engine(
        Limits(
            max_buffer=1000,
            max_chunk=100,
            max_hold=20.0,
            max_pending=16,
            max_pipes=100,
            max_stored=max_stored,
        ),
        declared=declared,
        can_persist=True,
    )


def commit_all(e: Engine, seq0: int = 1) -> tuple[list[Commit], list[Done]]:
    """Run one commit as the service would, with a store that assigns seqs from seq0."""
    work = e.take_commit()
    out: list[Done] = []
    nxt = seq0
    for c in work:
        seqs = list(range(nxt, nxt + len(c.chunks)))
        nxt += len(c.chunks)
        out += e.committed(c, seqs, True)
    return work, out


def test_persistent_writes_need_no_reader_and_are_visible_once_committed() -> None:
    """Rules P2: a persistent pipe accepts writes with no reader attached, but a write is
    answered and readable only after its commit; the reader gets each byte's offset."""
    e = pengine()
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    assert e.write("l.1", w.handle, "w1", b"hello", 1, False, 10, 0.0) == []
    r, _ = e.open("l.2", "p", "r", None, "fail")
    assert e.read("l.2", r.handle, "r1", 10, 10, 0.0) == []  # staged: not visible
    work, out = commit_all(e)
    assert [(c.name, c.chunks, c.deletes, c.cursor) for c in work] == [
        ("p", [(5, b"hello")], [], None)
    ]
    assert kinds(out) == [("w1", "ok"), ("r1", "data")]
    assert (bytes(out[1].data), out[1].at) == (b"hello", 0)


def test_unacked_bytes_of_a_crashed_reader_are_served_again() -> None:
    """Rule P3: bytes answered to a reader that leaves without acking them go to the
    next reader first; acked bytes do not, and the consumed offset (cursor) and the
    deletes follow the acks only."""
    e = pengine()
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    for s, data in enumerate([b"aaaa", b"bbbb", b"cccc"], 1):
        e.write("l.1", w.handle, s, data, s, False, 10, 0.0)
    commit_all(e)
    r, _ = e.open("l.2", "p", "r", None, "fail")
    (d,) = e.read("l.2", r.handle, "r1", 6, 10, 0.0)
    assert (bytes(d.data), d.at) == (b"aaaabb", 0)
    (d,) = e.read("l.2", r.handle, "r2", 3, 10, 0.0, consumed=5)  # acks "aaaab"
    assert (bytes(d.data), d.at) == (b"bbc", 6)
    work, _ = commit_all(e, 4)
    assert [(c.deletes, c.cursor) for c in work] == [([1], 5)]  # chunk 1 wholly consumed
    e.peer_gone("l.2")  # holds "b" (5) and "bbc" (6-9) unacked
    r2, _ = e.open("l.3", "p", "r", None, "fail")
    assert r2.armed  # Rule P4: the pipe holds unread bytes
    got = [(bytes(x.data), x.at) for x in e.read("l.3", r2.handle, "a", 100, 10, 0.0)]
    assert got == [(b"bbbc", 5)]  # the redo range [5, 9), whole
    got = [(bytes(x.data), x.at) for x in e.read("l.3", r2.handle, "b", 100, 10, 0.0, consumed=4)]
    assert got == [(b"ccc", 9)]
    e.close("l.1", w.handle)
    assert kinds(e.read("l.3", r2.handle, "c", 100, 10, 0.0, consumed=7)) == [("c", "eof")]
    work, _ = commit_all(e)
    assert [(c.deletes, c.cursor) for c in work] == [([2, 3], 12)]
    e.close("l.3", r2.handle)
    assert "p" not in e.pipes and e.offsets == {"p": 12}  # Rule P5: forgotten, offset kept
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    e.write("l.1", w.handle, "x", b"x", 1, False, 10, 0.0)
    work, _ = commit_all(e, 4)
    assert work[0].chunks == [(13, b"x")]  # offsets never go back


def test_bad_ack_is_refused() -> None:
    e = pengine()
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    e.write("l.1", w.handle, 1, b"abc", 1, False, 10, 0.0)
    commit_all(e)
    r, _ = e.open("l.2", "p", "r", None, "fail")
    e.read("l.2", r.handle, "r1", 10, 10, 0.0)
    with pytest.raises(EngineError) as info:
        e.read("l.2", r.handle, "r2", 10, 10, 0.0, consumed=4)
    assert info.value.code == "bad-request"


def test_failed_commit_puts_writes_back_in_order() -> None:
    """Rule P2 + Rule 3: when the append fails (store full) the staged chunks wait
    again, first and in order, nothing is answered; after retry_store they are staged
    again and committed with the same offsets."""
    e = pengine()
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    e.write("l.1", w.handle, 1, b"ab", 1, False, 10, 0.0)
    work = e.take_commit()
    e.write("l.1", w.handle, 2, b"cd", 2, False, 10, 0.0)  # staged during the commit
    assert e.committed(work[0], None, True) == []
    assert e.store_full and e.take_commit() == []
    assert [op.seq for op in w.pending] == [1, 2] and e.pipes["p"].charged == 0
    assert e.retry_store() == []
    work, out = commit_all(e)
    assert work[0].chunks == [(2, b"ab"), (4, b"cd")]
    assert kinds(out) == [(1, "ok"), (2, "ok")]


def test_store_full_then_timeout_follows_rule_3() -> None:
    """A write put back by a failed commit times out like any waiting write."""
    e = pengine()
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    e.write("l.1", w.handle, 1, b"ab", 1, False, 1.0, 0.0)
    e.committed(e.take_commit()[0], None, True)
    assert kinds(e.expire(1.0)) == [(1, "timeout")]
    e.retry_store()
    assert kinds(e.write("l.1", w.handle, "again", b"ab", 1, False, 5.0, 1.0)) == []
    assert kinds(commit_all(e)[1]) == [("again", "ok")]


def test_persistent_bound_is_max_stored() -> None:
    """Rule 1 with ``max_stored``: staged and stored bytes count; the next write waits."""
    e = pengine(max_stored=300)
    w, _ = e.open("l.1", "p", "w", None, "fail", True)
    for s in range(1, 4):
        e.write("l.1", w.handle, s, b"x" * 100, s, False, 10, 0.0)
    _, out = commit_all(e)
    assert kinds(out) == [(1, "ok")]  # 164 + 164 > 300
    assert e.pipes["p"].charged <= 300


def test_persistence_is_decided_once() -> None:
    """Rule P1: the first open (or the config) decides; a later open asking otherwise
    gets pipe-mismatch; no store or broadcast mode are refused bad-request."""
    e = pengine(cfg=Declared(persistent=True, max_stored=500))
    e.open("l.1", "plain", "w", None, "fail")
    for name, flag in (("plain", True), ("cfg", False)):
        with pytest.raises(EngineError) as info:
            e.open("l.1", name, "r", None, "fail", flag)
        assert info.value.code == PIPE_MISMATCH
    r, _ = e.open("l.1", "cfg", "r", None, "fail")
    assert r.pipe.persistent and r.pipe.bound == 500
    with pytest.raises(EngineError) as info:
        e.open("l.1", "cfg", "r", None, "fail", False)
    assert info.value.code == PIPE_MISMATCH
    with pytest.raises(EngineError) as info:
        e.open("l.1", "b", "r", "broadcast", "fail", True)
    assert info.value.code == "bad-request"
    with pytest.raises(EngineError) as info:
        engine().open("l.1", "p", "r", None, "fail", True)
    assert info.value.code == "bad-request" and "dir" in info.value.message


def test_recovered_pipe_resumes_at_its_cursor() -> None:
    """A pipe loaded from the store starts at the cursor inside its first chunk; a
    reader gets the rest then end of pipe (Rule P4: no writer attached)."""
    e = pengine()
    e.recover("p", 3, 9, [(7, 5, b"01234"), (8, 9, b"5678")])
    e.recover("empty", 40, 42, [])
    assert e.offsets == {"empty": 42}
    r, _ = e.open("l.2", "p", "r", None, "fail", True)
    out = e.read("l.2", r.handle, "a", 100, 10, 0.0)
    assert [(bytes(d.data), d.at) for d in out] == [(b"345678", 3)]
    assert kinds(e.read("l.2", r.handle, "c", 100, 10, 0.0, consumed=6)) == [("c", "eof")]
    work, _ = commit_all(e)
    assert [(c.deletes, c.cursor) for c in work] == [([7, 8], 9)]
