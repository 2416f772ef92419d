"""End to end over TCP: real broker processes listening on 127.0.0.1 ephemeral ports
(plain TCP with ``tcp.insecure`` and TLS with certificates made by trustme in the test).

Authentication (no token, wrong token, valid token, client certificates, bad
certificates), the access policy (send, subscribe, call, consume refused with
``forbidden`` and nothing routed; Unix clients unaffected by TCP-only rules) and
heartbeats (a SIGSTOPped TCP client is dropped and its callers get recipient-gone; a
SIGSTOPped broker is detected by the TCP client).
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

import msgq_trio
from msgq_trio import ConnectError, ConnectionLost, Forbidden, RecipientGone, UsageError
from msgq_trio.core.access import hash_token
from msgq_trio.protocol.codes import ErrorCode, FrameType
from msgq_trio.protocol.framing import encode_cbor


def _shared() -> Any:
    """tests/conftest.py as a module: its broker-process helpers (imported by path,
    since "conftest" names a different module when tests/ops runs in the same session)."""
    import importlib.util
    import sys

    name = "msgq_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "conftest.py"
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_c = _shared()
STARTUP_TIMEOUT = _c.STARTUP_TIMEOUT
BrokerProcess = _c.BrokerProcess
LineReader = _c.LineReader
RawPeer = _c.RawPeer
_finish_broker = _c._finish_broker
make_broker_argv = _c.make_broker_argv

ALICE = "alice-token-4f1d2c"  # may do what the rules below grant
MALLORY = "mallory-token-9a8b7c"  # authenticated, but no rule names her


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


class TcpBroker:
    """A broker process plus its TCP URL (``tcp://`` or ``tls://127.0.0.1:PORT``)."""

    def __init__(self, bp: BrokerProcess, url: str) -> None:
        self.bp = bp
        self.url = url
        self.path = bp.path

    def log(self) -> str:
        return self.bp.log()

    def log_with(self, *needles: str, timeout: float = 10.0) -> str:
        return self.bp.log_with(*needles, timeout=timeout)


DEFAULT_RULES: list[dict[str, Any]] = [
    {
        "who": ["tcp:alice"],
        "send": ["ok.*", "l.*"],
        "subscribe": ["ok.*"],
        "call": ["Svc", "msgq-queue"],
        "consume": ["jobs"],
        "produce": ["jobs"],
    }
]


@pytest.fixture
def tcp_broker(short_tmp: Path) -> Iterator[Callable[..., TcpBroker]]:
    """``start(rules=DEFAULT_RULES, tls=None, **tcp)`` runs ``msgq-trio serve`` with a
    configuration file: TCP on 127.0.0.1:0, tokens for alice and mallory, the rules as
    ``[[access.rule]]``, heartbeat 0.5 s x 3. Teardown is the conftest broker teardown
    (SIGTERM, exit 0, socket removed, no traceback in the log)."""
    started: list[BrokerProcess] = []

    def start(rules: list[dict[str, Any]] | None = None, **tcp: Any) -> TcpBroker:
        n = len(started)
        settings: dict[str, Any] = {
            "listen": ["127.0.0.1:0"],
            "tokens": {"alice": hash_token(ALICE), "mallory": hash_token(MALLORY)},
            "heartbeat_interval": 0.5,
            "heartbeat_misses": 3,
        }
        settings.update(tcp)
        if "certfile" not in settings:
            settings["insecure"] = True
        lines = ["[tcp]"] + [f"{k} = {toml_value(v)}" for k, v in settings.items()]
        for rule in DEFAULT_RULES if rules is None else rules:
            lines.append("[[access.rule]]")
            lines += [f"{k} = {toml_value(v)}" for k, v in rule.items()]
        cfg = short_tmp / f"t{n}.toml"
        cfg.write_text("\n".join(lines) + "\n")
        path = short_tmp / f"t{n}.sock"
        log_path = path.with_name(path.name + ".log")
        argv = make_broker_argv(path, "--config", str(cfg))
        with open(log_path, "wb") as err:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL
            )
        bp = BrokerProcess(path, proc, log_path, argv)
        started.append(bp)
        assert proc.stdout is not None
        reader = LineReader(proc.stdout.fileno())
        url = None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while url is None:
            line = reader.readline(max(0.1, deadline - time.monotonic()))
            assert line is not None, f"broker exited:\n{bp.log()}"
            if "://" in line:
                url = line.rsplit(" ", 1)[1]
        return TcpBroker(bp, url)

    yield start
    problems: list[str] = []
    for b in started:
        problems += _finish_broker(b)
    assert not problems, "\n".join(problems)


