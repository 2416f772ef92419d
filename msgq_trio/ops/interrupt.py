"""Ctrl-C for the command line's commands: SIGINT cancels the running command, which
then cleans up as on any cancellation, and the process ends with status 130 within a
bounded time.

Why not trio's default (KeyboardInterrupt raised wherever the interpreter is when the
signal lands): several trio operations that a client runs are not protected from it.
``TaskStatus.started()``, which ``connect()``'s ``nursery.start`` runs, moves the task out
of the temporary nursery and pokes that nursery last; a KeyboardInterrupt raised between
the two leaves the caller waiting in the temporary nursery for a wake-up that never comes.
The process then sits in ``epoll_wait`` for good, and a second Ctrl-C finds nothing to
interrupt (trio delivers it by aborting the main task's wait, which it already tried).
A stdin read in a worker thread (``pipe write``) defers KeyboardInterrupt the same way
until a line arrives. Here a SIGINT is a message (``trio.open_signal_receiver``) and
its effect a cancellation, which every await point handles; outside the receiver trio
raises KeyboardInterrupt only at checkpoints.

The contract of :func:`run`:

* the first SIGINT cancels the command: its innermost :func:`interruptible` block if it
  is in one, else the whole command unless it already left such a block (it is then
  cleaning up: closing pipe handles, the GOODBYE to the broker, which goes on);
  :func:`run` then raises KeyboardInterrupt (the CLI's status 130);
* a process started with SIGINT ignored keeps ignoring it (POSIX's convention for
  background jobs; Python and trio do the same), from its first instruction to its last;
* a second SIGINT ends the process at once with status 130 (``os._exit``), quietly; so
  does :data:`INTERRUPT_GRACE` seconds after the first without the command having ended
  (a broker that does not answer, a blocked standard output), with one line on stderr
  saying so. The kernel closes the sockets, and the broker cleans up as after any client
  that disconnects.

Why the inner block: cancelling the scope around ``async with connect()`` cancels the
connection's reader and writer with it, so a shielded cleanup inside the block (a pipe
handle's close call) would wait for an answer nobody reads. A command puts its work in
``with interruptible():`` inside its connection; the cleanup after it runs on a live
connection.
"""

from __future__ import annotations

import contextvars
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio

from . import swallowed

log = logging.getLogger("msgq_trio.cli")

T = TypeVar("T")

#: 128 + SIGINT: what a shell reports for a program that SIGINT ends.
EXIT_INTERRUPTED = 130
#: Seconds a command may take to clean up after Ctrl-C. A GOODBYE round trip with a
#: working broker takes milliseconds, even on a loaded machine well under a second; a
#: person who pressed Ctrl-C expects the prompt back in about the time it takes to look.
INTERRUPT_GRACE = 1.5


def exit_now() -> None:
    """End the process with status 130 without unwinding (no cleanup can block it)."""
    os._exit(EXIT_INTERRUPTED)


def _give_up(grace: float) -> None:
    # os.write, not print: the main thread may hold sys.stderr's lock, or be blocked.
    os.write(
        2,
        f"msgq-trio: interrupted; the command did not finish closing within {grace} s "
        "(a broker that does not answer, or a blocked output): exiting now\n".encode(),
    )
    exit_now()


class _Interrupt:
    """What one :func:`run` knows about Ctrl-C: whether it came, the scopes it may
    cancel, and whether the command is past its interruptible part."""

    def __init__(self, grace: float | None, outer: trio.CancelScope) -> None:
        self.grace = grace
        self.interrupted = False
        self.outer = outer
        self.inner: list[trio.CancelScope] = []
        self.cleaning_up = False

    def interrupt(self) -> None:
        self.interrupted = True
        if self.inner:
            self.inner[-1].cancel()
        elif not self.cleaning_up:
            self.outer.cancel()

    async def watch(self, signals: AsyncIterator[int]) -> None:
        async for _ in signals:
            if self.interrupted:
                exit_now()  # Ctrl-C again: the person does not want to wait
            if self.grace is not None:
                # A thread, not a trio timer: the loop itself may be what is stuck (a
                # blocking write to a full standard output holds the main thread). It
                # stays armed after run() returns: it bounds the process's exit too.
                timer = threading.Timer(self.grace, _give_up, (self.grace,))
                timer.daemon = True
                timer.start()
            self.interrupt()


_current: contextvars.ContextVar[_Interrupt | None] = contextvars.ContextVar(
    "msgq_trio_interrupt", default=None
)


@contextmanager
def interruptible() -> Iterator[trio.CancelScope]:
    """A cancel scope that Ctrl-C cancels (under :func:`run`; elsewhere a plain scope).
    Cancelled on entry when Ctrl-C came already. After it, a Ctrl-C lets the cleanup
    finish (within the grace period) instead of cancelling it."""
    state = _current.get()
    with trio.CancelScope() as scope:
        if state is None:
            yield scope
            return
        if state.interrupted:
            scope.cancel()
        state.inner.append(scope)
        try:
            yield scope
        finally:
            state.inner.remove(scope)
            if not state.inner:
                state.cleaning_up = True


async def _supervised(
    grace: float | None, async_fn: Callable[..., Awaitable[T]], args: tuple[object, ...]
) -> T:
    error: Exception | None = None
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as outer:
                state = _Interrupt(grace, outer)
                _current.set(state)
                nursery.start_soon(state.watch, signals)
                if swallowed.pending():
                    # Ctrl-C came before the receiver opened and was swallowed (a weak
                    # reference's callback): the command stops as if it came now.
                    state.interrupt()
                try:
                    result = await async_fn(*args)
                except Exception as exc:
                    if state.interrupted:
                        # An error out of a command being cancelled (a call failed as
                        # its connection closed) is a consequence of the interruption.
                        log.debug("error while interrupted", exc_info=True)
                    else:
                        error = exc  # raised below, outside the nursery: not in a group
            nursery.cancel_scope.cancel()
    if state.interrupted:
        raise KeyboardInterrupt
    if error is not None:
        raise error
    return result


def run(
    async_fn: Callable[..., Awaitable[T]], *args: object, grace: float | None = INTERRUPT_GRACE
) -> T:
    """``trio.run(async_fn, *args)`` with Ctrl-C as described in the module docstring;
    ``grace`` None: no forced exit (for a caller that is not a command line program).

    Raises:
        KeyboardInterrupt: SIGINT arrived (the command was cancelled and cleaned up), or
            arrived earlier and the interpreter swallowed it (``ops/swallowed.py``).
        Whatever ``async_fn`` raises when it was not interrupted.
    """
    swallowed.raise_if_pending()
    if threading.current_thread() is not threading.main_thread():
        # Signals are delivered to the main thread only; there is nothing to watch.
        return trio.run(async_fn, *args, restrict_keyboard_interrupt_to_checkpoints=True)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started with SIGINT ignored (a background job of a non-interactive shell,
        # nohup): Ctrl-C is not meant for this process, as for any program started so,
        # and the interpreter and trio leave it ignored too. Watching it here would make
        # the command ignore Ctrl-C until the watch is set up and obey it from then on.
        return trio.run(async_fn, *args, restrict_keyboard_interrupt_to_checkpoints=True)
    return trio.run(
        _supervised, grace, async_fn, args, restrict_keyboard_interrupt_to_checkpoints=True
    )
