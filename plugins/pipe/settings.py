"""Settings of the pipe plugin: the ``[plugins.pipe]`` table (docs/PIPES.md, "Limits")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from msgq_trio.protocol.names import valid_group_name

from ..link.settings import LinkConfig, parse_link

__all__ = ["PipeOptions", "PipeSettings", "parse_peers", "parse_settings"]

#: Keys of a ``peers`` table (the link plugin's downstream keys that apply to a peer).
PEER_KEYS = (
    "address",
    "token",
    "token_file",
    "tls",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "connect_timeout",
    "retry_min",
    "retry_max",
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@attrs.frozen
class PipeOptions:
    """One ``[plugins.pipe.pipes.NAME]`` table: what the operator fixes for a pipe name.

    * ``persistent`` false: the pipe is persistent (its bytes are stored in ``dir`` and
      survive both ends leaving and restarts); opens asking otherwise get
      ``pipe-mismatch``. ``persistent = false`` forbids persistent opens of the name.
    * ``max_stored`` (the plugin's ``max_stored``): this pipe's bound on stored bytes.
    """

    persistent: bool = False
    max_stored: int | None = None


@attrs.frozen
class PipeSettings:
    """The ``[plugins.pipe]`` table; every default with its reason.

    * ``group`` "msgq-pipe": the bus group the plugin answers pipe commands on.
    * ``max_buffer`` 4 MiB per pipe: the bytes a pipe holds for its readers. A Linux pipe
      holds 64 KiB, but here every chunk crosses the broker twice: at ~100-300 MB/s and a
      few ms per round trip the bandwidth-delay product is around 1 MiB, and 4 MiB keeps
      a writer busy across a reader's pauses. Same as the broker's ``out_soft_limit``.
    * ``max_chunk`` 256 KiB: the largest write chunk and read answer. Larger writes are
      split; 256 KiB frames are assembled in their own buffer by the broker (one copy)
      and keep per-frame overhead under 1 %.
    * ``max_hold`` 20 s: the longest a read or write waits in the plugin before it is
      answered ``timeout`` (the client asks again unless its own timeout passed). Far
      below the broker's ``request_timeout`` (300 s), so the broker never answers a held
      read itself, which would lose the bytes the plugin sends after it.
    * ``max_pending`` 16 operations per handle: a client pipelines a few chunks; more
      means a runaway client (answered ``limit-exceeded``).
    * ``max_pipes`` 10,000: bounds the plugin's memory against a client opening names in
      a loop (each open pipe costs ~1 KiB plus its buffer).
    * ``trace`` false: log every open, close, disconnect, read and write (pipe name,
      client lname and name, sizes, timeouts) at INFO in the broker's log (an operator
      debugging a pipeline needs to see what each application does). Off by default:
      a line per chunk.

    Persistent pipes (docs/PIPES.md, "Persistent pipes"):

    * ``dir`` "" (none): the LMDB directory of persistent pipes (created if missing).
      Required only to use persistent pipes: without it a persistent open is refused
      ``bad-request``. No default on purpose, like the queue plugin's: durable data must
      live where the operator decided, and it must not be the queue plugin's ``dir``
      (one process owns a store directory; the plugin locks it).
    * ``max_stored`` 64 MiB per persistent pipe: the bytes it holds (stored, and being
      committed) before writers wait. A persistent pipe is a log of what writers wrote
      while nobody read, and it is also held in the plugin's memory (loaded at start,
      like the queue plugin's queues), so this bounds memory per pipe; 64 MiB is 16
      ``max_buffer``s and fits the store's initial map without growing it.
    * ``map_size`` 64 MiB / ``max_map_size`` 1 GiB: the store's initial map and the most
      it doubles to (the queue plugin's defaults and reasons). A full map makes writers
      wait (their writes time out, nothing is dropped) until readers consumed bytes.
    * ``sync`` true: fsync every commit, so a write answered to its writer survives a
      crash of the machine, not only of the plugin. false is for tests and benchmarks.
    * ``pipes``: NAME -> :class:`PipeOptions`.

    Pipes across brokers (docs/PIPES.md, "Pipes across brokers"):

    * ``peers`` [] (none): the other brokers whose pipe services this one joins, each an
      address as ``msgq_trio.connect`` takes it (a Unix socket path, ``tcp://HOST:PORT``,
      ``tls://HOST:PORT``) or a table with the link plugin's downstream keys
      (``address``, ``token``/``token_file``, ``tls``/``tls_ca``/``tls_cert``/``tls_key``,
      ``connect_timeout``, ``retry_min``, ``retry_max``: the same defaults and reasons,
      plugins/link/settings.py). ``serve --pipe-peer ADDRESS`` (repeatable) replaces
      the list. Each broker lists the others.
    * ``peer``: a table of those keys but ``address``, taken by every peer that does
      not set them (e.g. the ``token_file`` of peers given by ``--pipe-peer``).
    * ``node`` "" = ``<hostname>:<this broker's socket>``: this broker's name among its
      peers; the names decide which broker holds each pipe, so they must differ (set it
      when two brokers would have the same default).
    * ``peer_wait`` 5 s: the longest an open waits for the connection to a peer that
      connected to this broker but is not yet connected from here (both brokers must
      count the same set of brokers, or they could place a pipe on two brokers). A
      broker restarting connects within its ``retry_max`` (5 s) of the other one.
    """

    group: str = "msgq-pipe"
    max_buffer: int = 4 * MiB
    max_chunk: int = 256 * KiB
    max_hold: float = 20.0
    max_pending: int = 16
    max_pipes: int = 10_000
    trace: bool = False
    dir: str = ""
    max_stored: int = 64 * MiB
    map_size: int = 64 * MiB
    max_map_size: int = 1 * GiB
    sync: bool = True
    pipes: dict[str, PipeOptions] = attrs.field(factory=dict)
    peers: list[LinkConfig] = attrs.field(factory=list)
    node: str = ""
    peer_wait: float = 5.0

    def __attrs_post_init__(self) -> None:
        if not self.peer_wait > 0:
            raise ValueError(f"peer_wait = {self.peer_wait}: must be positive")
        why = valid_group_name(self.group)
        if why or self.group.startswith("msgq."):
            raise ValueError(f"group = {self.group!r}: {why or 'reserved for the broker'}")
        if self.max_chunk < 1 or self.max_chunk > self.max_buffer:
            raise ValueError(
                f"max_chunk = {self.max_chunk}: need 1 <= max_chunk <= "
                f"max_buffer ({self.max_buffer})"
            )
        if self.max_chunk > 16 * MiB:
            raise ValueError(f"max_chunk = {self.max_chunk}: at most 16 MiB (frame size)")
        if not self.max_hold > 0:
            raise ValueError(f"max_hold = {self.max_hold}: must be positive")
        if self.max_pending < 2:
            raise ValueError(f"max_pending = {self.max_pending}: must be >= 2")
        if self.max_pipes < 1:
            raise ValueError(f"max_pipes = {self.max_pipes}: must be >= 1")
        if self.map_size < 1 * MiB or self.max_map_size < self.map_size:
            raise ValueError(
                f"map_size = {self.map_size}, max_map_size = "
                f"{self.max_map_size}: need 1 MiB <= map_size <= max_map_size"
            )
        for where, bound in [("max_stored", self.max_stored)] + [
            (f"pipes.{n}.max_stored", o.max_stored)
            for n, o in self.pipes.items()
            if o.max_stored is not None
        ]:
            assert bound is not None
            if not self.max_chunk <= bound < self.max_map_size:
                raise ValueError(
                    f"{where} = {bound}: need max_chunk ({self.max_chunk}) <= "
                    f"{where} < max_map_size ({self.max_map_size})"
                )
        for name, o in self.pipes.items():
            if not name or len(name) > 255:
                raise ValueError(f"pipes.{name!r}: pipe names are 1 to 255 characters")
            if o.persistent and not self.dir:
                raise ValueError(f"pipes.{name}.persistent = true needs dir (the store)")


_TYPES: dict[str, tuple[type, ...]] = {
    "group": (str,),
    "max_buffer": (int,),
    "max_chunk": (int,),
    "max_hold": (int, float),
    "max_pending": (int,),
    "max_pipes": (int,),
    "trace": (bool,),
    "dir": (str,),
    "max_stored": (int,),
    "map_size": (int,),
    "max_map_size": (int,),
    "sync": (bool,),
    "node": (str,),
    "peer_wait": (int, float),
}
_PTYPES: dict[str, tuple[type, ...]] = {"persistent": (bool,), "max_stored": (int,)}


def _check(table: Mapping[str, Any], types: Mapping[str, tuple[type, ...]], where: str) -> None:
    for k, v in table.items():
        if k not in types:
            raise ValueError(f"unknown key {where}{k!r} (known: {', '.join(types)})")
        t = types[k]
        if not isinstance(v, t) or (isinstance(v, bool) and bool not in t):
            raise ValueError(f"{where}{k} = {v!r}: must be {' or '.join(x.__name__ for x in t)}")


def parse_settings(table: Mapping[str, Any]) -> PipeSettings:
    """Settings from the ``[plugins.pipe]`` table. Raises ValueError naming the key."""
    kwargs = dict(table)
    pipes = kwargs.pop("pipes", {})
    kwargs["peers"] = parse_peers(kwargs.pop("peers", []), kwargs.pop("peer", {}))
    _check({k: v for k, v in kwargs.items() if k != "peers"}, _TYPES, "")
    if not isinstance(pipes, Mapping):
        raise ValueError("pipes must be a table of tables")
    options = {}
    for name, t in pipes.items():
        if not isinstance(t, Mapping):
            raise ValueError(f"pipes.{name} must be a table")
        _check(t, _PTYPES, f"pipes.{name}.")
        options[name] = PipeOptions(**t)
    return PipeSettings(**kwargs, pipes=options)


def parse_peers(peers: Any, defaults: Any = None) -> list[LinkConfig]:
    """The ``peers`` list: addresses or tables, parsed as the link plugin's downstream
    settings (one configuration and connection code for both); ``defaults`` (the
    ``[plugins.pipe.peer]`` table) holds the keys every peer takes unless its own table
    sets them (a token file for ``serve --pipe-peer tcp://...``). Raises ValueError."""
    if not isinstance(peers, list):
        raise ValueError("peers must be a list of addresses or tables")
    defaults = {} if defaults is None else defaults
    if not isinstance(defaults, Mapping):
        raise ValueError("peer must be a table (the settings every peer takes)")
    for k in defaults:
        if k not in PEER_KEYS or k == "address":
            raise ValueError(f"unknown key peer.{k!r} (known: {', '.join(PEER_KEYS[1:])})")
    out = []
    for i, p in enumerate(peers):
        where = f"peers[{i}]."
        table = {"address": p} if isinstance(p, str) else p
        if not isinstance(table, Mapping):
            raise ValueError(f"peers[{i}] = {p!r}: must be an address or a table")
        table = {**defaults, **table}
        for k in table:
            if k not in PEER_KEYS:
                raise ValueError(f"unknown key {where}{k!r} (known: {', '.join(PEER_KEYS)})")
        out.append(parse_link({**table, "from_queue": "-"}, where))
    addresses = [c.address for c in out]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"peers: an address is listed twice ({addresses})")
    return out
