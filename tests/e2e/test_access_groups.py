"""Access rules naming a Unix client's groups: ``gid:N`` (the SO_PEERCRED gid) and
``group:NAME`` (every group of the client's user in the group database).

The client runs as ``nobody`` in a child that imports msgq_trio as root and then drops
to nobody's uid and a chosen gid (no supplementary groups), as tests/e2e/test_socket_mode.py
does. On Debian nobody's passwd entry has gid 65534 (``nogroup``), so the group database
puts nobody in ``nogroup`` whatever gid the process runs with; ``daemon`` (gid 1) is a
group nobody is not in.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from msgq_trio.config import AccessRule
from msgq_trio.io.listeners import unix_principals

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the test connects as another uid (nobody)"
)

NOBODY = pwd.getpwnam("nobody").pw_uid
NOGROUP = 65534
DAEMON = 1

CLIENT = textwrap.dedent("""
    import os, sys
    import trio
    import msgq_trio
    uid, gid = int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    async def main():
        async with msgq_trio.connect(sys.argv[1], name="grouped") as bus:
            try:
                await bus.subscribe("Shared")
            except msgq_trio.RpcError as exc:
                print(exc.code)
            else:
                print("subscribed")
    trio.run(main)
""")

#: root (the test's own tools, none here) keeps everything; nobody may do only what the
#: rule under test grants. ``unix:*`` makes every local client one a rule names, so a
#: client no group rule matches gets only this rule's (empty) grants.
POLICY = """
[[access.rule]]
who = ["unix:*"]
call = ["msgq"]

[[access.rule]]
who = [{who}]
subscribe = ["Shared"]
"""


def subscribe_as(sock: Path, gid: int) -> str:
    """Subscribe to ``Shared`` as nobody with process gid ``gid``: "subscribed" or the
    refusal's error code."""
    r = subprocess.run(
        [sys.executable, "-c", CLIENT, str(sock), str(NOBODY), str(gid)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r
    return r.stdout.strip()


@pytest.fixture
def start_with_rule(
    short_tmp: Path, broker_factory: Callable[..., object]
) -> Callable[[str], Path]:
    """Start a broker whose socket anyone may open (0666 in a 0755 directory) with
    :data:`POLICY` granting ``subscribe Shared`` to the ``who`` entry given."""
    short_tmp.chmod(0o755)

    def start(who: str) -> Path:
        n = len(list(short_tmp.glob("*.toml")))
        conf = short_tmp / f"access{n}.toml"
        conf.write_text(POLICY.format(who=f'"{who}"'))
        sock = short_tmp / f"g{n}.sock"
        broker_factory("--config", str(conf), "--socket-mode", "0666", path=sock)
        return sock

    return start


@needs_root
def test_group_rule_grants_by_the_group_database(start_with_rule: Callable[[str], Path]) -> None:
    """``group:nogroup`` grants nobody the subscription whether its process runs with gid
    nogroup or daemon: the group database puts nobody in nogroup. A rule for a group
    nobody is not in (``group:audio``) leaves it refused ``forbidden``."""
    assert grp.getgrgid(NOGROUP).gr_name == "nogroup"
    granted = start_with_rule("group:nogroup")
    assert subscribe_as(granted, NOGROUP) == "subscribed"
    assert subscribe_as(granted, DAEMON) == "subscribed"
    other = start_with_rule("group:audio")
    assert subscribe_as(other, NOGROUP) == "forbidden"


@needs_root
def test_primary_gid_counts_as_a_group_and_as_gid(start_with_rule: Callable[[str], Path]) -> None:
    """The SO_PEERCRED gid: ``gid:1`` and ``group:daemon`` match nobody running with gid
    daemon and not nobody running with gid nogroup."""
    by_gid = start_with_rule(f"gid:{DAEMON}")
    assert subscribe_as(by_gid, DAEMON) == "subscribed"
    assert subscribe_as(by_gid, NOGROUP) == "forbidden"
    by_group = start_with_rule("group:daemon")
    assert subscribe_as(by_group, DAEMON) == "subscribed"
    assert subscribe_as(by_group, NOGROUP) == "forbidden"


@needs_root
def test_rule_for_another_gid_refuses(start_with_rule: Callable[[str], Path]) -> None:
    """Without a rule naming one of its identities nobody gets only ``unix:*``'s grants:
    ``gid:65534`` grants, ``gid:1`` does not."""
    granted = start_with_rule(f"gid:{NOGROUP}")
    assert subscribe_as(granted, NOGROUP) == "subscribed"
    refused = start_with_rule(f"gid:{DAEMON}")
    assert subscribe_as(refused, NOGROUP) == "forbidden"


def test_unix_principals_from_the_databases() -> None:
    """nobody running with gid daemon: user, uid, the kernel's gid, that gid's group and
    the passwd entry's group; a uid the passwd database lacks: only its gid's group, and
    numbers where no name is known."""
    assert unix_principals(NOBODY, DAEMON)[:5] == [
        "unix:nobody",
        f"uid:{NOBODY}",
        f"gid:{DAEMON}",
        "group:daemon",
        "group:nogroup",
    ]
    unknown = 3_999_999
    with pytest.raises(KeyError):
        pwd.getpwuid(unknown)
    assert unix_principals(unknown, NOGROUP) == [
        f"unix:{unknown}",
        f"uid:{unknown}",
        f"gid:{NOGROUP}",
        "group:nogroup",
    ]
    assert unix_principals(unknown, unknown) == [
        f"unix:{unknown}",
        f"uid:{unknown}",
        f"gid:{unknown}",
        f"group:{unknown}",
    ]


def test_who_kinds() -> None:
    """``gid:`` and ``group:`` are accepted in ``who``; an unknown kind is refused with
    the list of the valid ones."""
    assert AccessRule(who=["gid:1", "group:wheel"]).who == ("gid:1", "group:wheel")
    with pytest.raises(ValueError, match="'gid:N' or 'group:NAME'"):
        AccessRule(who=["grp:wheel"])
