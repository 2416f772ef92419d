"""The TCP fault proxy (msgq_trio/scenario/faultproxy.py) on real loopback sockets:
delay and jitter bounds, loss as retransmission stalls, the bandwidth cap, a cut after N
bytes, the black hole, run-time changes and its setting words. Every bound is a lower
bound the fault guarantees, or an upper bound many times the expected figure: behaviour,
never speed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import ConnectionLost
from msgq_trio.core.access import hash_token
from msgq_trio.protocol.codes import ErrorCode, FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame
from msgq_trio.scenario.faultproxy import Cut, FaultProxy, Faults, SettingError, parse_setting


def _shared() -> Any:
    """tests/conftest.py as a module: its broker-process helpers (imported by path, as
    tests/e2e/test_e2e_tcp.py does, since "conftest" names another module in a session
    that also collects tests/ops)."""
    name = "msgq_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent / "conftest.py"
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_c = _shared()
TOKEN = "proxy-test-token-5e1f"
#: The brokers here ping idle TCP clients every 0.5 s and drop them after 3 silent
#: intervals; clients learn the same settings from WELCOME.
HEARTBEAT_INTERVAL, HEARTBEAT_MISSES = 0.5, 3


class Sink:
    """A TCP server that records what each connection sent, and when."""

    def __init__(self) -> None:
        self.port = 0
        self.streams: list[trio.SocketStream] = []
        self.data: list[bytearray] = []
        self.times: list[list[tuple[float, int]]] = []
        self.eof: list[bool] = []
        self.changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            await self._read(stream)

    async def _read(self, stream: trio.SocketStream) -> None:
        i = len(self.data)
        self.streams.append(stream)
        self.data.append(bytearray())
        self.times.append([])
        self.eof.append(False)
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                chunk = b""
            if chunk:
                self.data[i] += chunk
                self.times[i].append((trio.current_time(), len(self.data[i])))
            else:
                self.eof[i] = True
            self.changed.set()
            self.changed = trio.Event()
            if not chunk:
                return

    async def wait_for(self, pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
        with trio.fail_after(timeout):
            while not pred():
                await self.changed.wait()


async def _setup(nursery: trio.Nursery, seed: int = 1) -> tuple[Sink, FaultProxy]:
    sink = Sink()
    await nursery.start(sink.serve)
    proxy = FaultProxy("127.0.0.1", sink.port, seed=seed)
    await nursery.start(proxy.serve)
    return sink, proxy


async def test_clean_proxy_forwards_both_ways_and_relays_close() -> None:
    """Without faults the bytes go through unchanged both ways, and a client's close
    reaches the server as EOF."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        payload = bytes(range(256)) * 1000
        await c.send_all(payload)
        await sink.wait_for(lambda: len(sink.data) == 1 and len(sink.data[0]) == len(payload))
        assert bytes(sink.data[0]) == payload
        await sink.streams[0].send_all(b"pong")
        with trio.fail_after(10):
            assert await c.receive_some(10) == b"pong"
        await c.aclose()
        await sink.wait_for(lambda: sink.eof[0])
        nursery.cancel_scope.cancel()


