"""``transport/splice.PipeTail`` on real kernel objects: a frame's rest spliced from one
socket into pipes and out into another arrives byte for byte; the pipe budget, a full
budget and a descriptor that cannot be spliced end in ``SpliceUnavailable`` with what
was spliced still readable (``materialize``); every pipe is released."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator

import pytest

from msgq_trio.transport.splice import PIPE_SIZE, PipeBudget, PipeTail, SpliceUnavailable

MiB = 1 << 20


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
    yield a, b
    a.close()
    b.close()


def fill(tail: PipeTail, sock: socket.socket, want: int) -> int:
    """Splice until ``want`` bytes are in or the socket is empty; the bytes moved."""
    got = 0
    while got < want:
        try:
            n = tail.fill_from(sock.fileno(), min(want - got, PIPE_SIZE))
        except BlockingIOError:
            break
        assert n > 0
        got += n
    return got


def test_a_rest_goes_through_the_pipes_byte_for_byte(pair) -> None:
    a, b = pair
    c, d = socket.socketpair()
    c.setblocking(False)  # (as the broker's sockets are: splice then never blocks)
    d.setblocking(False)
    data = random.Random(1).randbytes(3 * MiB + 123)
    budget = PipeBudget(64)
    tail = PipeTail(budget)
    out = bytearray()
    sent = 0
    while len(tail) < len(data):
        if sent < len(data):
            sent += a.send(data[sent : sent + MiB])
        fill(tail, b, len(data) - len(tail))
    assert len(tail) == len(data)
    assert budget.held == tail.pipes >= 3  # about a MiB per pipe
    while True:
        try:
            n = tail.drain_to(c.fileno())
        except BlockingIOError:
            n = -1
        if n == 0:
            break
        while True:
            try:
                chunk = d.recv(MiB)
            except BlockingIOError:
                break
            out += chunk
    d.setblocking(True)
    while len(out) < len(data):
        out += d.recv(MiB)
    assert bytes(out) == data
    assert budget.held == 0 == tail.pipes  # drained pipes are closed as it goes
    c.close()
    d.close()


def test_no_pipe_left_in_the_budget_stops_the_splice_and_keeps_what_came(pair) -> None:
    """A budget of one pipe: once it is full, SpliceUnavailable; materialize() gives the
    bytes spliced so far (the start of what was sent) and releases the pipe."""
    a, b = pair
    data = random.Random(2).randbytes(3 * MiB)
    budget = PipeBudget(1)
    tail = PipeTail(budget)
    sent = a.send(data)
    with pytest.raises(SpliceUnavailable, match="splice_max_pipes"):
        while True:
            fill(tail, b, sent)
            sent += a.send(data[sent:])
    assert budget.held == 1
    tail.materialize()
    assert tail.data is not None and len(tail.data) == len(tail) > 0
    assert data.startswith(tail.data)
    assert budget.held == 0
    assert tail.piece() == tail.data


def test_a_descriptor_splice_refuses_turns_splicing_off(pair) -> None:
    """An eventfd has no splice support (EINVAL): SpliceUnavailable, the budget records
    why, and from then on no pipe is created for any tail."""
    efd = os.eventfd(1)
    try:
        budget = PipeBudget(64)
        first = PipeTail(budget)
        with pytest.raises(SpliceUnavailable, match="splice"):
            first.fill_from(efd, 8)
        assert budget.unsupported.startswith("splice(2) failed")
        first.materialize()  # what the broker's reader does then: nothing came
        assert first.data == b"" and budget.held == 0
        a, b = pair
        a.send(b"x" * 100)
        with pytest.raises(SpliceUnavailable):
            PipeTail(budget).fill_from(b.fileno(), 100)
        assert budget.held == 0
    finally:
        os.close(efd)


def test_a_destination_splice_refuses_leaves_the_rest_readable(pair, tmp_path) -> None:
    """Splicing into a file opened for appending is refused (EINVAL): drain_to raises
    SpliceUnavailable and materialize() still gives every byte."""
    a, b = pair
    data = random.Random(3).randbytes(MiB + 7)
    budget = PipeBudget(64)
    tail = PipeTail(budget)
    a.send(data)
    assert fill(tail, b, len(data)) == len(data)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with pytest.raises(SpliceUnavailable):
            tail.drain_to(fd)
    finally:
        os.close(fd)
    tail.materialize()
    assert tail.data == data
    assert budget.held == 0


def test_a_pipe_full_of_small_pieces_is_counted_right(pair) -> None:
    """A pipe holds 256 pieces however small: 1,000 writes of 100 bytes fill pipes long
    before a MiB each, and the tail must count what each really holds to drain it all."""
    a, b = pair
    c, d = socket.socketpair()
    c.setblocking(False)
    d.setblocking(False)
    data = random.Random(4).randbytes(100_000)
    for i in range(0, len(data), 100):
        a.send(data[i : i + 100])  # one socket buffer each
    budget = PipeBudget(64)
    tail = PipeTail(budget)
    assert fill(tail, b, len(data)) == len(data)
    assert tail.pipes >= 3  # 256 pieces of 100 bytes per pipe
    out = bytearray()
    for _ in range(10_000):
        try:
            n = tail.drain_to(c.fileno())
        except BlockingIOError:
            n = -1
        with contextlib.suppress(BlockingIOError):
            while chunk := d.recv(MiB):
                out += chunk
        if n == 0:
            break
    else:
        pytest.fail(f"the tail did not drain: {len(out)} of {len(data)} bytes out")
    assert bytes(out) == data
    assert budget.held == 0
    c.close()
    d.close()
