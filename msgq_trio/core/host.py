"""What the dispatcher and the broker's own commands need from the broker that owns them.

:class:`~.broker.Broker` builds a :class:`~.dispatch.Dispatcher` and a
:class:`~.commands.BrokerCommands` over itself; both depend on this narrow protocol
instead of the ``Broker`` class, so the core's files import each other in one direction
only (broker -> dispatch, commands -> host), which the layering test checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..config import Limits
from ..protocol.codes import ErrorCode
from ..protocol.framing import Frame
from .access import Policy
from .delivery import Delivery
from .peers import Peer
from .relay import Relays
from .router import Router
from .rpc import PendingReplies
from .tap import Taps
from .traces import Traces


class CommandRunner(Protocol):
    """Runs a REQUEST addressed to the broker itself (:class:`~.commands.BrokerCommands`)."""

    def run(self, peer: Peer, frame: Frame, command: str) -> None: ...


class BrokerHost(Protocol):
    """The broker's state and decisions the dispatcher and the commands share."""

    version: str
    router: Router
    rpc: PendingReplies
    relays: Relays
    delivery: Delivery
    taps: Taps
    traces: Traces
    stats: dict[str, int]
    policy: Policy | None
    close_fd: Callable[[int], None]

    @property
    def limits(self) -> Limits: ...

    @property
    def own_commands(self) -> CommandRunner: ...

    def refuse(self, peer: Peer, verb: str, name: str) -> str: ...

    def quota_refused(
        self, peer: Peer, quota: str, used: int, limit: int, owner: str, *, strike: bool = True
    ) -> str: ...

    def kick(self, peer: Peer, code: ErrorCode, message: str) -> None: ...

    def publish_membership(self, event: str, params: dict[str, object]) -> None: ...