async def open_raw_tcp(url: str) -> RawPeer:
    host, _, port = url.partition("://")[2].rpartition(":")
    return RawPeer(await trio.open_tcp_stream(host, int(port)))


# -- authentication ------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "wrong-token-123"])
async def test_tcp_without_valid_credentials_is_refused_before_routing(tcp_broker, token) -> None:
    """No token / a wrong one: ConnectError code unauthenticated; a raw client that
    pipelines a MESSAGE right behind its HELLO gets ERROR unauthenticated and the message
    reaches nobody; the refusal is logged at WARNING with the address, never the token."""
    b = tcp_broker()
    async with msgq_trio.connect(b.path, name="sub") as sub:
        await sub.subscribe("ok.news")
        with pytest.raises(ConnectError) as ei:
            async with msgq_trio.connect(b.url, name="anon", token=token):
                pass
        assert ei.value.code == "unauthenticated"
        raw = await open_raw_tcp(b.url)
        extra = {} if token is None else {"token": token}
        hello = encode_cbor({"version": 1, "name": "raw", **extra})
        await raw.send_bytes(
            b"".join(
                bytes(p)
                for p in msgq_trio.protocol.framing.encode_frame(FrameType.HELLO, header=hello)
            )
            + b"".join(
                bytes(p)
                for p in msgq_trio.protocol.framing.encode_frame(
                    FrameType.MESSAGE, target="ok.news", body=encode_cbor("sneaked")
                )
            )
        )
        answer = await raw.receive_frame()
        assert answer is not None and answer.type == FrameType.ERROR
        assert answer.header()["code"] == "unauthenticated"
        assert await raw.receive_frame() is None  # closed
        await raw.stream.aclose()
        with trio.move_on_after(0.5):
            msg = await sub.receive()
            pytest.fail(f"an unauthenticated client's message was routed: {msg!r}")
    log = b.log_with("refusing tcp client 127.0.0.1:")
    assert "WARNING" in log
    if token:
        assert token not in log


async def test_valid_token_works_end_to_end(tcp_broker) -> None:
    """A TCP client with a valid token: WELCOME names its identity, RPC both ways,
    messages both ways, subscriptions; others see it with its stamp."""
    b = tcp_broker()
    async with (
        msgq_trio.connect(b.path, name="svc") as svc,
        msgq_trio.connect(b.url, name="remote", token=ALICE) as remote,
    ):
        assert remote.session.welcome["identity"] == "tcp:alice"
        await svc.subscribe("Svc")
        svc.add_command("add", lambda p: sum(p))  # noqa: PLW0108 (sum takes 2 params)
        remote.add_command("mul", lambda p: p[0] * p[1])
        assert await remote.call("Svc", "add", [1, 2, 3]) == 6
        assert await svc.call(remote.lname, "mul", [6, 7]) == 42
        await remote.subscribe("ok.feed")
        await svc.send("ok.feed", {"n": 1})
        got = await remote.receive(5)
        assert got.body == {"n": 1} and got.sender == svc.lname
        await svc.subscribe("ok.back")
        for i in range(2000):  # a burst: the run fast path with an access check
            await remote.send("ok.back", i)
        seen = [(await svc.receive(10)).body for _ in range(2000)]
        assert seen == list(range(2000))
        members = await svc.members("ok.feed")
        assert [m.lname for m in members] == [remote.lname]


