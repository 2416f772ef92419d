"""The command line behaves like the anchors (nats, busctl, redis-cli): every test runs
the real console script (``.venv/bin/msgq-trio``) against a real broker and checks the
exit status and what reaches stdout and stderr.

Ctrl-C (SIGINT) exits 130 without a traceback; a reader that went away (``| head``)
exits 141 without one; bad input is one ``error:`` line and exit 2; ``-s`` keeps the
``//`` of ``tcp://`` URLs; connection flags go before or after the subcommand; ``serve
--plugin queue`` needs no file; ``pipe`` without the pipe plugin says how to start it;
``dump --count`` counts what it shows; ``ctl stats`` is readable; ``--help`` is plain
text and every positional argument has help.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import trustme

from msgq_trio import cli
from msgq_trio.cli import build_parser
from msgq_trio.client.session import CLOSE_WAIT
from msgq_trio.core.access import hash_token

MSGQ = str(Path(sys.executable).with_name("msgq-trio"))
TIMEOUT = 60.0


def run(
    *argv: str, env: dict[str, str] | None = None, stdout: Any = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    """``msgq-trio ARGV`` to completion (stdin empty)."""
    return subprocess.run(
        [MSGQ, *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def start(*argv: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [MSGQ, *argv],
        text=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL, **kw},
    )


def until(predicate: Callable[[], Any], what: str) -> Any:
    """Poll ``predicate`` until truthy (TIMEOUT at most: a busy machine is slow)."""
    deadline = time.monotonic() + TIMEOUT
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def members(sock: Path, group: str) -> list[dict[str, Any]]:
    r = run("members", "--json", "-s", str(sock), group)
    assert r.returncode == 0, r
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def assert_quiet(stderr: str) -> None:
    for marker in ("Traceback", "KeyboardInterrupt", "BrokenPipeError", "ExceptionGroup"):
        assert marker not in stderr, stderr


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """CLI processes a test starts in the background; killed if still running."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=TIMEOUT)


# -- Ctrl-C ------------------------------------------------------------------------------
#: The CLI as the console script runs it, but saying "ready" once ``main()`` has taken
#: over (from inside its ``try``): SIGINT before that lands in the interpreter's
#: start-up, in ``import msgq_trio`` or between this script's lines (a traceback and
#: status -SIGINT that no code of the CLI can prevent; a "ready" printed by the script
#: itself left a few bytecodes of it, which a loaded machine once hit), so the points
#: below are counted from that moment.
CLI_CHILD = """\
import sys
from msgq_trio import cli
command = cli._main
def ready_then_command(argv):
    print("ready", flush=True)
    return command(argv)
cli._main = ready_then_command
sys.exit(cli.main())
"""
#: Long-running commands and their arguments (pipe names are made unique per child).
INTERRUPTED = {
    "listen": ["listen", "Stats"],
    "dump": ["dump"],
    "pipe read": ["pipe", "read"],
    "pipe write": ["pipe", "write"],
    "reply": ["reply", "Svc", "echo"],
}
#: Interruption points in all (spread over the commands) and how many of them get a
#: second SIGINT while the command shuts down after the first.
POINTS = 50
SECOND_SIGNALS = 15
#: Ctrl-C ends every command within this many seconds of the signal. What it tells
#: apart is a hang (forever) from an exit; the close may rightly wait CLOSE_WAIT for the
#: broker's GOODBYE, and a loaded machine (eight of these commands at once beside the
#: suite's other workers) adds seconds to starting and leaving an interpreter.
EXIT_BOUND = CLOSE_WAIT + 8.0
#: What a command may say on stderr before Ctrl-C (its own header lines).
HEADERS = ("# dumping", "# answering")


