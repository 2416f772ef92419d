"""A shared bus: the socket file's mode and group (``socket_mode``, ``socket_group``)
decide which other uids may connect, as for D-Bus's system bus.

The components run as another uid (``nobody``) in a child process. The child imports
msgq_trio as root and then drops to the uid and gids with os.setgroups/setgid/setuid
before it connects: ``subprocess``'s ``user=`` would drop them before exec, and this
virtualenv's interpreter lives under /root, which ``nobody`` may not read.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the test connects as another uid (nobody)"
)

NOBODY = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else -1
#: nobody's own group on Debian; the socket is shared with it.
SHARED_GID = 65534
#: a group nobody is not in (``daemon``).
OTHER_GID = 1

CLIENT = textwrap.dedent("""
    import os, sys
    import trio
    import msgq_trio
    uid, gid = int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    async def main():
        async with msgq_trio.connect(sys.argv[1], name="other-uid") as bus:
            print(await bus.call("msgq", "ping"))
    try:
        trio.run(main)
    except msgq_trio.ConnectError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
""")


def as_other(sock: Path, uid: int, gid: int) -> subprocess.CompletedProcess[str]:
    """Connect and ping as ``uid``/``gid`` (no supplementary groups)."""
    return subprocess.run(
        [sys.executable, "-c", CLIENT, str(sock), str(uid), str(gid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def shared_dir(short_tmp: Path) -> Path:
    """short_tmp opened for traversal (0755): only the socket's own mode may refuse."""
    short_tmp.chmod(0o755)
    return short_tmp


def test_group_shared_socket_admits_the_group_and_refuses_others(
    shared_dir: Path, broker_factory: Callable[..., object]
) -> None:
    """``--socket-mode 0660 --socket-group nogroup``: the file is srw-rw---- root:nogroup;
    nobody in nogroup connects and is served; nobody in another group is refused by the
    kernel (Permission denied), before the broker sees it."""
    sock = shared_dir / "shared.sock"
    broker_factory("--socket-mode", "0660", "--socket-group", "nogroup", path=sock)
    st = sock.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == SHARED_GID
    ok = as_other(sock, NOBODY, SHARED_GID)
    assert (ok.returncode, ok.stdout.strip()) == (0, "pong"), ok
    refused = as_other(sock, NOBODY, OTHER_GID)
    assert refused.returncode == 1 and "Permission denied" in refused.stderr, refused


def test_private_mode_refuses_even_the_group(
    shared_dir: Path, broker_factory: Callable[..., object]
) -> None:
    """``socket_mode = "0600"`` in the configuration file: only the broker's uid may
    connect; nobody is refused even in the socket's group."""
    conf = shared_dir / "broker.toml"
    conf.write_text('socket_mode = "0600"\nsocket_group = "65534"\n')
    sock = shared_dir / "private.sock"
    broker_factory("--config", str(conf), path=sock)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    refused = as_other(sock, NOBODY, SHARED_GID)
    assert refused.returncode == 1 and "Permission denied" in refused.stderr, refused


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--socket-mode", "rw-rw----"], "socket_mode"),
        (["--socket-mode", "01777"], "socket_mode"),
        (["--socket-group", "no-such-group-xyz"], "no such group"),
    ],
)
def test_invalid_socket_settings_are_refused(
    short_tmp: Path, flags: list[str], needle: str
) -> None:
    """A mode that is not octal permission bits or an unknown group: exit 2 with one
    line naming the setting, before any socket is made."""
    sock = short_tmp / "bad.sock"
    r = subprocess.run(
        [sys.executable, "-m", "msgq_trio", "serve", "-s", str(sock), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2, r
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not os.path.lexists(sock)
