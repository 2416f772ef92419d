"""One connection for Python and C: a Python program using libmsgq through ctypes
(tests/c/libmsgq_py.py) hands its connection's native handle to a C component loaded
into it as a shared object (tests/c/component.c); the component calls and registers a
command on that connection, Python keeps calling and receiving on it, and the broker
sees one client. The program is tests/c/shared_handle_app.py, run as a child process
against the plain and the sanitized build (``cbuild``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from libmsgq_build import C_DIR, CBuild, check_clean

import msgq_trio

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT = 60.0
SANITIZE = ["-fsanitize=address,undefined"]


def build_component(build: CBuild) -> Path:
    """component.c as a shared object linked against this build's libmsgq (instrumented
    like it for the sanitized build); built once per build directory."""
    so = build.dir / "component.so"
    if so.exists():
        return so
    cflags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "libcbor"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    argv = [
        "cc", "-shared", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Werror",
        *(SANITIZE if build.name == "asan" else []),
        "-I", str(C_DIR / "include"), str(HERE / "component.c"), "-o", str(so),
        "-L", str(build.dir), "-lmsgq", f"-Wl,-rpath,{build.dir}", *cflags,
    ]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return so


def app_env(build: CBuild) -> dict[str, str]:
    """The environment of the Python program: for the sanitized build, the ASan runtime
    preloaded (the interpreter is not instrumented, so it must come first), and leak
    checking off because the interpreter keeps memory to the end by design; memory
    errors and undefined behaviour in libmsgq and the component still fail the run."""
    env = {**build.env, "PYTHONPATH": str(HERE)}
    if build.name == "asan":
        libasan = subprocess.run(
            ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
        env["LD_PRELOAD"] = libasan
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
    return env


class Lines:
    """JSON lines from the program's stdout."""

    def __init__(self, proc: trio.Process, err: Path) -> None:
        assert proc.stdout is not None
        self._stdout = proc.stdout
        self._err = err
        self._buf = b""

    async def next(self) -> dict[str, Any]:
        with trio.fail_after(RUN_TIMEOUT):
            while b"\n" not in self._buf:
                chunk = await self._stdout.receive_some()
                assert chunk, f"the program ended early:\n{self._err.read_text()}"
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        row: dict[str, Any] = json.loads(line)
        return row


async def test_c_component_shares_the_python_connection(
    cbuild: CBuild, broker: Any, short_tmp: Path
) -> None:
    """The component's call and Python's own call leave through the same connection (the
    callee sees one sender, the broker one member with the program's pid), the command
    the component registered is answered by Python's loop, and a message sent to the
    program arrives on that connection afterwards."""
    component = build_component(cbuild)
    async with msgq_trio.connect(str(broker.path), name="py-peer") as peer:
        await peer.subscribe("PyPeer")
        greeted: list[tuple[str, str, str]] = []

        @peer.command("greet")
        def greet(params: Any, request: msgq_trio.Message) -> str:
            name = str(params["name"])
            greeted.append((request.sender, request.sender_name, name))
            return "hello " + name

        errlog = short_tmp / "app.err"
        err = os.open(errlog, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            proc = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    str(HERE / "shared_handle_app.py"),
                    str(cbuild.dir / "libmsgq.so"),
                    str(component),
                    str(broker.path),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=app_env(cbuild),
            )
        finally:
            os.close(err)
        try:
            lines = Lines(proc, errlog)
            connected = await lines.next()
            lname = connected["lname"]
            assert connected == {"step": "connected", "lname": lname}
            assert await lines.next() == {"step": "component", "rc": 0, "text": "hello C"}
            assert await lines.next() == {"step": "register", "rc": 0}
            assert await lines.next() == {"step": "python", "result": "hello Python"}
            assert await lines.next() == {"step": "ready"}

            # Both calls came over one connection: one stamped sender, one member.
            assert greeted == [(lname, "shared-app", "C"), (lname, "shared-app", "Python")]
            members = await peer.members("App")
            assert [(m.lname, m.name, m.pid) for m in members] == [(lname, "shared-app", proc.pid)]

            # The component's handler is served by the Python program's loop.
            assert await peer.call("App", "double", 21) == 42
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await peer.call(lname, "double", "x")
            assert ei.value.code == "bad-request"

            # Python still receives on the connection after the component used it.
            await peer.send("App", {"n": 1})
            assert await lines.next() == {"step": "message", "sender": peer.lname, "body": {"n": 1}}
            await peer.send("App", "bye")
            assert await lines.next() == {"step": "message", "sender": peer.lname, "body": "bye"}
            assert await lines.next() == {"step": "closed"}
            with trio.fail_after(RUN_TIMEOUT):
                status = await proc.wait()
            assert await peer.members("App") == []
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
    stderr = errlog.read_text()
    assert status == 0, stderr
    check_clean(stderr)
