"""Control commands against a real broker: clients, drop, shutdown, stats, the uid
allow-list (refusals are ``forbidden`` and logged with the caller's identity), and the
``msgq-trio ctl`` tables and JSON."""

from __future__ import annotations

import os
import signal
import time

import pytest
import trio
from ops_helpers import ctl, wait_for

import msgq_trio
from msgq_trio import ConnectionLost, RecipientGone
from msgq_trio.errors import RemoteError

CONTROL_COMMANDS = [
    "clients",
    "drop",
    "shutdown",
    "config-get",
    "config-set",
    "config-reload",
    "stats",
    "capture-start",
    "capture-stop",
    "capture-status",
    "dump-start",
    "dump-stop",
]


async def test_clients_lists_identity_traffic_queue_and_pending(broker, spawn_client) -> None:
    """``clients`` shows each client's lname, name, pid, uid, groups, messages and bytes
    both ways, queued bytes, pending requests both ways and when it connected; ``ctl
    clients`` prints the same as a table."""
    helper = spawn_client(
        broker.path, name="zonemgr", groups=["ZoneMgr"], commands={"hang": "hang"}
    )
    t0 = time.time()
    async with msgq_trio.connect(broker.path, name="bindctl") as caller:
        await caller.subscribe("Stats")
        for i in range(3):
            await caller.send("ZoneMgr", {"i": i})
        async with trio.open_nursery() as nursery:

            async def pending_call() -> None:
                with pytest.raises(RecipientGone):
                    await caller.call("ZoneMgr", "hang", {})

            nursery.start_soon(pending_call)
            assert (await helper.areadline()).startswith("got ")
            rows = await ctl(broker.path, "clients")
            by_name = {r["name"]: r for r in rows}
            me, zm = by_name["bindctl"], by_name["zonemgr"]
            assert me["lname"] == caller.lname and me["pid"] == os.getpid()
            assert zm["lname"] == helper.lname and zm["pid"] == helper.pid
            assert me["uid"] == os.getuid() and zm["uid"] == os.getuid()
            assert me["groups"] == ["Stats"] and zm["groups"] == ["ZoneMgr"]
            assert me["msgs_in"] >= 5 and me["bytes_in"] > 0  # subscribe, 3 sends, call
            assert zm["msgs_out"] >= 4 and zm["bytes_out"] > 0
            assert me["pending_out"] == 1 and me["pending_in"] == 0
            assert zm["pending_in"] == 1 and zm["pending_out"] == 0
            assert me["queued_bytes"] == 0
            assert t0 - 5 <= me["connected_at"] <= time.time() and me["connected_for"] >= 0
            assert "msgq-trio-ctl" in by_name  # the caller of ctl itself

            table = await ctl(broker.path, "clients", json_out=False)
            assert table.returncode == 0, table.stderr
            header, *lines = table.stdout.splitlines()
            assert header.split()[:4] == ["LNAME", "NAME", "PID", "UID"]
            assert "PENDING OUT/IN" in header
            line = next(ln for ln in lines if "bindctl" in ln)
            assert caller.lname in line and "Stats" in line and "1/0" in line
            helper.sigkill()  # the pending call ends with recipient-gone


async def test_drop_disconnects_and_logs_who_and_why(broker) -> None:
    """``drop LNAME`` disconnects that client (it learns why, the membership event says
    ``dropped``), the broker logs the victim's identity and the operator; an unknown
    lname is ``no-recipient`` and ctl exits 1."""
    async with (
        msgq_trio.connect(broker.path, name="victim") as victim,
        msgq_trio.connect(broker.path, name="watcher") as watcher,
    ):
        await watcher.subscribe("msgq.membership")
        row = await ctl(broker.path, "drop", victim.lname, "--reason", "maintenance")
        assert row["lname"] == victim.lname and row["name"] == "victim"
        with pytest.raises(ConnectionLost) as ei:
            await victim.receive(timeout=10)
        assert ei.value.code == "dropped"
        with trio.fail_after(10):
            while True:
                msg = await watcher.receive()
                if msg.event == "disconnected" and msg.body["lname"] == victim.lname:
                    assert msg.body["reason"] == "dropped"
                    break
        log = broker.log_with(f"dropping client {victim.lname} (name='victim'", "maintenance")
        assert f"dropping client {victim.lname} (name='victim' pid={os.getpid()}" in log
        assert f"[lname={victim.lname} client='victim' pid={os.getpid()}" in log
        r = await ctl(broker.path, "drop", "l.999", json_out=False)
        assert r.returncode == 1 and "no-recipient" in r.stderr
        with pytest.raises(RemoteError) as ei2:
            await watcher.call("msgq", "drop", {"lname": watcher.lname})
        assert ei2.value.code == "bad-request"
        assert await watcher.call("msgq", "ping") == "pong"


