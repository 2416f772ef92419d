"""The direct client (msgq_trio.connect_direct): blocking calls doing their own socket I/O,
against a real broker process, with trio clients and helper processes on the other side."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    LimitExceeded,
    NoRecipient,
    RecipientGone,
    RemoteError,
    RequestTimeout,
    UsageError,
)
from msgq_trio.client.direct import DirectBus


@contextmanager
def serving(bus: DirectBus) -> Iterator[None]:
    """Run ``bus.serve`` in a thread until the block ends (the bus belongs to that thread
    meanwhile); re-raise what the serving thread raised."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                bus.serve(0.02)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    if errors:
        raise errors[0]


def calc(bus: DirectBus) -> None:
    """Commands: add (sum of a list), fail (CommandFailed), bad (ValueError), boom
    (RuntimeError), relay (a nested call from inside the handler)."""

    @bus.command("add")
    def add(params: list[int]) -> int:
        return sum(params)

    @bus.command("fail")
    def fail(params: Any) -> None:
        raise CommandFailed("no-such-zone", "zone example.org not loaded", {"zone": params})

    @bus.command("bad")
    def bad(params: Any) -> None:
        raise ValueError("class must be IN")

    @bus.command("boom")
    def boom(params: Any) -> None:
        raise RuntimeError("bug in the handler")

    @bus.command("relay")
    def relay(params: dict[str, Any]) -> Any:
        return bus.call(params["to"], "add", params["args"])


@pytest.mark.parametrize("flags", [(), ("--busy-poll", "0.0001")], ids=["default", "busy-poll"])
def test_call_between_direct_clients(broker_factory, flags) -> None:
    """call() returns the handler's result through a group, the lname, G[0] and G[?];
    handler exceptions come back as the codes the trio client uses. Also through a broker
    that busy-polls (limits.busy_poll, as the benchmark's msgq_trio-busy-poll rows)."""
    broker = broker_factory(*flags)
    with (
        msgq_trio.connect_direct(broker.path, name="calc") as c,
        msgq_trio.connect_direct(broker.path, name="user") as u,
    ):
        calc(c)
        assert c.subscribe("Calc") is True
        assert c.subscribe("Calc") is False
        with serving(c):
            assert u.call("Calc", "add", [1, 2, 3]) == 6
            assert u.call(c.lname, "add", [4, 5]) == 9
            assert u.call("Calc[0]", "add", [10]) == 10
            assert u.call("Calc[?]", "add", []) == 0
            assert [u.call("Calc", "add", [i, i]) for i in range(200)] == [
                2 * i for i in range(200)
            ]
            with pytest.raises(RemoteError) as failed:
                u.call("Calc", "fail", "example.org")
            assert failed.value.code == "no-such-zone"
            assert failed.value.data == {"zone": "example.org"}
            assert failed.value.sender == c.lname
            with pytest.raises(RemoteError) as bad:
                u.call("Calc", "bad")
            assert bad.value.code == "bad-request"
            assert "class must be IN" in bad.value.message
            with pytest.raises(RemoteError) as boom:
                u.call("Calc", "boom")
            assert boom.value.code == "internal-error"
            assert boom.value.data == {"type": "RuntimeError"}
            with pytest.raises(RemoteError) as unknown:
                u.call("Calc", "nope")
            assert unknown.value.code == "unknown-command"
            assert sorted(unknown.value.data) == ["add", "bad", "boom", "fail", "relay"]
            members = u.members("Calc")
            assert [(m.lname, m.name) for m in members] == [(c.lname, "calc")]


