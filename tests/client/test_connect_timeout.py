"""connect() is bounded on every driver: a path that carries nothing (a listening socket
nobody accepts from, so the dial succeeds and WELCOME never comes) fails the connect
with ConnectError after its ``timeout``, not after the kernel's or the broker's."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import msgq_trio
import msgq_trio.aio
from msgq_trio import ConnectError, Reconnect, UsageError
from msgq_trio.client.lifecycle import CONNECT_TIMEOUT, Lifecycle, State

TIMEOUT = 0.5
#: Generous under a loaded machine: the bound is ``TIMEOUT``, and the test fails only if
#: nothing ends the connect for many times longer.
PATIENCE = 15.0


@pytest.fixture
def silent_unix(short_tmp: Path) -> Iterator[str]:
    """A Unix socket that listens and never accepts: connect() succeeds, nothing answers."""
    path = str(short_tmp / "silent.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)
    try:
        yield path
    finally:
        sock.close()


@pytest.fixture
def silent_tcp() -> Iterator[str]:
    """The same over TCP on loopback: the kernel completes the handshake, nobody reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _assert_timed_out(exc: BaseException, elapsed: float) -> None:
    assert isinstance(exc, ConnectError)
    assert "WELCOME" in str(exc) and f"{TIMEOUT:g} s" in str(exc)
    assert TIMEOUT * 0.9 <= elapsed < PATIENCE


async def _trio_connect(target: str, **kw: object) -> None:
    with trio.fail_after(PATIENCE):
        async with msgq_trio.connect(target, "silent", timeout=TIMEOUT, token="t", **kw):  # type: ignore[arg-type]
            pytest.fail("connected to a socket that never answers")


@pytest.mark.parametrize("target", ["silent_unix", "silent_tcp"])
@pytest.mark.parametrize("reconnect", [False, True])
async def test_trio_connect_gives_up_after_its_timeout(
    target: str, reconnect: bool, request: pytest.FixtureRequest
) -> None:
    """Also with a reconnect policy: the first connection is connect()'s, bounded by
    its timeout (the policy's attempt_timeout bounds the reconnects)."""
    address = request.getfixturevalue(target)
    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        await _trio_connect(
            address, reconnect=Reconnect(attempt_timeout=60.0) if reconnect else False
        )
    _assert_timed_out(info.value, time.monotonic() - start)


@pytest.mark.parametrize("target", ["silent_unix", "silent_tcp"])
def test_asyncio_connect_gives_up_after_its_timeout(
    target: str, request: pytest.FixtureRequest
) -> None:
    address = request.getfixturevalue(target)

    async def main() -> None:
        async with msgq_trio.aio.connect(address, "silent", timeout=TIMEOUT, token="t"):
            pytest.fail("connected to a socket that never answers")

    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        asyncio.run(asyncio.wait_for(main(), PATIENCE))
    _assert_timed_out(info.value, time.monotonic() - start)


def test_direct_connect_gives_up_after_its_timeout(silent_unix: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        msgq_trio.connect_direct(silent_unix, "silent", timeout=TIMEOUT)
    _assert_timed_out(info.value, time.monotonic() - start)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "5"])
async def test_a_bad_timeout_is_the_callers_error(bad: object, silent_unix: str) -> None:
    with pytest.raises(UsageError, match="connect timeout"):
        async with msgq_trio.connect(silent_unix, timeout=bad):  # type: ignore[arg-type]
            pass
    with pytest.raises(UsageError, match="connect timeout"):
        msgq_trio.connect_direct(silent_unix, timeout=bad)  # type: ignore[arg-type]


def test_the_first_attempt_is_bounded_by_the_connect_timeout() -> None:
    """The table: dialing while CONNECTING sets the deadline from connect_timeout (the
    default 30 s), with or without a policy; a reconnect's from attempt_timeout."""
    life = Lifecycle(None, "x")
    life.dialing(100.0)
    assert life.attempt_deadline == 100.0 + CONNECT_TIMEOUT
    life = Lifecycle(Reconnect(attempt_timeout=7.0), "x", connect_timeout=2.0)
    life.dialing(100.0)
    assert life.attempt_deadline == 102.0
    assert "2 s" in str(life.timed_out())
    life.welcomed()
    assert life.attempt_deadline is None and life.state is State.READY