async def test_forbidden_send_subscribe_call_consume(tcp_broker) -> None:
    """A valid token without the grant: subscribe, call and the queue-consumer commands
    on a queue not granted answer Forbidden (nothing reaches the service); a one-way
    send to a group not granted drops the client with ERROR forbidden and reaches nobody.
    The denials are logged with the client's identity."""
    b = tcp_broker()
    calls: list[Any] = []
    async with msgq_trio.connect(b.path, name="svc") as svc:
        await svc.subscribe("Secret")
        await svc.subscribe("msgq-queue")
        await svc.subscribe("ok.public")

        def record(params: Any, request: msgq_trio.Message) -> str:
            calls.append((request.command, params))
            return "done"

        svc.set_default_handler(record)
        async with msgq_trio.connect(b.url, name="remote", token=ALICE) as remote:
            with pytest.raises(Forbidden):
                await remote.subscribe("Secret")
            with pytest.raises(Forbidden):
                await remote.call("Secret", "anything")
            with pytest.raises(Forbidden):
                await remote.call("msgq-queue", "fetch", {"queue": "payroll", "n": 1})
            with pytest.raises(Forbidden):
                await remote.call("msgq-queue", "consume", {"queue": "payroll"})
            with pytest.raises(Forbidden):
                await remote.call("msgq-queue", "put", {"queue": "payroll", "seq": 1})
            for cmd in ("send", "peek", "purge"):  # produce / consume / consume
                with pytest.raises(Forbidden):
                    await remote.call("msgq-queue", cmd, {"queue": "payroll"})
            # ...while the granted queue passes through to the service.
            assert await remote.call("msgq-queue", "fetch", {"queue": "jobs", "n": 1}) == "done"
            assert calls == [("fetch", {"queue": "jobs", "n": 1})]
            with pytest.raises(Forbidden):
                await remote.members("Secret")
            await remote.send("Secret", "leak")
            with pytest.raises(ConnectionLost) as ei:
                await remote.receive(5)
            assert ei.value.code == "forbidden"
        with trio.move_on_after(0.5):
            msg = await svc.receive()
            pytest.fail(f"a forbidden message was routed: {msg!r}")
        assert len(calls) == 1
    whats = (
        "subscribe to 'Secret'",
        "call to 'Secret'",
        "consume (queue command 'fetch') on 'payroll'",
        "send to 'Secret'",
    )
    log = b.log_with(*whats)
    for what in whats:
        assert "tcp:alice@127.0.0.1:" in log and what in log, what


async def test_policy_reload_drops_clients_holding_revoked_memberships(tcp_broker) -> None:
    """SIGHUP with rules that no longer let alice subscribe to ok.news: her connection
    that holds that membership is dropped with ERROR forbidden naming the revoked grant
    (and the log names her); her other connection, whose membership the new rules still
    cover, keeps working, and the group no longer lists the dropped one."""
    b = tcp_broker()
    async with (
        msgq_trio.connect(b.url, name="news", token=ALICE) as news,
        msgq_trio.connect(b.url, name="other", token=ALICE) as other,
        msgq_trio.connect(b.path, name="local") as local,
    ):
        await news.subscribe("ok.news")
        await other.subscribe("ok.other")
        assert [m.lname for m in await local.members("ok.news")] == [news.lname]
        cfg = trio.Path(b.bp.argv[b.bp.argv.index("--config") + 1])
        text = await cfg.read_text()
        assert 'subscribe = ["ok.*"]' in text
        await cfg.write_text(text.replace('subscribe = ["ok.*"]', 'subscribe = ["ok.other"]'))
        b.bp.proc.send_signal(signal.SIGHUP)
        with pytest.raises(ConnectionLost) as ei:
            await news.receive(10)
        assert ei.value.code == "forbidden"
        assert "subscribe to 'ok.news'" in str(ei.value) and "tcp:alice" in str(ei.value)
        # The broker removed the membership before it sent the ERROR (same core step).
        assert await local.members("ok.news") == []
        # The untouched connection still receives what it subscribed to.
        await local.send("ok.other", "still here")
        msg = await other.receive(5)
        assert msg.body == "still here"
        with pytest.raises(Forbidden):
            await other.subscribe("ok.news")
    b.log_with("tcp:alice@127.0.0.1:", "no longer allows tcp:alice")


