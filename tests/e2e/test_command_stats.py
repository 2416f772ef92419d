"""Per-command statistics end to end: a real broker counts every call's outcome per
(group, command), and ``msgq-trio ctl stats --commands`` and the Prometheus endpoint show
exactly those counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import msgq_trio
from msgq_trio.errors import CommandFailed, RpcError

PY = sys.executable

# The 1,000 calls, by how they end.
N_OK, N_FAILED, N_GONE, N_NOBODY, N_TIMEOUT = 700, 200, 50, 40, 10
assert N_OK + N_FAILED + N_GONE + N_NOBODY + N_TIMEOUT == 1000


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "msgq_trio", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        stdin=subprocess.DEVNULL,
    )


async def ctl(socket: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    r = await trio.to_thread.run_sync(lambda: run_cli("ctl", "--socket", str(socket), *argv))
    assert "Traceback" not in r.stderr, r.stderr
    return r


async def http_get(address: str) -> str:
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], head
    return body.decode()


def samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(fams: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [s for s in fams.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name} {labels}: {found}"
    return float(found[0].value)


async def test_counts_of_a_thousand_calls(broker_factory, spawn_client) -> None:
    """700 answered, 200 failed with the callee's code ``zone-missing``, 50 pending on a
    callee that is then SIGKILLed, 40 to a group with no member and 10 past their deadline:
    the command table and the metrics show exactly these counts, each under its own
    (group, command)."""
    b = broker_factory("--metrics", "127.0.0.1:0")
    hang = spawn_client(b.path, name="hang", groups=["Hang"], commands={"wait": "hang"})
    async with (
        msgq_trio.connect(b.path, name="caller") as caller,
        msgq_trio.connect(b.path, name="zones") as zones,
        msgq_trio.connect(b.path, name="slow") as slow,
    ):

        def lookup(params: Any) -> Any:
            if params["fail"]:
                raise CommandFailed("zone-missing", f"no zone {params['i']}")
            return params["i"]

        async def never(_params: Any) -> Any:
            await trio.sleep_forever()

        zones.add_command("lookup", lookup)
        await zones.subscribe("Zones")
        slow.add_command("wait", never)
        await slow.subscribe("Slow")

        outcomes: dict[str, int] = {}

        async def one(target: str, command: str, params: Any, timeout: float | None = None):
            try:
                await caller.call(target, command, params, timeout=timeout)
                key = "ok"
            except RpcError as exc:
                key = exc.code
            outcomes[key] = outcomes.get(key, 0) + 1

        with trio.fail_after(60):
            # Calls to the callee that will be killed: pending until it dies.
            async with trio.open_nursery() as gone:
                for i in range(N_GONE):
                    gone.start_soon(one, "Hang", "wait", i)
                for _ in range(N_GONE):
                    line = await hang.areadline()
                    assert line is not None and line.startswith("got "), line
                # The ok and failed calls, 50 at a time, while those are pending.
                calls = [(i, i >= N_OK) for i in range(N_OK + N_FAILED)]
                for start in range(0, len(calls), 50):
                    async with trio.open_nursery() as n:
                        for i, fail in calls[start : start + 50]:
                            n.start_soon(one, "Zones", "lookup", {"i": i, "fail": fail})
                async with trio.open_nursery() as n:
                    for i in range(N_NOBODY):
                        n.start_soon(one, "Nobody", "lookup", i)
                    for i in range(N_TIMEOUT):
                        n.start_soon(one, "Slow", "wait", i, 0.3)
                await trio.to_thread.run_sync(hang.sigkill)
        assert outcomes == {
            "ok": N_OK,
            "zone-missing": N_FAILED,
            "recipient-gone": N_GONE,
            "no-recipient": N_NOBODY,
            "timeout": N_TIMEOUT,
        }

        r = await ctl(b.path, "--json", "stats", "--commands")
        assert r.returncode == 0, r.stderr
        table = json.loads(r.stdout)
        rows = {(row["group"], row["command"]): row for row in table["commands"]}
        assert set(rows) == {
            ("Zones", "lookup"),
            ("Hang", "wait"),
            ("Nobody", "lookup"),
            ("Slow", "wait"),
        }
        zero = dict.fromkeys(
            ("ok", "error", "no-recipient", "refused", "recipient-gone", "timeout", "cancelled"),
            0,
        )
        z = rows[("Zones", "lookup")]
        assert z["requests"] == N_OK + N_FAILED
        assert z["outcomes"] == {**zero, "ok": N_OK, "error": N_FAILED}
        assert z["errors"] == {"zone-missing": N_FAILED}
        assert z["latency"]["count"] == N_OK + N_FAILED == sum(z["latency"]["buckets"])
        assert z["latency"]["p50"] is not None
        assert rows[("Hang", "wait")]["requests"] == N_GONE
        assert rows[("Hang", "wait")]["outcomes"] == {**zero, "recipient-gone": N_GONE}
        assert rows[("Nobody", "lookup")]["outcomes"] == {**zero, "no-recipient": N_NOBODY}
        assert rows[("Slow", "wait")]["outcomes"] == {**zero, "timeout": N_TIMEOUT}
        assert rows[("Slow", "wait")]["latency"]["count"] == 0
        assert sum(row["requests"] for row in table["commands"]) == 1000
        assert (table["pairs"], table["max_pairs"], table["overflow"]) == (4, 1024, 0)
        # Sorted by requests; --top keeps the first.
        assert [row["command"] for row in table["commands"]][:2] == ["lookup", "wait"]
        r = await ctl(b.path, "stats", "--commands", "--top", "1")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].split()[:4] == ["GROUP", "COMMAND", "REQUESTS", "OK"]
        assert lines[1].split()[:5] == ["Zones", "lookup", "900", "700", "200"]
        assert "zone-missing=200" in lines[1]
        assert lines[2] == "4 of at most 1024 (group, command) pairs tracked"

        # The same counts as Prometheus series.
        address = (await caller.call("msgq", "stats"))["metrics"]["address"]
        fams = samples(await http_get(address))
        zl = {"group": "Zones", "command": "lookup"}
        assert value(fams, "msgq_command_requests_total", **zl) == N_OK + N_FAILED
        assert value(fams, "msgq_command_outcomes_total", **zl, outcome="ok") == N_OK
        assert value(fams, "msgq_command_outcomes_total", **zl, outcome="error") == N_FAILED
        assert value(fams, "msgq_command_errors_total", **zl, code="zone-missing") == N_FAILED
        assert value(fams, "msgq_command_latency_seconds_count", **zl) == N_OK + N_FAILED
        assert value(fams, "msgq_command_latency_seconds_bucket", **zl, le="+Inf") == 900
        for group, command, outcome, n in (
            ("Hang", "wait", "recipient-gone", N_GONE),
            ("Nobody", "lookup", "no-recipient", N_NOBODY),
            ("Slow", "wait", "timeout", N_TIMEOUT),
        ):
            labels = {"group": group, "command": command}
            assert value(fams, "msgq_command_requests_total", **labels) == n
            assert value(fams, "msgq_command_outcomes_total", **labels, outcome=outcome) == n
            assert value(fams, "msgq_command_outcomes_total", **labels, outcome="ok") == 0
        assert value(fams, "msgq_command_stats_pairs") == 4
        assert value(fams, "msgq_command_stats_overflow_total") == 0


async def test_pairs_past_the_bound_are_counted_as_other(broker_factory) -> None:
    """With ``--max-command-stats 2`` a client calling made-up commands fills two pairs;
    the rest are counted under other/other and as overflow, visible in the table and the
    metrics; a direct call to one connection is counted under group ``l.*``."""
    b = broker_factory("--max-command-stats", "2", "--metrics", "127.0.0.1:0")
    async with (
        msgq_trio.connect(b.path, name="caller") as caller,
        msgq_trio.connect(b.path, name="callee") as callee,
    ):
        callee.add_command("known", lambda p: p)
        await callee.subscribe("G")
        assert await caller.call(callee.lname, "known", 1) == 1
        for i in range(5):
            with pytest.raises(RpcError) as err:
                await caller.call("G", f"made-up-{i}")
            assert err.value.code == "unknown-command"
        r = await ctl(b.path, "--json", "stats", "--commands")
        assert r.returncode == 0, r.stderr
        table = json.loads(r.stdout)
        assert (table["pairs"], table["max_pairs"], table["overflow"]) == (2, 2, 4)
        rows = [(x["group"], x["command"], x["requests"]) for x in table["commands"]]
        assert rows == [("other", "other", 4), ("G", "made-up-0", 1), ("l.*", "known", 1)]
        assert table["commands"][0]["errors"] == {"unknown-command": 4}
        r = await ctl(b.path, "stats", "--commands")
        assert r.stdout.splitlines()[-1] == (
            "2 of at most 2 (group, command) pairs tracked; "
            "4 requests past the bound counted under other"
        )
        stats = await caller.call("msgq", "stats")
        assert stats["command_stats"] == {"pairs": 2, "max_pairs": 2, "overflow": 4}
        fams = samples(await http_get(stats["metrics"]["address"]))
        assert value(fams, "msgq_command_stats_overflow_total") == 4
        assert value(fams, "msgq_command_requests_total", group="other", command="other") == 4
        assert len(fams["msgq_command_requests_total"]) == 3
        # Raised at runtime: new pairs are tracked again, the counts so far stay.
        r = await ctl(b.path, "config", "set", "max_command_stats", "3")
        assert r.returncode == 0, r.stderr
        with pytest.raises(RpcError):
            await caller.call("G", "made-up-9")
        table = await caller.call("msgq", "command-stats")
        assert (table["pairs"], table["max_pairs"], table["overflow"]) == (3, 3, 4)
        assert ("G", "made-up-9", 1) in [
            (x["group"], x["command"], x["requests"]) for x in table["commands"]
        ]


async def test_bad_top_is_the_callers_fault(broker) -> None:
    """A ``top`` that is not a positive integer is refused (bad-request) by the broker;
    ``--top 0`` is refused by the command line before it connects (exit status 2)."""
    async with msgq_trio.connect(broker.path, name="c") as bus:
        for top in (0, -1, "3", True):
            with pytest.raises(RpcError) as err:
                await bus.call("msgq", "command-stats", {"top": top})
            assert err.value.code == "bad-request"
            assert "top must be a positive integer" in err.value.message
    r = await ctl(broker.path, "stats", "--commands", "--top", "0")
    assert r.returncode == 2 and "positive integer" in r.stderr
    r = await ctl(broker.path, "stats", "--top", "3")
    assert r.returncode == 2 and "--top goes with --commands" in r.stderr


async def test_refused_all_and_cancelled_calls(broker) -> None:
    """A plain call to a group of two is refused by the broker (``refused``); a call to
    every member counts one request and an outcome per member; a caller that leaves with
    a call pending counts it ``cancelled`` once the broker has seen it go."""
    async with (
        msgq_trio.connect(broker.path, name="caller") as caller,
        msgq_trio.connect(broker.path, name="m1") as m1,
        msgq_trio.connect(broker.path, name="m2") as m2,
    ):

        async def never(_params: Any) -> Any:
            await trio.sleep_forever()

        for m in (m1, m2):
            m.add_command("echo", lambda p: p)
            await m.subscribe("G")
        m1.add_command("wait", never)
        await m1.subscribe("Slow")
        with pytest.raises(RpcError) as err:
            await caller.call("G", "echo", 1)
        assert err.value.code == "multiple-recipients"
        answers = await caller.call_all("G", "echo", 2)
        assert len(answers) == 2
        async with msgq_trio.connect(broker.path, name="quitter") as quitter:
            with trio.move_on_after(0.2):
                await quitter.call("Slow", "wait")

        async def rows() -> dict[tuple[str, str], Any]:
            table = await caller.call("msgq", "command-stats")
            return {(r["group"], r["command"]): r for r in table["commands"]}

        with trio.fail_after(10):
            while True:  # the broker sees the quitter go after its close returned
                got = await rows()
                if got[("Slow", "wait")]["outcomes"]["cancelled"] == 1:
                    break
                await trio.sleep(0.02)
        echo = got[("G", "echo")]
        assert echo["requests"] == 2
        assert (echo["outcomes"]["refused"], echo["outcomes"]["ok"]) == (1, 2)
        assert sum(echo["outcomes"].values()) == 3
        wait = got[("Slow", "wait")]
        assert wait["requests"] == 1 and sum(wait["outcomes"].values()) == 1
