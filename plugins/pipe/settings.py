"""Settings of the pipe plugin: the ``[plugins.pipe]`` table (docs/PIPES.md, "Limits")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from msgq_trio.core.router import valid_group_name

__all__ = ["PipeSettings", "parse_settings"]

KiB = 1 << 10
MiB = 1 << 20


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
      client lname and name, sizes, timeouts) at INFO in the broker's log (seed 002 asks
      for it to see what applications do). Off by default: a line per chunk.
    """

    group: str = "msgq-pipe"
    max_buffer: int = 4 * MiB
    max_chunk: int = 256 * KiB
    max_hold: float = 20.0
    max_pending: int = 16
    max_pipes: int = 10_000
    trace: bool = False

    def __attrs_post_init__(self) -> None:
        why = valid_group_name(self.group)
        if why or self.group.startswith("msgq."):
            raise ValueError(f"group = {self.group!r}: {why or 'reserved for the broker'}")
        if self.max_chunk < 1 or self.max_chunk > self.max_buffer:
            raise ValueError(f"max_chunk = {self.max_chunk}: need 1 <= max_chunk <= "
                             f"max_buffer ({self.max_buffer})")
        if self.max_chunk > 16 * MiB:
            raise ValueError(f"max_chunk = {self.max_chunk}: at most 16 MiB (frame size)")
        if not self.max_hold > 0:
            raise ValueError(f"max_hold = {self.max_hold}: must be positive")
        if self.max_pending < 2:
            raise ValueError(f"max_pending = {self.max_pending}: must be >= 2")
        if self.max_pipes < 1:
            raise ValueError(f"max_pipes = {self.max_pipes}: must be >= 1")


_TYPES: dict[str, tuple[type, ...]] = {
    "group": (str,), "max_buffer": (int,), "max_chunk": (int,),
    "max_hold": (int, float), "max_pending": (int,), "max_pipes": (int,), "trace": (bool,),
}


def parse_settings(table: Mapping[str, Any]) -> PipeSettings:
    """Settings from the ``[plugins.pipe]`` table. Raises ValueError naming the key."""
    for k, v in table.items():
        if k not in _TYPES:
            raise ValueError(f"unknown key {k!r} (known: {', '.join(_TYPES)})")
        types = _TYPES[k]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise ValueError(f"{k} = {v!r}: must be {' or '.join(t.__name__ for t in types)}")
    return PipeSettings(**table)
