"""The benchmark harness, run from a checkout: ``python -m benchmarks [options]``.

msgq_trio (its trio, asyncio and direct clients) next to two ceilings (raw AF_UNIX
sockets with no broker; a minimal Python relay) and, with ``--peers``, NATS, Redis (sync
and redis.asyncio) and ZeroMQ, on five identical workloads; the asyncio clients also side
by side in a table of their own. Every broker and every client is its own process. Entry
points: :func:`run.main` (the command line) and :func:`run.smoke` (quick mode, for the
test suite). Results: BENCHMARKS.md.

Not part of the msgq_trio wheel: it lives at the top of the repository with its own
requirements (``benchmarks/requirements.txt``: the peers' clients), so no worker or
installer for another message bus lands in a user's site-packages.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout this package sits in: children started as ``python -m benchmarks.X``
#: find the package there wherever the parent was started from.
REPO = Path(__file__).resolve().parent.parent


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the checkout first on
    ``PYTHONPATH``, for a child that runs a module of this package."""
    out = dict(os.environ if env is None else env)
    path = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in path:
        out["PYTHONPATH"] = os.pathsep.join([str(REPO), *path])
    return out