async def test_delay_with_jitter_holds_every_chunk_at_least_delay_minus_jitter() -> None:
    """With ``delay 300ms 100ms`` no chunk arrives sooner than 200 ms after it was sent,
    the order of bytes is kept, and nothing is held for seconds."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        proxy.apply("delay 300ms 100ms")
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        sent: list[tuple[float, int]] = []
        total = 0
        for i in range(10):
            chunk = bytes([i]) * 1000
            sent.append((trio.current_time(), total + len(chunk)))
            await c.send_all(chunk)
            total += len(chunk)
            await trio.sleep(0.03)
        await sink.wait_for(lambda: len(sink.data) == 1 and len(sink.data[0]) == total)
        assert bytes(sink.data[0]) == b"".join(bytes([i]) * 1000 for i in range(10))
        for t_sent, end in sent:
            t_arrived = next(t for t, n in sink.times[0] if n >= end)
            assert t_arrived - t_sent >= 0.2 - 0.01
            assert t_arrived - t_sent < 5.0
        await c.aclose()
        nursery.cancel_scope.cancel()


async def test_loss_is_a_retransmission_stall_never_lost_bytes() -> None:
    """``loss 100% rto 300ms``: every chunk is stalled one retransmission timeout, and
    every byte still arrives, in order (a TCP flow loses time, not data); at 50% loss a
    long stream arrives whole."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        proxy.apply("loss 100% rto 300ms")
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        t0 = trio.current_time()
        await c.send_all(b"x" * 100)
        await sink.wait_for(lambda: len(sink.data) == 1 and len(sink.data[0]) == 100)
        assert sink.times[0][0][0] - t0 >= 0.29
        assert proxy.stalls >= 1
        proxy.apply("loss 50% rto 10ms")
        payload = bytes(i % 251 for i in range(200_000))
        for i in range(0, len(payload), 1000):
            await c.send_all(payload[i : i + 1000])
        await sink.wait_for(lambda: len(sink.data[0]) == 100 + len(payload))
        assert bytes(sink.data[0][100:]) == payload
        await c.aclose()
        nursery.cancel_scope.cancel()


async def test_rate_cap_spreads_the_bytes_over_time() -> None:
    """``rate 100kbps`` (100 000 bytes/s): 60 000 bytes take at least about 0.6 s to go
    through, where the uncapped proxy has no such floor."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        proxy.apply("rate 100kbps")
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        t0 = trio.current_time()
        await c.send_all(b"r" * 60_000)
        await sink.wait_for(lambda: len(sink.data) == 1 and len(sink.data[0]) == 60_000)
        assert sink.times[0][-1][0] - t0 >= 0.5
        await c.aclose()
        nursery.cancel_scope.cancel()


async def test_cut_after_n_bytes_delivers_exactly_n_then_closes_both_sides() -> None:
    """``cut 300``: the server gets exactly the next 300 bytes and then EOF, and the
    client sees its connection end; a new connection goes through whole."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await c.send_all(b"a" * 50)
        await sink.wait_for(lambda: len(sink.data) == 1 and len(sink.data[0]) == 50)
        proxy.apply("cut 300")
        await c.send_all(b"b" * 1000)
        await sink.wait_for(lambda: sink.eof[0])
        assert bytes(sink.data[0]) == b"a" * 50 + b"b" * 300
        with trio.fail_after(10):
            try:
                assert await c.receive_some(10) == b""
            except trio.BrokenResourceError:
                pass
        await c.aclose()
        assert proxy.cuts == 1
        c2 = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await c2.send_all(b"c" * 2000)
        await sink.wait_for(lambda: len(sink.data) == 2 and len(sink.data[1]) == 2000)
        await c2.aclose()
        nursery.cancel_scope.cancel()


