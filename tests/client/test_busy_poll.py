"""The trio client's ``busy_poll``: a lone call polls its socket for the answer instead of
sleeping (``Bus._poll_answer``), and the rule that decides when (``CallPoller``).

The rule is tested on its own, with times as arguments. The polling is tested against a
real broker and helper processes (an answer from the caller's own program cannot come
while it polls), and against a peer speaking the protocol by hand in a thread for what no
broker does on cue (garbage, an EOF or silence in the middle of a poll). Those tests hold
the window open by hand and far longer than the tests' own time limits, so a poll that
did not stop when it must shows as a test that fails, not as a slow one.
"""

from __future__ import annotations

import socket as pysocket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import ConnectionLost, RequestTimeout, UsageError
from msgq_trio.client.polling import BUSY_POLL, CallPoller, Poll, check_busy_poll
from msgq_trio.protocol.codes import PROTOCOL_VERSION, FrameType
from msgq_trio.protocol.connection import Connection, Role
from msgq_trio.protocol.framing import Frame, encode_cbor

LIMIT = 0.0002
#: A window no test waits out: every test here fails after at most 10 s.
HELD_OPEN = 60.0


# -- the rule --------------------------------------------------------------------------
def test_the_window_opens_after_two_answers_within_the_limit() -> None:
    p = CallPoller(LIMIT, cpus=2)
    assert p.window == 0.0
    p.answered(LIMIT / 2, Poll.SLEPT)
    assert p.window == 0.0
    p.answered(LIMIT, Poll.SLEPT)
    assert p.window == LIMIT


def test_a_late_answer_closes_the_window_and_breaks_the_run() -> None:
    """Late is more than twice the limit for a caller that slept (its own wake-up is part
    of the delay)."""
    p = CallPoller(LIMIT, cpus=2)
    p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT * 2.1, Poll.SLEPT)  # late: the run of short answers starts over
    p.answered(LIMIT / 2, Poll.SLEPT)
    assert p.window == 0.0
    p.answered(LIMIT / 2, Poll.SLEPT)
    assert p.window == LIMIT
    p.answered(LIMIT * 2.1, Poll.SLEPT)  # a call that could not poll, answered late
    assert p.window == 0.0


def test_a_caller_that_slept_past_the_limit_polls_again() -> None:
    """After a miss, answers that came a little over the limit while the caller slept
    (its wake-up from the loop's wait included: on a busy host that alone is about the
    limit) reopen the window, so one bad stretch does not leave the caller sleeping for
    good; up to twice the limit counts, beyond it does not."""
    p = CallPoller(LIMIT, cpus=2)
    p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT * 1.5, Poll.MISSED)  # a bad stretch: now four are needed
    assert p.window == 0.0
    for _ in range(3):
        p.answered(LIMIT * 1.9, Poll.SLEPT)
        assert p.window == 0.0
    p.answered(LIMIT * 1.9, Poll.SLEPT)
    assert p.window == LIMIT
    p.answered(LIMIT / 2, Poll.CAUGHT)
    p.answered(LIMIT * 1.9, Poll.SLEPT)  # a call that could not poll: the window stays
    assert p.window == LIMIT


def test_a_caught_answer_keeps_the_window_and_is_counted() -> None:
    p = CallPoller(LIMIT, cpus=2)
    p.answered(0.0, Poll.SLEPT)
    p.answered(0.0, Poll.SLEPT)
    for _ in range(5):
        p.answered(LIMIT / 2, Poll.CAUGHT)
    assert (p.window, p.caught, p.missed) == (LIMIT, 5, 0)


def test_every_miss_doubles_the_answers_needed_to_open_again_up_to_64() -> None:
    p = CallPoller(LIMIT, cpus=2)
    needed = []
    for _ in range(8):
        short = 0
        while not p.window:
            p.answered(LIMIT / 2, Poll.SLEPT)
            short += 1
        needed.append(short)
        p.answered(LIMIT * 1.5, Poll.MISSED)
        assert p.window == 0.0
    assert needed == [2, 4, 8, 16, 32, 64, 64, 64]
    assert p.missed == 8
    # A catch puts it back to two.
    while not p.window:
        p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT / 2, Poll.CAUGHT)
    p.answered(LIMIT * 1.5, Poll.MISSED)
    p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT / 2, Poll.SLEPT)
    p.answered(LIMIT / 2, Poll.SLEPT)
    assert p.window == LIMIT  # four (after one miss), not 128


