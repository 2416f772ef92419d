"""Shared fixtures: real broker processes on short Unix socket paths, helper client
processes that a test can SIGKILL, and raw-socket peers for fault injection.

Nothing here is a mock: every broker is ``python -m msgq_trio serve`` in its own process,
every client talks to it through a real AF_UNIX socket.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from msgq_trio.protocol.codes import PROTOCOL_VERSION, FrameType
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame

PY = sys.executable
#: A broker's start (Python's start and imports, then listening) within this bound: on a
#: quiet machine it takes about a second, on one with many runnable processes per core
#: tens of seconds; only a broker that never starts waits this long.
STARTUP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


# -- bytecode compiled once, for every process the suite starts ---------------------------
def pytest_configure(config: pytest.Config) -> None:
    """Compile the checkout's bytecode once, before any worker starts (tests/precompile.py
    says why)."""
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the process that started it compiled already
    from precompile import compile_checkout

    compile_checkout()


# -- the order of files under -n N --dist loadfile (see tests/longest_first.py) -------------
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` hands out the longest files first (tests/longest_first.py);
    any other mode is pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from longest_first import LongestFirstScheduling

    return LongestFirstScheduling(config, log)


# -- what a test must leave as it found it ------------------------------------------------
@pytest.fixture(autouse=True)
def _sigint_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test that leaves SIGINT ignored or blocked in this worker process, and
    puts it back. Both are inherited by every process the worker starts later (an ignored
    signal survives exec, and so does the signal mask), so a later test's CLI child would
    not see Ctrl-C at all until it installs its own handler: the test that finds it is not
    the test that caused it. A Python-level handler (PySpark's, for one) is not inherited
    and is not checked."""
    before = signal.getsignal(signal.SIGINT)
    blocked_before = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    problems = []
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN and before != signal.SIG_IGN:
        signal.signal(signal.SIGINT, before)
        problems.append("left SIGINT ignored")
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []) and not blocked_before:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        problems.append("left SIGINT blocked")
    if problems:
        pytest.fail(f"{request.node.nodeid} {' and '.join(problems)} in the test process")


@pytest.fixture
def sigint_as_in_a_terminal() -> Iterator[None]:
    """SIGINT handled as in a program a person started from a terminal, for the duration
    of a test about Ctrl-C (for this process and the processes it starts): a suite
    started with SIGINT ignored (in the background of a non-interactive shell, under
    nohup) would pass that on, and a command started so rightly ignores Ctrl-C
    (msgq_trio/ops/interrupt.py)."""
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


# -- temporary directories with short paths (AF_UNIX paths are limited to ~107 bytes) ---------
@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory directly under /tmp, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="mq", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- reading lines from a child's stdout without blocking forever ---------------------------
class LineReader:
    """Reads lines from a pipe with a timeout (select + os.read, no buffered file object)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = b""
        self.eof = False

    def readline(self, timeout: float) -> str | None:
        """The next line without its newline, or None at EOF. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if self.eof:
                if self._buf:
                    line, self._buf = self._buf, b""
                    return line.decode(errors="replace")
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line within {timeout} s (buffered: {self._buf!r})")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                chunk = os.read(self._fd, 65536)
                if chunk:
                    self._buf += chunk
                else:
                    self.eof = True
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    async def areadline(self, timeout: float) -> str | None:
        """:meth:`readline` in a worker thread, so the test's trio tasks keep running."""
        return await trio.to_thread.run_sync(self.readline, timeout)


