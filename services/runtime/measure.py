"""What the benchmarks measure the same way: latency percentiles and a process's CPU time.

One definition so that figures from `bear bench router`, `gateway`, `prefix` and the estimator's
service bench compare: milliseconds at p50/p90/p99 over the samples, and user + system CPU seconds
read from Linux /proc (NaN where it cannot be read: another OS, a process gone)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def latency_ms(xs: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean in milliseconds of ``xs`` (seconds), and how many; NaN with no samples
    (every request of a path failed: its errors say why)."""
    if not len(xs):
        nan = float("nan")
        return {"p50_ms": nan, "p90_ms": nan, "p99_ms": nan, "mean_ms": nan, "n": 0}
    a = np.asarray(xs, dtype=float) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()), "n": len(a)}


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User + system CPU seconds of process ``pid`` (and, with ``children``, of its reaped
    children), from /proc/<pid>/stat; NaN where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return sum(int(x) for x in fields[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``'s main thread (its event loop, in a BEAR
    service), from /proc/<pid>/task/<pid>/stat; the rest of ``cpu_seconds`` is its other threads'
    (thread pools, a native library's workers). NaN where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")
