"""``msgq-trio demo``: start a real broker process and show messages, RPC and failures flowing."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from . import NoRecipient, RecipientGone, connect


def start_broker(socket: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start ``msgq-trio serve`` as a child process and wait until it accepts connections."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "msgq_trio",
            "--log-level",
            "WARNING",
            "serve",
            "--socket",
            str(socket),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    import socket as pysocket

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with status {proc.returncode}")
        s = pysocket.socket(pysocket.AF_UNIX)
        try:
            s.connect(str(socket))
            return proc
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    proc.kill()
    raise RuntimeError("broker did not start within 15 s")


async def _demo(socket: Path) -> None:
    async with (
        connect(socket, name="ZoneMgr") as zonemgr,
        connect(socket, name="Auth") as auth,
        connect(socket, name="bindctl") as ctl,
    ):
        await zonemgr.subscribe("ZoneMgr")

        @zonemgr.command("get_zone_count")
        async def get_zone_count(params: dict[str, str]) -> int:
            return 42 if params.get("class") == "IN" else 0

        await auth.subscribe("Auth")
        await auth.subscribe("msgq.membership")
        print(f"connected: ZoneMgr={zonemgr.lname} Auth={auth.lname} bindctl={ctl.lname}")

        await ctl.send("Auth", {"zone": "example.org", "action": "reload"})
        msg = await auth.receive(timeout=5)
        while msg.kind != "message":
            msg = await auth.receive(timeout=5)
        print(f"Auth received {msg.body} from {msg.sender} ({msg.sender_name})")

        count = await ctl.call("ZoneMgr", "get_zone_count", {"class": "IN"})
        print(f"bindctl: ZoneMgr says there are {count} zones")

        try:
            await ctl.call("XfrIn", "retransfer")
        except NoRecipient as exc:
            print(f"bindctl: calling XfrIn -> {exc.code}: {exc.message}")

        members = await ctl.members("ZoneMgr")
        print("members of ZoneMgr:", ", ".join(f"{m.lname} ({m.name})" for m in members))

    # A callee that dies while a call is pending: the caller learns at once, no timer.
    async with connect(socket, name="bindctl") as ctl, connect(socket, name="Stats") as stats:
        await stats.subscribe("Stats")

        @stats.command("collect")
        async def collect(_params: object) -> None:
            await trio.sleep_forever()

        crashed_at = 0.0

        async def caller() -> None:
            try:
                await ctl.call("Stats", "collect")
            except RecipientGone as exc:
                ms = (trio.current_time() - crashed_at) * 1000
                print(f"bindctl: Stats crashed mid-call -> {exc.code} {ms:.1f} ms later")

        async with trio.open_nursery() as n:
            n.start_soon(caller)
            await trio.sleep(0.2)
            crashed_at = trio.current_time()
            await stats._stream.aclose()  # simulate a crash: the socket just closes
    print("demo finished: messages, RPC, no-recipient and recipient-gone all worked")


def run_demo(socket: Path | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="msgq-trio-demo-") as tmp:
        path = socket or Path(tmp) / "bus.sock"
        broker = start_broker(path)
        print(f"broker started (pid {broker.pid}) on {path}")
        try:
            trio.run(_demo, path)
        finally:
            broker.terminate()
            status = broker.wait(10)
            print(f"broker stopped with status {status}")
        return 0 if status == 0 and not os.path.exists(path) else 1