async def test_cut_at_once_closes_every_connection() -> None:
    """``cut``: every open connection is closed on both sides at once."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        clients = [await trio.open_tcp_stream("127.0.0.1", proxy.port) for _ in range(3)]
        for c in clients:
            await c.send_all(b"hi")
        await sink.wait_for(lambda: len(sink.data) == 3 and all(len(d) == 2 for d in sink.data))
        proxy.cut()
        await sink.wait_for(lambda: all(sink.eof))
        for c in clients:
            with trio.fail_after(10):
                try:
                    assert await c.receive_some(10) == b""
                except trio.BrokenResourceError:
                    pass
            await c.aclose()
        nursery.cancel_scope.cancel()


async def test_blackhole_keeps_both_sockets_open_and_swallows_everything() -> None:
    """``blackhole``: bytes from either side vanish, and neither side sees its
    connection end (not even the client's close); after ``clear`` new bytes flow
    again on the same connection."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await c.send_all(b"before")
        await sink.wait_for(lambda: len(sink.data) == 1 and len(sink.data[0]) == 6)
        proxy.apply("blackhole")
        await c.send_all(b"swallowed" * 100)
        await sink.streams[0].send_all(b"also swallowed")
        with trio.move_on_after(1.0) as waited:
            await c.receive_some(100)
        assert waited.cancelled_caught  # nothing came back, and no EOF either
        assert bytes(sink.data[0]) == b"before" and not sink.eof[0]
        proxy.apply("clear")
        await c.send_all(b"after")
        await sink.wait_for(lambda: bytes(sink.data[0]).endswith(b"after"))
        assert bytes(sink.data[0]) == b"beforeafter"
        await c.aclose()
        await sink.wait_for(lambda: sink.eof[0])
        nursery.cancel_scope.cancel()


async def test_unreachable_target_closes_the_accepted_connection() -> None:
    """A target that refuses: the client's connection is closed, the proxy carries on."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    dead_port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy("127.0.0.1", dead_port)
        await nursery.start(proxy.serve)
        for _ in range(2):
            c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
            with trio.fail_after(10):
                try:
                    assert await c.receive_some(10) == b""
                except trio.BrokenResourceError:
                    pass
            await c.aclose()
        nursery.cancel_scope.cancel()


def test_setting_words() -> None:
    f = parse_setting("delay 50ms 20ms loss 5% rate 1mbit")
    assert f == Faults(delay=0.05, jitter=0.02, loss=0.05, rate=125000.0)
    assert parse_setting("loss 10%", base=f) == Faults(
        delay=0.05, jitter=0.02, loss=0.1, rate=125000.0
    )
    assert parse_setting("rto 1s") == Faults(rto=1.0)
    assert parse_setting("cut") == Cut(None, "to_server")
    assert parse_setting("cut 12 to_client") == Cut(12, "to_client")
    assert parse_setting("blackhole", base=f) == Faults(blackhole=True)
    assert parse_setting("clear", base=f) == Faults()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("delay fast", "delay"),
        ("loss 5", "percentage"),
        ("loss 101%", "percentage"),
        ("rate 0mbit", "rate"),
        ("rate 5furlongs", "rate"),
        ("cut sideways", "direction"),
        ("duplicate 5%", "duplicate"),
    ],
)
def test_bad_settings_are_refused_naming_the_word(text: str, needle: str) -> None:
    with pytest.raises(SettingError, match=needle):
        parse_setting(text)


async def test_standalone_proxy_takes_settings_on_stdin() -> None:
    """``python -m msgq_trio.scenario.faultproxy HOST:PORT`` prints its address, answers
    each stdin line ok/error, and forwards; a bad line does not end it."""
    async with trio.open_nursery() as nursery:
        sink = Sink()
        await nursery.start(sink.serve)
        # Popen with text pipes read in a worker thread: the process starts at once.
        proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "msgq_trio.scenario.faultproxy", f"127.0.0.1:{sink.port}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            first = await trio.to_thread.run_sync(proc.stdout.readline)
            assert first.startswith("listening tcp://127.0.0.1:")
            port = int(first.rsplit(":", 1)[1])
            for line, answer in (("bogus", "error"), ("delay 10ms", "ok delay 10ms")):
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                got = await trio.to_thread.run_sync(proc.stdout.readline)
                assert got.startswith(answer)
            c = await trio.open_tcp_stream("127.0.0.1", port)
            await c.send_all(b"through")
            await sink.wait_for(lambda: len(sink.data) == 1 and bytes(sink.data[0]) == b"through")
            await c.aclose()
            proc.stdin.close()
            assert await trio.to_thread.run_sync(proc.wait, 10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        nursery.cancel_scope.cancel()


# -- real brokers behind the proxy -------------------------------------------------------------
@pytest.fixture
def tcp_broker(short_tmp: Path) -> Iterator[Callable[[], tuple[Any, int]]]:
    """``start()`` runs ``msgq-trio serve`` with plain TCP on 127.0.0.1:0 (one token that
    may do anything, heartbeat 0.5 s x 3) and returns (the conftest BrokerProcess, its TCP port).
    Teardown is the conftest broker teardown (SIGTERM, exit 0, no traceback)."""
    started: list[Any] = []

    def start() -> tuple[Any, int]:
        n = len(started)
        cfg = short_tmp / f"p{n}.toml"
        cfg.write_text(
            "[tcp]\n"
            'listen = ["127.0.0.1:0"]\n'
            "insecure = true\n"
            f'tokens = {{ alice = "{hash_token(TOKEN)}" }}\n'
            f"heartbeat_interval = {HEARTBEAT_INTERVAL}\n"
            f"heartbeat_misses = {HEARTBEAT_MISSES}\n"
            "[[access.rule]]\n"
            'who = ["tcp:alice"]\n'
            'send = ["*"]\nsubscribe = ["*"]\ncall = ["*"]\n'
        )
        path = short_tmp / f"p{n}.sock"
        log_path = path.with_name(path.name + ".log")
        argv = _c.make_broker_argv(path, "--config", str(cfg))
        with open(log_path, "wb") as err:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL
            )
        bp = _c.BrokerProcess(path, proc, log_path, argv)
        started.append(bp)
        assert proc.stdout is not None
        reader = _c.LineReader(proc.stdout.fileno())
        deadline = time.monotonic() + _c.STARTUP_TIMEOUT
        while True:
            line = reader.readline(max(0.1, deadline - time.monotonic()))
            assert line is not None, f"broker exited:\n{bp.log()}"
            if "tcp://" in line:
                return bp, int(line.rsplit(":", 1)[1])

    yield start
    problems: list[str] = []
    for b in started:
        problems += _c._finish_broker(b)
    assert not problems, "\n".join(problems)


async def test_blackholed_tcp_client_is_detected_within_the_heartbeat_bound(tcp_broker) -> None:
    """A TCP client reaches the broker through the proxy, which then black-holes the
    connection (both sockets open, every byte swallowed: an unplugged cable). Both ends
    find out from heartbeats alone: the client's receive fails ConnectionLost
    heartbeat-timeout, and the broker drops the client (its group membership goes, the
    drop is logged), each within a bound of a few heartbeat intervals and not before
    the misses could be counted."""
    bp, port = tcp_broker()
    bound = HEARTBEAT_INTERVAL * (HEARTBEAT_MISSES + 1) + 8.0  # wide: a busy machine
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy("127.0.0.1", port)
        await nursery.start(proxy.serve)
        async with msgq_trio.connect(bp.path, name="observer") as observer:
            url = f"tcp://127.0.0.1:{proxy.port}"
            async with msgq_trio.connect(url, name="far", token=TOKEN) as far:
                await far.subscribe("Far")
                assert len(await observer.members("Far")) == 1
                proxy.apply("blackhole")
                t0 = trio.current_time()
                with trio.fail_after(bound):
                    with pytest.raises(ConnectionLost) as ei:
                        await far.receive()
                waited = trio.current_time() - t0
                assert ei.value.code == ErrorCode.HEARTBEAT_TIMEOUT
                # Silence must last (misses - 1) intervals before it can count as dead.
                assert waited >= HEARTBEAT_INTERVAL * (HEARTBEAT_MISSES - 1) - 0.1
            with trio.fail_after(bound):
                # Polled: membership lives in the broker process, nothing signals here.
                while True:
                    if not await observer.members("Far"):
                        break
                    await trio.sleep(0.1)
        assert proxy.accepted == 1 and proxy.cuts == 0  # no FIN/RST did the telling
        nursery.cancel_scope.cancel()
    bp.log_with("heartbeat", "tcp:alice@")


async def test_cut_mid_frame_delivers_nothing_half(tcp_broker) -> None:
    """A raw TCP client sends two whole messages and then a third, through the proxy,
    which cuts the connection in the middle of the third frame. The subscriber gets the
    two whole messages, nothing of the third, and the broker carries on serving a new
    connection through the same proxy."""
    bp, port = tcp_broker()
    async with trio.open_nursery() as nursery:
        proxy = FaultProxy("127.0.0.1", port)
        await nursery.start(proxy.serve)
        async with msgq_trio.connect(bp.path, name="sub") as sub:
            await sub.subscribe("cut.news")
            raw = _c.RawPeer(await trio.open_tcp_stream("127.0.0.1", proxy.port))
            welcome = await raw.hello(name="raw", token=TOKEN)
            assert welcome.type == FrameType.WELCOME

            def frame(body: object) -> bytes:
                return b"".join(
                    bytes(p)
                    for p in encode_frame(
                        FrameType.MESSAGE, target="cut.news", body=encode_cbor(body)
                    )
                )

            whole = frame("one") + frame("two")
            third = frame("three" * 200)
            proxy.cut(after=len(whole) + len(third) // 2)
            await raw.send_bytes(whole + third)
            got = []
            with trio.fail_after(10):
                for _ in range(2):
                    got.append((await sub.receive()).body)
            assert got == ["one", "two"]
            with trio.move_on_after(1.0):
                msg = await sub.receive()
                pytest.fail(f"a half-delivered frame was routed: {msg!r}")
            assert proxy.cuts == 1
            await raw.stream.aclose()
            url = f"tcp://127.0.0.1:{proxy.port}"
            async with msgq_trio.connect(url, name="again", token=TOKEN) as again:
                await again.send("cut.news", "four")
                with trio.fail_after(10):
                    assert (await sub.receive()).body == "four"
        nursery.cancel_scope.cancel()


async def test_connection_opened_into_a_blackhole_goes_through_when_it_ends() -> None:
    """A connection made during a black hole is held, unread; after ``clear`` its bytes
    arrive whole (late, not lost), as a retransmitted SYN would get through."""
    async with trio.open_nursery() as nursery:
        sink, proxy = await _setup(nursery)
        proxy.apply("blackhole")
        c = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await c.send_all(b"hello")
        await trio.sleep(0.5)
        assert sink.data == []  # not even connected to the target yet
        proxy.apply("clear")
        await sink.wait_for(lambda: len(sink.data) == 1 and bytes(sink.data[0]) == b"hello")
        await c.aclose()
        nursery.cancel_scope.cancel()


# -- scenario files: the proxy's keys ----------------------------------------------------------
_SCENARIO = """
summary = "s"
fault = "f"
broker_does = "b"
[broker]
{broker}
[[clients]]
name = "sub"
role = "subscriber"
[[faults]]
at = 1.0
action = "net-proxy"
{fault}
"""


@pytest.mark.parametrize(
    ("broker", "fault", "needle"),
    [
        ('listen = "tcp"\nproxy = true', 'proxy = "delay fast"', r"faults\[0\]\.proxy: delay"),
        ('listen = "tcp"\nproxy = true', "", r"faults\[0\]\.proxy: net-proxy needs it"),
        ('listen = "tcp"', 'proxy = "blackhole"', r"needs a broker with proxy = true"),
        ("proxy = true", 'proxy = "clear"', r"broker\.proxy: needs listen"),
    ],
)
def test_scenario_proxy_keys_are_checked(
    tmp_path: Path, broker: str, fault: str, needle: str
) -> None:
    from msgq_trio.scenario.model import ScenarioError, load_scenario

    p = tmp_path / "sc.toml"
    p.write_text(_SCENARIO.format(broker=broker, fault=fault))
    with pytest.raises(ScenarioError, match=needle):
        load_scenario(p)


def test_scenario_proxy_keys_are_read(tmp_path: Path) -> None:
    from msgq_trio.scenario.model import load_scenario

    p = tmp_path / "sc.toml"
    p.write_text(_SCENARIO.format(broker='listen = "tcp"\nproxy = true', fault='proxy = "cut 7"'))
    sc = load_scenario(p)
    assert sc.broker.proxy and sc.faults[0].proxy == "cut 7"