def interrupt_once(
    sock: Path, command: str, n: int, delay: float, second: float | None
) -> tuple[int | None, float, str]:
    """Start ``command``, SIGINT it ``delay`` s after ``main()`` took over (and again
    ``second`` s after that); (exit status or None if still running after TIMEOUT,
    seconds from the first SIGINT to the exit, stderr)."""
    argv = [*INTERRUPTED[command], "-s", str(sock)]
    if command.startswith("pipe"):
        argv.insert(2, f"p{n}")
    idle_stdin, keep_open = os.pipe()  # pipe write reads a stdin that never ends
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", CLI_CHILD, *argv],
            stdin=idle_stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(idle_stdin)
        assert p.stdout is not None and p.stderr is not None
        assert p.stdout.readline() == "ready\n"
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        if second is not None:
            time.sleep(second)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        try:
            p.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
        took = time.monotonic() - signalled
        _out, err = p.communicate()
        return (None if p.returncode == -signal.SIGKILL else p.returncode), took, err
    finally:
        os.close(keep_open)


@pytest.mark.usefixtures("sigint_as_in_a_terminal")
def test_ctrl_c_at_any_point_exits_130_quietly_and_promptly(broker_factory) -> None:
    """SIGINT at POINTS seeded random moments of the first 2 s of ``listen``, ``dump``,
    ``pipe read``, ``pipe write`` (on a stdin that never ends) and ``reply`` (denser
    early, in the connect and subscribe), SECOND_SIGNALS of them again while the command
    shuts down: every one exits 130 within EXIT_BOUND s of the first signal, with no
    traceback and nothing on stderr but the command's own header line. Several
    commands run at once, which is also the load."""
    b = broker_factory("--plugin", "pipe")
    rng = random.Random(20261128)
    commands = list(INTERRUPTED)
    plan = [
        (
            commands[n % len(commands)],
            n,
            2.0 * rng.random() ** 2,
            rng.uniform(0.0, 0.5) if n % (POINTS // SECOND_SIGNALS) == 0 else None,
        )
        for n in range(POINTS)
    ]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: interrupt_once(b.path, *job), plan))
    failures = []
    for (command, _n, delay, second), (status, took, err) in zip(plan, results, strict=True):
        extra = [line for line in err.splitlines() if not line.startswith(HEADERS)]
        if status != 130 or took > EXIT_BOUND or extra:
            failures.append(
                f"{command}: SIGINT at {delay:.2f} s"
                + (f" and {second:.2f} s later" if second is not None else "")
                + f": status {status} after {took:.2f} s, stderr {err[-2000:]!r}"
            )
    assert failures == [], "\n".join(failures)


#: The CLI as the console script runs it, with a Ctrl-C that the interpreter swallows
#: before the command starts: KeyboardInterrupt raised in a weak reference's callback
#: (where a SIGINT that lands during an import raises it: importlib's module locks) is
#: printed as "Exception ignored" and dropped.
SWALLOWED_CHILD = """\
import sys, weakref
from msgq_trio import cli
command = cli._main
class Module:
    pass
def swallow_then_command(argv):
    def callback(_ref):
        raise KeyboardInterrupt
    module = Module()
    ref = weakref.ref(module, callback)
    del module
    return command(argv)
cli._main = swallow_then_command
sys.exit(cli.main())
"""


