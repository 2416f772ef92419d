"""Fault actions a scenario can schedule: what each one does to which process.

The runner (:mod:`msgq_trio.scenario.runner`) applies them at ``at`` seconds after traffic
starts; the model validates names against :data:`CLIENT_ACTIONS` and
:data:`BROKER_ACTIONS`; docs/FAULTS.md lists :data:`DESCRIPTIONS`. Faults that a client
inflicts itself (half frames, garbage, connection storms, fd floods) are client roles,
released at their time by the ``start`` action.
"""

from __future__ import annotations

import signal

#: Client fault -> the signal sent to the target process(es) (``start`` sends ``go``).
CLIENT_SIGNALS: dict[str, signal.Signals] = {
    "sigkill": signal.SIGKILL,
    "sigstop": signal.SIGSTOP,
    "sigcont": signal.SIGCONT,
    "sigterm": signal.SIGTERM,
    # The client programs give SIGUSR1/SIGUSR2 a role-specific meaning.
    "stop-reading": signal.SIGUSR1,
    "resume-reading": signal.SIGUSR2,
    "release": signal.SIGUSR1,
}
CLIENT_ACTIONS: tuple[str, ...] = (*CLIENT_SIGNALS, "start", "restart")
BROKER_ACTIONS: tuple[str, ...] = ("kill-broker", "restart-broker", "stop-broker", "cont-broker")
#: Actions on one of the broker's plugin processes (``target`` names the plugin).
PLUGIN_ACTIONS: tuple[str, ...] = ("kill-plugin", "fill-disk", "free-disk")
#: Actions on the network between the runner's namespace and a broker of
#: ``[brokers.NAME]`` with ``netns = true`` (``target`` names it).
NET_ACTIONS: tuple[str, ...] = ("net-cut", "net-heal", "net-netem", "net-clear")
#: Client faults after which the target is "at fault": its latency is not a healthy one.
DISRUPTING_ACTIONS: tuple[str, ...] = (
    "sigkill",
    "sigstop",
    "sigterm",
    "stop-reading",
    "start",
    "restart",
)

DESCRIPTIONS: dict[str, str] = {
    "sigkill": "SIGKILL the client process(es): a crash, no GOODBYE, sockets just close",
    "sigstop": "SIGSTOP: the process stops reading and writing (the runner SIGCONTs it "
    "before the end)",
    "sigcont": "SIGCONT a stopped client",
    "sigterm": "SIGTERM: the client stops in order and reports",
    "stop-reading": "SIGUSR1 to a stalled-reader: it stops reading its socket altogether",
    "resume-reading": "SIGUSR2 to a stalled-reader: it reads again",
    "release": "SIGUSR1 to a hold client: it closes its connections",
    "start": "the target gets `go` only now, so the fault it inflicts (half frames, garbage, "
    "a connection storm, an fd flood) strikes at this time",
    "restart": "SIGKILL the client process(es) and start them again with the same command "
    "line (a user program's crash and its supervisor's restart); built-in roles get `go` "
    "once ready",
    "kill-plugin": "SIGKILL the plugin named by target (queue, pipe, link); the broker's "
    "supervisor restarts it; plugin.<name>.restart_ms is the time until it is ready again",
    "fill-disk": "fill the queue store's file system (the tmpfs of broker.queue_disk) to the "
    "last byte with a filler file: commits fail, producers get queue-full",
    "free-disk": "delete the filler file: the queue stores again",
    "net-cut": "take the network to the target broker's namespace down (its interface, "
    "no FIN, no RST: only heartbeats and timeouts notice)",
    "net-heal": "bring the target broker's network up again",
    "net-netem": "add delay, jitter, loss, reordering or duplication to the target broker's "
    'network in both directions (`netem = "delay 200ms 50ms loss 5%"`, tc-netem(8) '
    "syntax)",
    "net-clear": "remove what net-netem added",
    "net-proxy": "change the fault proxy in front of the target broker's TCP listener "
    '(proxy = "delay 50ms 20ms loss 5%" / "blackhole" / "cut 100" / "clear"; any kernel, '
    "no root)",
    "kill-broker": "SIGKILL the broker (its socket file stays behind, stale); with target, "
    "that broker of [brokers.NAME]",
    "restart-broker": "start a new broker on the same socket path and flags (SIGKILLing the "
    "old one if it still runs); broker.restart_ms is the time until it listens",
    "stop-broker": "SIGSTOP the broker",
    "cont-broker": "SIGCONT the broker",
}