@pytest.mark.parametrize(("limit", "cpus"), [(0.0, 2), (LIMIT, 1)], ids=["limit-0", "one-cpu"])
def test_off_when_the_limit_is_0_or_on_one_cpu(limit: float, cpus: int) -> None:
    p = CallPoller(limit, cpus=cpus)
    for _ in range(10):
        p.answered(0.0, Poll.SLEPT)
    assert (p.limit, p.window) == (0.0, 0.0)


@pytest.mark.parametrize("bad", [-0.001, 1.5, True, "0.1", None])
def test_bad_busy_poll_values_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="busy_poll"):
        check_busy_poll(bad)
    assert check_busy_poll(0) == 0.0 and check_busy_poll(1) == 1.0
    assert check_busy_poll(BUSY_POLL) == BUSY_POLL


async def test_connect_refuses_a_bad_busy_poll_as_usage_error(broker: Any) -> None:
    with pytest.raises(UsageError, match="busy_poll must be between 0 and 1 s"):
        async with msgq_trio.connect(broker.path, "bad", busy_poll=-1):
            pass


# -- the polling, against a real broker --------------------------------------------------
async def hold_open(bus: msgq_trio.Bus) -> CallPoller:
    """Make ``bus``'s next lone call poll for HELD_OPEN (on any number of CPUs), once
    its reader is parked waiting for the socket (a caller polls only then)."""
    poller = CallPoller(1.0, cpus=2)
    poller.window = HELD_OPEN
    bus._poller = poller
    while not bus._reader_waiting:  # noqa: ASYNC110 (the reader sets no event for this)
        await trio.sleep(0.001)
    return poller


