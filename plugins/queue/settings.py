"""Settings of the queue plugin: the ``[plugins.queue]`` table and per-queue options.

Every default carries its reason; docs/QUEUE.md has the same table for operators.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from msgq_trio.protocol.names import valid_group_name

__all__ = ["QueueOptions", "QueueSettings", "max_store_size_for", "parse_settings"]

MiB = 1 << 20
GiB = 1 << 30


@attrs.frozen
class QueueOptions:
    """Options of one queue (``[plugins.queue.queues.<name>]`` or the ``declare`` command).

    * ``bind`` "" (none): a group whose traffic this queue takes over (transparent
      insertion): requests and messages to it from anyone but the plugin are stored and
      forwarded to the group's members.
    * ``max_deliveries`` 0 (unlimited): after this many deliveries without an ack a
      message moves to ``dead_letter``. Unlimited by default, like RabbitMQ classic queues:
      moving data aside must be the operator's decision.
    * ``dead_letter`` "" = ``<name>.dlq`` when ``max_deliveries`` is set.
    * ``ack_timeout`` 30 s: a delivery not acked within it is redelivered to another
      consumer (RabbitMQ's consumer_timeout is 30 min, SQS's visibility timeout 30 s; a
      local bus's consumers answer in milliseconds, 30 s only catches stuck ones).
    * ``window`` 16: in-flight deliveries per member of a bound group (API consumers choose
      their own window); 16 keeps a fast local consumer busy across one round trip while
      a slow member holds back little (window 1, strict one-at-a-time delivery, works too).
    * ``ack_grace`` None = the plugin's ``ack_grace``: how long a message in flight to a
      consumer of this queue is left out of commits waiting for its ack. A queue whose
      consumer is a link to another broker (docs/QUEUE.md, "Chained queues") needs the
      downstream round trip, and the downstream queue's own grace, inside it.
    """

    bind: str = ""
    max_deliveries: int = 0
    dead_letter: str = ""
    ack_timeout: float = 30.0
    window: int = 16
    ack_grace: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.bind and valid_group_name(self.bind):
            raise ValueError(f"bind = {self.bind!r}: {valid_group_name(self.bind)}")
        if self.bind.startswith("msgq."):
            raise ValueError(f"bind = {self.bind!r}: groups under msgq. cannot be bound")
        if self.max_deliveries < 0:
            raise ValueError(f"max_deliveries = {self.max_deliveries}: must be >= 0")
        if not self.ack_timeout > 0:
            raise ValueError(f"ack_timeout = {self.ack_timeout}: must be positive")
        if self.window < 1:
            raise ValueError(f"window = {self.window}: must be >= 1")
        if self.ack_grace is not None and not 0 <= self.ack_grace <= 3600:
            raise ValueError(f"ack_grace = {self.ack_grace}: must be 0..3600 s")

    def dlq_name(self, queue: str) -> str:
        return self.dead_letter or f"{queue}.dlq"


@attrs.frozen
class QueueSettings:
    """The ``[plugins.queue]`` table.

    * ``dir`` (required): the LMDB environment's directory (created if missing). No
      default on purpose: durable data must live where the operator decided.
    * ``group`` "msgq-queue": the bus group the plugin answers queue commands on.
    * ``map_size`` 64 MiB: initial LMDB map (at most ``max_store_size``); the file grows
      only as data does.
    * ``max_store_size`` 0 = derived at start: the most the store's file may grow to
      (the map doubles up to it); at the bound puts are refused ``queue-full``. The
      derived value is the store's current size plus 90 % of the free space of its
      file system at start (``max_store_size_for``): a backlog may use the disk, but
      never fills it to the last byte, so the other tenth is left for logs and the
      rest of the system. ``max_map_size`` is its former name, still accepted.
    * ``resident_messages`` 10,000 and ``resident_bytes`` 32 MiB per queue: the most
      messages (bodies) a queue keeps in the plugin's memory: ready for delivery, in
      flight, or waiting for their commit. Past them new messages are only stored and
      read back from the store in pages as consumers take them. 10,000 is one full
      commit (``max_batch``) and keeps a consumer fed for tens of milliseconds at
      200,000 msgs/s while the next page is read; 32 MiB holds 10,000 bodies of 3 KiB
      and half of one 64 MiB frame, the largest a client sends by default.
    * ``sync`` true: fsync every commit (ack 1 means on disk). false is for benchmarks
      and tests of everything but durability.
    * ``max_batch`` 10,000 messages per commit: past about a thousand messages per
      transaction the fsync is a small part of a commit and larger batches gain little;
      the bound caps one commit's latency and memory (≈ 1 MiB of 100-byte messages).
    * ``max_delay`` 0 s: group commit flushes as soon as the previous commit finished,
      taking everything that arrived meanwhile; a positive delay waits that long for more
      before each commit (a fixed 100 ms wait limits a producer that waits for each ack
      to 10 msgs/s, so it is opt-in).
    * ``ack_grace`` 0.05 s: a message in flight to a consumer is left out of commits for
      up to this long, waiting for its ack (then it is never written); messages no
      consumer holds are committed at once. An ack 1 is delayed by it only while a
      consumer holds the message without acking (a consumer that acks gives the ack 1
      at that moment). 50 ms covers a put's way through broker, plugin and an acking
      consumer even while many producers keep the CPUs busy, and keeps an ack 1 held
      by a slow consumer under 0.1 s. 0 disables it (then only acks racing a running
      commit skip writes).
    * ``metrics`` "" (off): ``HOST:PORT`` (port 0: any free one; ``[::1]:PORT`` for
      IPv6) where the plugin process serves its queues as Prometheus text at
      ``/metrics`` (plugins/queue/metrics.py). Opt-in because it opens a TCP port; the
      plugin's own endpoint because the broker's (``serve --metrics``) runs in the
      broker process, which cannot see a plugin process's queues. Bound before the
      plugin is ready, so a port that cannot be bound fails the broker's start.
    * ``queues``: ``<name>`` -> :class:`QueueOptions` table, declared at start.
    """

    dir: str
    group: str = "msgq-queue"
    map_size: int = 64 * MiB
    max_store_size: int = 0
    resident_messages: int = 10_000
    resident_bytes: int = 32 * MiB
    sync: bool = True
    max_batch: int = 10_000
    max_delay: float = 0.0
    ack_grace: float = 0.05
    metrics: str = ""
    queues: dict[str, QueueOptions] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not self.dir:
            raise ValueError("dir must name the store's directory")
        why = valid_group_name(self.group)
        if why or self.group.startswith("msgq."):
            raise ValueError(f"group = {self.group!r}: {why or 'reserved for the broker'}")
        if self.map_size < 1 * MiB or (self.max_store_size and self.max_store_size < 1 * MiB):
            raise ValueError(
                f"map_size = {self.map_size}, max_store_size = {self.max_store_size}: "
                "need map_size >= 1 MiB and max_store_size >= 1 MiB (or 0: derived from "
                "the free space); the initial map is the smaller of the two"
            )
        if self.resident_messages < 1 or self.resident_bytes < 1 * MiB:
            raise ValueError(
                f"resident_messages = {self.resident_messages}, resident_bytes = "
                f"{self.resident_bytes}: need resident_messages >= 1, resident_bytes >= "
                "1 MiB"
            )
        if self.max_batch < 1:
            raise ValueError(f"max_batch = {self.max_batch}: must be >= 1")
        if self.ack_grace < 0:
            raise ValueError(f"ack_grace = {self.ack_grace}: must be >= 0")
        if self.max_delay < 0:
            raise ValueError(f"max_delay = {self.max_delay}: must be >= 0")
        if self.metrics:
            # Imported here: the exposition module loads prometheus_client, which the
            # broker's start (it reads every installed plugin's declaration) should not.
            from msgq_trio.exposition import parse_listen

            try:
                parse_listen(self.metrics)
            except ValueError as exc:
                raise ValueError(f"metrics = {self.metrics!r}: {exc}") from None
        bound = [o.bind for o in self.queues.values() if o.bind]
        if len(bound) != len(set(bound)):
            raise ValueError("two queues bind the same group")


_TYPES: dict[str, tuple[type, ...]] = {
    "dir": (str,),
    "group": (str,),
    "map_size": (int,),
    "max_store_size": (int,),
    "max_map_size": (int,),
    "resident_messages": (int,),
    "resident_bytes": (int,),
    "sync": (bool,),
    "max_batch": (int,),
    "max_delay": (int, float),
    "ack_grace": (int, float),
    "metrics": (str,),
}
_QTYPES: dict[str, tuple[type, ...]] = {
    "bind": (str,),
    "max_deliveries": (int,),
    "dead_letter": (str,),
    "ack_timeout": (int, float),
    "window": (int,),
    "ack_grace": (int, float),
}


def _check(key: str, value: object, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types)
        raise ValueError(f"{key} = {value!r}: must be {names}")


def max_store_size_for(directory: str, configured: int, map_size: int) -> int:
    """The store's bound: ``configured`` if set, else the size of ``directory``'s store
    file now plus 90 % of its file system's free space (at least ``map_size``), in whole
    MiB. Raises OSError if ``directory`` cannot be examined."""
    if configured:
        return configured
    st = os.statvfs(directory)
    try:
        current = os.stat(os.path.join(directory, "data.mdb")).st_size
    except FileNotFoundError:
        current = 0
    free = st.f_bavail * st.f_frsize
    return max(map_size, (current + free * 9 // 10) // MiB * MiB)


def parse_options(table: Mapping[str, Any], where: str = "") -> QueueOptions:
    """Queue options from a table. Raises ValueError naming the key."""
    for k, v in table.items():
        if k not in _QTYPES:
            raise ValueError(f"unknown key {where}{k!r} (known: {', '.join(_QTYPES)})")
        _check(where + k, v, _QTYPES[k])
    opts = dict(table)
    if "ack_grace" in opts:
        opts["ack_grace"] = float(opts["ack_grace"])
    return QueueOptions(**opts)


def parse_settings(table: Mapping[str, Any]) -> QueueSettings:
    """Settings from the ``[plugins.queue]`` table. Raises ValueError naming the key."""
    kwargs: dict[str, Any] = {}
    for k, v in table.items():
        if k == "queues":
            if not isinstance(v, Mapping):
                raise ValueError("queues must be a table of tables")
            queues = {}
            for qname, qtable in v.items():
                if not isinstance(qtable, Mapping):
                    raise ValueError(f"queues.{qname} must be a table")
                queues[qname] = parse_options(qtable, f"queues.{qname}.")
            kwargs["queues"] = queues
            continue
        if k not in _TYPES:
            raise ValueError(f"unknown key {k!r} (known: {', '.join([*_TYPES, 'queues'])})")
        _check(k, v, _TYPES[k])
        if k == "max_map_size" and "max_store_size" in table:
            raise ValueError("give max_store_size or its former name max_map_size, not both")
        kwargs["max_store_size" if k == "max_map_size" else k] = v
    if "dir" not in kwargs:
        raise ValueError("dir is required (the store's directory)")
    return QueueSettings(**kwargs)
