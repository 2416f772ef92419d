"""Broker configuration: every limit and timeout, with its default and the reason for it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .protocol.framing import ABSOLUTE_MAX_FRAME_SIZE, DEFAULT_MAX_FRAME_SIZE
from .runtime import DEFAULT_GC_THRESHOLD

MiB = 1024 * 1024


def _positive(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attr.name} must be a positive number, got {value!r}")


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attr.name} must be a non-negative integer, got {value!r}")


def _non_negative_number(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{attr.name} must be a number >= 0, got {value!r}")


#: The smallest non-zero ``splice_min_size``: above what the broker's writer sends straight
#: to a socket without its task (256 KiB, io/connection.py), which knows nothing of pipes.
SPLICE_MIN_SIZE_FLOOR = 512 * 1024


@attrs.frozen
class Limits:
    """Bounds the broker enforces. Each is checked before memory is spent.

    Defaults and where they come from:

    * ``max_frame_size`` 64 MiB: a configuration push to a large component carries
      multi-megabyte snippets; NATS' max_payload ceiling is 64 MiB, dbus-daemon allows
      128 MiB. Checked on the length prefix.
    * ``out_soft_limit`` 4 MiB per receiver: above it the broker stops reading from the
      senders that feed this receiver until it drains (backpressure instead of loss). A
      prototype that dropped receivers at a hard bound disconnected healthy subscribers
      under a 4 MiB burst; pausing senders lost nothing.
    * ``out_hard_limit`` 256 MiB per receiver (at least 2 frames of max size): a frame that
      would push a receiver's queue past it is refused to a requester (receiver-full); a
      one-way message or notification is *held* in its sender's reader (delivered to
      nobody yet, the sender's socket not read) until every receiver has room, so a burst
      from many senders loses nothing; a frame the broker itself owes a receiver (an
      answer it asked for, a membership event) drops that receiver (slow-consumer).
      Bounded memory even with many senders.
    * ``slow_consumer_timeout`` 10 s: a receiver above the soft limit that makes no write
      progress for this long is dropped, so one stopped reader (SIGSTOP) can pause its
      senders only this long. dbus-broker has no timer; NATS uses 2 s write_deadline for
      TCP over networks; a local bus can afford more patience for GC pauses.
    * ``request_timeout`` 300 s: long enough for any honest handler (a zone
      reload, a database write), so it only catches a black-holing recipient (always a
      bug, logged at ERROR).
    * ``max_pending_requests`` 10,000 per caller: D-Bus max_replies_per_connection is 128
      in the system bus, 50,000 in the session bus; 10k covers mass RPC to large groups.
    * ``max_subscriptions`` 4,096 per client: dbus-daemon's max_match_rules_per_connection
      is 512 (system) / 50,000 (session); a component subscribes to a handful of groups.
    * ``max_connections`` 8,192: below the usual 1024/soft 1M fd limits once raised; each
      connection costs a socket fd and two tasks.
    * ``idle_in_frame_timeout`` 30 s: a client that starts a frame and stalls is dropped
      (a broker that waits forever on a half-written frame freezes every client behind it).
    * ``handshake_timeout`` 10 s: a connection that never sends HELLO is dropped.
    * ``shutdown_grace`` 2 s: on SIGTERM, time to flush queued frames and GOODBYEs.
    * ``max_fds_per_message`` 253: Linux's SCM_MAX_FD, also D-Bus' per-message maximum;
      more in one message is refused (the client library refuses it before sending).
    * ``max_fds_queued`` 1,024 per receiver: descriptors waiting in the broker for one
      client (dbus-daemon: 64 system / 4,096 session bus per connection). A receiver that
      would exceed it is treated like one over ``out_hard_limit``. A sender held by such a
      receiver also keeps open what its last receive brought in and the broker has not
      yet parsed: at most 64 plus one message's (``transport.sockets.FD_DRAIN_MAX_FDS``).
    * ``socket_send_buffer`` 1 MiB: SO_SNDBUF asked for each client socket (the kernel
      doubles it; 0 keeps the kernel default, ``net.core.wmem_default``, 208 KiB on stock
      Linux). A Unix stream socket carries at most this much in flight, so with the default
      every 4 MiB frame needs ~20 wakeups per hop, and at 1 MiB a few; larger buffers
      stopped paying (more bytes in flight, colder copies: BENCHMARKS.md, "Tried, did not
      help"). The kernel only charges it while bytes are in flight, and it is capped
      by ``net.core.wmem_max``. It is on top of ``out_soft_limit``: a stopped reader holds up
      to that plus twice this much for its senders.
    * ``busy_poll`` 200 us: the longest the broker keeps polling its sockets after a read
      instead of sleeping in ``epoll_wait``, so that the next frame (the callee's answer,
      the caller's next request) is taken without a wake-up out of ``epoll_wait``, often
      across CPUs (two per round trip). Adaptive, after KVM's halt polling (io/polling.py,
      ``BusyPoller.adapt``):
      two reads in a row within ``busy_poll`` of the one before open the window, one
      later closes it; so the broker polls while frames come back to back, and not for a
      quiet bus or calls paced apart. Back to back it takes a wake-up off each hop of a
      round trip; its cost is the polling itself, worst for steady traffic with reads
      just under the limit apart (figures: BENCHMARKS.md, "Busy polling"). 0 turns it
      off; off anyway where the broker may run on one CPU only. The default is the
      smallest limit that opens for a round trip's reads as a sleeping broker sees them
      (the same section).
    * ``splice_min_size`` 1 MiB: a one-way MESSAGE or NOTIFY of which at least this many
      bytes are still to come once its head has arrived (and that has no descriptors or
      blobs) is moved through the broker with ``splice(2)``: its rest goes from the
      sender's socket into pipes and, once all of it is there, from the pipes into the
      receiver's socket, with no copy into the broker and out again (its two kernel
      copies were the largest part of the broker's CPU per 4 MiB message; BENCHMARKS.md,
      "Large frames spliced through the broker"). Below 1 MiB a frame needs too few
      pipes' worth to repay them. A frame that goes to several receivers, to a TCP one or
      into a capture is read back into memory once (one copy, as without splicing).
      0 turns it off; the floor is 512 KiB, above the size the broker writes straight
      to a socket.
    * ``splice_max_pipes`` 64: the pipes (about 1 MiB each, two descriptors each) the
      broker holds at once for frames in flight, so 64 MiB of kernel memory and 128
      descriptors at most; a frame that finds none free takes the copying path (no
      message is refused for it). Also falls back when the user's pipe quota
      (``fs.pipe-user-pages-soft``) or descriptor limit is reached, and for good
      (logged once) where the kernel or a sandbox refuses ``splice`` itself.
    * ``max_pattern_bytes`` 1,024: the longest subscription pattern (``Zone.*``), in UTF-8
      bytes; dbus-broker caps a match rule at 1,024 bytes. A pattern is a match rule, not
      a name, so it is bounded by this instead of the 255 of a group name.
    * ``max_pattern_tokens`` 16: the most ``.``-separated tokens in a pattern. A pattern's
      trie path and each lookup grow with the tokens; NATS recommends at most 16 tokens
      per subject ("Subject-Based Messaging"), so no sensible name needs more.
    * ``max_command_stats`` 1,024: (target group, command) pairs the per-command
      statistics track (core/cmdstats.py), each about 1 KiB with its latency buckets, so
      1 MiB at most and a Prometheus scrape of a few thousand series per family; a bus has
      tens of components with tens of commands each. The requests of further pairs are
      counted under ``other`` (and as overflow), so a client inventing command names costs
      no memory.
    * ``max_command_codes`` 16 per pair: the error codes a pair counts its callee's
      errors under (a callee chooses its codes; the protocol's own are 14); past it they
      are counted under ``other``.
    * ``trace_max_traces`` 256 and ``trace_max_hops`` 128: the hops of traced frames the
      broker keeps for the command ``trace`` (``msgq-trio trace``, core/traces.py): the
      oldest trace is forgotten first, hops past the bound are counted only. A trace is
      read right after its call, so the table holds the traces in flight and the last
      few; 32,768 hops of a few hundred bytes are a few MiB at most (Zipkin's in-memory
      collector, also a debugging store, keeps 500,000 spans, ``MEM_MAX_SPANS``).
      Untraced traffic never enters it.
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
    max_fds_per_message: int = attrs.field(default=253, validator=_positive)
    max_fds_queued: int = attrs.field(default=1024, validator=_positive)
    socket_send_buffer: int = attrs.field(default=1 * MiB, validator=_non_negative)

    busy_poll: float = attrs.field(default=0.0002, validator=_non_negative_number)
    splice_min_size: int = attrs.field(default=1 * MiB, validator=_non_negative)
    splice_max_pipes: int = attrs.field(default=64, validator=_non_negative)
    max_pattern_bytes: int = attrs.field(default=1024, validator=_positive)
    max_pattern_tokens: int = attrs.field(default=16, validator=_positive)
    max_command_stats: int = attrs.field(default=1024, validator=_positive)
    max_command_codes: int = attrs.field(default=16, validator=_positive)
    trace_max_traces: int = attrs.field(default=256, validator=_positive)
    trace_max_hops: int = attrs.field(default=128, validator=_positive)

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
        if 0 < self.splice_min_size < SPLICE_MIN_SIZE_FLOOR:
            raise ValueError(
                f"splice_min_size must be 0 (off) or at least {SPLICE_MIN_SIZE_FLOOR}, "
                f"got {self.splice_min_size}"
            )
        if self.busy_poll > 1:
            # More is a misconfiguration: a core burnt for a second after every read.
            raise ValueError(f"busy_poll must be at most 1 s, got {self.busy_poll!r}")


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


def default_state_dir() -> Path:
    """Where the broker's plugins keep durable state when ``state_dir`` is not set.

    ``$STATE_DIRECTORY`` (set by systemd for a unit with ``StateDirectory=``; its first
    entry), else ``/var/lib/msgq-trio`` for root (a system bus), else
    ``$XDG_STATE_HOME/msgq-trio`` (``~/.local/state/msgq-trio``). Never the socket's
    directory: that is usually a tmpfs (``/run``, ``$XDG_RUNTIME_DIR``) emptied at boot,
    and a durable queue must outlive a reboot.
    """
    env = os.environ.get("STATE_DIRECTORY", "")
    if env:
        return Path(env.split(":")[0])
    if os.getuid() == 0:
        return Path("/var/lib/msgq-trio")
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "msgq-trio"


def parse_socket_mode(text: str) -> int | None:
    """``socket_mode`` as permission bits: ``"0660"`` -> 0o660, ``""`` -> None (umask).

    Raises:
        ValueError: not 3 or 4 octal digits, or bits beyond 0777.
    """
    if text == "":
        return None
    t = text[2:] if text.startswith("0o") else text
    if not 3 <= len(t) <= 4 or any(c not in "01234567" for c in t) or int(t, 8) > 0o777:
        raise ValueError(f'socket_mode must be octal permission bits like "0660"; got {text!r}')
    return int(t, 8)


def resolve_group(text: str) -> int | None:
    """``socket_group`` as a gid: a group name or a number; ``""`` -> None (keep the
    broker's group).

    Raises:
        ValueError: no such group on this host.
    """
    import grp

    if text == "":
        return None
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"socket_group {text!r}: no such group on this host") from None


