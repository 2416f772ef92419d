"""Configuration: the TOML file, flags over the file, refusal of invalid files at start and
at runtime (SIGHUP keeps the running configuration), runtime changes that apply."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio
from ops_helpers import ctl, run_cli, wait_for

import msgq_trio
from msgq_trio.config import BrokerConfig
from msgq_trio.errors import LimitExceeded, RemoteError
from msgq_trio.ops import config_file
from msgq_trio.ops.config_file import ConfigError, ConfigSource


# -- the file format, without a broker -----------------------------------------------------
@pytest.mark.parametrize(
    "doc,key,shown",
    [
        ({"limits": {"max_frame_size": -1}}, "limits.max_frame_size", "-1"),
        ({"limits": {"request_timeout": "soon"}}, "limits.request_timeout", '"soon"'),
        ({"limits": {"max_frame_sise": 5}}, "limits.max_frame_sise", "max_frame_size"),
        ({"log": {"level": "LOUD"}}, "log.level", '"LOUD"'),
        ({"capture": {"kinds": ["message", "gossip"]}}, "capture.kinds", "gossip"),
        ({"control": {"allow_uids": [0, -5]}}, "control.allow_uids", "-5"),
        ({"limitz": {}}, "limitz", "limits"),
        ({"log": 3}, "log", "3"),
    ],
)
def test_invalid_values_name_key_and_value(doc: dict, key: str, shown: str) -> None:
    """Every kind of mistake is a ConfigError whose message names the key and shows the
    value (or, for a misspelt key, suggests the right one)."""
    with pytest.raises(ConfigError) as ei:
        config_file.build(doc)
    assert key in str(ei.value)
    assert shown in str(ei.value)


def test_rules_between_keys_and_defaults() -> None:
    """Cross-key rules are checked; an empty file gives the documented defaults; a dotted
    key can be read, set (bare limit names work) and diffed."""
    with pytest.raises(ConfigError, match="out_hard_limit"):
        config_file.build({"limits": {"max_frame_size": 1 << 20, "out_hard_limit": 1 << 20}})
    with pytest.raises(ConfigError, match=r"capture\.dir"):
        config_file.build({"capture": {"enabled": True}})
    cfg = config_file.build({})
    assert cfg == BrokerConfig()
    new = config_file.with_key(cfg, "request_timeout", 30)
    assert config_file.get_key(new, "limits.request_timeout") == 30.0
    assert config_file.diff(cfg, new) == [("limits.request_timeout", 300.0, 30.0)]
    assert config_file.applies("socket") == "restart"
    assert config_file.applies("limits.max_frame_size") == "new connections"
    with pytest.raises(ConfigError, match="unknown"):
        config_file.with_key(cfg, "limits.nonsense", 1)


def test_flags_override_the_file(short_tmp: Path) -> None:
    """Precedence: defaults < file < command line."""
    path = short_tmp / "c.toml"
    path.write_text("[limits]\nrequest_timeout = 42\nmax_subscriptions = 7\n")
    cfg = ConfigSource(path, {"limits.max_subscriptions": 9}).load()
    assert cfg.limits.request_timeout == 42.0
    assert cfg.limits.max_subscriptions == 9
    assert cfg.limits.max_connections == 8192
    with pytest.raises(ConfigError, match="on the command line"):
        ConfigSource(path, {"limits.max_subscriptions": 0}).load()


@pytest.mark.parametrize(
    "text,expect",
    [
        ("[limits]\nmax_frame_size = -1\n", ["limits.max_frame_size = -1"]),
        ("[limits]\nrequest_timeout = 'soon'\n", ["limits.request_timeout", '"soon"']),
        ("[limits\nbroken", ["not valid TOML"]),
        ("[capture]\nenabled = true\n", ["capture.dir"]),
    ],
)
async def test_invalid_file_refused_at_start(short_tmp: Path, text: str, expect: list[str]) -> None:
    """``serve --config BAD`` exits with status 2 and one clear line naming the file, key
    and value; no traceback, no socket."""
    conf = short_tmp / "bad.toml"
    conf.write_text(text)
    sock = short_tmp / "never.sock"
    r = await trio.to_thread.run_sync(
        lambda: run_cli("serve", "--socket", str(sock), "--config", str(conf))
    )
    assert r.returncode == 2, r.stderr
    assert "invalid configuration" in r.stderr
    for e in expect:
        assert e in r.stderr, r.stderr
    assert str(conf) in r.stderr
    assert "Traceback" not in r.stderr
    assert not sock.exists()


async def test_sighup_refuses_a_broken_file_and_applies_a_good_one(
    broker_factory, write_config
) -> None:
    """A broken file on SIGHUP is refused (logged, counted) and the running configuration
    stays; a good one applies, visible in ``config get`` and enforced at once; a change of
    a start-only key is reported, not applied."""
    conf = write_config("[limits]\nrequest_timeout = 60\nmax_subscriptions = 100\n")
    b = broker_factory("--config", str(conf))
    assert await ctl(b.path, "config", "get", "limits.request_timeout") == 60.0

    write_config("[limits]\nrequest_timeout = 5\nmax_frame_size = -1\n")
    os.kill(b.pid, signal.SIGHUP)
    await wait_for(lambda: "configuration refused" in b.log())
    b.log_with("limits.max_frame_size = -1")
    assert await ctl(b.path, "config", "get", "limits.request_timeout") == 60.0
    stats = await ctl(b.path, "stats")
    assert stats["config"]["reloads_failed"] == 1
    assert stats["config"]["generation"] == 1

    write_config(
        "[limits]\nrequest_timeout = 5\nmax_subscriptions = 2\n[metrics]\nlisten = '127.0.0.1:0'\n"
    )
    os.kill(b.pid, signal.SIGHUP)

    async def applied() -> bool:
        return await ctl(b.path, "config", "get", "request_timeout") == 5.0

    await wait_for(applied)
    assert await ctl(b.path, "config", "get", "max_subscriptions") == 2
    # metrics.listen is read at start only: reported, the running value stays.
    assert await ctl(b.path, "config", "get", "metrics.listen") == ""
    b.log_with("read at start only")
    # The new quota is enforced for a client that was already connected... and new ones.
    async with msgq_trio.connect(b.path, name="quota") as bus:
        await bus.subscribe("A")
        await bus.subscribe("B")
        with pytest.raises(LimitExceeded):
            await bus.subscribe("C")


async def test_config_set_and_reload_commands(broker_factory, write_config, raw_peer) -> None:
    """``ctl config set`` changes one key at once (a bad value is refused with the key in
    the message, nothing changes); ``ctl config reload`` returns to the file's values."""
    conf = write_config("[limits]\nrequest_timeout = 60\n")
    b = broker_factory("--config", str(conf))
    r = await ctl(b.path, "config", "set", "limits.request_timeout", "7.5")
    assert r["changed"] == [
        {"key": "limits.request_timeout", "old": 60.0, "new": 7.5, "applies": "now"}
    ]
    assert await ctl(b.path, "config", "get", "limits.request_timeout") == 7.5
    # A change to a limit read per connection says so.
    r = await ctl(b.path, "config", "set", "max_frame_size", str(32 << 20))
    assert r["changed"][0]["applies"] == "new connections"
    async with raw_peer(b.path) as raw:
        welcome = await raw.hello("new-connection")
        assert welcome.header()["limits"]["max_frame_size"] == 32 << 20
    # Refused: nothing changes, exit status 1, the key and value named.
    bad = await ctl(b.path, "config", "set", "limits.out_soft_limit", "-4", json_out=False)
    assert bad.returncode == 1
    assert "limits.out_soft_limit = -4" in bad.stderr
    bad = await ctl(b.path, "config", "set", "log.file", "/nonexistent-dir/x.log", json_out=False)
    assert bad.returncode == 1 and "log.file" in bad.stderr and "cannot open" in bad.stderr
    assert await ctl(b.path, "config", "get", "log.file") == ""
    # The restart-only socket path: reported, not applied.
    r = await ctl(b.path, "config", "set", "socket", "/tmp/elsewhere.sock")
    assert r["restart_required"] == ["socket"]
    assert await ctl(b.path, "config", "get", "socket") == str(b.path)
    # The table form.
    table = await ctl(b.path, "config", "get", json_out=False)
    assert table.returncode == 0
    assert "limits.request_timeout       = 7.5" in table.stdout
    r = await ctl(b.path, "config", "reload")
    assert {c["key"] for c in r["changed"]} >= {"limits.request_timeout", "limits.max_frame_size"}
    assert await ctl(b.path, "config", "get", "limits.request_timeout") == 60.0
    # Through the bus, the error code is bad-request.
    async with msgq_trio.connect(b.path) as bus:
        with pytest.raises(RemoteError) as ei:
            await bus.call("msgq", "config-set", {"key": "log.level", "value": "LOUD"})
        assert ei.value.code == "bad-request"
        assert "log.level" in ei.value.message
