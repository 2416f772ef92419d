"""Ctrl-C under ``msgq_trio.ops.interrupt.run``: a SIGINT is a cancellation delivered at
an await point (inside the command's ``interruptible()`` block if it is in one), never a
KeyboardInterrupt raised in the middle of whatever code runs when it lands; ``run``
raises KeyboardInterrupt once the command has unwound.

In-process with a real SIGINT to this process (the receiver of ``run`` takes it), and
``grace=None`` so that no timer can end the test run.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import trio

from msgq_trio.ops.interrupt import interruptible, run

pytestmark = pytest.mark.usefixtures("sigint_as_in_a_terminal")


def test_sigint_cancels_at_the_next_await_not_in_between() -> None:
    """SIGINT during a stretch of code without an await: the stretch runs to its end (a
    KeyboardInterrupt raised inside it could leave a nursery half updated, as in trio's
    TaskStatus.started()), the next await is cancelled, the cleanup after the
    interruptible block still runs, and run() raises KeyboardInterrupt."""
    seen: list[str] = []

    async def command() -> None:
        with interruptible():
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                pass  # the signal's Python handler runs here
            seen.append("stretch done")
            await trio.sleep(30)
            seen.append("slept")  # not reached
        seen.append("cleanup")
        await trio.sleep(0.01)  # a cleanup may await: only the block was cancelled
        seen.append("cleaned up")

    with pytest.raises(KeyboardInterrupt):
        run(command, grace=None)
    assert seen == ["stretch done", "cleanup", "cleaned up"]


def test_sigint_before_the_block_cancels_the_command() -> None:
    """SIGINT before the command reached its interruptible block (still connecting):
    the whole command is cancelled; a block entered afterwards starts cancelled."""
    seen: list[str] = []

    async def command() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await trio.sleep(30)
        finally:
            seen.append("cancelled")
            with interruptible() as scope:
                seen.append(f"block cancelled on entry: {scope.cancel_called}")

    with pytest.raises(KeyboardInterrupt):
        run(command, grace=None)
    assert seen == ["cancelled", "block cancelled on entry: True"]


def test_sigint_during_the_cleanup_lets_it_finish() -> None:
    """SIGINT after the interruptible block ended (the command is closing its
    connection): the cleanup is not cancelled; run() raises KeyboardInterrupt after."""
    seen: list[str] = []

    async def command() -> int:
        with interruptible():
            await trio.lowlevel.checkpoint()
        os.kill(os.getpid(), signal.SIGINT)
        await trio.sleep(0.2)  # the signal is taken meanwhile
        seen.append("cleanup finished")
        return 0

    with pytest.raises(KeyboardInterrupt):
        run(command, grace=None)
    assert seen == ["cleanup finished"]


def test_without_sigint_run_returns_the_result() -> None:
    """No Ctrl-C: run() is trio.run (result and exceptions pass through)."""

    async def ok() -> int:
        with interruptible():
            await trio.lowlevel.checkpoint()
        return 7

    async def fails() -> None:
        raise ValueError("the command's own error")

    assert run(ok, grace=None) == 7
    with pytest.raises(ValueError, match="own error"):
        run(fails, grace=None)