def run_swallowed(*argv: str) -> subprocess.CompletedProcess[str]:
    """``msgq-trio ARGV`` as SWALLOWED_CHILD runs it, to completion."""
    return subprocess.run(
        [sys.executable, "-c", SWALLOWED_CHILD, *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


@pytest.mark.parametrize(
    "command", [["listen", "Stats"], ["dump"], ["reply", "Svc", "echo"], ["members", "Stats"]]
)
def test_ctrl_c_the_interpreter_swallowed_still_stops_the_command(
    broker_factory, command: list[str]
) -> None:
    """SIGINT that lands in a weak reference's callback (seen under load: ``dump``
    interrupted while importing) is lost to Python; the command must not then run on
    until the next Ctrl-C. A long-running command stops at once, a short one exits 130
    after it, and stderr stays quiet."""
    b = broker_factory()
    p = run_swallowed(*command, "-s", str(b.path))
    assert p.returncode == 130, p
    extra = [line for line in p.stderr.splitlines() if not line.startswith(HEADERS)]
    assert extra == [], p.stderr


def test_a_broker_that_swallowed_ctrl_c_at_start_shuts_down(short_tmp: Path) -> None:
    """``serve`` with a Ctrl-C swallowed before it took over SIGINT shuts down cleanly
    (its socket removed) instead of serving until the next signal."""
    sock = short_tmp / "b.sock"
    p = run_swallowed("serve", "-s", str(sock))
    assert p.returncode == 130, p
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert not sock.exists()


def test_ctrl_c_inside_a_class_definition_is_still_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT that lands while a module being imported defines a class whose field
    descriptor runs ``__set_name__`` (a dataclass, an attrs class): Python 3.11 raises
    ``RuntimeError`` from the KeyboardInterrupt. The command still exits 130, as for any
    Ctrl-C (once seen under load in the test above, in ``console/model.py``); an error
    that Ctrl-C did not cause still propagates."""

    class Interrupted:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    def define_a_class(_argv: list[str]) -> int:
        type("History", (), {"points": Interrupted()})
        return 0

    monkeypatch.setattr(cli, "_main", define_a_class)
    assert cli.main(["listen", "Stats"]) == 130

    def fail(_argv: list[str]) -> int:
        raise RuntimeError("a bug") from ValueError("not an interrupt")

    monkeypatch.setattr(cli, "_main", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["listen", "Stats"])


#: A shell that starts its arguments with SIGINT ignored.
IGNORING_SIGINT = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it(broker) -> None:
    """``msgq-trio listen`` started with SIGINT ignored (``trap '' INT``, as a
    non-interactive shell starts a background job): Ctrl-C, early or once it listens,
    leaves it running, as it would any program started so; SIGTERM still ends it."""
    child_argv = [sys.executable, "-c", CLI_CHILD, "listen", "Stats", "-s", str(broker.path)]
    for delay in (0.0, 1.0):
        p = subprocess.Popen(
            [*IGNORING_SIGINT, *child_argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None
            assert p.stdout.readline() == "ready\n"
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):
                p.wait(1.0)
            p.send_signal(signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):
                p.wait(1.0)
            p.terminate()
            assert p.wait(TIMEOUT) == -signal.SIGTERM
        finally:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=TIMEOUT)


def reading(sock: Path) -> bool:
    """Whether a ``pipe read`` client has opened its pipe and asked for data."""
    r = run("ctl", "clients", "--json", "-s", str(sock))
    assert r.returncode == 0, r
    rows = json.loads(r.stdout)
    return any(c["name"] == "msgq-trio-pipe-read" and c["msgs_in"] >= 2 for c in rows)


@pytest.mark.usefixtures("sigint_as_in_a_terminal")
def test_ctrl_c_with_a_broker_that_does_not_answer(broker_factory, procs) -> None:
    """``listen`` and ``pipe read`` connected to a broker that stopped (SIGSTOP: the
    GOODBYE and the pipe's close are never answered): SIGINT still ends them with 130
    within EXIT_BOUND s, no traceback, one line saying why the exit did not wait."""
    b = broker_factory("--plugin", "pipe")
    listen = start("listen", "Stats", "-s", str(b.path))
    reader = start("pipe", "read", "logs", "-s", str(b.path))
    procs += [listen, reader]
    until(lambda: members(b.path, "Stats"), "listen to subscribe")
    until(lambda: reading(b.path), "the pipe reader to wait in a read")
    os.kill(b.pid, signal.SIGSTOP)
    try:
        for p in (listen, reader):
            p.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        for p in (listen, reader):
            _out, err = p.communicate(timeout=TIMEOUT)
            assert time.monotonic() - signalled <= EXIT_BOUND + 0.5, err
            assert p.returncode == 130, err
            assert_quiet(err)
            assert "did not finish closing" in err and len(err.splitlines()) == 1, err
    finally:
        os.kill(b.pid, signal.SIGCONT)


@pytest.mark.usefixtures("sigint_as_in_a_terminal")
def test_ctrl_c_on_the_console_script(broker, procs) -> None:
    """The installed ``msgq-trio listen`` and ``dump``, interrupted once they run:
    status 130, nothing on stderr but dump's own header line, no traceback."""
    listen = start("listen", "Stats", "-s", str(broker.path))
    dump = start("dump", "-s", str(broker.path))
    procs += [listen, dump]
    until(lambda: members(broker.path, "Stats"), "listen to subscribe")
    assert dump.stderr is not None
    assert dump.stderr.readline().startswith("# dumping")
    for p in (listen, dump):
        p.send_signal(signal.SIGINT)
        _out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == 130, err
        assert_quiet(err)
        assert err.strip() == "", err


# -- closed standard output ----------------------------------------------------------------
def closed_pipe() -> int:
    """The write end of a pipe whose reader has already gone (``| head`` that ended)."""
    r, w = os.pipe()
    os.close(r)
    return w


def test_ctl_stats_into_a_closed_pipe_exits_quietly(broker) -> None:
    """``ctl stats | head -0``: status 141 (as for a program SIGPIPE ends), no
    BrokenPipeError traceback, nothing on stderr."""
    w = closed_pipe()
    try:
        r = run("ctl", "stats", "-s", str(broker.path), stdout=w)
    finally:
        os.close(w)
    assert r.returncode == 141, r.stderr
    assert r.stderr == ""


def test_dump_json_into_a_closed_pipe_exits_quietly(broker, procs) -> None:
    """``dump --json | head -1`` after head exited: the first record to print ends dump
    with 141 and no traceback."""
    w = closed_pipe()
    try:
        dump = start("dump", "--json", "-s", str(broker.path), stdout=w)
    finally:
        os.close(w)
    procs.append(dump)
    assert dump.stderr is not None
    assert dump.stderr.readline().startswith("# dumping")
    assert run("send", "-s", str(broker.path), "Stats", '{"n": 1}').returncode == 0
    _out, err = dump.communicate(timeout=TIMEOUT)
    assert dump.returncode == 141, err
    assert_quiet(err)


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["send", "Stats", "hello"],
        ["call", "G", "x", "{bad"],
        ["notify", "G", "ev", "[1,"],
    ],
)
def test_bad_json_is_one_error_line_and_exit_2(broker, argv: list[str]) -> None:
    """A body or parameters that are not JSON: exit 2 and exactly one line on stderr,
    ``msgq-trio CMD: error: ... is not JSON ...``; nothing is sent."""
    r = run(*argv, "-s", str(broker.path))
    assert r.returncode == 2, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "not JSON" in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["call", "G"],
        ["ctl", "config", "frob"],
        ["queue", "peek"],
        ["listen", "G", "--count", "many"],
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv: list[str]) -> None:
    """A missing argument, an unknown action or a malformed flag value: exit 2 and one
    line naming the subcommand and pointing at its --help (no usage dump)."""
    r = run(*argv)
    assert r.returncode == 2, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"msgq-trio {argv[0]}"), r.stderr
    assert "error:" in lines[0] and "--help" in lines[0]


