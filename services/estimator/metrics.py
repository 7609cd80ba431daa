"""Prometheus metrics of the estimator service (one set per process, shared by its workers)."""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def metrics() -> Any:
    from types import SimpleNamespace

    from prometheus_client import Counter, Histogram

    return SimpleNamespace(
        requests=Counter("bear_estimator_requests_total", "Estimate requests handled"),
        errors=Counter("bear_estimator_errors_total", "Estimate requests answered with an error", ["code"]),
        deadline_dropped=Counter("bear_estimator_deadline_dropped_total", "Requests dropped past their deadline"),
        latency=Histogram(
            "bear_estimator_service_seconds",
            "Service time of one estimate request (receipt to reply)",
            buckets=(5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0),
        ),
        methods=Counter("bear_estimator_answers_total", "Per-instance answers by method", ["method"]),
        snapshots_kept=Counter("bear_estimator_snapshots_parsed_total", "Snapshots parsed and kept"),
        snapshots_dropped=Counter(
            "bear_estimator_snapshots_dropped_total", "Snapshots never used: replaced by a newer one before use"
        ),
        snapshots_malformed=Counter("bear_estimator_snapshots_malformed_total", "Malformed snapshots dropped"),
        dispatch_malformed=Counter("bear_estimator_dispatch_malformed_total", "Malformed dispatch messages dropped"),
        calibration_updates=Counter("bear_estimator_calibration_updates_total", "β updates received"),
        state_events=Counter(
            "bear_estimator_state_events_total",
            "Ingest of per-step deltas: delta_applied, delta_old, delta_gap, delta_malformed, delta_unreadable, "
            "delta_future; mirror_verified / mirror_mismatch (a full snapshot of the state held)", ["event"]),
        resyncs=Counter("bear_estimator_resyncs_total",
                        "Resync requests by outcome (installed, refused, or the error code)", ["outcome"]),
        prefix=Counter("bear_estimator_prefix_hits_total",
                       "Per-instance answers by how the prefix-cache hit was found (mirror, unsynced, ...)", ["how"]),
        unkeyed_dispatches=Counter(
            "bear_estimator_unkeyed_dispatches_total",
            "Dispatches queued ahead at a pool described block by block that came without token ids "
            "(a router that did not tokenise): replayed by counts, per estimate that replayed them"),
        kv_malformed=Counter("bear_estimator_kv_malformed_total", "Malformed prefix-cache messages dropped"),
        kv_resyncs=Counter("bear_estimator_kv_mirror_lost_total", "Mirrors that lost sync (gap, epoch)", ["reason"]),
        kv_resync_requests=Counter("bear_estimator_kv_resync_requests_total", "Whole-state requests sent"),
    )