def test_no_recipient_and_usage_errors(broker) -> None:
    """Nobody there: NoRecipient at once (no timeout to guess); bad arguments are
    UsageError raised before anything is sent, and the connection stays usable."""
    with msgq_trio.connect_direct(broker.path, name="user") as u:
        t0 = time.monotonic()
        for target in ["Nobody", "l.999999", "Nobody[?]", "Nobody[3]"]:
            with pytest.raises(NoRecipient):
                u.call(target, "x")
        assert time.monotonic() - t0 < 10.0  # not the 300 s request timeout
        with pytest.raises(UsageError):
            u.call("Nobody", 42)  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            u.call("Nobody", "x", object())
        with pytest.raises(UsageError):
            u.send("Nobody", object())
        with pytest.raises(UsageError):
            u.call("Nobody", "x", timeout=0)
        assert u.subscribe("G") is True


def test_trio_client_calls_direct_client_and_back(broker) -> None:
    """A trio client calls a direct client's command, whose handler calls the trio
    client back (a nested call inside the handler): both directions interoperate."""
    with msgq_trio.connect_direct(broker.path, name="calc") as c:
        calc(c)
        c.subscribe("Calc")

        async def trio_side() -> None:
            async with msgq_trio.connect(broker.path, name="trio") as t:
                await t.subscribe("Adder")

                @t.command("add")
                def add(params: list[int]) -> int:
                    return 1000 + sum(params)

                assert await t.call("Calc", "add", [1, 2]) == 3
                assert await t.call("Calc", "relay", {"to": "Adder", "args": [5]}) == 1005

        with serving(c):
            trio.run(trio_side)


def test_calls_crossing_between_two_direct_clients(broker) -> None:
    """Two direct clients in two threads call each other at the same time, 300 times
    each: a request that arrives while a client waits for its own answer is served
    inline, so neither deadlocks."""
    with (
        msgq_trio.connect_direct(broker.path, name="a") as a,
        msgq_trio.connect_direct(broker.path, name="b") as b,
    ):
        for bus in (a, b):
            calc(bus)
        results: dict[str, list[int]] = {}

        def run(me: DirectBus, other: DirectBus, key: str) -> None:
            results[key] = [me.call(other.lname, "add", [i, 1], timeout=10) for i in range(300)]
            me.serve(0.3)  # answer the other's last calls

        ta = threading.Thread(target=run, args=(a, b, "a"))
        tb = threading.Thread(target=run, args=(b, a, "b"))
        ta.start()
        tb.start()
        ta.join(30)
        tb.join(30)
        assert not ta.is_alive() and not tb.is_alive()
        assert results == {"a": [i + 1 for i in range(300)], "b": [i + 1 for i in range(300)]}


def test_send_receive_in_order_with_stamped_sender(broker) -> None:
    """One-way messages arrive in order, stamped with the true sender; receive() times
    out with TimeoutError when nothing comes."""
    with (
        msgq_trio.connect_direct(broker.path, name="sub") as sub,
        msgq_trio.connect_direct(broker.path, name="pub") as pub,
    ):
        sub.subscribe("Stats")
        for i in range(2000):
            pub.send("Stats", {"i": i, "pad": b"x" * 100})
        got = []
        for _ in range(2000):
            msg = sub.receive(timeout=10)
            assert (msg.sender, msg.sender_name, msg.kind, msg.target) == (
                pub.lname,
                "pub",
                "message",
                "Stats",
            )
            got.append(msg.body["i"])
        assert got == list(range(2000))
        with pytest.raises(TimeoutError):
            sub.receive(timeout=0.1)


def test_messages_over_max_buffered_raise_and_are_kept(broker) -> None:
    """Messages that arrive while a client only makes calls are kept for receive(); past
    max_buffered the call raises LimitExceeded instead of growing or dropping, every
    message is then still received in order, and calls work again."""
    with (
        msgq_trio.connect_direct(broker.path, name="calc") as c,
        msgq_trio.connect_direct(broker.path, name="busy", max_buffered=20_000) as busy,
        msgq_trio.connect_direct(broker.path, name="pub") as pub,
    ):
        calc(c)
        c.subscribe("Calc")
        busy.subscribe("News")
        for i in range(300):
            pub.send("News", {"i": i, "pad": b"x" * 200})
        with serving(c):
            with pytest.raises(LimitExceeded) as full:
                for _ in range(1000):
                    busy.call("Calc", "add", [1])
            assert "max_buffered=20000" in str(full.value)
            got = [busy.receive(timeout=10).body["i"] for _ in range(300)]
            assert got == list(range(300))
            assert busy.call("Calc", "add", [2, 3]) == 5


