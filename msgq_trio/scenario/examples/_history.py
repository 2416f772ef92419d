"""The history file of an example program: MSGQ_TRIO_HISTORY (appended to, so a restarted
program continues it), or nowhere when the variable is unset."""

from __future__ import annotations

import os
import time
from typing import Any

from ..history import Recorder


class History:
    """Appends this process's operations, one JSON line each, flushed at once (a SIGKILL
    loses nothing already recorded)."""

    def __init__(self) -> None:
        self.rec = Recorder(os.environ.get("MSGQ_TRIO_CLIENT", f"pid-{os.getpid()}"))
        path = os.environ.get("MSGQ_TRIO_HISTORY")
        self._out = open(path, "a") if path else None  # noqa: SIM115 - lives with the process

    def _write(self, line: str) -> None:
        if self._out is not None:
            self._out.write(line + "\n")
            self._out.flush()

    def invoke(self, f: str, **fields: Any) -> int:
        op_id, line = self.rec.invoke(f, time.monotonic(), **fields)
        self._write(line)
        return op_id

    def complete(self, op_id: int, type_: str, f: str, **fields: Any) -> None:
        self._write(self.rec.complete(op_id, type_, f, time.monotonic(), **fields))

    def event(self, f: str, **fields: Any) -> None:
        self._write(self.rec.event(f, time.monotonic(), **fields))
