"""Run each configured plugin as a supervised child process of the broker.

Policy (docs/QUEUE.md, "Plugins"):

* First start: the broker waits until every plugin reports ready (``start_timeout``). A
  plugin that exits or does not get ready in time makes the broker's start fail with a
  clear message (``PluginStartError``; ``serve`` exits with status 1): a broker whose
  configured queues are missing must not pretend to be up.
* After it was ready once, a plugin that exits (crash, lost connection) is logged at
  ERROR with its exit status and restarted after a backoff that doubles from
  ``BACKOFF_INITIAL`` to ``BACKOFF_MAX`` and resets after ``HEALTHY_AFTER`` seconds of
  running; its own traceback is on the broker's stderr (the child inherits it).
* Shutdown: a plugin that leaves while the broker shuts down is not restarted; one still
  running when the supervisor is cancelled gets SIGTERM, then SIGKILL after
  ``KILL_AFTER`` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from msgq_trio.runtime import DEFAULT_GC_THRESHOLD, GC_THRESHOLD_ENV

from .otel import OTEL_FILE_ENV

log = logging.getLogger("msgq_trio.plugins")

__all__ = ["PluginStartError", "PluginSupervisor"]

#: Until the first "ready": the queue plugin opens its store and reads each queue's counts
#: (not its messages) before it is ready; 30 s leaves room for slow disks.
START_TIMEOUT = 30.0
#: Restart backoff: quick for a one-off crash, bounded so a crash loop costs little CPU
#: and log volume (systemd's default RestartSec is 100 ms; 10 s caps a loop at 6/min).
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 10.0
HEALTHY_AFTER = 60.0
#: SIGTERM -> SIGKILL grace (plugins hold no state that is not already durable).
KILL_AFTER = 5.0


class PluginStartError(RuntimeError):
    """A plugin did not get ready at the broker's start (its name and why)."""


class PluginSupervisor:
    """Starts and restarts the plugin processes.

    Args:
        socket: the broker's socket, handed to each plugin.
        plugins: plugin name -> its settings table (already checked by the loader).
        stopping: returns True once the broker shuts down (no restarts then).
        gc_threshold: the broker's ``gc_threshold``, handed to each plugin process
            (``msgq_trio.runtime``).
        otel_file: the broker's ``[tracing] otel_file`` while it emits spans (None:
            it does not), handed to each plugin process, which then emits its own
            (plugins/otel.py).
    """

    def __init__(
        self,
        socket: Path,
        plugins: dict[str, dict[str, Any]],
        *,
        stopping: Callable[[], bool] = lambda: False,
        start_timeout: float = START_TIMEOUT,
        gc_threshold: int = DEFAULT_GC_THRESHOLD,
        otel_file: str | None = None,
    ) -> None:
        self.socket = socket
        self.gc_threshold = gc_threshold
        self.otel_file = otel_file
        self.plugins = plugins
        self.stopping = stopping
        self.start_timeout = start_timeout
        #: name -> how often it was restarted (for tests and operators).
        self.restarts: dict[str, int] = dict.fromkeys(plugins, 0)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every plugin, report started when all are ready, supervise until cancelled.

        Raises:
            PluginStartError: a plugin failed its first start (the others are stopped).
        """
        async with trio.open_nursery() as nursery:
            for name, table in self.plugins.items():
                await nursery.start(self._supervise, name, table)
            task_status.started()

    async def _supervise(
        self, name: str, table: dict[str, Any], *, task_status: trio.TaskStatus[None]
    ) -> None:
        delay = BACKOFF_INITIAL
        first: trio.TaskStatus[None] | None = task_status
        while True:
            began = trio.current_time()
            status, ready = await self._run_child(name, table, first)
            if first is not None and not ready:
                raise PluginStartError(
                    f"plugin {name!r} failed to start (exit status {status}; "
                    "its error is in the broker's log)"
                )
            first = None
            if self.stopping():
                log.info("plugin %s stopped (status %s)", name, status)
                return
            if trio.current_time() - began > HEALTHY_AFTER:
                delay = BACKOFF_INITIAL
            log.error("plugin %s exited with status %s; restarting in %.1f s", name, status, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
            self.restarts[name] += 1

    async def _run_child(
        self, name: str, table: dict[str, Any], first: trio.TaskStatus[None] | None
    ) -> tuple[int | None, bool]:
        """Run the plugin process once; returns (exit status, whether it got ready)."""
        argv = [
            sys.executable,
            "-m",
            "msgq_trio.plugins.host",
            name,
            str(self.socket),
            json.dumps(table),
        ]
        env = {**os.environ, GC_THRESHOLD_ENV: str(self.gc_threshold)}
        if self.otel_file is not None:  # the broker emits spans: its plugins too
            env[OTEL_FILE_ENV] = self.otel_file
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert proc.stdout is not None
        ready = False
        try:
            buf = b""
            limit = self.start_timeout if first is not None else float("inf")
            closed = False
            with trio.move_on_after(limit):
                while b"ready\n" not in buf:
                    chunk = await proc.stdout.receive_some(4096)
                    if not chunk:
                        closed = True  # it exited (or closed stdout) before ready
                        break
                    buf += chunk
                else:
                    ready = True
            if not ready:
                if closed:
                    # Reap it: its status tells the caller what happened; its own error
                    # line is already in the log (plugin stderr is the broker's).
                    with trio.move_on_after(KILL_AFTER):
                        return await proc.wait(), False
                log.error("plugin %s not ready after %.0f s: stopping it", name, limit)
                proc.kill()
                return await proc.wait(), False
            log.info("plugin %s ready (pid %d)", name, proc.pid)
            if first is not None:
                first.started()
            # Drain stdout (the plugin writes nothing more) until it exits.
            while await proc.stdout.receive_some(4096):
                pass
            return await proc.wait(), True
        finally:
            if proc.returncode is None:
                with trio.CancelScope(shield=True):
                    proc.send_signal(signal.SIGTERM)
                    with trio.move_on_after(KILL_AFTER):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    await pipe.aclose()
