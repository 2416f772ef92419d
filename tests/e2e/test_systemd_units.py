"""The deployment examples in docs/DEPLOY.md are valid as written: the ``.socket`` and
``.service`` units pass ``systemd-analyze verify`` without a warning, and the system bus
configuration loads (with a group that exists on the test host)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from msgq_trio.ops.config_file import ConfigSource

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md"
MSGQ = str(Path(sys.executable).with_name("msgq-trio"))


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DEPLOY.read_text(), re.S)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (Debian: apt-get install systemd)",
)
def test_units_verify_without_warnings(short_tmp: Path) -> None:
    """Both units, with ExecStart pointed at this checkout's console script (verify
    checks that it is executable): exit 0 and nothing on stderr, where systemd reports
    unknown keys and unparsable values it would otherwise ignore."""
    socket_unit, service_unit = blocks("ini")
    assert "ListenStream=" in socket_unit and "Type=notify" in service_unit
    (short_tmp / "msgq-trio.socket").write_text(socket_unit)
    (short_tmp / "msgq-trio.service").write_text(
        service_unit.replace("/usr/local/bin/msgq-trio", MSGQ)
    )
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "msgq-trio.socket", "msgq-trio.service"],
        cwd=short_tmp,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (r.returncode, r.stderr) == (0, ""), r.stderr


def test_system_bus_configuration_loads(short_tmp: Path) -> None:
    """The broker.toml of the shared system bus is a valid configuration; its queue
    plugin's store lands under the state directory."""
    (toml,) = blocks("toml")
    conf = short_tmp / "broker.toml"
    conf.write_text(toml.replace('socket_group = "msgq"', 'socket_group = "nogroup"'))
    cfg = ConfigSource(conf).load()
    assert (cfg.socket_mode, cfg.socket_group) == ("0660", "nogroup")
    assert cfg.plugins["queue"]["dir"] == "/var/lib/msgq-trio/queue"
    assert len(cfg.access.rules) == 2