def _socket_mode(_inst: object, _attr: attrs.Attribute[Any], value: Any) -> None:
    parse_socket_mode(value)


def _socket_group(_inst: object, _attr: attrs.Attribute[Any], value: Any) -> None:
    resolve_group(value)


# -- operations settings (configuration file, docs/CONFIG.md) ---------------------------------

#: Log levels, most to least severe. TRAFFIC (below DEBUG) logs every frame routed.
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRAFFIC")
LOG_FORMATS = ("text", "json")
SYSLOG_FACILITIES = (
    "kern",
    "user",
    "mail",
    "daemon",
    "auth",
    "syslog",
    "lpr",
    "news",
    "uucp",
    "cron",
    "authpriv",
    "ftp",
    "local0",
    "local1",
    "local2",
    "local3",
    "local4",
    "local5",
    "local6",
    "local7",
)
#: Capture record kinds (docs/CAPTURE.md): REQUEST, REPLY, ERROR, NOTIFY to a client group,
#: NOTIFY to msgq.membership, MESSAGE.
CAPTURE_KINDS = ("command", "answer", "error", "notification", "membership", "message")
#: How a captured frame's body is written: not at all, its CBOR bytes in base64, or decoded.
CAPTURE_BODY_MODES = ("none", "base64", "json")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attr.name} must be one of {', '.join(choices)}; got {value!r}")

    return check