async def test_calls_answered_back_to_back_are_caught_while_polling(
    broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """A caller whose answers come within the limit (here the largest, 1 s, so a loaded
    machine still answers within it) opens its window after two answers and then takes
    its answers while polling; every result is right."""
    helper = spawn_client(broker.path, name="echoer", groups=["Echo"], commands={"echo": "echo"})
    async with msgq_trio.connect(broker.path, "caller", busy_poll=1.0) as bus:
        poller = bus._poller
        if poller.limit == 0.0:  # this process may run on one CPU only: the rule says off
            poller = bus._poller = CallPoller(1.0, cpus=2)
        with trio.fail_after(10):
            for i in range(20):
                got = await bus.call("Echo", "echo", {"i": i})
                assert got == {"lname": helper.lname, "params": {"i": i}}
        assert poller.window == 1.0
        assert poller.caught >= 1


async def test_a_message_that_comes_while_polling_is_queued_for_the_application(
    broker: Any, spawn_client: Callable[..., Any]
) -> None:
    spawn_client(broker.path, name="notifier", groups=["Notify"], commands={"notify": "notify"})
    async with msgq_trio.connect(broker.path, "caller") as bus:
        poller = await hold_open(bus)
        with trio.fail_after(10):
            params = {"to": bus.lname, "n": 7}
            assert await bus.call("Notify", "notify", params) == params
            assert poller.caught == 1  # the message first, then the answer: both taken
            msg = await bus.receive(timeout=5)
        assert msg.body == {"note": 7}


async def test_the_poll_stops_at_the_inbound_high_water(
    broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """Messages that fill the inbound queue past its high water stop the poll, as they
    stop the reader: the caller waits, and its answer (sent half a second after the
    message, so the two never arrive together) still comes."""
    spawn_client(
        broker.path, name="notifier", groups=["Notify"], commands={"notify": "notify-then-wait"}
    )
    async with msgq_trio.connect(broker.path, "caller") as bus:
        poller = await hold_open(bus)
        # As if the inbox were over its byte bound: a bound below zero bytes.
        high_water = bus._inbox.max_bytes
        bus._inbox.max_bytes = -1
        with trio.fail_after(10):
            params = {"to": bus.lname, "n": 1}
            assert await bus.call("Notify", "notify", params) == params
        assert (poller.caught, poller.missed) == (0, 1)
        bus._inbox.max_bytes = high_water
        with trio.fail_after(10):
            assert (await bus.receive()).body == {"note": 1}


@pytest.mark.parametrize("form", ["def", "async-def-without-await", "async-def"])
async def test_a_request_that_comes_while_polling_is_served(
    broker: Any, spawn_client: Callable[..., Any], form: str
) -> None:
    """The callee calls the caller back before it answers. A handler that awaits is a
    task of its own: the poll stops for it (else the call could not end until the
    window did). A plain ``def`` one, or an ``async def`` one without an ``await``, is
    answered inline, and the poll goes on."""
    spawn_client(broker.path, name="cb", groups=["Callback"], commands={"callback": "callback"})
    async with msgq_trio.connect(broker.path, "caller") as bus:
        if form == "def":
            bus.add_command("ping", lambda n: n + 1)
        elif form == "async-def-without-await":

            async def ping_inline(n: int) -> int:
                return n + 1

            bus.add_command("ping", ping_inline)
        else:

            async def ping(n: int) -> int:
                await trio.lowlevel.checkpoint()
                return n + 1

            bus.add_command("ping", ping)
        poller = await hold_open(bus)
        with trio.fail_after(10):
            assert await bus.call("Callback", "callback", {"to": bus.lname, "n": 1}) == {"pong": 2}
        if form == "async-def":
            assert (poller.caught, poller.missed) == (0, 1)
        else:
            assert (poller.caught, poller.missed) == (1, 0)


async def test_a_call_does_not_poll_while_another_is_pending(
    broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """Only a lone call polls: with another call pending (here one that hangs), the
    reader takes the answers, and a concurrent burst of calls all get theirs."""
    helper = spawn_client(
        broker.path, name="echoer", groups=["Echo"], commands={"echo": "echo", "hang": "hang"}
    )
    async with msgq_trio.connect(broker.path, "caller") as bus:
        results: list[Any] = []

        async def one(i: int) -> None:
            results.append(await bus.call("Echo", "echo", i))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(bus.call, "Echo", "hang")
                line = await helper.areadline()
                assert line is not None and line.startswith("got ")  # the call is pending
                poller = await hold_open(bus)
                await one(-1)
                assert (poller.caught, poller.missed) == (0, 0)
                async with trio.open_nursery() as burst:
                    for i in range(4):
                        burst.start_soon(one, i)
                nursery.cancel_scope.cancel()  # the hanging call
        assert sorted(r["params"] for r in results) == [-1, 0, 1, 2, 3]


async def test_a_call_does_not_poll_while_another_task_is_runnable(
    broker: Any, spawn_client: Callable[..., Any]
) -> None:
    """A task that is ready to run (here one woken by the caller just before its call)
    is not kept waiting by a polling caller: the call sleeps at once, and the task runs
    before the answer is taken."""
    spawn_client(broker.path, name="echoer", groups=["Echo"], commands={"echo": "echo"})
    async with msgq_trio.connect(broker.path, "caller") as bus:
        poller = await hold_open(bus)
        go = trio.Event()
        ran: list[str] = []

        async def woken() -> None:
            await go.wait()
            ran.append("woken")

        async def call() -> None:
            go.set()  # woken is now runnable: it waits for the next scheduler pass
            assert (await bus.call("Echo", "echo", 1))["params"] == 1
            ran.append("answered")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(woken)
                # Two schedule points: woken has run up to its wait on the event.
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
                await call()
        assert ran == ["woken", "answered"]
        assert (poller.caught, poller.missed) == (0, 0)


# -- the polling, against a peer speaking the protocol by hand ---------------------------
class HandPeer:
    """A one-client "broker" in a thread: it answers the handshake, then gives each
    request it reads to ``on_request(sock, proto, frame)``."""

    def __init__(self, path: Path, on_request: Callable[[pysocket.socket, Any, Frame], None]):
        self.listener = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.on_request = on_request
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                proto = Connection(Role.BROKER)
                while not proto.events():
                    proto.receive_data(conn.recv(65536))
                welcome = {"version": PROTOCOL_VERSION, "lname": "l.1", "broker": "hand"}
                conn.sendall(b"".join(proto.send(FrameType.WELCOME, header=welcome)))
                while not self.done.is_set():
                    data = conn.recv(65536)
                    if not data:
                        break
                    proto.receive_data(data)
                    for ev in proto.events():
                        if isinstance(ev, Frame) and ev.type == FrameType.REQUEST:
                            self.on_request(conn, proto, ev)
                self.done.wait(20)
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.listener.close()
        assert not self.thread.is_alive()


@pytest.fixture
def hand_peer(short_tmp: Path) -> Iterator[Callable[..., HandPeer]]:
    peers: list[HandPeer] = []

    def start(on_request: Callable[[pysocket.socket, Any, Frame], None]) -> HandPeer:
        peers.append(HandPeer(short_tmp / f"hand{len(peers)}.sock", on_request))
        return peers[-1]

    yield start
    for p in peers:
        p.close()


def reply(conn: pysocket.socket, proto: Any, frame: Frame, result: Any) -> None:
    pieces = proto.send(FrameType.REPLY, request_id=frame.request_id, body=encode_cbor(result))
    conn.sendall(b"".join(pieces))


async def test_garbage_while_polling_fails_the_bus_as_a_protocol_violation(
    hand_peer: Callable[..., HandPeer],
) -> None:
    def answer_then_garbage(conn: pysocket.socket, proto: Any, frame: Frame) -> None:
        if frame.header().get("cmd") == "ok":
            reply(conn, proto, frame, "fine")
        else:
            conn.sendall(b"\x00\x00\x00\x1c" + b"\xee" * 28)  # an unknown frame type

    peer = hand_peer(answer_then_garbage)
    async with msgq_trio.connect(peer.listener.getsockname(), "caller") as bus:
        poller = await hold_open(bus)
        with trio.fail_after(10):
            assert await bus.call("X", "ok") == "fine"
            with pytest.raises(ConnectionLost, match="violated the protocol"):
                await bus.call("X", "garbage")
        assert poller.caught == 2  # the answer, and the failure, both taken polling
    assert peer.errors == []


async def test_an_eof_while_polling_ends_the_poll_and_fails_the_call(
    hand_peer: Callable[..., HandPeer],
) -> None:
    def hang_up(conn: pysocket.socket, proto: Any, frame: Frame) -> None:
        conn.shutdown(pysocket.SHUT_RDWR)

    peer = hand_peer(hang_up)
    async with msgq_trio.connect(peer.listener.getsockname(), "caller") as bus:
        poller = await hold_open(bus)
        with trio.fail_after(10), pytest.raises(ConnectionLost, match="closed the connection"):
            await bus.call("X", "anything")
        assert poller.missed == 1  # the reader took the EOF
    assert peer.errors == []


async def test_a_call_with_a_timeout_polls_no_longer_than_its_deadline(
    hand_peer: Callable[..., HandPeer],
) -> None:
    """A silent peer: the call's own deadline (timeout plus the client's grace) ends the
    poll, and the call raises RequestTimeout, well before the window would end."""
    peer = hand_peer(lambda conn, proto, frame: None)
    async with msgq_trio.connect(peer.listener.getsockname(), "caller") as bus:
        poller = await hold_open(bus)
        with trio.fail_after(10), pytest.raises(RequestTimeout, match="none from the broker"):
            await bus.call("X", "anything", timeout=0.2)
        assert poller.missed == 1
    assert peer.errors == []


async def test_a_trio_deadline_ends_the_poll(hand_peer: Callable[..., HandPeer]) -> None:
    """A cancel scope's deadline (any trio timer) falls within the window: the poll ends
    there, and the scope cancels the call as it would a sleeping one."""
    peer = hand_peer(lambda conn, proto, frame: None)
    async with msgq_trio.connect(peer.listener.getsockname(), "caller") as bus:
        poller = await hold_open(bus)
        with trio.fail_after(10):
            with trio.move_on_after(0.3) as scope:
                await bus.call("X", "anything")
        assert scope.cancelled_caught
        assert poller.missed == 1
    assert peer.errors == []
