"""Prometheus counters of an instance's publication (snapshotter or sim engine): one set per
publisher, in a registry of its own unless one is given (the snapshotter's, the process's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class PublisherMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.snapshots_published = Counter("bear_instance_snapshots_published", "Snapshots published", registry=r)
        self.snapshots_dropped = Counter(
            "bear_instance_snapshots_dropped",
            "Snapshots not published: coalesced (min interval), NATS disconnected, or publish failed",
            ["reason"], registry=r)
        self.deltas_published = Counter(
            "bear_instance_deltas_published", "bear.delta/1 messages published", registry=r)
        self.state_bytes = Counter(
            "bear_instance_state_bytes", "Bytes of state published: per-step deltas, full snapshots, resync answers",
            ["kind"], registry=r)
        self.resyncs = Counter(
            "bear_instance_resync_requests", "Resync requests by outcome (answered, rate_limited, no_state, bad_request)",
            ["outcome"], registry=r)
        self.idle_resends = Counter(
            "bear_instance_idle_resends", "An idle engine's last snapshot re-sent with a fresh time", registry=r)
        self.batches_published = Counter(
            "bear_instance_batch_records_published", "bear.batch/1 records published", registry=r)
        self.batches_dropped = Counter(
            "bear_instance_batch_records_dropped", "bear.batch/1 records dropped (buffer full or NATS down)",
            registry=r)