# -- broker processes -------------------------------------------------------------------------
class BrokerProcess:
    """A running ``msgq-trio serve`` child process.

    Attributes:
        path: the Unix socket it listens on.
        proc: the Popen object; ``pid`` its process id.
        expect_exit: set when the test stopped or killed it (teardown then checks nothing).
    """

    def __init__(
        self, path: Path, proc: subprocess.Popen[bytes], log_path: Path, argv: list[str]
    ) -> None:
        self.path = path
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path
        self.argv = argv
        self.expect_exit = False

    def log(self) -> str:
        """Everything the broker wrote to stderr so far (its log)."""
        return self.log_path.read_text(errors="replace")

    def log_with(self, *needles: str, timeout: float = 10.0) -> str:
        """The log once it contains every one of ``needles``: the broker writes its log
        from a listener thread, so a line about an event can land a little after the
        event is visible to a client. Fails (naming what is missing) after ``timeout``.
        A blocking wait of milliseconds: the broker is another process."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            missing = [n for n in needles if n not in text]
            if not missing:
                return text
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"broker log lacks {missing!r} after {timeout} s:\n"
                    + "\n".join(text.splitlines()[-30:])
                )
            time.sleep(0.02)

    def send_signal(self, sig: int) -> None:
        self.expect_exit = True
        self.proc.send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Send ``sig`` and wait for the exit status."""
        self.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> None:
        self.expect_exit = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STOP_TIMEOUT)

    def close_pipes(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def make_broker_argv(path: Path, *flags: str, log_level: str = "INFO") -> list[str]:
    """The command line of ``msgq-trio serve`` on ``path`` with extra flags."""
    return [PY, "-m", "msgq_trio", "--log-level", log_level, "serve", "--socket", str(path), *flags]


@pytest.fixture
def broker_argv() -> Callable[..., list[str]]:
    """``broker_argv(path, *flags)``: the broker command line, for tests that run it
    themselves (e.g. expecting it to refuse to start)."""
    return make_broker_argv


def launch_broker(
    path: Path, *flags: str, log_level: str = "INFO", prefix: tuple[str, ...] = ()
) -> BrokerProcess:
    """Start a broker process and wait until it prints that it is listening. ``prefix``
    is put before the command (``ip netns exec NS``: it execs, so the pid is the broker)."""
    log_path = path.with_name(path.name + ".log")
    argv = [*prefix, *make_broker_argv(path, *flags, log_level=log_level)]
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    bp = BrokerProcess(path, proc, log_path, argv)
    assert proc.stdout is not None
    reader = LineReader(proc.stdout.fileno())
    try:
        line = reader.readline(STARTUP_TIMEOUT)
    except TimeoutError:
        line = None
    if line is None or "listening" not in line:
        if proc.poll() is None:
            proc.kill()
        proc.wait(STOP_TIMEOUT)
        bp.close_pipes()
        raise RuntimeError(
            f"broker did not start (status {proc.returncode}, stdout {line!r}):\n{bp.log()}"
        )
    return bp


def _finish_broker(b: BrokerProcess) -> list[str]:
    """Teardown of one broker: SIGTERM, expect status 0 and the socket file removed."""
    problems: list[str] = []
    try:
        if b.proc.poll() is None:
            if b.expect_exit:
                b.proc.kill()
                b.proc.wait(STOP_TIMEOUT)
                return problems
            b.proc.send_signal(signal.SIGTERM)
            try:
                rc = b.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                b.proc.kill()
                b.proc.wait(STOP_TIMEOUT)
                problems.append(f"broker {b.pid} ignored SIGTERM for {STOP_TIMEOUT} s")
                return problems
            if rc != 0:
                problems.append(
                    f"broker {b.pid} exited with status {rc} after SIGTERM:\n{b.log()[-3000:]}"
                )
            if os.path.lexists(b.path):
                problems.append(f"broker {b.pid} left its socket file {b.path} behind")
        elif not b.expect_exit:
            problems.append(
                f"broker {b.pid} died during the test with status "
                f"{b.proc.returncode}:\n{b.log()[-3000:]}"
            )
    finally:
        b.close_pipes()
    log = b.log()
    for marker in ("Traceback", "internal error"):
        if marker in log:
            problems.append(
                f"broker {b.pid} logged {marker!r} (a bug in the broker):\n{log[-3000:]}"
            )
            break
    return problems


@pytest.fixture
def broker_factory(short_tmp: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """``start(*flags, path=None, prefix=())`` starts a broker with extra ``serve`` flags
    (``prefix``: a command the broker runs under, e.g. ``ip netns exec NS``).

    Teardown sends SIGTERM to every broker still running and asserts exit status 0 and
    that the socket file is gone; a broker the test stopped or killed itself is not checked
    again, one that died on its own fails the test. A broker whose log shows a traceback or
    an "internal error" (a bug confined to one connection) fails the test too.
    """
    started: list[BrokerProcess] = []

    def start(
        *flags: str, path: Path | None = None, log_level: str = "INFO", prefix: tuple[str, ...] = ()
    ) -> BrokerProcess:
        p = path if path is not None else short_tmp / f"b{len(started)}.sock"
        b = launch_broker(p, *flags, log_level=log_level, prefix=prefix)
        started.append(b)
        return b

    yield start
    problems: list[str] = []
    for b in started:
        problems += _finish_broker(b)
    assert not problems, "\n".join(problems)


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A broker process with default limits on a fresh socket."""
    return broker_factory()


# -- helper client processes (so a test can SIGKILL a real client) ----------------------------
CLIENT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from contextlib import AsyncExitStack
    import trio
    import msgq_trio

    cfg = json.loads(sys.argv[1])

    def out(*parts):
        print(*parts, flush=True)

    def make_handler(bus, cmd, behaviour):
        if behaviour == "echo":
            def echo(params):
                return {"lname": bus.lname, "params": params}
            return echo
        if behaviour == "hang":
            async def hang(params):
                out("got", bus.lname, cmd, json.dumps(params))
                await trio.sleep_forever()
            return hang
        if behaviour == "pid":
            return lambda params: os.getpid()
        if behaviour == "notify":  # a message to params["to"], then the answer
            async def notify(params):
                await bus.send(params["to"], {"note": params["n"]})
                return params
            return notify
        if behaviour == "notify-then-wait":  # as notify, the answer 0.5 s after the message
            async def notify_then_wait(params):
                await bus.send(params["to"], {"note": params["n"]})
                await trio.sleep(0.5)
                return params
            return notify_then_wait
        if behaviour == "callback":  # calls params["to"]'s ping, answers with its result
            async def callback(params):
                return {"pong": await bus.call(params["to"], "ping", params["n"])}
            return callback
        raise SystemExit(f"unknown behaviour {behaviour!r}")

    async def main():
        async with AsyncExitStack() as stack:
            buses = []
            for _ in range(cfg.get("count", 1)):
                bus = await stack.enter_async_context(
                    msgq_trio.connect(cfg["socket"], name=cfg.get("name", "helper")))
                buses.append(bus)
                for cmd, behaviour in cfg.get("commands", {}).items():
                    bus.add_command(cmd, make_handler(bus, cmd, behaviour))
                for g in cfg.get("groups", []):
                    await bus.subscribe(g)
            out(json.dumps({"pid": os.getpid(), "lnames": [b.lname for b in buses]}))
            out("ready")
            flood = cfg.get("flood")
            if flood:  # send to flood["target"] without end: a sender the broker must pause
                chunk = bytes(flood["size"])
                while True:
                    await buses[0].send(flood["target"], None, attachments=[chunk])
            await trio.sleep_forever()

    trio.run(main)
""")


class ClientProcess:
    """A helper client process: ``count`` connections, each subscribed to ``groups`` and
    serving ``commands`` ({command: "echo" | "hang" | "pid" | "notify" |
    "notify-then-wait" | "callback"}).

    ``hang`` handlers print ``got <lname> <command> <params-json>`` when a request arrives.
    """

    def __init__(
        self, proc: subprocess.Popen[bytes], lnames: list[str], reader: LineReader, log_path: Path
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.lnames = lnames
        self.reader = reader
        self.log_path = log_path

    @property
    def lname(self) -> str:
        return self.lnames[0]

    def readline(self, timeout: float = 10.0) -> str | None:
        return self.reader.readline(timeout)

    async def areadline(self, timeout: float = 10.0) -> str | None:
        return await self.reader.areadline(timeout)

    def sigkill(self) -> None:
        """SIGKILL the process and reap it (a real crash: no GOODBYE, sockets just close)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(STOP_TIMEOUT)

    def close(self) -> None:
        self.sigkill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def spawn_client(
    broker_factory: Callable[..., BrokerProcess], short_tmp: Path
) -> Iterator[Callable[..., ClientProcess]]:
    """``spawn(socket, name=..., groups=(), commands={}, count=1, flood=None)`` starts a
    helper client process and waits until all its connections are subscribed and serving.
    With ``flood={"target": T, "size": N}`` its first connection then sends N-byte
    attachments to T without end.

    Depends on ``broker_factory`` so that helpers are killed before brokers are stopped.
    """
    procs: list[ClientProcess] = []

    def spawn(
        socket: Path,
        *,
        name: str = "helper",
        groups: tuple[str, ...] | list[str] = (),
        commands: dict[str, str] | None = None,
        count: int = 1,
        flood: dict[str, Any] | None = None,
        timeout: float = 30.0,
    ) -> ClientProcess:
        cfg = {
            "socket": str(socket),
            "name": name,
            "groups": list(groups),
            "commands": commands or {},
            "count": count,
            "flood": flood,
        }
        log_path = short_tmp / f"client{len(procs)}.log"
        with open(log_path, "wb") as err:
            proc = subprocess.Popen(
                [PY, "-c", CLIENT_SCRIPT, json.dumps(cfg)],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        assert proc.stdout is not None
        reader = LineReader(proc.stdout.fileno())
        cp = ClientProcess(proc, [], reader, log_path)
        procs.append(cp)
        try:
            info = reader.readline(timeout)
            ready = reader.readline(timeout)
        except TimeoutError:
            info = ready = None
        if ready != "ready" or info is None:
            raise RuntimeError(
                f"helper client did not start: {info!r} {ready!r}\n"
                f"{log_path.read_text(errors='replace')}"
            )
        cp.lnames = json.loads(info)["lnames"]
        return cp

    yield spawn
    for cp in procs:
        cp.close()


async def _call_paused_then_kill(
    caller: Any, flooder: ClientProcess, timeout: float
) -> list[BaseException]:
    """Wait until the broker has paused a reader (its stats: no event announces a
    pause), call ``flooder``'s ``work`` command (a ``hang`` handler), SIGKILL the flooder
    once the request reached it, and return what the call raised."""
    with trio.fail_after(10):
        while (await caller.call("msgq", "stats"))["paused_readers"] < 1:  # noqa: ASYNC110
            await trio.sleep(0.02)
    outcome: list[BaseException] = []

    async def call() -> None:
        try:
            await caller.call(flooder.lname, "work", {}, timeout=timeout)
        except Exception as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        assert await flooder.areadline() == f"got {flooder.lname} work {{}}"
        assert (await caller.call("msgq", "stats"))["paused_readers"] == 1
        flooder.sigkill()
    return outcome


@pytest.fixture
def call_paused_then_kill() -> Callable[..., Any]:
    """``await call_paused_then_kill(caller_bus, flooder, timeout)``: see
    :func:`_call_paused_then_kill` (a flooder is a ``spawn_client(..., flood=...)``)."""
    return _call_paused_then_kill


# -- raw-socket peers (fault injection below the client library) ------------------------------
class RawPeer:
    """A client that speaks the wire protocol by hand over a real socket.

    It can send anything: forged source sections, absurd length prefixes, garbage.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = FrameParser(0xFFFFFFFF)
        self.lname = ""
        self.eof = False

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_frame(self, ftype: int, **kw: Any) -> None:
        await self.stream.send_all(b"".join(bytes(p) for p in encode_frame(ftype, **kw)))

    async def hello(
        self, name: str = "raw", version: int = PROTOCOL_VERSION, **extra: Any
    ) -> Frame:
        """Send HELLO; return the broker's answer (WELCOME or ERROR)."""
        await self.send_frame(
            FrameType.HELLO, header=encode_cbor({"version": version, "name": name, **extra})
        )
        frame = await self.receive_frame()
        assert frame is not None, "broker closed the connection instead of answering HELLO"
        if frame.type == FrameType.WELCOME:
            self.lname = str(frame.header()["lname"])
        return frame

    async def subscribe(self, group: str, request_id: int = 1) -> None:
        """Ask the broker to subscribe this peer to ``group``; the next frame must be the
        REPLY (call it before anything else can arrive)."""
        await self.send_frame(
            FrameType.REQUEST,
            target="msgq",
            request_id=request_id,
            header=encode_cbor({"cmd": "subscribe"}),
            body=encode_cbor({"group": group}),
        )
        reply = await self.receive_frame()
        assert reply is not None and reply.type == FrameType.REPLY, reply
        assert reply.request_id == request_id

    async def receive_frame(self, timeout: float = 10.0) -> Frame | None:
        """The next frame, or None at EOF. Fails the test after ``timeout``."""
        with trio.fail_after(timeout):
            while True:
                f = self.parser.next_frame()
                if f is not None:
                    return f
                if self.eof:
                    return None
                try:
                    data = await self.stream.receive_some(1 << 20)
                except trio.BrokenResourceError:  # ECONNRESET counts as the end
                    data = b""
                if not data:
                    self.eof = True
                else:
                    self.parser.feed(data)

    async def frames_until_eof(self, timeout: float = 10.0) -> list[Frame]:
        """Every frame until the broker closes the connection (fails after ``timeout``)."""
        out: list[Frame] = []
        with trio.fail_after(timeout):
            while True:
                f = await self.receive_frame(timeout=timeout)
                if f is None:
                    return out
                out.append(f)

    async def aclose(self) -> None:
        await self.stream.aclose()


@asynccontextmanager
async def open_raw_peer(path: Path) -> AsyncIterator[RawPeer]:
    stream = await trio.open_unix_socket(str(path))
    peer = RawPeer(stream)
    try:
        yield peer
    finally:
        await peer.aclose()


@pytest.fixture
def raw_peer() -> Callable[[Path], Any]:
    """``async with raw_peer(path) as peer:`` opens a raw-socket connection to a broker."""
    return open_raw_peer