# -- addresses and remote brokers ---------------------------------------------------------------
def start_tcp_broker(
    broker_factory: Callable[..., Any], short_tmp: Path, tcp: str
) -> tuple[Any, str]:
    """A broker with a TCP listener from a configuration file; (broker, its URL)."""
    conf = short_tmp / "tcp.toml"
    conf.write_text(
        f'[tcp]\nlisten = ["127.0.0.1:0"]\ntokens = {{ cli = "{hash_token(TOKEN)}" }}\n{tcp}\n'
    )
    b = broker_factory("--config", str(conf))
    r = until(lambda: re.search(r"listening on (tcp|tls)://(\S+)", b.log()), "TCP listener")
    return b, f"{r.group(1)}://{r.group(2)}"


TOKEN = "cli-token-2b7d91"


def test_tcp_url_and_token_flags(broker_factory, short_tmp: Path) -> None:
    """``-s tcp://127.0.0.1:PORT`` keeps its ``//``; ``--token`` (after the subcommand
    or before it) or ``$MSGQ_TRIO_TOKEN`` authenticates; without a token the error is
    one line naming the refusal."""
    b, url = start_tcp_broker(broker_factory, short_tmp, "insecure = true")
    assert url.startswith("tcp://")
    r = run("call", "-s", url, "msgq", "ping", "--token", TOKEN)
    assert (r.returncode, r.stdout.strip()) == (0, '"pong"'), r
    r = run("--token", TOKEN, "-s", url, "call", "msgq", "ping")
    assert r.stdout.strip() == '"pong"', r
    r = run("call", "-s", url, "msgq", "ping", env={**os.environ, "MSGQ_TRIO_TOKEN": TOKEN})
    assert r.stdout.strip() == '"pong"', r
    env = {k: v for k, v in os.environ.items() if k != "MSGQ_TRIO_TOKEN"}
    r = run("call", "-s", url, "msgq", "ping", env=env)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r
    assert "must authenticate" in r.stderr
    # Nobody listens here: the message shows the address as given.
    port = url.rpartition(":")[2]
    b.stop()
    r = run("call", "-s", f"tcp://127.0.0.1:{port}", "msgq", "ping", "--token", TOKEN)
    assert r.returncode == 1 and f"tcp://127.0.0.1:{port}" in r.stderr, r.stderr