def _all_of(choices: tuple[str, ...]) -> Any:
    def check(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        bad = [v for v in value if v not in choices]
        if bad:
            raise ValueError(
                f"{attr.name} entries must be among {', '.join(choices)}; got {bad[0]!r}"
            )

    return check


def _non_negative_ints(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{attr.name} entries must be uids (integers >= 0); got {v!r}")


def _at_least(n: int) -> Any:
    def check(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < n:
            raise ValueError(f"{attr.name} must be at least {n}; got {value!r}")

    return check


@attrs.frozen
class LogSettings:
    """Where and how the broker logs (section ``[log]``). All apply at runtime.

    * ``level`` INFO: connections and drops of clients are logged at INFO/WARNING, so an
      operator sees every drop with the client's identity without per-connection noise;
      DEBUG adds connects and disconnects, TRAFFIC every frame routed (costly: opt-in).
    * ``format`` text: one line per record with ``[lname=... client=... pid=... uid=...]``
      fields; ``json`` writes one JSON object per line (for log shippers).
    * ``file`` "" (stderr): a path appends to that file (reopened if it is rotated away).
    * ``syslog`` false: true sends the log to ``syslog_address`` (``/dev/log``, where
      journald and rsyslog listen) with ``syslog_facility`` (daemon).
    """

    level: str = attrs.field(default="INFO", validator=_one_of(LOG_LEVELS))
    format: str = attrs.field(default="text", validator=_one_of(LOG_FORMATS))
    file: str = ""
    syslog: bool = False
    syslog_address: str = "/dev/log"
    syslog_facility: str = attrs.field(default="daemon", validator=_one_of(SYSLOG_FACILITIES))


@attrs.frozen
class ControlSettings:
    """Who may use the control commands (section ``[control]``). Applies at runtime.

    * ``allow_uids`` [] = only the uid the broker runs as: control commands reveal every
      client's traffic and can drop clients or stop the bus. A non-empty list replaces that
      default (list the broker's own uid too if it should keep access). No uid, root
      included, is allowed implicitly.
    """

    allow_uids: tuple[int, ...] = attrs.field(
        default=(), converter=tuple, validator=_non_negative_ints
    )


@attrs.frozen
class CaptureSettings:
    """Traffic capture to rotated JSON Lines files (section ``[capture]``; docs/CAPTURE.md).

    * ``enabled`` false: capture costs nothing while off (the broker's tap is None).
    * ``dir`` "": directory for the files; required when enabled (no default on purpose:
      the socket's directory is often a small tmpfs).
    * ``prefix`` "capture": files are ``<prefix>-000001.jsonl``, ``-000002``, ...
    * ``max_bytes`` 64 MiB per file and ``max_files`` 10 files kept (oldest deleted): disk
      use stays under 640 MiB by default; a file holds at least one record.
    * ``kinds`` / ``senders`` / ``targets`` [] = everything; else a record must match one
      entry of each non-empty list (kind name; sender lname or client name; target or its
      group).
    * ``body`` none: bodies are private data and the bulk of the traffic; ``base64`` writes
      the CBOR bytes, ``json`` the decoded value.
    * ``buffer_records`` 65,536 and ``buffer_bytes`` 32 MiB: the in-memory buffer between
      routing and the writer task; overflow is counted and written as a
      ``capture-dropped`` record, never blocks routing.
    * ``flush_interval`` 0.5 s: how often the writer task writes the buffer out.
    """

    enabled: bool = False
    dir: str = ""
    prefix: str = "capture"
    max_bytes: int = attrs.field(default=64 * MiB, validator=_at_least(4096))
    max_files: int = attrs.field(default=10, validator=_at_least(1))
    kinds: tuple[str, ...] = attrs.field(
        default=(), converter=tuple, validator=_all_of(CAPTURE_KINDS)
    )
    senders: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    targets: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    body: str = attrs.field(default="none", validator=_one_of(CAPTURE_BODY_MODES))
    buffer_records: int = attrs.field(default=65536, validator=_at_least(16))
    buffer_bytes: int = attrs.field(default=32 * MiB, validator=_at_least(65536))
    flush_interval: float = attrs.field(default=0.5, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.enabled and not self.dir:
            raise ValueError("capture.dir must be set when capture.enabled is true")
        if not self.prefix or "/" in self.prefix:
            raise ValueError(f"capture.prefix must be a non-empty file name; got {self.prefix!r}")


@attrs.frozen
class MetricsSettings:
    """Prometheus text endpoint (section ``[metrics]``). Read at start only.

    * ``listen`` "" = off: opt-in, since it opens a TCP port; ``HOST:PORT`` (port 0 picks
      a free one, reported in the log and in ``stats``) serves ``GET /metrics``.
    """

    listen: str = ""


@attrs.frozen
class TracingSettings:
    """The broker's own OpenTelemetry spans (section ``[tracing]``). Read at start only.

    * ``otel`` false: off by default (it needs the ``otel`` extra, and an exporter to
      send to); true: each traced hop the broker routes is a span, the child of the
      sender's (ops/otel.py), exported as the standard ``OTEL_*`` environment variables
      say (``OTEL_TRACES_EXPORTER``: ``otlp`` by default, ``console``, ``none``).
      Untraced traffic costs nothing more either way.
    * ``otel_file`` "": where the ``console`` exporter writes (one JSON span a line);
      "" is standard error.
    """

    otel: bool = False
    otel_file: str = ""


def _listen_addresses(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    for v in value:
        host, sep, port = str(v).rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"{attr.name} entries must be HOST:PORT; got {v!r}")


def _token_hashes(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    for name, h in value.items():
        if not isinstance(name, str) or not name or len(name) > 255 or "\0" in name:
            raise ValueError(f"{attr.name}: identity names must be 1..255 characters")
        algo, sep, digest = str(h).partition(":")
        if (
            algo != "sha256"
            or not sep
            or len(digest) != 64
            or not all(c in "0123456789abcdef" for c in digest)
        ):
            raise ValueError(
                f"{attr.name}.{name} must be 'sha256:' and 64 lowercase hex digits (the hash "
                "of the token, never the token itself: `msgq-trio token` makes both)"
            )


@attrs.frozen
class TcpSettings:
    """TCP listeners for clients on other hosts (section ``[tcp]``; docs/SECURITY.md).

    Read at start only, except ``tokens`` and the heartbeat settings (new connections).

    * ``listen`` [] = off: the Unix socket is always served; TCP is opt-in because it
      exposes the bus beyond this host's file permissions.
    * ``certfile`` / ``keyfile`` "": the broker's TLS certificate chain and key (PEM).
      Without them a listener is plain TCP, which is refused unless ``insecure`` is true
      *and* the listener is on a loopback address: tokens and traffic would cross the
      network in clear text, and anyone on the path could take over a session.
    * ``client_ca`` "": a CA bundle (PEM); when set, clients may authenticate with a
      certificate it signed (identity = the subject's CN) instead of a token. A presented
      certificate that does not verify fails the TLS handshake.
    * ``require_client_cert`` false: true refuses TLS clients without such a certificate.
    * ``insecure`` false: allow plain TCP on loopback addresses (tests, a local TLS
      terminator); never on other addresses.
    * ``tokens`` {}: identity name -> ``"sha256:<hex>"``, the SHA-256 of a token that
      client sends in HELLO. Only hashes are stored: a leaked configuration file does not
      leak credentials. Tokens are random (``msgq-trio token`` makes 256-bit ones), so an
      unsalted fast hash is enough (no dictionary to attack; GitHub stores its tokens so).
    * ``heartbeat_interval`` 5 s and ``heartbeat_misses`` 3: an idle TCP connection is
      pinged every interval and dropped after ``misses`` intervals without a byte from it
      (15 s: NATS' ping_interval 2 min x 2 is for the internet; on a bus of cooperating
      processes a dead host should fail calls within seconds, as a Unix disconnect does).
    """

    listen: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_listen_addresses)
    certfile: str = ""
    keyfile: str = ""
    client_ca: str = ""
    require_client_cert: bool = False
    insecure: bool = False
    tokens: dict[str, str] = attrs.field(factory=dict, validator=_token_hashes)
    heartbeat_interval: float = attrs.field(default=5.0, validator=_positive)
    heartbeat_misses: int = attrs.field(default=3, validator=_at_least(1))

    def __attrs_post_init__(self) -> None:
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("tcp.certfile and tcp.keyfile must be given together")
        if (self.client_ca or self.require_client_cert) and not self.certfile:
            raise ValueError("tcp.client_ca / require_client_cert need TLS (tcp.certfile)")
        if self.require_client_cert and not self.client_ca:
            raise ValueError("tcp.require_client_cert needs tcp.client_ca")
        if self.listen and not self.certfile:
            if not self.insecure:
                raise ValueError(
                    "tcp.listen without TLS (tcp.certfile/keyfile): plain TCP sends tokens "
                    "and traffic in clear text; set tcp.insecure = true to allow it on "
                    "loopback addresses only"
                )
            for addr in self.listen:
                if not is_loopback(addr.rpartition(":")[0]):
                    raise ValueError(
                        f"tcp.listen {addr!r}: plain TCP (tcp.insecure) is allowed on "
                        "loopback addresses only; configure TLS to listen there"
                    )


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost`` (names are not resolved otherwise)."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: What a rule in ``[[access]]`` can grant: patterns per verb (docs/SECURITY.md).
ACCESS_VERBS = ("send", "subscribe", "call", "bind", "consume", "produce")


def _verb_table(verbs: Mapping[str, str]) -> dict[str, str]:
    return dict(verbs)


@attrs.frozen
class CommandAccess:
    """What a plugin's commands need from the access policy, declared by the plugin
    (``Plugin.access``, plugins/api.py) and enforced by the broker (core/access.py) on a
    restricted client's REQUEST to ``group``: a command listed in ``verbs`` needs that
    verb on the object the request's ``params[param]`` names, besides ``call`` on the
    group. Commands not listed need ``call`` only.

    * ``group``: the group the plugin answers these commands on. The broker's
      ``[access] queue_group`` replaces it for the plugin registered as ``queue``.
    * ``param``: the params key naming the object (the queue plugin's: ``"queue"``); a
      request without a string there is refused, since nothing could be granted on it.
    * ``verbs``: command -> one of :data:`ACCESS_VERBS` (the queue plugin's commands need
      ``consume`` or ``produce``). The broker refuses to start with a plugin that
      declares any other verb (plugins/loader.py).
    """

    group: str
    param: str
    verbs: dict[str, str] = attrs.field(converter=_verb_table)


@attrs.frozen
class AccessRule:
    """One ``[[access]]`` table: what the identities matching ``who`` may do.

    ``who`` are glob patterns over identities: ``tcp:NAME`` (token or certificate CN),
    ``unix:USER``, ``uid:N``, ``gid:N`` (SO_PEERCRED of a Unix client) and ``group:NAME``
    (every group of that user in the group database), ``*`` for everyone. Each
    verb lists glob patterns over group names (``send``, ``call``, ``subscribe``,
    ``bind``; an lname target is matched as ``l.N``) or queue names (``consume``,
    ``produce``); ``control`` grants the control commands.
    """

    who: tuple[str, ...] = attrs.field(converter=tuple)
    send: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    subscribe: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    call: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    bind: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    consume: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    produce: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    control: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.who:
            raise ValueError("who must name at least one identity pattern")
        for v in self.who:
            kind = v.partition(":")[0]
            if v != "*" and kind not in ("tcp", "unix", "uid", "gid", "group"):
                raise ValueError(
                    f"who entry {v!r} must be '*', 'tcp:NAME', 'unix:USER', 'uid:N', "
                    "'gid:N' or 'group:NAME'"
                )


@attrs.frozen
class AccessSettings:
    """The access policy (``[[access]]`` tables plus ``[access_options]``).

    * ``rules`` []: no rules = Unix clients may do everything (the socket's file
      permissions are the policy);
      TCP clients may do nothing but the harmless broker commands (ping, version,
      members, unsubscribe) until a rule grants them more. A client is checked against
      the rules whose ``who`` matches it, the union of their grants; a Unix client no
      rule matches keeps everything, a TCP client no rule matches gets nothing.
    * ``queue_group`` "msgq-queue": the queue plugin's group, on which the verbs the
      queue plugin declares for its commands (:class:`CommandAccess`; its consumer
      commands need ``consume``, its producer commands ``produce`` on the queue named
      in the request) are checked, whether or not this broker runs the plugin.
    """

    rules: tuple[AccessRule, ...] = attrs.field(default=(), converter=tuple)
    queue_group: str = "msgq-queue"


#: The quotas of ``[quotas]`` a user may be given its own value for in ``[quotas.users]``.
USER_QUOTAS = ("memory", "connections", "fds", "subscriptions", "pending_requests")


def machine_memory() -> tuple[int, str]:
    """The memory the broker's host gives it, and where that figure came from: the
    cgroup v2 limit (``/sys/fs/cgroup/memory.max``) when one is set and lower, else the
    machine's physical memory (``sysconf(SC_PHYS_PAGES) x SC_PAGE_SIZE``, what
    ``/proc/meminfo`` calls MemTotal). 1 GiB when neither can be read."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "physical memory (sysconf SC_PHYS_PAGES x SC_PAGE_SIZE)"
    except (OSError, ValueError):
        total, source = 1024 * MiB, "1 GiB (physical memory unknown)"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit() and 0 < int(text) < total:
            total, source = int(text), "the cgroup's memory.max"
    except OSError:
        pass
    return total, source


def _user_quota_table(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{attr.name} must be a table of user tables")
    for who, table in value.items():
        kind, _, name = str(who).partition(":")
        if kind not in ("uid", "tcp") or not name or (kind == "uid" and not name.isdigit()):
            raise ValueError(
                f"{attr.name}: {who!r} must be 'uid:N' (a local user) or 'tcp:NAME' "
                "(an authenticated TCP identity)"
            )
        if not isinstance(table, Mapping):
            raise ValueError(f"{attr.name}.{who} must be a table")
        for k, v in table.items():
            if k not in USER_QUOTAS:
                raise ValueError(
                    f"{attr.name}.{who}.{k}: unknown quota (a user table has "
                    f"{', '.join(USER_QUOTAS)})"
                )
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{attr.name}.{who}.{k} must be a positive integer, got {v!r}")


def _share(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"{attr.name} must be a number in (0, 1], got {value!r}")


@attrs.frozen
class QuotaSettings:
    """Per-user quotas (section ``[quotas]``; docs/SECURITY.md, "Per-user quotas").
    All apply at runtime: a tightened quota refuses new use, never drops existing use.

    A user is a local uid (SO_PEERCRED; key ``uid:N``) or an authenticated TCP identity
    (``tcp:NAME``). Every user is subject to them, root and the broker's own plugins
    included; ``users`` gives one user other values.

    * ``enabled`` true: false turns every per-user quota off (per-connection limits stay).
    * ``broker_memory_total`` 0 = the machine's memory (the cgroup's ``memory.max`` if
      lower; :func:`machine_memory`): the figure the memory quota is a share of.
    * ``user_memory_share`` 1/16: the bytes one user may have queued in the broker (on
      its connections' outgoing queues) are this share of ``broker_memory_total``; 1.5 GiB
      on a 24 GiB machine, so one user can take at most 1/16 of the machine through the
      broker, and a normal component (one receiver's ``out_soft_limit`` is 4 MiB) never
      comes near it.
    * ``connections`` 4,096: connections of one user at once, half of
      ``max_connections``, so one user can never hold every slot and another user always
      finds room. Far above dbus-daemon's 256 per user and dbus-broker's launcher's 64,
      because a deployment here runs its whole suite under one uid, with a connection
      per zone transfer or per script: thousands are normal use, not an attack.
    * ``fds`` 4,096: descriptors queued in the broker for one user's connections, four
      receivers at ``max_fds_queued`` (dbus-broker: 64 per user, for a bus that passes
      descriptors rarely).
    * ``subscriptions`` 131,072: group memberships of one user, 32 connections at
      ``max_subscriptions``: a suite of a thousand components under one uid with a
      hundred subscriptions each (the routing workload of BENCHMARKS.md) fits; at a few
      hundred bytes each the total stays in tens of MiB. dbus-broker's 16,384 per user is
      for a desktop bus with a few match rules per client.
    * ``pending_requests`` 40,000: requests one user's connections wait answers for,
      four callers at ``max_pending_requests``.
    * ``refusals_before_drop`` 100: a connection refused this many times for a quota
      (``limit-exceeded``) is pushing on regardless and is dropped; the refusals it was
      given were its chance to back off.
    * ``users`` {}: ``{"uid:N" | "tcp:NAME" = {quota = value, ...}}``, one user's own
      values (``memory`` in bytes, ``connections``, ``fds``, ``subscriptions``,
      ``pending_requests``).
    """

    enabled: bool = True
    broker_memory_total: int = attrs.field(default=0, validator=_non_negative)
    user_memory_share: float = attrs.field(default=1 / 16, validator=_share)
    connections: int = attrs.field(default=4096, validator=_positive)
    fds: int = attrs.field(default=4096, validator=_positive)
    subscriptions: int = attrs.field(default=131_072, validator=_positive)
    pending_requests: int = attrs.field(default=40_000, validator=_positive)
    refusals_before_drop: int = attrs.field(default=100, validator=_positive)
    users: dict[str, dict[str, int]] = attrs.field(factory=dict, validator=_user_quota_table)

    def memory_total(self) -> int:
        """``broker_memory_total``, or the machine's memory when it is 0."""
        return self.broker_memory_total or machine_memory()[0]

    def for_user(self, key: str, memory_total: int) -> dict[str, int]:
        """The quotas of user ``key`` (``uid:N`` / ``tcp:NAME``): the defaults with its
        ``users`` entry over them; ``memory`` in bytes."""
        out = {
            "memory": int(memory_total * self.user_memory_share),
            "connections": self.connections,
            "fds": self.fds,
            "subscriptions": self.subscriptions,
            "pending_requests": self.pending_requests,
        }
        out.update(self.users.get(key, {}))
        return out


@attrs.frozen
class BrokerConfig:
    """Everything ``msgq-trio serve`` reads from its configuration file and flags.

    ``socket`` "" means :func:`default_socket_path`. ``socket_mode`` "" leaves the socket
    file's permission bits to the umask; ``"0660"`` with ``socket_group`` lets that
    group's members connect (a shared system bus, docs/DEPLOY.md). ``state_dir`` ""
    means :func:`default_state_dir`: the queue plugin's store defaults to
    ``<state_dir>/queue``. These, ``socket`` and ``metrics.listen`` take effect at start
    only; everything else can change at runtime (docs/CONFIG.md).
    """

    socket: str = ""
    socket_mode: str = attrs.field(default="", validator=_socket_mode)
    socket_group: str = attrs.field(default="", validator=_socket_group)
    state_dir: str = ""
    #: The youngest generation's threshold of CPython's cyclic garbage collector in the
    #: broker and its plugin processes (0: the interpreter's own, 700); msgq_trio.runtime
    #: says why it is raised. Read at start only.
    gc_threshold: int = attrs.field(default=DEFAULT_GC_THRESHOLD, validator=_non_negative)
    limits: Limits = attrs.field(factory=Limits)
    log: LogSettings = attrs.field(factory=LogSettings)
    control: ControlSettings = attrs.field(factory=ControlSettings)
    capture: CaptureSettings = attrs.field(factory=CaptureSettings)
    metrics: MetricsSettings = attrs.field(factory=MetricsSettings)
    tracing: TracingSettings = attrs.field(factory=TracingSettings)
    tcp: TcpSettings = attrs.field(factory=TcpSettings)
    access: AccessSettings = attrs.field(factory=AccessSettings)
    quotas: QuotaSettings = attrs.field(factory=QuotaSettings)
    #: ``[plugins.<name>]`` tables: each names a plugin (entry point group
    #: ``msgq_trio.plugins``) to run under the broker's supervision, with its settings
    #: (checked by the plugin itself; docs/QUEUE.md). Read at start only.
    plugins: dict[str, dict[str, Any]] = attrs.field(factory=dict)
