"""The access verbs of a plugin's commands come from the plugin's own declaration
(``Plugin.access``, plugins/api.py), read by the broker when it starts: a plugin the
broker's code has never heard of gets its commands checked; a declaration with a verb
the broker does not know stops the start; ``[access] queue_group`` moves the queue
plugin's checks, also on a reload.

The test plugins (tests/plugins/access_plugin.py) are registered like an installed
distribution's: a ``.dist-info`` directory with ``entry_points.txt`` on the broker's
PYTHONPATH, which the plugin processes inherit.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from access_plugin import PLUGIN as TALLY
from msgq_trio.plugins.loader import PluginConfigError, enforced_commands

import msgq_trio
from msgq_trio import Forbidden
from msgq_trio.config import AccessSettings, CommandAccess

#: Bounds only a broken build reaches (a reload normally applies in milliseconds).
RELOAD_TIMEOUT = 20.0


@pytest.fixture
def test_plugins(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Register ``tally`` and ``badverb`` (tests/plugins/access_plugin.py) under the
    entry-point group ``msgq_trio.plugins`` for the brokers this test starts."""
    site = short_tmp / "site"
    dist = site / "msgq_test_access_plugins-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: msgq-test-access-plugins\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[msgq_trio.plugins]\ntally = access_plugin:PLUGIN\nbadverb = access_plugin:BAD\n"
    )
    shutil.copy(Path(__file__).with_name("access_plugin.py"), site)
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(site), *([inherited] if inherited else [])])
    )
    return site