def test_callee_sigkill_fails_the_call_fast(broker, spawn_client) -> None:
    """A callee process SIGKILLed mid-call: the blocked call() raises RecipientGone
    naming it, within 2 s, with the broker's 300 s request timeout untouched."""
    victim = spawn_client(broker.path, name="victim", groups=["Victim"], commands={"work": "hang"})
    with msgq_trio.connect_direct(broker.path, name="caller") as caller:
        killed: list[float] = []

        def kill_when_called() -> None:
            line = victim.readline(timeout=20)
            assert line is not None and line.startswith(f"got {victim.lname} work")
            killed.append(time.monotonic())
            victim.sigkill()

        t = threading.Thread(target=kill_when_called)
        t.start()
        with pytest.raises(RecipientGone) as gone:
            caller.call("Victim", "work", 1)
        t.join(10)
        assert gone.value.sender == victim.lname
        assert time.monotonic() - killed[0] < 10.0  # not the 300 s request timeout
        with pytest.raises(NoRecipient):
            caller.call("Victim", "work", 2)


def test_call_timeout_is_the_brokers(broker_factory) -> None:
    """A callee that never answers: call(timeout=0.5) gets the broker's `timeout`
    (RequestTimeout) after about 0.5 s."""
    b = broker_factory()
    with (
        msgq_trio.connect_direct(b.path, name="hole") as hole,
        msgq_trio.connect_direct(b.path, name="caller") as caller,
    ):
        hole.subscribe("Hole")
        # hole never reads again: its request sits unanswered in its socket
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout) as timed_out:
            caller.call("Hole", "anything", timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 10.0  # not the 300 s default
        assert timed_out.value.code == "timeout"


def test_broker_shutdown_and_no_broker(broker, short_tmp) -> None:
    """The broker stopping (SIGTERM) ends a blocked receive() and later calls with
    ConnectionLost; connecting where no broker listens is a ConnectError; tcp:// is a
    UsageError."""
    with msgq_trio.connect_direct(broker.path, name="user") as u:
        u.subscribe("G")
        threading.Timer(0.3, os.kill, (broker.pid, signal.SIGTERM)).start()
        broker.expect_exit = True
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost) as lost:
            u.receive(timeout=20)
        assert time.monotonic() - t0 < 15.0  # ended by the shutdown, not the timeout
        assert lost.value.code == "broker-shutdown"
        with pytest.raises(ConnectionLost):
            u.call("G", "x")
    assert broker.wait() == 0
    with pytest.raises(ConnectError):
        msgq_trio.connect_direct(short_tmp / "nobody.sock")
    with pytest.raises(UsageError):
        msgq_trio.connect_direct("tcp://127.0.0.1:1")


def test_close_flushes_and_says_goodbye(broker) -> None:
    """Messages sent right before close() are delivered (close flushes and waits for the
    broker's GOODBYE); the membership ends with a clean `closed` reason."""

    async def watch() -> list[tuple[str, Any]]:
        async with msgq_trio.connect(broker.path, name="watcher") as w:
            await w.subscribe("msgq.membership")
            await w.subscribe("Sink")
            done = trio.Event()
            events: list[tuple[str, Any]] = []

            def run_client() -> None:
                with msgq_trio.connect_direct(broker.path, name="shortlived") as s:
                    for i in range(100):
                        s.send("Sink", i)

            async def collect() -> None:
                async for msg in w:
                    if msg.kind == "notification":
                        params = msg.body
                        if params.get("name") == "shortlived":
                            events.append((msg.header.get("event"), params))
                            if msg.header.get("event") == "disconnected":
                                done.set()
                                return
                    else:
                        events.append(("message", msg.body))

            async with trio.open_nursery() as n:
                n.start_soon(collect)
                await trio.to_thread.run_sync(run_client)
                with trio.fail_after(10):
                    await done.wait()
            return events

    events = trio.run(watch)
    assert [body for kind, body in events if kind == "message"] == list(range(100))
    disconnected = [p for kind, p in events if kind == "disconnected"]
    assert len(disconnected) == 1
    assert disconnected[0].get("reason") == "closed"


