"""The pipe engine as pure data (plugins/pipe/engine.py): its rules, without processes."""

from __future__ import annotations

from msgq_trio.plugins.pipe.engine import PIPE_BROKEN, Done, Engine, Limits


def engine(max_buffer: int = 1000, max_chunk: int = 100) -> Engine:
    return Engine(Limits(max_buffer=max_buffer, max_chunk=max_chunk, max_hold=20.0,
                         max_pending=16, max_pipes=100))


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
    data = b"".join(bytes(d.data) for d in e.read("l.9", r.handle, "r", 100, 10, 0.0)
                    + e.read("l.9", r.handle, "r", 100, 10, 0.0))
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
