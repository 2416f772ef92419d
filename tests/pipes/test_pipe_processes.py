"""Pipes between real client processes: SIGKILL of either end mid-transfer, the CLI as a
fifo in a shell pipeline, the plugin dying, and 256 MiB through a slow reader with the
broker's and the plugin's memory (RSS from /proc) under the configured bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from pipe_helpers import plugin_pid, rss, wait_line

import msgq_trio
from msgq_trio.errors import PipeBroken

MiB = 1 << 20


def pipe_stats(socket: Path, name: str) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with msgq_trio.connect(socket, "stats") as bus:
            return dict(await bus.call("msgq-pipe", "pipe.stats", {"pipe": name}))

    return trio.run(main)


def test_sigkill_writer_mid_transfer_gives_eof_after_buffered_data(
    pipe_broker: Callable[..., Any], spawn_peer: Callable[..., Any]
) -> None:
    """The writer process is SIGKILLed mid-transfer: the reader gets every byte the pipe
    had accepted (the pattern holds up to the last byte) and then end of pipe, at once;
    the pipe is then flushed."""
    b = pipe_broker()
    reader = spawn_peer(b.path, "read", "k1", "--chunk", str(256 * 1024))
    wait_line(reader, "open", 20)
    writer = spawn_peer(b.path, "write", "k1")  # writes forever
    wait_line(reader, "progress", 30)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    t0 = time.monotonic()
    line = wait_line(reader, "read", 10)
    assert line.endswith(" ok"), line
    assert int(line.split()[1]) >= 16 * MiB
    assert time.monotonic() - t0 < 10
    assert reader.wait(10) == 0
    assert pipe_stats(b.path, "k1")["exists"] is False


def test_sigkill_reader_mid_transfer_breaks_the_writer(
    pipe_broker: Callable[..., Any], spawn_peer: Callable[..., Any]
) -> None:
    """The reader process is SIGKILLed mid-transfer: the writer (on_reader_gone="fail")
    fails PipeBroken on its next write within moments, and exits."""
    b = pipe_broker()
    reader = spawn_peer(b.path, "read", "k2")
    wait_line(reader, "open", 20)
    writer = spawn_peer(b.path, "write", "k2")
    wait_line(writer, "progress", 30)
    reader.send_signal(signal.SIGKILL)
    reader.wait(10)
    t0 = time.monotonic()
    line = wait_line(writer, "error", 10)
    assert "PipeBroken" in line, line
    assert time.monotonic() - t0 < 10
    assert writer.wait(10) == 1
    assert pipe_stats(b.path, "k2")["exists"] is False


def test_cli_moves_stdin_to_stdout_across_processes(
    pipe_broker: Callable[..., Any], short_tmp: Path
) -> None:
    """``msgq-trio pipe write NAME < file`` and ``msgq-trio pipe read NAME > out`` in a
    shell script, started reader-last: the output is the input, byte for byte."""
    b = pipe_broker()
    src = short_tmp / "in.bin"
    src.write_bytes(os.urandom(5 * MiB + 17))
    out = short_tmp / "out.bin"
    cli = f"{sys.executable} -m msgq_trio"
    script = (
        f"{cli} pipe write data < {src} & sleep 0.3; {cli} pipe read data > {out}; "
        f"wait $!; printf 'hello\\n' | {cli} pipe write hi & {cli} pipe read hi; wait $!"
    )
    res = subprocess.run(
        ["sh", "-c", script],
        env=dict(os.environ, MSGQ_TRIO_SOCKET=str(b.path)),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() == src.read_bytes()
    assert res.stdout == b"hello\n"


def test_cli_timeout_exit_status(pipe_broker: Callable[..., Any]) -> None:
    """``pipe read --timeout`` with no writer ends with status 3 and says timeout (not
    end of pipe, which is status 0)."""
    b = pipe_broker()
    res = subprocess.run(
        [sys.executable, "-m", "msgq_trio", "pipe", "read", "nobody", "--timeout", "0.3"],
        env=dict(os.environ, MSGQ_TRIO_SOCKET=str(b.path)),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 3 and b"timeout" in res.stderr


async def test_plugin_killed_breaks_open_pipes(pipe_broker: Callable[..., Any]) -> None:
    """The pipe plugin process dies (SIGKILL): a read waiting in it fails PipeBroken at
    once (the broker answers recipient-gone), and after the supervisor restarted the
    plugin, new pipes work."""
    b = pipe_broker()
    async with msgq_trio.connect(b.path, "r") as rb:
        r = await rb.pipe("doomed").open_reader()
        async with trio.open_nursery() as n:

            async def kill() -> None:
                await trio.sleep(0.3)
                os.kill(plugin_pid(b.pid), signal.SIGKILL)

            n.start_soon(kill)
            with pytest.raises(PipeBroken), trio.fail_after(5):
                await r.read()
        with pytest.raises(PipeBroken):
            await r.read()
        with trio.fail_after(30):
            while True:
                try:
                    w = await rb.pipe("fresh").open_writer()
                    break
                except msgq_trio.NoRecipient:
                    await trio.sleep(0.1)
        r2 = await rb.pipe("fresh").open_reader()
        await w.write(b"alive")
        assert await r2.read(10) == b"alive"


@pytest.mark.slow
def test_256_mib_through_a_slow_reader_stays_under_the_bound(
    pipe_broker: Callable[..., Any], spawn_peer: Callable[..., Any]
) -> None:
    """256 MiB from a writer process to a reader process that pauses every 16 MiB: every
    byte arrives in order (the reader checks the pattern), the pipe never holds more
    than max_buffer (2 MiB here; sampled from the plugin's counters), and neither the
    broker's nor the plugin's RSS grows by more than 32 MiB (the bound plus the chunks
    in flight, frames being assembled and allocator slack; 1/8 of what went through,
    128 times the bound: a pipe that kept what it passed on would show it)."""
    max_buffer = 2 * MiB
    total = 256 * MiB
    b = pipe_broker(max_buffer=max_buffer)
    ppid = plugin_pid(b.pid)
    reader = spawn_peer(
        b.path,
        "read",
        "big",
        "--chunk",
        str(256 * 1024),
        "--pause-every",
        str(16 * MiB),
        "--pause",
        "0.3",
    )
    wait_line(reader, "open", 20)
    base = {"broker": rss(b.pid), "plugin": rss(ppid)}
    peak = dict(base)
    writer = spawn_peer(b.path, "write", "big", "--total", str(total))
    wait_line(writer, "open", 20)
    t0 = time.monotonic()
    charged_peak = 0
    done: str | None = None

    async def sample() -> None:
        nonlocal charged_peak
        async with msgq_trio.connect(b.path, "sampler") as bus:
            while reader.poll() is None:
                st = await bus.call("msgq-pipe", "pipe.stats", {"pipe": "big"})
                charged_peak = max(charged_peak, int(st.get("charged", 0)))
                peak["broker"] = max(peak["broker"], rss(b.pid))
                peak["plugin"] = max(peak["plugin"], rss(ppid))
                await trio.sleep(0.1)

    async def main() -> None:
        nonlocal done
        async with trio.open_nursery() as n:
            n.start_soon(sample)
            done = await trio.to_thread.run_sync(wait_line, reader, "read", 120)
            n.cancel_scope.cancel()

    trio.run(main)
    elapsed = time.monotonic() - t0
    assert done == f"read {total} ok", done
    assert writer.wait(10) == 0 and reader.wait(10) == 0
    growth = {k: peak[k] - base[k] for k in base}
    print(
        f"{total // MiB} MiB in {elapsed:.1f} s ({total / elapsed / 1e6:.0f} MB/s); RSS growth "
        f"broker {growth['broker'] / MiB:.1f} MiB, plugin {growth['plugin'] / MiB:.1f} MiB;"
        f" pipe peak {charged_peak / MiB:.2f} MiB"
    )
    assert charged_peak <= max_buffer
    assert growth["broker"] < 32 * MiB, growth
    assert growth["plugin"] < 32 * MiB, growth