def test_direct_bus_is_exported(broker) -> None:
    """The public names: msgq_trio.connect_direct and msgq_trio.DirectBus."""
    assert msgq_trio.DirectBus is DirectBus
    connect: Callable[..., DirectBus] = msgq_trio.connect_direct
    with connect(broker.path) as bus:
        assert bus.lname.startswith("l.")


def test_receives_descriptors_sent_by_a_trio_client(broker) -> None:
    """A message carrying file descriptors (SCM_RIGHTS) reaches a direct client with its
    own working duplicates; a descriptor it does not take is closed with the message."""
    r, w = os.pipe()
    try:
        with msgq_trio.connect_direct(broker.path, name="sink") as sink:
            sink.subscribe("Fds")

            async def send() -> None:
                async with msgq_trio.connect(broker.path, name="src") as src:
                    await src.send("Fds", "pipe", fds=[w])
                    await src.send("Fds", "dropped", fds=[w, w, w])
                    await src.flush()

            trio.run(send)
            msg = sink.receive(timeout=10)
            assert msg.body == "pipe" and len(msg.fds) == 1
            [mine] = msg.take_fds()
            assert mine != w
            os.write(mine, b"hello")
            os.close(mine)
            assert os.read(r, 5) == b"hello"
            second = sink.receive(timeout=10)
            assert second.body == "dropped" and len(second.fds) == 3
            dups = list(second.fds)
            second.close()
            for fd in dups:
                with pytest.raises(OSError):
                    os.fstat(fd)
    finally:
        os.close(r)
        os.close(w)


def test_eof_while_a_write_waits_ends_it(short_tmp) -> None:
    """A broker that says GOODBYE, closes its side and reads no more (what a shutting-down
    broker does for its grace period) while the client's write waits for socket space:
    send() raises ConnectionLost at once instead of waiting (or spinning) until the
    socket is closed. The peer here speaks the protocol by hand (no broker could be
    held in that state on cue)."""
    import socket as pysocket

    from msgq_trio.protocol.codes import PROTOCOL_VERSION, FrameType
    from msgq_trio.protocol.connection import Connection, Role

    path = short_tmp / "fake.sock"
    listener = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    done = threading.Event()

    def fake_broker() -> None:
        conn, _ = listener.accept()
        with conn:
            proto = Connection(Role.BROKER)
            while not proto.events():
                proto.receive_data(conn.recv(65536))
            conn.sendall(
                b"".join(
                    proto.send(
                        FrameType.WELCOME,
                        header={"version": PROTOCOL_VERSION, "lname": "l.1", "broker": "fake"},
                    )
                )
            )
            time.sleep(0.5)  # the client fills both socket buffers meanwhile
            conn.sendall(
                b"".join(proto.send(FrameType.GOODBYE, header={"reason": "broker-shutdown"}))
            )
            conn.shutdown(pysocket.SHUT_WR)
            done.wait(20)  # keep the socket open, unread, like a broker's grace period

    t = threading.Thread(target=fake_broker, daemon=True)
    t.start()
    try:
        with msgq_trio.connect_direct(path, name="writer", send_buffer=65536) as bus:
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost) as lost:
                for _ in range(10_000):
                    bus.send("G", b"x" * 65536)
            assert time.monotonic() - t0 < 15.0  # not the fake broker's 20 s
            assert lost.value.code == "broker-shutdown"
    finally:
        done.set()
        t.join(10)
        listener.close()