async def test_identity_without_rules_gets_nothing(tcp_broker) -> None:
    """An authenticated TCP identity that no rule names may only ping and ask the
    version: the TCP default is deny."""
    b = tcp_broker()
    async with (
        msgq_trio.connect(b.path, name="svc") as svc,
        msgq_trio.connect(b.url, name="m", token=MALLORY) as m,
    ):
        await svc.subscribe("ok.x")
        assert (await m.version())["protocol"] == 1
        with pytest.raises(Forbidden):
            await m.subscribe("ok.x")
        with pytest.raises(Forbidden):
            await m.call("ok.x", "c")


async def test_unix_clients_unaffected_by_tcp_only_policy(tcp_broker) -> None:
    """Rules that name only TCP identities leave Unix clients with everything."""
    b = tcp_broker()
    async with msgq_trio.connect(b.path, name="a") as a, msgq_trio.connect(b.path, name="c") as c:
        await a.subscribe("Secret")
        a.add_command("echo", lambda p: p)
        assert await c.call("Secret", "echo", 5) == 5
        await c.send("Secret", "hi")
        assert (await a.receive(5)).body == "hi"
        assert await c.subscribe("anything.at.all")


LOCAL_NO_BIND = {"who": ["unix:*"], "send": ["*"], "subscribe": ["*"], "call": ["*"]}


@pytest.mark.parametrize(
    ("rules", "may_bind"),
    [
        pytest.param([], {"G", "H"}, id="no-policy"),
        pytest.param(DEFAULT_RULES, {"G", "H"}, id="tcp-only-policy"),
        pytest.param([LOCAL_NO_BIND], set(), id="local-rule-without-bind"),
        pytest.param([{**LOCAL_NO_BIND, "bind": ["G"]}], {"G"}, id="local-rule-bind-G"),
    ],
)
async def test_bind_is_open_without_a_policy_and_needs_a_grant_with_one(
    tcp_broker, rules: list[dict[str, Any]], may_bind: set[str]
) -> None:
    """docs/SECURITY.md's threat model: without a policy (or with one that names no local
    identity) any local client may bind any group and so divert its messages from the
    members; a local client a rule names may bind only the groups its ``bind`` grant
    lists, and a refused bind is answered Forbidden, logged with its identity, and leaves
    the traffic with the members."""
    b = tcp_broker(rules=rules)
    async with (
        msgq_trio.connect(b.path, name="member") as member,
        msgq_trio.connect(b.path, name="binder") as binder,
        msgq_trio.connect(b.path, name="sender") as sender,
    ):
        for g in ("G", "H", "End"):
            await member.subscribe(g)
        for g in ("G", "H"):
            if g in may_bind:
                assert await binder.call("msgq", "bind", {"group": g}) is True
            else:
                with pytest.raises(Forbidden, match=f"bind.*{g}"):
                    await binder.call("msgq", "bind", {"group": g})
        for g in ("G", "H", "End"):
            await sender.send(g, g)
        got: list[str] = []
        with trio.fail_after(10):
            while not got or got[-1] != "End":
                got.append((await member.receive()).body)
        assert got == [g for g in ("G", "H") if g not in may_bind] + ["End"]
        for g in sorted(may_bind):
            assert (await binder.receive(5)).body == g
    # The broker's log is written by a thread of its own: wait for the lines.
    want = [f"bind {g!r} is not allowed for unix:" for g in sorted({"G", "H"} - may_bind)]
    with trio.fail_after(10):
        while not all(w in b.log() for w in want):  # noqa: ASYNC110
            await trio.sleep(0.05)
    for w in want:
        line = next(ln for ln in b.log().splitlines() if w in ln)
        assert f"forbidden: {binder.lname} (name='binder'" in line, line


async def test_control_commands_need_a_control_grant(tcp_broker) -> None:
    """TCP clients may not use control commands unless a rule grants control."""
    b = tcp_broker(rules=[*DEFAULT_RULES, {"who": ["tcp:mallory"], "control": True}])
    async with (
        msgq_trio.connect(b.url, name="r", token=ALICE) as r,
        msgq_trio.connect(b.url, name="m", token=MALLORY) as m,
    ):
        with pytest.raises(Forbidden, match="tcp:alice"):
            await r.call("msgq", "clients")
        rows = await m.call("msgq", "clients")
        assert {row["lname"] for row in rows} >= {r.lname, m.lname}


