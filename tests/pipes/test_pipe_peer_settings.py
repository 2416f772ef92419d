"""The ``peers``, ``node`` and ``peer_wait`` settings of the pipe plugin, and the home
of a name (plugins/pipe/peers.py): bad input is refused naming the key."""

from __future__ import annotations

import pytest

from plugins.pipe.peers import home_of
from plugins.pipe.settings import parse_settings


def test_peers_as_addresses_and_tables() -> None:
    s = parse_settings(
        {
            "peers": ["/run/b.sock", {"address": "tcp://h:1", "token": "t", "retry_max": 2}],
            "node": "a",
        }
    )
    assert [p.address for p in s.peers] == ["/run/b.sock", "tcp://h:1"]
    assert s.peers[1].token == "t" and s.peers[1].retry_max == 2
    assert s.peers[0].connect_timeout == 10.0  # the link plugin's default
    s = parse_settings({"peers": ["x", {"address": "y", "token": "own"}], "peer": {"token": "t"}})
    assert [p.token for p in s.peers] == ["t", "own"]


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"peers": "x"}, "peers must be a list"),
        ({"peers": [3]}, "peers[0]"),
        ({"peers": [{"address": "a", "from_queue": "q"}]}, "unknown key peers[0].'from_queue'"),
        ({"peers": [{"token": "t"}]}, "peers[0].address is required"),
        ({"peers": ["a", "a"]}, "listed twice"),
        ({"peers": [{"address": "a", "retry_min": -1}]}, "retry_min"),
        ({"peer_wait": 0}, "peer_wait"),
        ({"peers": ["a"], "peer": {"address": "b"}}, "unknown key peer.'address'"),
        ({"peers": ["a"], "peer": 3}, "peer must be a table"),
        ({"node": 3}, "node"),
    ],
)
def test_bad_peer_settings_name_the_key(table: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_settings(table)


def test_home_is_the_same_for_every_order_and_spreads() -> None:
    nodes = ["a", "b", "c"]
    for i in range(100):
        assert home_of(f"p{i}", nodes) == home_of(f"p{i}", list(reversed(nodes)))
    homes = {home_of(f"p{i}", nodes) for i in range(100)}
    assert homes == set(nodes)
    # A node leaving moves only its own names.
    for i in range(100):
        h = home_of(f"p{i}", nodes)
        if h != "c":
            assert home_of(f"p{i}", ["a", "b"]) == h