def restricted_config(path: Path, *extra: str, **grants: list[str]) -> Path:
    """A configuration whose one rule restricts every client of this uid (the test's and
    the plugins' connections alike) to ``grants``."""
    lines = [*extra, "[[access.rule]]", f'who = ["uid:{os.getuid()}"]']
    lines += [f"{verb} = {list(patterns)!r}".replace("'", '"') for verb, patterns in grants.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_the_broker_enforces_the_verbs_a_plugin_declares(
    broker_factory: Callable[..., Any], short_tmp: Path, test_plugins: Path
) -> None:
    """``tally`` declares ``bump`` -> produce and ``read`` -> consume on the counter its
    params name: a restricted client's ``bump`` of a counter it may produce to is
    answered, of another one (or of none) refused, ``read`` refused without consume; an
    undeclared command needs ``call`` only. The denials name the declared verb, params
    key and command."""
    cfg = restricted_config(
        short_tmp / "tally.toml",
        "[plugins.tally]",
        call=["tally"],
        subscribe=["tally"],
        produce=["mine"],
    )
    b = broker_factory("--config", str(cfg))
    async with msgq_trio.connect(b.path, name="user") as c:
        assert await c.call("tally", "bump", {"counter": "mine"}) == ["bump", {"counter": "mine"}]
        assert await c.call("tally", "other", {"counter": "theirs"}) == [
            "other",
            {"counter": "theirs"},
        ]
        with pytest.raises(Forbidden, match="produce \\(counter command 'bump'\\) on 'theirs'"):
            await c.call("tally", "bump", {"counter": "theirs"})
        with pytest.raises(Forbidden, match="consume \\(counter command 'read'\\) on 'mine'"):
            await c.call("tally", "read", {"counter": "mine"})
        with pytest.raises(Forbidden, match="on 'None'"):
            await c.call("tally", "bump", {"queue": "mine"})
        # The queue plugin's commands stay its own: on another group they need only call.
        assert await c.call("tally", "fetch", {"queue": "payroll"}) == [
            "fetch",
            {"queue": "payroll"},
        ]


@pytest.mark.parametrize(("line", "young"), [("", 10_000), ("gc_threshold = 12345", 12345)])
async def test_plugin_processes_run_with_the_brokers_gc_threshold(
    broker_factory: Callable[..., Any], short_tmp: Path, test_plugins: Path, line: str, young: int
) -> None:
    """The broker's ``gc_threshold`` (default 10,000) is the youngest generation's
    threshold of its plugin processes' collector; the older ones keep CPython's."""
    cfg = short_tmp / "gc.toml"
    cfg.write_text(f"{line}\n[plugins.tally]\n")
    b = broker_factory("--config", str(cfg))
    async with msgq_trio.connect(b.path, name="user") as c:
        assert await c.call("tally", "gc-threshold") == [young, *gc.get_threshold()[1:]]


def test_a_plugin_process_refuses_a_bad_gc_threshold(short_tmp: Path) -> None:
    """A plugin process whose inherited MSGQ_TRIO_GC_THRESHOLD is not a non-negative
    integer (only someone other than the broker sets one so) stops at once, exit status
    2, one line naming the variable."""
    for bad in ("lots", "-1"):
        r = subprocess.run(
            [sys.executable, "-m", "msgq_trio.plugins.host", "queue", str(short_tmp / "s"), "{}"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "MSGQ_TRIO_GC_THRESHOLD": bad},
        )
        assert r.returncode == 2, r.stderr
        assert f"MSGQ_TRIO_GC_THRESHOLD={bad!r}" in r.stderr and "Traceback" not in r.stderr


def test_a_plugin_declaring_an_unknown_verb_stops_the_start(
    broker_argv: Callable[..., list[str]], short_tmp: Path, test_plugins: Path
) -> None:
    """``serve --plugin badverb``: exit status 1 before listening, one line naming the
    plugin, the command and the verb; no traceback, no socket file."""
    sock = short_tmp / "bad.sock"
    r = subprocess.run(
        broker_argv(sock, "--plugin", "badverb"),
        check=False,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert "cannot start: plugin 'badverb' declares verb 'obliterate' for its command 'zap'" in (
        r.stderr
    )
    assert "Traceback" not in r.stderr
    assert "listening" not in r.stdout
    assert not sock.exists()


def test_queue_group_places_the_queue_plugins_declaration() -> None:
    """The queue plugin's declaration is enforced on ``[access] queue_group``, another
    plugin's on the group it declares; two plugins' commands on one group are refused,
    naming both."""
    from msgq_trio.plugins.queue import ACCESS

    declared = {"queue": ACCESS, "tally": TALLY.access}
    table = enforced_commands(AccessSettings(queue_group="jobs-api"), declared)
    assert set(table) == {"jobs-api", "tally"}
    assert table["jobs-api"].verbs == ACCESS.verbs and table["jobs-api"].param == "queue"
    assert table["tally"] == TALLY.access
    clash = CommandAccess(group="tally", param="x", verbs={"y": "consume"})
    with pytest.raises(PluginConfigError, match="'tally' and 'other' both declare"):
        enforced_commands(AccessSettings(), {"tally": TALLY.access, "other": clash})


async def test_a_reload_moves_the_queue_checks_with_queue_group(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """No plugin runs (a stand-in answers), yet the queue plugin's declared verbs are
    checked on ``queue_group``; after SIGHUP with ``queue_group = "q2"`` they are
    checked on q2 and no longer on msgq-queue."""
    grants = {"call": ["msgq-queue", "q2"], "subscribe": ["msgq-queue", "q2"]}
    cfg = restricted_config(short_tmp / "q.toml", consume=["jobs"], **grants)
    b = broker_factory("--config", str(cfg))
    async with (
        msgq_trio.connect(b.path, name="svc") as svc,
        msgq_trio.connect(b.path, name="user") as c,
    ):
        svc.set_default_handler(lambda params, request: "done")
        await svc.subscribe("msgq-queue")
        await svc.subscribe("q2")
        payroll = {"queue": "payroll", "n": 1}
        with pytest.raises(Forbidden):
            await c.call("msgq-queue", "fetch", payroll)
        assert await c.call("q2", "fetch", payroll) == "done"

        restricted_config(cfg, "[access]", 'queue_group = "q2"', consume=["jobs"], **grants)
        os.kill(b.pid, signal.SIGHUP)
        with trio.fail_after(RELOAD_TIMEOUT):
            while True:
                try:
                    await c.call("q2", "fetch", payroll)
                except Forbidden:
                    break
                await trio.sleep(0.05)
        assert await c.call("msgq-queue", "fetch", payroll) == "done"
        assert await c.call("q2", "fetch", {"queue": "jobs", "n": 1}) == "done"