# -- TLS -----------------------------------------------------------------------------------
@pytest.fixture
def pki(short_tmp: Path) -> dict[str, Any]:
    """A CA, a broker certificate for 127.0.0.1, a client certificate (CN=carol) from the
    same CA, and one from a CA the broker does not trust."""
    ca = trustme.CA()
    other = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.private_key_and_cert_chain_pem.write_to_path(str(short_tmp / "server.pem"))
    ca.cert_pem.write_to_path(str(short_tmp / "ca.pem"))
    return {
        "ca": ca,
        "certfile": str(short_tmp / "server.pem"),
        "client_ca": str(short_tmp / "ca.pem"),
        "carol": ca.issue_cert("carol@example", common_name="carol"),
        "eve": other.issue_cert("eve@example", common_name="carol"),
        "other": other,
    }


def client_ctx(ca: trustme.CA, cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(ctx)
    if cert is not None:
        cert.configure_cert(ctx)
    return ctx


async def test_tls_token_and_client_certificate(tcp_broker, pki) -> None:
    """Over TLS: a token works; a client certificate from the trusted CA authenticates
    as its CN (carol, granted by a rule); a certificate from another CA fails the
    handshake; a client that does not trust the broker's certificate refuses it."""
    rules = [*DEFAULT_RULES, {"who": ["tcp:carol"], "call": ["Svc"]}]
    b = tcp_broker(
        rules=rules, certfile=pki["certfile"], keyfile=pki["certfile"], client_ca=pki["client_ca"]
    )
    assert b.url.startswith("tls://")
    async with msgq_trio.connect(b.path, name="svc") as svc:
        await svc.subscribe("Svc")
        svc.add_command("who", lambda _p, req: req.sender_name)
        async with msgq_trio.connect(
            b.url, name="tok", token=ALICE, ssl_context=client_ctx(pki["ca"])
        ) as t:
            assert await t.call("Svc", "who") == "tok"
            # No busy polling over TLS: the copy tasks could not run while a call polled.
            assert t._poller.limit == 0.0
        async with msgq_trio.connect(
            b.url, name="cert", ssl_context=client_ctx(pki["ca"], pki["carol"])
        ) as c:
            assert c.session.welcome["identity"] == "tcp:carol"
            assert await c.call("Svc", "who") == "cert"
        with pytest.raises(ConnectError):
            async with msgq_trio.connect(
                b.url, name="eve", ssl_context=client_ctx(pki["ca"], pki["eve"])
            ):
                pass
        with pytest.raises(ConnectError) as ei:
            async with msgq_trio.connect(
                b.url, name="x", token=ALICE, ssl_context=client_ctx(pki["other"])
            ):
                pass
        assert "TLS" in str(ei.value)
        with pytest.raises(ConnectError) as ei:
            async with msgq_trio.connect(b.url, name="notoken", ssl_context=client_ctx(pki["ca"])):
                pass
        assert ei.value.code == "unauthenticated"
    b.log_with("TLS handshake failed")


async def test_tls_trust_and_client_certificate_from_the_environment(
    tcp_broker, pki, short_tmp: Path, monkeypatch
) -> None:
    """Without ``ssl_context``, ``connect`` trusts ``$MSGQ_TRIO_TLS_CA`` and presents
    ``$MSGQ_TRIO_TLS_CERT`` (as the command line does): a program started with only
    environment variables connects; without the CA it refuses the broker's certificate;
    a CA file that cannot be loaded is the caller's error, named."""
    rules = [*DEFAULT_RULES, {"who": ["tcp:carol"], "call": ["Svc"]}]
    b = tcp_broker(
        rules=rules, certfile=pki["certfile"], keyfile=pki["certfile"], client_ca=pki["client_ca"]
    )
    with pytest.raises(ConnectError) as ei:
        async with msgq_trio.connect(b.url, name="x", token=ALICE):
            pass
    assert "TLS" in str(ei.value)
    monkeypatch.setenv("MSGQ_TRIO_TLS_CA", pki["client_ca"])
    async with msgq_trio.connect(b.url, name="tok", token=ALICE) as t:
        assert t.session.welcome["identity"] == "tcp:alice"
    carol = short_tmp / "carol.pem"
    pki["carol"].private_key_and_cert_chain_pem.write_to_path(str(carol))
    monkeypatch.setenv("MSGQ_TRIO_TLS_CERT", str(carol))
    async with msgq_trio.connect(b.url, name="cert") as c:
        assert c.session.welcome["identity"] == "tcp:carol"
    monkeypatch.setenv("MSGQ_TRIO_TLS_CA", str(short_tmp / "absent.pem"))
    with pytest.raises(UsageError, match=r"MSGQ_TRIO_TLS_CA .*absent\.pem"):
        async with msgq_trio.connect(b.url, name="y", token=ALICE):
            pass


# -- heartbeats ----------------------------------------------------------------------------
async def test_sigstopped_tcp_client_dropped_and_its_calls_fail(
    tcp_broker, spawn_client, monkeypatch
) -> None:
    """A TCP client process that stops (SIGSTOP: no FIN, no RST) is dropped after
    heartbeat_misses x heartbeat_interval (3 x 0.5 s); the call it was serving fails
    RecipientGone for the caller, as on a Unix disconnect."""
    b = tcp_broker(rules=[{"who": ["tcp:alice"], "subscribe": ["*"], "send": ["*"], "call": ["*"]}])
    monkeypatch.setenv("MSGQ_TRIO_TOKEN", ALICE)
    helper = spawn_client(b.url, name="stopped", groups=["Hang"], commands={"h": "hang"})
    async with msgq_trio.connect(b.path, name="caller") as caller:
        async with trio.open_nursery() as nursery:
            outcome: list[BaseException] = []
            failed = trio.Event()

            async def call() -> None:
                try:
                    await caller.call("Hang", "h", 1)
                except RecipientGone as exc:
                    outcome.append(exc)
                failed.set()

            nursery.start_soon(call)
            assert (await helper.areadline()).startswith("got ")  # type: ignore[union-attr]
            os.kill(helper.pid, signal.SIGSTOP)
            try:
                t0 = trio.current_time()
                with trio.fail_after(10):
                    await failed.wait()
                waited = trio.current_time() - t0
            finally:
                os.kill(helper.pid, signal.SIGCONT)
        assert isinstance(outcome[0], RecipientGone)
        assert waited >= 1.0  # not before the misses were counted (3 x 0.5 s)
    b.log_with("heartbeat", "tcp:alice@")


async def test_tcp_sender_killed_while_paused_fails_its_callers_fast(
    tcp_broker, spawn_client, call_paused_then_kill, monkeypatch
) -> None:
    """Over TCP, as on the Unix socket: a client the broker has paused (it floods a
    stopped subscriber) is SIGKILLed with a call pending on it. Its FIN sits behind the
    data the broker is not reading, and heartbeats leave a paused client alone, yet the
    caller gets recipient-gone within the call's 5 s (without the hang-up poll the
    broker would see the FIN only after slow_consumer_timeout, 10 s, drops the
    subscriber)."""
    b = tcp_broker(rules=[{"who": ["tcp:alice"], "subscribe": ["*"], "send": ["*"], "call": ["*"]}])
    monkeypatch.setenv("MSGQ_TRIO_TOKEN", ALICE)
    sink = spawn_client(b.path, name="sink", groups=["Sink"])
    os.kill(sink.pid, signal.SIGSTOP)
    try:
        flooder = spawn_client(
            b.url,
            name="flooder",
            commands={"work": "hang"},
            flood={"target": "Sink", "size": 65536},
        )
        async with msgq_trio.connect(b.path, name="caller") as caller:
            outcome = await call_paused_then_kill(caller, flooder, timeout=5)
            assert [type(e) for e in outcome] == [RecipientGone]
    finally:
        os.kill(sink.pid, signal.SIGCONT)
    b.log_with("closed the connection", "paused by backpressure")


async def test_sigstopped_broker_detected_by_tcp_client(tcp_broker) -> None:
    """The broker stops (SIGSTOP): a TCP client's pending call and its receive fail with
    ConnectionLost code heartbeat-timeout within a few heartbeat intervals."""
    b = tcp_broker(rules=[{"who": ["tcp:alice"], "call": ["*"], "subscribe": ["*"]}])
    async with msgq_trio.connect(b.path, name="svc") as svc:
        await svc.subscribe("Slow")

        @svc.command("sleep")
        async def _sleep(_p: Any) -> None:
            await trio.sleep_forever()

        async with msgq_trio.connect(b.url, name="r", token=ALICE) as r:
            errors: list[BaseException] = []

            async def pending_call() -> None:
                try:
                    await r.call("Slow", "sleep")
                except ConnectionLost as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pending_call)
                await trio.sleep(0.3)
                b.bp.proc.send_signal(signal.SIGSTOP)
                try:
                    with trio.fail_after(10):
                        with pytest.raises(ConnectionLost) as ei:
                            await r.receive()
                finally:
                    b.bp.proc.send_signal(signal.SIGCONT)
            assert ei.value.code == ErrorCode.HEARTBEAT_TIMEOUT
            assert errors and isinstance(errors[0], ConnectionLost)


