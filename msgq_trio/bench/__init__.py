"""The benchmark harness: ``msgq-trio bench`` / ``python -m msgq_trio.bench``.

msgq_trio (its trio, asyncio and direct clients) next to two ceilings (raw AF_UNIX
sockets with no broker; a minimal Python relay) and, with ``--peers``, NATS, Redis (sync
and redis.asyncio) and ZeroMQ, on five identical workloads; the asyncio clients also side
by side in a table of their own. Every broker and every client is its own process. Entry
points: :func:`run.main` (the command line) and :func:`run.smoke` (quick mode, for the
test suite). Results: BENCHMARKS.md.
"""
