"""Settings of the link plugin: the ``[plugins.link]`` table and one table per link.

Every default carries its reason; docs/QUEUE.md ("Chained queues / links") has the same
table for operators.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from msgq_trio.protocol.names import valid_group_name

__all__ = ["LinkConfig", "LinkSettings", "parse_settings"]


@attrs.frozen
class LinkConfig:
    """One link: consume ``from_queue`` on this broker, put into ``to_queue`` on the broker
    at ``address`` (``[plugins.link.links.<name>]``).

    * ``address`` (required): the downstream broker, as ``msgq_trio.connect`` takes it (a
      Unix socket path; a ``tcp://host:port`` address once the client supports TCP).
    * ``from_queue`` (required), ``to_queue`` (default: the same name).
    * ``source`` "" = ``<hostname>:<this broker's socket>:<from_queue>``: prefix of the
      producer names the messages carry downstream (``<source>/<original producer>``),
      so producers of two upstream brokers with the same name do not share a dedup
      record there. Set it when two brokers forward into one queue and their default
      would be equal (e.g. the same socket path on two hosts with one hostname).
    * ``window`` 1,000: messages the link holds unacked (its credit at the upstream
      queue). It must cover a round trip: at ~100,000 msgs/s and 10 ms it is 1,000; it
      also bounds what a broken link gives back for storing at once.
    * ``put_timeout`` 10 s: a downstream put without answer for this long (broker
      stopped, network black hole) makes the link drop the connection and give its
      messages back to the upstream queue (which stores them). A healthy downstream
      answers within its ``ack_grace`` plus a commit (~0.1 s); 10 s only catches dead
      peers, like the broker's own keep-alive-free request deadline philosophy.
    * ``connect_timeout`` 10 s: connecting plus the handshake (a stopped broker accepts
      the TCP/Unix connection but never says WELCOME).
    * ``retry_min`` 0.1 s, ``retry_max`` 5 s: reconnect backoff, doubling (quick after a
      one-off failure; 5 s caps the delay after a long outage, when every message
      waits stored upstream).
    * ``token`` / ``token_file``: credential passed to ``connect(token=...)``; the file
      is read at each connect (rotation without restart). Empty: none.
    * ``tls`` false; ``tls_ca``, ``tls_cert``, ``tls_key``: an ``ssl.SSLContext`` built
      from them is passed as ``connect(ssl_context=...)``.
    """

    address: str
    from_queue: str
    to_queue: str = ""
    source: str = ""
    window: int = 1000
    put_timeout: float = 10.0
    connect_timeout: float = 10.0
    retry_min: float = 0.1
    retry_max: float = 5.0
    token: str = ""
    token_file: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.address:
            raise ValueError("address must name the downstream broker")
        if not self.from_queue:
            raise ValueError("from_queue must name the queue to forward")
        if self.window < 1:
            raise ValueError(f"window = {self.window}: must be >= 1")
        for key in ("put_timeout", "connect_timeout", "retry_min", "retry_max"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} = {getattr(self, key)}: must be positive")
        if self.retry_max < self.retry_min:
            raise ValueError("retry_max must be >= retry_min")
        if self.token and self.token_file:
            raise ValueError("give token or token_file, not both")
        if (self.tls_ca or self.tls_cert or self.tls_key) and not self.tls:
            raise ValueError("tls_ca/tls_cert/tls_key need tls = true")

    @property
    def target_queue(self) -> str:
        return self.to_queue or self.from_queue


@attrs.frozen
class LinkSettings:
    """The ``[plugins.link]`` table.

    * ``group`` "msgq-link": the group the plugin answers ``status`` on
      (``msgq-trio ctl links``).
    * ``metrics`` "" (off): ``HOST:PORT`` (port 0: any free one) where the plugin process
      serves its links' state as Prometheus text at ``/metrics``. Opt-in because it opens
      a TCP port; the plugin's own endpoint because the broker's (``serve --metrics``)
      runs in the broker process, which cannot see a plugin process's state. The bound
      address is in every ``status`` row (``metrics``).
    * ``links``: ``<name>`` -> :class:`LinkConfig`.
    """

    group: str = "msgq-link"
    metrics: str = ""
    links: dict[str, LinkConfig] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        why = valid_group_name(self.group)
        if why or self.group.startswith("msgq."):
            raise ValueError(f"group = {self.group!r}: {why or 'reserved for the broker'}")
        if self.metrics:
            # Imported here: the exposition module loads prometheus_client, which the
            # broker's start (it reads every installed plugin's declaration) should not.
            from msgq_trio.exposition import parse_listen

            try:
                parse_listen(self.metrics)
            except ValueError as exc:
                raise ValueError(f"metrics = {self.metrics!r}: {exc}") from None
        for name in self.links:
            if not name or any(c in name for c in "[]/ \t"):
                raise ValueError(f"links.{name!r}: a link name must be a plain word")


_LTYPES: dict[str, tuple[type, ...]] = {
    "address": (str,),
    "from_queue": (str,),
    "to_queue": (str,),
    "source": (str,),
    "window": (int,),
    "put_timeout": (int, float),
    "connect_timeout": (int, float),
    "retry_min": (int, float),
    "retry_max": (int, float),
    "token": (str,),
    "token_file": (str,),
    "tls": (bool,),
    "tls_ca": (str,),
    "tls_cert": (str,),
    "tls_key": (str,),
}


def _check(key: str, value: object, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types)
        raise ValueError(f"{key} = {value!r}: must be {names}")


def parse_link(table: Mapping[str, Any], where: str) -> LinkConfig:
    """One link's table. Raises ValueError naming the key."""
    for k, v in table.items():
        if k not in _LTYPES:
            raise ValueError(f"unknown key {where}{k!r} (known: {', '.join(_LTYPES)})")
        _check(where + k, v, _LTYPES[k])
    for k in ("address", "from_queue"):
        if k not in table:
            raise ValueError(f"{where}{k} is required")
    try:
        return LinkConfig(**table)
    except ValueError as exc:
        raise ValueError(f"{where[:-1]}: {exc}") from None


def parse_settings(table: Mapping[str, Any]) -> LinkSettings:
    """Settings from the ``[plugins.link]`` table. Raises ValueError naming the key."""
    kwargs: dict[str, Any] = {}
    for k, v in table.items():
        if k == "links":
            if not isinstance(v, Mapping):
                raise ValueError("links must be a table of tables")
            links = {}
            for name, ltable in v.items():
                if not isinstance(ltable, Mapping):
                    raise ValueError(f"links.{name} must be a table")
                links[name] = parse_link(ltable, f"links.{name}.")
            kwargs["links"] = links
        elif k in ("group", "metrics"):
            _check(k, v, (str,))
            kwargs[k] = v
        else:
            raise ValueError(f"unknown key {k!r} (known: group, metrics, links)")
    if not kwargs.get("links"):
        raise ValueError("links: configure at least one link ([plugins.link.links.NAME])")
    return LinkSettings(**kwargs)