async def test_idle_tcp_client_is_kept(tcp_broker) -> None:
    """An idle but live TCP client (it answers heartbeats) stays connected across many
    heartbeat intervals, and so does the broker from its point of view."""
    b = tcp_broker(rules=[{"who": ["tcp:alice"], "call": ["*"]}])
    async with msgq_trio.connect(b.path, name="svc") as svc:
        await svc.subscribe("Svc")
        svc.add_command("echo", lambda p: p)
        async with msgq_trio.connect(b.url, name="idle", token=ALICE) as idle:
            await trio.sleep(3.0)  # 6 intervals, twice the misses
            assert await idle.call("Svc", "echo", "still here") == "still here"
    assert "heartbeat" not in b.log()


# -- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"tcp": {"listen": ["0.0.0.0:7000"], "insecure": True}}, "loopback addresses only"),
        ({"tcp": {"listen": ["127.0.0.1:7000"]}}, "tcp.insecure"),
        ({"tcp": {"tokens": {"alice": "plaintext-token"}}}, "sha256:"),
        ({"tcp": {"certfile": "c.pem"}}, "together"),
        ({"access": {"rule": [{"who": ["tcp:a"], "sendd": ["x"]}]}}, "did you mean send"),
        ({"access": {"rule": [{"send": ["x"]}]}}, "needs a 'who'"),
        ({"access": {"rule": [{"who": ["alice"]}]}}, "tcp:NAME"),
    ],
)
def test_invalid_tcp_and_access_configuration_is_refused(data, needle) -> None:
    """Plain TCP off loopback, plain-text tokens, half a TLS setup and malformed rules
    are configuration errors naming the key, before anything listens."""
    from msgq_trio.ops.config_file import ConfigError, build

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        build(data)


