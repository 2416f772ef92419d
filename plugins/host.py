"""The plugin process: ``python -m msgq_trio.plugins.host NAME SOCKET SETTINGS-JSON``.

Started by :mod:`msgq_trio.plugins.supervisor`. Loads the plugin, runs it, writes
``ready`` on stdout once the plugin says it is ready, and exits:

* when the plugin returns or raises (status 0 / 1; the traceback goes to stderr, except
  for an ``OSError`` or ``lmdb.Error`` (store directory unusable, disk full): one line
  naming the cause, the traceback at DEBUG);
* when stdin reaches EOF: the broker, which holds the other end, is gone (even after
  SIGKILL), so the plugin must not outlive it and, e.g., keep its store locked: it
  exits at once (``os._exit``), without closing its connections to the dead broker.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import trio

from msgq_trio.errors import ConnectError
from msgq_trio.runtime import threshold_from_env, tune_collector

from .loader import load_plugin
from .otel import start_plugin_spans

log = logging.getLogger("msgq_trio.plugins.host")


async def _watch_parent() -> None:
    """Return when stdin (a pipe from the broker) reaches EOF: the broker exited."""
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            if not os.read(fd, 4096):
                return
        except BlockingIOError:
            continue


#: Whether this process told the supervisor it is ready (for the wording of a failure).
_state = {"ready": False}

#: Seconds a plugin process has to finish once its broker is gone; then it exits at once.
BROKER_GONE_EXIT = 1.0


def _exit_now() -> None:
    sys.stderr.flush()
    os._exit(0)


def _stop_on_sigterm(name: str, scope: trio.CancelScope) -> None:
    """Make SIGTERM (the supervisor's stop) cancel ``scope``, so that the plugin finishes
    what it holds (the queue plugin's final commit) instead of dying on the signal.

    The handler stays installed until the process ends, unlike
    ``trio.open_signal_receiver``'s: the supervisor may send SIGTERM just as the plugin
    stops by itself (its bus connection ended), and a receiver restored to the default
    action then either kills the process before its final commit or, when the signal
    is pending during the restore, makes CPython print "Signal 15 ignored due to race
    condition". A SIGTERM after the run is over is ignored: the process is exiting.
    """
    token = trio.lowlevel.current_trio_token()

    def stop() -> None:
        if not scope.cancel_called:
            log.info("plugin %s: SIGTERM, stopping", name)
        scope.cancel()

    def on_sigterm(signum: int, frame: object) -> None:
        try:
            token.run_sync_soon(stop, idempotent=True)
        except trio.RunFinishedError:
            pass  # trio.run returned: the process is already on its way out

    signal.signal(signal.SIGTERM, on_sigterm)


def _quiet_late_sigterm_reports() -> None:
    """Drop CPython's report "Signal 15 ignored due to race condition" (an unraisable
    OSError, printed with a traceback); install before ``trio.run``. It describes a
    SIGTERM that arrived while :func:`_ignore_sigterm_from_now_on` swapped the handler:
    the supervisor may send SIGTERM just as the plugin stops by itself, and ignoring it
    then is the intent. Any other report goes to the hook that was there.
    """
    previous = sys.unraisablehook
    race = f"Signal {int(signal.SIGTERM)} ignored due to race condition"

    def hook(report: Any) -> None:
        exc = report.exc_value
        if isinstance(exc, OSError) and str(exc) == race:
            return
        previous(report)

    sys.unraisablehook = hook


def _ignore_sigterm_from_now_on() -> None:
    """Ignore SIGTERM once the plugin has stopped: the process is exiting, and Python's
    finalization would otherwise restore the default action, so that a late SIGTERM
    from the supervisor turns a clean exit (status 0) into a death by signal."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


async def _main(name: str, socket: Path, table: dict[str, object]) -> int:
    plugin = load_plugin(name)
    settings = plugin.check_config(table)
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await _watch_parent()
                log.info("plugin %s: the broker is gone, exiting", name)
                # Cancelled like on SIGTERM, so that the plugin finishes what it holds (the
                # queue plugin's final commit keeps a consumed message's resend a duplicate),
                # but gone within BROKER_GONE_EXIT regardless: the restarted broker's plugin
                # waits for this one's store lock. Closing the connections to the dead broker
                # does not wait for its GOODBYE (their readers are cancelled too). Nothing
                # answered is lost if the timer cuts the commit short: every write a plugin
                # answered is committed, and its stores survive a kill -9 by design.
                timer = threading.Timer(BROKER_GONE_EXIT, _exit_now)
                timer.daemon = True
                timer.start()
                nursery.cancel_scope.cancel()

            async def run(*, task_status: trio.TaskStatus[None]) -> None:
                await plugin.run(socket, settings, task_status=task_status)
                # run() returned (e.g. its bus connection ended): the process ends with it.
                nursery.cancel_scope.cancel()

            _stop_on_sigterm(name, nursery.cancel_scope)
            nursery.start_soon(watch)
            await nursery.start(run)
            sys.stdout.write("ready\n")
            sys.stdout.flush()
            _state["ready"] = True
    finally:
        # Still inside trio.run: from here on no SIGTERM reaches a Python handler, so
        # none writes to trio's wakeup socket while the run closes it (CPython would
        # print "Exception ignored when trying to write to the signal wakeup fd").
        _ignore_sigterm_from_now_on()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m msgq_trio.plugins.host NAME SOCKET SETTINGS-JSON", file=sys.stderr)
        return 2
    name, socket, raw = args
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s plugin {name} [%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        tune_collector(threshold_from_env())
    except ValueError as bad:
        log.error("plugin %s: cannot start: %s", name, bad)
        return 2
    failed: list[BaseException] = []
    unusable: list[BaseException] = []
    spans = start_plugin_spans(name)  # while the broker emits spans
    try:
        _quiet_late_sigterm_reports()
        try:
            return trio.run(_main, name, Path(socket), json.loads(raw))
        finally:
            if spans is not None:
                spans.close()
    except* ConnectError as group:
        # The broker died (or is being killed) while this process started: not a bug in
        # the plugin, so one line instead of a traceback (the supervisor, if any is left,
        # restarts it).
        failed.extend(group.exceptions)
    except* (OSError, lmdb.Error) as group:
        # The environment refused what the plugin needs (store directory missing or not
        # writable, LMDB cannot open it): an operator's problem, so one line naming the
        # cause; the traceback goes to DEBUG for whoever wants it.
        unusable.extend(group.exceptions)
    if unusable:
        exc = unusable[0]
        what = "stopped" if _state["ready"] else "cannot start"
        log.error("plugin %s: %s: %s: %s", name, what, type(exc).__name__, exc)
        log.debug("plugin %s: start failure", name, exc_info=exc)
        return 1
    log.error("plugin %s: cannot connect to the broker: %s", name, failed[0])
    return 1


if __name__ == "__main__":
    sys.exit(main())
