"""End to end: RPC through a real broker process (results, handler errors, no-recipient,
recipient-gone on SIGKILL, broker and caller deadlines, call_all/call_many, callbacks,
membership events)."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import (
    Bus,
    CommandFailed,
    NoRecipient,
    RecipientGone,
    RemoteError,
    RequestTimeout,
    Result,
)
from msgq_trio.errors import MultipleRecipients


async def serve_calc(bus: Bus) -> None:
    await bus.subscribe("Calc")

    @bus.command("add")
    def add(params: list[int]) -> int:
        return sum(params)

    @bus.command("slow_add")
    async def slow_add(params: list[int]) -> int:
        await trio.sleep(0.01)
        return sum(params)

    @bus.command("whoami")
    def whoami(_params: object, request: msgq_trio.Message) -> dict[str, str]:
        return {"me": bus.lname, "caller": request.sender, "caller_name": request.sender_name}


async def test_call_returns_result(broker) -> None:
    """call() returns the handler's result (sync and async handlers) via the group, the
    lname, G[0] and G[?]; the handler sees the caller's true identity."""
    async with (
        msgq_trio.connect(broker.path, name="calc") as calc,
        msgq_trio.connect(broker.path, name="user") as user,
    ):
        await serve_calc(calc)
        assert await user.call("Calc", "add", [1, 2, 3]) == 6
        assert await user.call(calc.lname, "slow_add", [4, 5]) == 9
        assert await user.call("Calc[0]", "add", [10]) == 10
        assert await user.call("Calc[?]", "add", []) == 0
        assert await user.call("Calc", "whoami") == {
            "me": calc.lname,
            "caller": user.lname,
            "caller_name": "user",
        }
        results = [await user.call("Calc", "add", [i, i]) for i in range(50)]
        assert results == [2 * i for i in range(50)]


async def test_command_name_must_be_a_string(broker) -> None:
    """A non-string command is the caller's mistake: UsageError locally, nothing sent, and
    the connection carries on (a cached request header must not hide the check)."""
    async with (
        msgq_trio.connect(broker.path, name="calc") as calc,
        msgq_trio.connect(broker.path, name="user") as user,
    ):
        await serve_calc(calc)
        with pytest.raises(msgq_trio.UsageError, match="command must be a str"):
            await user.call("Calc", ["add"], [1])  # type: ignore[arg-type]
        assert await user.call("Calc", "add", [1, 2]) == 3
        assert await user.call("Calc", "add", [2, 2], timeout=5) == 4


async def test_sigkill_callee_fails_100_pending_calls_at_once(broker, spawn_client) -> None:
    """100 calls pending on a callee process that is SIGKILLed all raise RecipientGone
    within 2 s (the broker's request timeout stays at its 300 s default: no timer)."""
    victim = spawn_client(broker.path, name="victim", groups=["Victim"], commands={"work": "hang"})
    outcomes: list[BaseException | object] = []
    all_done = trio.Event()
    async with msgq_trio.connect(broker.path, name="caller") as caller:

        async def one(i: int) -> None:
            try:
                outcomes.append(await caller.call("Victim", "work", i))
            except Exception as exc:
                outcomes.append(exc)
            if len(outcomes) == 100:
                all_done.set()

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
            for _ in range(100):
                line = await victim.areadline(timeout=20)
                assert line is not None and line.startswith(f"got {victim.lname} work")
            assert outcomes == []
            t0 = trio.current_time()
            victim.sigkill()
            with trio.fail_after(30):
                await all_done.wait()
            elapsed = trio.current_time() - t0
    assert len(outcomes) == 100
    assert all(isinstance(o, RecipientGone) for o in outcomes), outcomes[:3]
    assert all(o.sender == victim.lname for o in outcomes)  # type: ignore[union-attr]
    # "At once" against the 300 s request timeout; bounds only catch a wait for a
    # timeout, with room for a loaded machine.
    assert elapsed < 10.0


@pytest.mark.parametrize(
    "target", ["EmptyGroup", "l.999999", "Solo[5]", "EmptyGroup[?]", "EmptyGroup[0]"]
)
async def test_no_recipient_at_once(broker, target: str) -> None:
    """A call to an empty group, an unknown lname or an instance index out of range raises
    NoRecipient immediately."""
    async with (
        msgq_trio.connect(broker.path, name="solo") as solo,
        msgq_trio.connect(broker.path, name="caller") as caller,
    ):
        await solo.subscribe("Solo")
        t0 = trio.current_time()
        with pytest.raises(NoRecipient) as ei:
            await caller.call(target, "anything")
        assert trio.current_time() - t0 < 10.0  # not the 300 s request timeout
        assert ei.value.code == "no-recipient"


