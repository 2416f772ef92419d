"""Process helpers shared by the scenario runner (msgq_trio/scenario) and the benchmark
harness (benchmarks/ in the repository): a free TCP port, a process's RSS and CPU time
from /proc, the descriptor limit. Standard library only, so any layer may import it;
private (no API promise to users).
"""

from __future__ import annotations

import os
import socket

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_kib(pid: int) -> int | None:
    """Resident set size of process ``pid`` in KiB (``VmRSS``); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def raise_nofile() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; children inherit it.

    Returns the (soft, hard) limits now in force. Thousands of idle clients need as many
    descriptors in the broker and in the client processes; the usual soft limit is 1,024.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft, hard


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
