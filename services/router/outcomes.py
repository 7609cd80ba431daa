"""Every routed query's record: one JSON line in the outcome log and Prometheus metrics.

Record fields: ``query_id, t, policy, instance, model, target_s, predicted_ttft_s, ttft_method,
observed_ttft_s, on_time, utility, feasible, decision_s, wait_s (predictor and estimator),
predict_s, estimate_s, claim_s (each answer's time after the questions went out), fallbacks, status, attempts,
usage, candidates`` (per candidate: acc, cost, out_len, ttft, method, queue counters, score)."""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from bear.protocol.codec import json_line

log = structlog.get_logger("bear.router")

DECISION_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


@cache
def metrics() -> Any:
    """One set per process (prometheus_client's default registry)."""
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    return SimpleNamespace(
        queries=Counter("bear_router_queries_total", "Queries by final status", ["status"]),
        decision=Histogram("bear_router_decision_seconds", "Submit received → dispatch sent", buckets=DECISION_BUCKETS),
        overhead=Histogram("bear_router_overhead_seconds",
                           "Decision time minus the wait for predictor and estimator replies", buckets=DECISION_BUCKETS),
        routed=Counter("bear_router_routed_total", "Queries dispatched per instance", ["instance"]),
        on_time=Counter("bear_router_on_time_total", "Queries whose observed TTFT met the target"),
        completed=Counter("bear_router_completed_total", "Queries that finished with done"),
        on_time_ratio=Gauge("bear_router_on_time_ratio", "On-time share of the queries completed by this router"),
        ttft=Histogram("bear_router_ttft_seconds", "Observed TTFT (submit received → first token)",
                       buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)),
        fallbacks=Counter("bear_router_fallbacks_total", "Decisions made without a dependency", ["kind"]),
        duplicates=Counter("bear_router_duplicates_total", "Resubmitted query ids not executed again"),
        takeovers=Counter("bear_router_takeovers_total", "Queries taken over from a router that is gone: run "
                                                         "here (run), or answered incomplete (incomplete)", ["outcome"]),
        inflight=Gauge("bear_router_inflight", "Queries in progress"),
        shed=Counter("bear_router_shed_total", "Submits refused on arrival (overloaded) or not started "
                                               "(client deadline passed)", ["reason"]),
        registry_rejected=Counter("bear_router_registry_rejected_total",
                                  "Registry and calibration entries not taken", ["reason"]),
        loop_lag=Gauge("bear_router_loop_lag_seconds", "Recent event-loop lag (what admission sheds on)"),
        primed=Counter("bear_router_answers_primed_total", "Answers encoded ahead of their next turn (queued), "
                                                           "or not (skipped: the priming thread was busy; paused: "
                                                           "recent primes were rarely used)", ["outcome"]),
        outcome_log_errors=Counter("bear_router_outcome_log_errors_total",
                                   "Outcome-log records not written (the file could not be written: a full disk)"),
        dedup_fallback=Counter("bear_router_dedup_fallback_total",
                               "Dedup claims the KV bucket did not take (JetStream away or not writing): "
                               "this router's memory of recent ids decided"),
        degraded=Gauge("bear_router_degraded", "1 while a part the router goes on without is failing: "
                                               "outcome_log (not writable), dedup (JetStream KV claims failing)",
                       ["part"]),
        prompt_tokens=Counter("bear_router_prompt_tokens_total", "Queries done by how the chosen instance's prompt "
                                                                 "length was known: exact (its tokenizer) or estimated "
                                                                 "(none registered or fetched)", ["how"]),
    )


class OutcomeLog:
    """Appends records to a JSONL file, unbuffered (one write syscall per record, ~10 µs: done
    inline on the loop; tail -f shows every query at once), and updates the metrics.

    A record that cannot be written (ENOSPC: a full disk; any ``OSError``) is dropped, never
    raised into routing: counted (``bear_router_outcome_log_errors_total``), the log degraded
    (``bear_router_degraded{part="outcome_log"}`` 1), one warning line when it starts and one when
    a record is written again (with the number dropped) — not one per query. ``writer``: what
    writes a record's bytes (tests inject one that fails)."""

    def __init__(self, path: Path | None, writer: Callable[[bytes], object] | None = None) -> None:
        self.path = path
        self._f: BinaryIO | None = None
        self.m = metrics()
        self._done = 0
        self._on_time = 0
        self.dropped = 0  # records not written, this process
        self.failing = False  # the last write failed
        self._dropped_since = 0  # records dropped since the log last worked
        self._size = 0  # the file's length in whole lines
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = path.open("ab", buffering=0)
            self._size = os.fstat(self._f.fileno()).st_size
        self.writer = writer if writer is not None else (self._f.write if self._f is not None else None)

    def record(self, rec: dict[str, Any]) -> None:
        status = rec.get("status", "done")
        self.m.queries.labels(status=status).inc()
        if status == "done":
            self._done += 1
            self.m.completed.inc()
            if rec.get("on_time"):
                self._on_time += 1
                self.m.on_time.inc()
            self.m.on_time_ratio.set(self._on_time / self._done)
            ttft = rec.get("observed_ttft_s")
            if isinstance(ttft, float) and math.isfinite(ttft):
                self.m.ttft.observe(ttft)
        if self.writer is not None:
            self._append(json_line(rec))

    def _append(self, line: bytes) -> None:
        try:
            n = self.writer(line)  # type: ignore[misc]
            if isinstance(n, int) and n < len(line):  # a short write: the disk filled within the line
                raise OSError(errno.ENOSPC, f"{n} of {len(line)} bytes written")
        except OSError as exc:
            self._cut()
            self.dropped += 1
            self._dropped_since += 1
            self.m.outcome_log_errors.inc()
            if not self.failing:
                self.failing = True
                self.m.degraded.labels(part="outcome_log").set(1)
                log.warning("outcome log not writable; routing goes on, records are dropped and counted "
                            "(bear_router_outcome_log_errors_total)", path=str(self.path), error=str(exc))
            return
        self._size += len(line)
        if self.failing:
            self.failing = False
            self.m.degraded.labels(part="outcome_log").set(0)
            log.warning("outcome log writable again", path=str(self.path), dropped=self._dropped_since)
            self._dropped_since = 0

    def _cut(self) -> None:
        """Drop what a failed write left of its line (the file ends with whole lines only)."""
        if self._f is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if os.fstat(self._f.fileno()).st_size > self._size:
                os.ftruncate(self._f.fileno(), self._size)

    def flush(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
            self.writer = None