async def test_call_to_group_of_two(broker) -> None:
    """A single-answer call to a group with 2 members raises MultipleRecipients and reaches
    neither member."""
    async with (
        msgq_trio.connect(broker.path, name="a") as a,
        msgq_trio.connect(broker.path, name="b") as b,
        msgq_trio.connect(broker.path, name="caller") as caller,
    ):
        calls: list[str] = []

        def recorder(lname: str) -> Any:
            return lambda _params: calls.append(lname)

        for bus in (a, b):
            bus.add_command("x", recorder(bus.lname))
            await bus.subscribe("Pair")
        with pytest.raises(MultipleRecipients) as ei:
            await caller.call("Pair", "x")
        assert ei.value.code == "multiple-recipients"
        assert await caller.call("Pair[1]", "x") is None
        assert calls == [b.lname]


async def test_black_hole_times_out_at_broker_deadline(broker_factory) -> None:
    """With --request-timeout 0.5 a call to a handler that never answers raises
    RequestTimeout after about 0.5 s, and the broker logs an ERROR naming both lnames."""
    b = broker_factory("--request-timeout", "0.5")
    async with (
        msgq_trio.connect(b.path, name="hole") as hole,
        msgq_trio.connect(b.path, name="asker") as asker,
    ):
        await hole.subscribe("Hole")

        @hole.command("swallow")
        async def swallow(_params: object) -> None:
            await trio.sleep_forever()

        t0 = trio.current_time()
        with pytest.raises(RequestTimeout) as ei:
            await asker.call("Hole", "swallow")
        elapsed = trio.current_time() - t0
        assert 0.45 <= elapsed < 10.0, elapsed  # not the 300 s default
        assert ei.value.code == "timeout"
        assert ei.value.sender == hole.lname
    lines = [ln for ln in b.log_with(" ERROR ", f"{hole.lname} (").splitlines() if " ERROR " in ln]
    assert any(f"{asker.lname} (" in ln and f"{hole.lname} (" in ln for ln in lines), lines


async def test_caller_timeout(broker) -> None:
    """call(timeout=0.3) to a handler that never answers raises RequestTimeout after about
    0.3 s even though the broker's own deadline is 300 s."""
    async with (
        msgq_trio.connect(broker.path, name="hole") as hole,
        msgq_trio.connect(broker.path, name="asker") as asker,
    ):

        @hole.command("swallow")
        async def swallow(_params: object) -> None:
            await trio.sleep_forever()

        t0 = trio.current_time()
        with pytest.raises(RequestTimeout):
            await asker.call(hole.lname, "swallow", timeout=0.3)
        assert 0.25 <= trio.current_time() - t0 < 10.0  # not the broker's 300 s


async def test_handler_errors_map_to_codes(broker) -> None:
    """CommandFailed keeps code/message/data; ValueError is bad-request; RuntimeError is
    internal-error naming the type; an unknown command is unknown-command."""
    async with (
        msgq_trio.connect(broker.path, name="svc") as svc,
        msgq_trio.connect(broker.path, name="caller") as caller,
    ):
        await svc.subscribe("Svc")

        @svc.command("missing")
        def missing(_params: object) -> None:
            raise CommandFailed("zone-missing", "no such zone", {"zone": "x"})

        @svc.command("picky")
        def picky(_params: object) -> None:
            raise ValueError("params must be a list")

        @svc.command("broken")
        async def broken(_params: object) -> None:
            raise RuntimeError("disk on fire")

        with pytest.raises(RemoteError) as ei:
            await caller.call("Svc", "missing")
        assert (ei.value.code, ei.value.message, ei.value.data) == (
            "zone-missing",
            "no such zone",
            {"zone": "x"},
        )
        assert ei.value.sender == svc.lname

        with pytest.raises(RemoteError) as ei:
            await caller.call("Svc", "picky")
        assert ei.value.code == "bad-request"
        assert "params must be a list" in ei.value.message

        with pytest.raises(RemoteError) as ei:
            await caller.call("Svc", "broken")
        assert ei.value.code == "internal-error"
        assert "RuntimeError" in ei.value.message

        with pytest.raises(RemoteError) as ei:
            await caller.call("Svc", "no_such_command")
        assert ei.value.code == "unknown-command"
        assert "missing" in ei.value.data
        # The service survived all of that.
        with pytest.raises(RemoteError):
            await caller.call("Svc", "missing")


