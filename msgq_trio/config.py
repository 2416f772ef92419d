"""Broker configuration: every limit and timeout, with its default and the reason for it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from .protocol.framing import ABSOLUTE_MAX_FRAME_SIZE, DEFAULT_MAX_FRAME_SIZE

MiB = 1024 * 1024


def _positive(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attr.name} must be a positive number, got {value!r}")


@attrs.frozen
class Limits:
    """Bounds the broker enforces. Each is checked before memory is spent.

    Defaults and where they come from:

    * ``max_frame_size`` 64 MiB: seed 000 wants multi-megabyte config snippets; NATS'
      max_payload ceiling is 64 MiB, dbus-daemon allows 128 MiB. Checked on the length prefix.
    * ``out_soft_limit`` 4 MiB per receiver: above it the broker stops reading from the
      senders that feed this receiver until it drains (backpressure instead of loss). A
      prototype that dropped receivers at a hard bound disconnected healthy subscribers
      under a 4 MiB burst; pausing senders lost nothing.
    * ``out_hard_limit`` 256 MiB per receiver (at least 2 frames of max size): a frame that
      would push a receiver's queue past it is refused to a requester (receiver-full) or,
      for a message the receiver subscribed to / an answer it asked for, the receiver is
      dropped (slow-consumer). Bounded memory even with many senders.
    * ``slow_consumer_timeout`` 10 s: a receiver above the soft limit that makes no write
      progress for this long is dropped, so one stopped reader (SIGSTOP) can pause its
      senders only this long. dbus-broker has no timer; NATS uses 2 s write_deadline for
      TCP over networks; a local bus can afford more patience for GC pauses.
    * ``request_timeout`` 300 s: seed 000 asks for a long, configurable timeout that only
      catches a black-holing recipient (always a bug, logged at ERROR).
    * ``max_pending_requests`` 10,000 per caller: D-Bus max_replies_per_connection is 128
      in the system bus, 50,000 in the session bus; 10k covers mass RPC to large groups.
    * ``max_subscriptions`` 4,096 per client: dbus-daemon's max_match_rules_per_connection
      is 512 (system) / 50,000 (session); a component subscribes to a handful of groups.
    * ``max_connections`` 8,192: below the usual 1024/soft 1M fd limits once raised; each
      connection costs a socket fd and two tasks.
    * ``idle_in_frame_timeout`` 30 s: a client that starts a frame and stalls is dropped
      (seed 000: a half-written frame froze BIND 10's whole msgq).
    * ``handshake_timeout`` 10 s: a connection that never sends HELLO is dropped.
    * ``shutdown_grace`` 2 s: on SIGTERM, time to flush queued frames and GOODBYEs.
    """

    max_frame_size: int = attrs.field(default=DEFAULT_MAX_FRAME_SIZE, validator=_positive)
    out_soft_limit: int = attrs.field(default=4 * MiB, validator=_positive)
    out_hard_limit: int = attrs.field(default=256 * MiB, validator=_positive)
    slow_consumer_timeout: float = attrs.field(default=10.0, validator=_positive)
    request_timeout: float = attrs.field(default=300.0, validator=_positive)
    max_pending_requests: int = attrs.field(default=10_000, validator=_positive)
    max_subscriptions: int = attrs.field(default=4096, validator=_positive)
    max_connections: int = attrs.field(default=8192, validator=_positive)
    idle_in_frame_timeout: float = attrs.field(default=30.0, validator=_positive)
    handshake_timeout: float = attrs.field(default=10.0, validator=_positive)
    shutdown_grace: float = attrs.field(default=2.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.max_frame_size > ABSOLUTE_MAX_FRAME_SIZE:
            raise ValueError(f"max_frame_size must be <= {ABSOLUTE_MAX_FRAME_SIZE}")
        if self.out_hard_limit < 2 * self.max_frame_size:
            raise ValueError(
                "out_hard_limit must be at least 2 x max_frame_size "
                f"({self.out_hard_limit} < 2 x {self.max_frame_size})"
            )
        if self.out_soft_limit > self.out_hard_limit:
            raise ValueError("out_soft_limit must not exceed out_hard_limit")


def default_socket_path() -> Path:
    """Where the broker listens when neither ``--socket`` nor ``$MSGQ_TRIO_SOCKET`` is given.

    ``$XDG_RUNTIME_DIR/msgq-trio/bus.sock`` (a per-user tmpfs, mode 0700 by systemd), else
    ``/tmp/msgq-trio-<uid>/bus.sock``. The directory is created with mode 0700 by the broker.
    """
    env = os.environ.get("MSGQ_TRIO_SOCKET")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "msgq-trio" / "bus.sock"
    return Path(f"/tmp/msgq-trio-{os.getuid()}") / "bus.sock"