async def test_shutdown_command(broker) -> None:
    """``ctl shutdown`` answers, then the broker says GOODBYE to everyone, removes its
    socket and exits with status 0."""
    async with msgq_trio.connect(broker.path, name="bystander") as bus:
        broker.expect_exit = True
        r = await ctl(broker.path, "shutdown")
        assert r == {"shutting_down": True}
        with pytest.raises(ConnectionLost) as ei:
            await bus.receive(timeout=10)
        assert ei.value.code == "broker-shutdown"
    assert await trio.to_thread.run_sync(broker.wait, 15) == 0
    assert not await trio.Path(broker.path).exists()
    assert "shutdown requested by" in broker.log()


async def test_stats_extends_the_server_figures(broker) -> None:
    """``stats`` keeps the server's figures and adds lifetime traffic, disconnects by
    reason, capture, control and configuration; ``ctl stats`` prints key/value lines."""
    async with msgq_trio.connect(broker.path, name="a") as a:
        for _ in range(10):
            await a.send("Nobody", b"x" * 100)
        await a.flush()
    async with msgq_trio.connect(broker.path, name="b") as b:
        st = await b.call("msgq", "stats")
    for key in ("connections", "tasks", "fds", "pending_requests", "queued_bytes", "counters"):
        assert key in st
    assert st["traffic"]["messages_in"] >= 11  # survives the sender's disconnection
    assert st["traffic"]["bytes_in"] > 1000
    assert st["disconnects"]["closed"] >= 1
    assert st["connections_total"] >= 2
    assert st["capture"]["state"] == "off" and st["capture"]["tap"] is False
    assert st["control"]["allow_uids"] == [os.geteuid()]
    r = await ctl(broker.path, "stats", json_out=False)
    assert r.returncode == 0
    assert any(ln.startswith("traffic.messages_in") for ln in r.stdout.splitlines())


async def test_control_commands_refused_outside_the_allow_list(broker_factory) -> None:
    """With an allow-list that does not hold our uid, every control command answers
    ``forbidden`` and the refusal is logged with the caller's identity; the commands of
    the bus itself stay open; ``ctl`` exits 1 naming the error."""
    other = 54321 if os.getuid() != 54321 else 54322
    b = broker_factory("--ctl-allow-uid", str(other))
    async with msgq_trio.connect(b.path, name="intruder") as bus:
        for cmd in CONTROL_COMMANDS:
            with pytest.raises(RemoteError) as ei:
                await bus.call("msgq", cmd, {"lname": bus.lname, "key": "socket"})
            assert ei.value.code == "forbidden", cmd
            assert str(other) in ei.value.message
        assert await bus.call("msgq", "ping") == "pong"
        assert await bus.subscribe("G") is True
        assert [m.lname for m in await bus.members("G")] == [bus.lname]
        assert await bus.unsubscribe("G") is True
        assert (await bus.version())["protocol"] == 1
        log = b.log_with(f"refused control command 'clients' from {bus.lname}")
        assert (
            f"refused control command 'clients' from {bus.lname} (name='intruder' "
            f"pid={os.getpid()} uid={os.getuid()})"
        ) in log
        assert f"[lname={bus.lname} client='intruder' pid={os.getpid()}" in log
    r = await ctl(b.path, "clients", json_out=False)
    assert r.returncode == 1 and "forbidden" in r.stderr
    assert "Traceback" not in r.stderr


async def test_allow_list_from_the_file_and_at_runtime(broker_factory, write_config) -> None:
    """``control.allow_uids`` in the file admits the listed uids only; changing it with
    config-set takes effect for the next command (here: locking ourselves out)."""
    me = os.geteuid()
    conf = write_config(f"[control]\nallow_uids = [{me}, 4242]\n")
    b = broker_factory("--config", str(conf))
    async with msgq_trio.connect(b.path, name="op") as bus:
        st = await bus.call("msgq", "stats")
        assert st["control"]["allow_uids"] == sorted([me, 4242])
        await bus.call("msgq", "config-set", {"key": "control.allow_uids", "value": [4242]})
        with pytest.raises(RemoteError) as ei:
            await bus.call("msgq", "stats")
        assert ei.value.code == "forbidden"
    # SIGHUP restores the file's list.
    b.proc.send_signal(signal.SIGHUP)
    async with msgq_trio.connect(b.path, name="op") as bus:

        async def allowed() -> bool:
            try:
                await bus.call("msgq", "stats")
            except RemoteError:
                return False
            return True

        await wait_for(allowed)