async def test_call_all(broker) -> None:
    """call_all() returns one Result per other member in join order with their answers;
    the caller (a member itself) is not called; an empty group raises NoRecipient."""
    async with AsyncExitStack() as stack:
        caller = await stack.enter_async_context(msgq_trio.connect(broker.path, name="c"))
        members = []

        def status(lname: str) -> Any:
            return lambda params: {"lname": lname, "p": params}

        for i in range(3):
            m = await stack.enter_async_context(msgq_trio.connect(broker.path, name=f"m{i}"))
            m.add_command("status", status(m.lname))
            await m.subscribe("Status")
            members.append(m)
            if i == 1:
                await caller.subscribe("Status")
        caller.add_command("status", lambda p: pytest.fail("the caller was called"))
        results = await caller.call_all("Status", "status", 7)
        assert [r.sender for r in results] == [m.lname for m in members]
        assert all(r.ok for r in results)
        assert [r.value for r in results] == [{"lname": m.lname, "p": 7} for m in members]
        with pytest.raises(NoRecipient):
            await caller.call_all("Nobody", "status")


async def test_call_all_with_a_failing_member(broker) -> None:
    """call_all(): a member whose handler fails yields an error Result, others succeed."""
    async with (
        msgq_trio.connect(broker.path, name="ok") as ok,
        msgq_trio.connect(broker.path, name="bad") as bad,
        msgq_trio.connect(broker.path, name="caller") as caller,
    ):
        ok.add_command("x", lambda p: "fine")

        def fail(_p: object) -> None:
            raise CommandFailed("nope", "refused")

        bad.add_command("x", fail)
        await ok.subscribe("G")
        await bad.subscribe("G")
        results = await caller.call_all("G", "x")
        assert [(r.sender, r.ok) for r in results] == [(ok.lname, True), (bad.lname, False)]
        assert results[0].unwrap() == "fine"
        assert isinstance(results[1].error, RemoteError) and results[1].error.code == "nope"


async def test_call_many_50_instances_with_a_sigkill(broker, spawn_client) -> None:
    """call_many over Workers[0..49] (50 connections in two helper processes): SIGKILL the
    process holding 3 of them while all calls are pending -> exactly those 3 raise
    RecipientGone, the other 47 succeed with their own instance's answer."""
    steady = spawn_client(
        broker.path, name="steady", groups=["Workers"], commands={"work": "echo"}, count=47
    )
    doomed = spawn_client(
        broker.path, name="doomed", groups=["Workers"], commands={"work": "hang"}, count=3
    )
    async with msgq_trio.connect(broker.path, name="boss") as boss:
        members = await boss.members("Workers")
        assert [m.lname for m in members] == steady.lnames + doomed.lnames
        results: list[Result] = []

        async def run() -> None:
            results.extend(await boss.call_many([(f"Workers[{i}]", "work", i) for i in range(50)]))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                got = [await doomed.areadline(timeout=15) for _ in range(3)]
                assert sorted(line.split()[1] for line in got) == sorted(doomed.lnames)  # type: ignore[union-attr]
                doomed.sigkill()
    assert len(results) == 50
    failed = [i for i, r in enumerate(results) if not r.ok]
    assert failed == [47, 48, 49]
    for i in failed:
        assert isinstance(results[i].error, RecipientGone)
        assert results[i].target == f"Workers[{i}]"
    for i, r in enumerate(results[:47]):
        assert r.value == {"lname": members[i].lname, "params": i}