def test_tls_ca_flag(broker_factory, short_tmp: Path) -> None:
    """``tls://`` with ``--tls-ca`` (or ``$MSGQ_TRIO_TLS_CA``) trusts the broker's CA;
    without it the system trust store refuses the certificate (one error line)."""
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(short_tmp / "server.pem")
    )
    ca.cert_pem.write_to_path(str(short_tmp / "ca.pem"))
    pem = short_tmp / "server.pem"
    _b, url = start_tcp_broker(broker_factory, short_tmp, f'certfile = "{pem}"\nkeyfile = "{pem}"')
    assert url.startswith("tls://")
    r = run(
        "call", "msgq", "ping", "-s", url, "--token", TOKEN, "--tls-ca", str(short_tmp / "ca.pem")
    )
    assert (r.returncode, r.stdout.strip()) == (0, '"pong"'), r
    r = run(
        "call",
        "msgq",
        "ping",
        "-s",
        url,
        "--token",
        TOKEN,
        env={**os.environ, "MSGQ_TRIO_TLS_CA": str(short_tmp / "ca.pem")},
    )
    assert r.stdout.strip() == '"pong"', r
    r = run("call", "msgq", "ping", "-s", url, "--token", TOKEN)
    assert r.returncode == 1 and "TLS" in r.stderr and len(r.stderr.splitlines()) == 1, r
    r = run("call", "msgq", "ping", "-s", url, "--tls-ca", str(short_tmp / "missing.pem"))
    assert r.returncode == 2 and "--tls-ca" in r.stderr, r


