"""Soak runs: a scenario's ``[soak]`` table turned into a fault schedule, and the verdict
on the broker's RSS and fds sampled through a long run.

Pure functions (no trio, no processes): :func:`expand` makes the scenario the runner
runs (a fault every ``fault_every`` seconds drawn with the run's seed from the pool, the
built-in clients' ``duration`` and the programs' ``{duration}`` / ``{count:R}``
placeholders set from the soak's duration); :func:`flatness` compares the broker's
samples of the end window with those of the reference window.

Like with like across broker restarts: a restarted broker starts small and grows to its
working size, so a sample counts only once its broker is ``settled`` seconds old, and a
window's figure is the median of its samples (a fault's passing spike, e.g. a garbage
round's buffers, moves a median little; a leak moves every sample). The fds compared
are the broker's descriptors less its client connections (``fds - connections``): the
number of connected clients varies with the faults (a stopped or restarting client), a
leaked descriptor does not go away.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from .model import FaultSpec, Scenario, SoakSpec

#: A stopping fault and the fault that undoes it ``undo_after`` seconds later.
UNDO: dict[str, str] = {"sigstop": "sigcont", "stop-broker": "cont-broker"}
_COUNT_RE = re.compile(r"\{count:(\d+(?:\.\d+)?)\}")


def scaled(spec: SoakSpec, duration: float) -> SoakSpec:
    """``spec`` for a run of ``duration`` seconds: the windows and the settling time
    shrink with a run shorter than ``warmup + 2 * window`` (a test's short run), so the
    comparison still has a reference and an end; faults come at least four times and a
    stopping fault is undone within a tenth of the run."""
    warmup, window, settled = spec.warmup, spec.window, spec.settled
    if duration < warmup + 2 * window:
        warmup = window = duration / 4
        settled = min(settled, duration / 10)
    undo_after = min(spec.undo_after, duration / 10)
    return attrs.evolve(
        spec,
        duration=duration,
        warmup=warmup,
        window=window,
        settled=settled,
        undo_after=undo_after,
        sample_every=min(spec.sample_every, max(0.2, duration / 40)),
        fault_every=min(spec.fault_every, max(duration / 4, undo_after + 0.5)),
    )


def schedule(spec: SoakSpec, seed: int) -> list[FaultSpec]:
    """The faults of the run: one at ``fault_every``, ``2 * fault_every``, ... while at
    least ``fault_every`` of traffic remains after it, drawn from the pool with ``seed``
    (the same seed, the same run); a stopping fault is followed by its undoing one, a
    ``net-proxy`` setting by ``clear``, ``undo_after`` seconds later."""
    rng = random.Random(seed)
    out: list[FaultSpec] = []
    n = 1
    while n * spec.fault_every <= spec.duration - spec.fault_every / 2:
        at = round(n * spec.fault_every, 3)
        f = rng.choice(spec.pool)
        out.append(attrs.evolve(f, name=f"s{n}-{f.action}", at=at))
        undo = UNDO.get(f.action)
        if undo is not None:
            out.append(attrs.evolve(f, name=f"s{n}-{undo}", at=at + spec.undo_after, action=undo))
        elif f.action == "net-proxy" and f.proxy != "clear":
            out.append(attrs.evolve(f, name=f"s{n}-clear", at=at + spec.undo_after, proxy="clear"))
        n += 1
    return out


def _fill(value: Any, duration: float) -> Any:
    if isinstance(value, str):
        value = value.replace("{duration}", f"{duration:g}")
        return _COUNT_RE.sub(lambda m: str(max(1, int(float(m.group(1)) * duration))), value)
    if isinstance(value, list):
        return [_fill(v, duration) for v in value]
    return value


def expand(sc: Scenario, seed: int, duration: float | None = None) -> Scenario:
    """The scenario a soak runs (``sc`` itself without ``[soak]``): the pool drawn into
    faults (after the scenario's own), every built-in client with a ``duration`` running
    for the soak's, ``{duration}`` and ``{count:R}`` (R per second over the duration,
    an integer) filled in the programs' command lines and environments, and the timeout
    the soak's duration plus the scenario's ``timeout``."""
    if sc.soak is None:
        return sc
    spec = scaled(sc.soak, duration if duration is not None else sc.soak.duration)
    clients = []
    for c in sc.clients:
        params = dict(c.params)
        if c.role == "exec":
            params["command"] = _fill(params["command"], spec.duration)
            params["env"] = _fill(params["env"], spec.duration)
        elif "duration" in params:
            params["duration"] = spec.duration
        clients.append(attrs.evolve(c, params=params))
    faults = sorted([*sc.faults, *schedule(spec, seed)], key=lambda f: f.at)
    return attrs.evolve(
        sc,
        soak=spec,
        clients=tuple(clients),
        faults=tuple(faults),
        timeout=spec.duration + sc.timeout,
    )


def flatness(samples: Sequence[dict[str, Any]], spec: SoakSpec) -> dict[str, float]:
    """Figures of the broker's RSS and fds over the run from ``samples`` (each with
    ``t`` seconds since traffic started, ``age`` of its broker, ``rss_bytes``, ``fds``
    and ``connections``): the medians of the settled samples in the reference window
    ``[warmup, warmup + window)`` and in the last ``window`` seconds, and the growth in
    percent (``soak.rss_growth_pct``, ``soak.fds_growth_pct``). No figure for a window
    without a settled sample."""
    out: dict[str, float] = {"soak.samples": float(len(samples))}
    if not samples:
        return out
    settled = [s for s in samples if s["age"] >= spec.settled]
    if not settled:
        return out
    end_t = max(s["t"] for s in samples)
    ref = [s for s in settled if spec.warmup <= s["t"] < spec.warmup + spec.window]
    end = [s for s in settled if s["t"] >= end_t - spec.window]
    first = min(samples, key=lambda s: s["t"])
    out["soak.rss_start_mib"] = round(first["rss_bytes"] / 2**20, 2)
    out["soak.fds_start"] = float(first["fds"])
    out["soak.rss_max_mib"] = round(max(s["rss_bytes"] for s in samples) / 2**20, 2)
    out["soak.fds_max"] = float(max(s["fds"] for s in samples))
    if not ref or not end:
        return out
    figures: dict[str, Callable[[dict[str, Any]], float]] = {
        "rss": lambda s: float(s["rss_bytes"]) / 2**20,
        "fds": lambda s: float(s["fds"] - s["connections"]),
    }
    for key, get in figures.items():
        r = statistics.median(get(s) for s in ref)
        e = statistics.median(get(s) for s in end)
        unit = "_mib" if key == "rss" else ""
        out[f"soak.{key}_ref{unit}"] = round(r, 2)
        out[f"soak.{key}_end{unit}"] = round(e, 2)
        out[f"soak.{key}_growth_pct"] = round((e - r) / r * 100, 2) if r > 0 else 0.0
    return out


def faults_by_kind(fault_log: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``soak.faults.ACTION`` counts of the faults that struck (``soak.faults`` all)."""
    out: dict[str, float] = {"soak.faults": float(len(fault_log))}
    for f in fault_log:
        key = f"soak.faults.{f['action']}" + (f".{f['target']}" if f.get("target") else "")
        out[key] = out.get(key, 0.0) + 1
    return out