def test_access_rules_round_trip_through_the_configuration() -> None:
    """[[access.rule]] tables and [tcp] survive build -> to_dict -> build unchanged."""
    from msgq_trio.ops.config_file import build, to_dict

    cfg = build(
        {
            "tcp": {"listen": ["127.0.0.1:0"], "insecure": True, "tokens": {"a": hash_token("t")}},
            "access": {"rule": [{"who": ["tcp:a"], "send": ["x.*"], "control": True}]},
        }
    )
    assert build(to_dict(cfg)) == cfg
    assert cfg.access.rules[0].send == ("x.*",)


async def test_a_spliced_message_reaches_a_tls_subscriber_whole(tcp_broker, pki) -> None:
    """A 4 MiB message from a Unix client is spliced into the broker's pipes; a receiver
    over TLS cannot be written from a pipe (only the SSL object writes its socket), so
    the broker reads the rest back once and sends the bytes: the remote subscriber gets
    the very body (limits.splice_min_size)."""
    b = tcp_broker(certfile=pki["certfile"], keyfile=pki["certfile"])
    body = os.urandom(4 * 1024 * 1024)
    async with (
        msgq_trio.connect(b.path, name="svc") as svc,
        msgq_trio.connect(
            b.url, name="remote", token=ALICE, ssl_context=client_ctx(pki["ca"])
        ) as remote,
    ):
        await remote.subscribe("ok.big")
        await svc.send("ok.big", body)
        got = await remote.receive(10)
        assert got.body == body
        st = await svc.call("msgq", "stats")
        assert st["spliced_frames"] == 1 and st["splice_pipes"] == 0