# -- flags anywhere --------------------------------------------------------------------------
def test_global_flags_after_the_subcommand(broker, short_tmp: Path) -> None:
    """``ctl config -s SOCK get socket`` and ``ctl -s SOCK config get socket`` and
    ``-s SOCK ctl config get socket`` all work; ``serve --log-level DEBUG`` is accepted
    (and logs at DEBUG)."""
    for argv in (
        ["ctl", "config", "-s", str(broker.path), "get", "socket"],
        ["ctl", "-s", str(broker.path), "config", "get", "socket"],
        ["-s", str(broker.path), "ctl", "config", "get", "socket"],
        ["ctl", "config", "get", "socket", "-s", str(broker.path)],
    ):
        r = run(*argv)
        assert (r.returncode, r.stdout.strip()) == (0, json.dumps(str(broker.path))), (argv, r)
    sock = short_tmp / "debug.sock"
    log = short_tmp / "debug.log"
    with open(log, "w") as err:
        serve = subprocess.Popen(
            [MSGQ, "serve", "--log-level", "DEBUG", "-s", str(sock)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert serve.stdout is not None
        assert "listening" in serve.stdout.readline()
        assert run("call", "-s", str(sock), "msgq", "ping").returncode == 0
        until(lambda: " DEBUG " in log.read_text(), "a DEBUG line")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=TIMEOUT)
    assert serve.returncode == 0, log.read_text()


# -- serve --plugin queue without a file ---------------------------------------------------------
def test_serve_plugin_queue_without_a_dir(
    broker_factory, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --plugin queue`` keeps the store under the state directory
    ($STATE_DIRECTORY here, as systemd's StateDirectory= sets it): <state>/queue; a
    queue put through it is listed by ``queue ls``. ``--queue-dir`` puts it elsewhere."""
    state = short_tmp / "state"
    monkeypatch.setenv("STATE_DIRECTORY", str(state))
    b = broker_factory("--plugin", "queue")
    r = run("queue", "ls", "-s", str(b.path))
    assert (r.returncode, r.stdout.strip()) == (0, "no queues"), r
    assert (state / "queue" / "data.mdb").exists()
    other = short_tmp / "elsewhere"
    b2 = broker_factory("--queue-dir", str(other))
    r = run("queue", "ls", "-s", str(b2.path))
    assert r.returncode == 0, r
    assert (other / "data.mdb").exists()


# -- pipe without the plugin --------------------------------------------------------------------
def test_pipe_without_the_plugin_says_how_to_start_it(broker) -> None:
    """``pipe write logs`` on a broker without the pipe plugin: exit 1 and one line in
    the common ``error:`` format with the hint ``--plugin pipe``."""
    r = run("pipe", "write", "logs", "-s", str(broker.path))
    assert r.returncode == 1, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: the pipe plugin is not running")
    assert "--plugin pipe" in lines[0]


# -- dump --count ---------------------------------------------------------------------------------
def test_dump_count_counts_only_other_clients_frames(broker, procs) -> None:
    """``dump --count 2 --json``: its own dump-start command and answer are not shown
    and not counted, so the two messages sent after it are what it prints."""
    dump = start("dump", "--count", "2", "--json", "-s", str(broker.path))
    procs.append(dump)
    assert dump.stderr is not None
    assert dump.stderr.readline().startswith("# dumping")
    for n in (1, 2):
        assert run("send", "-s", str(broker.path), "Stats", json.dumps({"n": n})).returncode == 0
    out, err = dump.communicate(timeout=TIMEOUT)
    assert dump.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["kind"], r["sender_name"], r["target"]) for r in records] == [
        ("message", "msgq-trio-send", "Stats")
    ] * 2, records


# -- ctl stats -----------------------------------------------------------------------------------
def test_ctl_stats_in_human_units(broker) -> None:
    """``ctl stats``: uptime as a duration (``2.4s``), timestamps as local dates with
    their age, byte counts with units; ``--json`` keeps the raw numbers."""
    r = run("ctl", "stats", "-s", str(broker.path))
    assert r.returncode == 0, r
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert re.fullmatch(r"\d+(\.\d)?s|\d+m\d\ds|\d+h\d\dm", rows["uptime"]), rows["uptime"]
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} \(.+ ago\)", rows["config.loaded_at"]
    ), rows["config.loaded_at"]
    assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", rows["rss_bytes"]), rows["rss_bytes"]
    raw = json.loads(run("ctl", "stats", "--json", "-s", str(broker.path)).stdout)
    assert isinstance(raw["uptime"], float)


@pytest.mark.parametrize(("line", "young"), [("", 10_000), ("gc_threshold = 0", 700)])
def test_the_broker_runs_with_its_gc_threshold(
    broker_factory: Callable[..., Any], tmp_path: Path, line: str, young: int
) -> None:
    """``gc_threshold`` (default 10,000; 0 keeps CPython's 700) is the youngest
    generation's threshold of the broker's collector, shown by ``ctl stats``."""
    cfg = tmp_path / "gc.toml"
    cfg.write_text(line + "\n")
    b = broker_factory("--config", str(cfg))
    raw = json.loads(run("ctl", "stats", "--json", "-s", str(b.path)).stdout)
    assert raw["collector"]["threshold"][0] == young
    assert len(raw["collector"]["collections"]) == 3


# -- help --------------------------------------------------------------------------------------
def _all_parsers(p: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield p.prog, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _all_parsers(child)


def test_every_positional_has_help() -> None:
    """Every positional argument of every subcommand says what it is."""
    missing = [
        f"{prog} {a.dest}"
        for prog, p in _all_parsers(build_parser())
        for a in p._actions
        if not a.option_strings
        and a.nargs != 0
        and not isinstance(a, argparse._SubParsersAction)
        and not a.help
    ]
    assert missing == []


@pytest.mark.parametrize("argv", [[], ["ctl"], ["serve"], ["dump"], ["scenario"]])
def test_help_is_plain_text(argv: list[str]) -> None:
    """``--help`` shows no reST markup (````literal````, ``:func:`x```)."""
    r = run(*argv, "--help")
    assert r.returncode == 0, r
    assert "``" not in r.stdout and ":func:" not in r.stdout and ":mod:" not in r.stdout, r.stdout


# -- reply and members --json -------------------------------------------------------------------
def test_reply_answers_calls_from_the_shell(broker, procs) -> None:
    """``reply Svc echo '{"ok": true}' --count 1``: ``members --json Svc`` lists it, a
    ``call Svc echo`` gets the answer, the request is printed as a JSON line with the
    caller's name and parameters, and reply exits 0 after one answer."""
    reply = start("reply", "Svc", "echo", '{"ok": true}', "--count", "1", "-s", str(broker.path))
    procs.append(reply)
    assert reply.stderr is not None
    assert reply.stderr.readline().startswith("# answering Svc echo")
    (member,) = members(broker.path, "Svc")
    assert member["name"] == "msgq-trio-reply" and member["lname"].startswith("l.")
    r = run("call", "Svc", "echo", '{"x": 1}', "-s", str(broker.path))
    assert (r.returncode, json.loads(r.stdout)) == (0, {"ok": True}), r
    out, err = reply.communicate(timeout=TIMEOUT)
    assert reply.returncode == 0, err
    assert json.loads(out) == {
        "from": json.loads(out)["from"],
        "name": "msgq-trio-call",
        "params": {"x": 1},
    }
    r = run("call", "Svc", "echo", "-s", str(broker.path))
    assert r.returncode == 1 and r.stderr.startswith("error: no-recipient"), r


# -- shell completion ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("msgq-trio ct", "ctl"),
        ("msgq-trio ctl config g", "get"),
        ("msgq-trio call --to", "--token"),
    ],
)
def test_shell_completion(short_tmp: Path, line: str, expected: str) -> None:
    """The console script answers bash's completion request (argcomplete's protocol:
    ``_ARGCOMPLETE``, ``COMP_LINE``, ``COMP_POINT``) with the matching words, and exits
    0 without running a command."""
    pytest.importorskip("argcomplete", reason="argcomplete is in the dev extra")
    out = short_tmp / "completions"
    env = {
        **os.environ,
        "_ARGCOMPLETE": "1",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
    }
    r = run(env=env)
    assert r.returncode == 0, r
    words = out.read_text().split("\v")
    assert [w.strip() for w in words] == [expected], words