async def test_call_cb_and_call_many_cb(broker) -> None:
    """call_cb runs its callback with (True, result) or (False, error); call_many_cb runs
    its callback once with every Result."""
    async with (
        msgq_trio.connect(broker.path, name="calc") as calc,
        msgq_trio.connect(broker.path, name="user") as user,
    ):
        await serve_calc(calc)
        got: list[tuple[str, Any]] = []
        done = trio.Event()

        def record(tag: str) -> Any:
            async def cb(*args: Any) -> None:
                got.append((tag, args))
                if len(got) == 3:
                    done.set()

            return cb

        user.call_cb("Calc", "add", [2, 3], record("ok"))
        user.call_cb("Nobody", "add", [1], record("err"))
        user.call_many_cb(
            [("Calc", "add", [1]), ("Calc", "slow_add", [2, 2]), ("Nobody", "add")], record("many")
        )
        with trio.fail_after(10):
            await done.wait()
        by_tag = dict(got)
        assert by_tag["ok"] == (True, 5)
        ok, err = by_tag["err"]
        assert ok is False and isinstance(err, NoRecipient)
        (results,) = by_tag["many"]
        assert [(r.ok, r.value) for r in results[:2]] == [(True, 1), (True, 4)]
        assert isinstance(results[2].error, NoRecipient)


async def test_membership_events_of_a_sigkilled_client(broker, spawn_client) -> None:
    """A watcher subscribed to msgq.membership sees, for a client process that is
    SIGKILLed: connected, subscribed (each group), unsubscribed (each group, reason
    disconnect), disconnected (reason connection-lost), in that order."""
    async with msgq_trio.connect(broker.path, name="watcher") as watcher:
        await watcher.subscribe("msgq.membership")
        helper = spawn_client(broker.path, name="mortal", groups=["G1", "G2"])
        helper.sigkill()
        events = []
        with trio.fail_after(10):
            async for msg in watcher:
                assert msg.kind == "notification"
                assert msg.sender == "l.0"
                if msg.body.get("lname") != helper.lname:
                    continue
                events.append((msg.event, msg.body.get("group"), msg.body.get("reason")))
                if msg.event == "disconnected":
                    break
        assert events == [
            ("connected", None, None),
            ("subscribed", "G1", None),
            ("subscribed", "G2", None),
            ("unsubscribed", "G1", "disconnect"),
            ("unsubscribed", "G2", "disconnect"),
            ("disconnected", None, "connection-lost"),
        ]


async def test_caller_leaves_with_pending_calls(broker) -> None:
    """When a caller disconnects with calls pending, the callee's late answers are
    discarded and the broker stays healthy: nothing pending, others can still call."""
    async with (
        msgq_trio.connect(broker.path, name="callee") as callee,
        msgq_trio.connect(broker.path, name="other") as other,
    ):
        await callee.subscribe("Slow")
        started = 0
        all_started = trio.Event()
        release = trio.Event()

        @callee.command("slow")
        async def slow(params: int) -> int:
            nonlocal started
            started += 1
            if started == 5:
                all_started.set()
            await release.wait()
            return params

        @callee.command("echo")
        def echo(params: object) -> object:
            return params

        async with (
            msgq_trio.connect(broker.path, name="impatient") as impatient,
            trio.open_nursery() as nursery,
        ):
            for i in range(5):
                nursery.start_soon(impatient.call, "Slow", "slow", i)
            with trio.fail_after(10):
                await all_started.wait()
            nursery.cancel_scope.cancel()
        release.set()
        await trio.sleep(0.2)  # let the late answers reach the broker
        assert await other.call("Slow", "echo", "alive") == "alive"
        stats = await other.call("msgq", "stats")
        assert stats["pending_requests"] == 0
        assert stats["counters"]["late_answers"] == 5
        assert [m.name for m in await other.members("Slow")] == ["callee"]
    log = broker.log()
    assert "Traceback" not in log and "internal error" not in log, log


async def test_request_to_self(broker) -> None:
    """A client may call its own lname and answer itself."""
    async with msgq_trio.connect(broker.path, name="narcissus") as bus:
        bus.add_command("mirror", lambda p: ["mirror", p])
        assert await bus.call(bus.lname, "mirror", 1) == ["mirror", 1]


async def test_helper_process_reports_json(broker, spawn_client) -> None:
    """The helper client process serves 'echo' on every connection it opens (sanity check
    of the fixture the fault tests rely on)."""
    helper = spawn_client(broker.path, name="h", groups=["H"], commands={"e": "echo"}, count=2)
    assert len(set(helper.lnames)) == 2
    async with msgq_trio.connect(broker.path) as bus:
        for i, lname in enumerate(helper.lnames):
            assert await bus.call(f"H[{i}]", "e", [i]) == {"lname": lname, "params": [i]}
    assert json.loads(json.dumps(helper.lnames)) == helper.lnames
