"""msgq_trio benchmark clients on the C client (libmsgq):
``python -m benchmarks.worker_msgq_c SPEC_JSON``.

The ``msgq_trio-c`` system: the same broker as ``msgq_trio``, with every client a C
process. This module only replaces itself (``execv``) with the built ``msgq-bench``
(clients/c/bench/msgq_bench.c, its path in the spec's ``addr.c_worker``), which speaks
the worker protocol of :mod:`benchmarks.common` itself; so the process the parent
watches, and whose CPU time it reads from /proc, is the C program, and no Python
runs beside it.
"""

from __future__ import annotations

import json
import os
import sys

from .common import emit


def main(argv: list[str] | None = None) -> int:
    """Exec the C worker with the spec; an ``error`` RESULT if that is impossible."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.worker_msgq_c SPEC_JSON", file=sys.stderr)
        return 2
    binary = json.loads(args[0]).get("addr", {}).get("c_worker")
    if not binary:
        emit({"error": "the spec has no addr.c_worker (the msgq-bench to run)"})
        return 2
    sys.stdout.flush()
    try:
        os.execv(binary, [binary, args[0]])
    except OSError as exc:
        emit({"error": f"cannot run {binary}: {exc}"})
    return 1


if __name__ == "__main__":
    sys.exit(main())
