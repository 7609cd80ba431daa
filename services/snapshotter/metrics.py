"""Prometheus metrics of the snapshotter (one process per instance, so no instance label)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bear.instance.metrics import PublisherMetrics

_OVERHEAD_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3)


class SnapshotterMetrics:
    """Counters for what the snapshotter reads, publishes and drops; a private registry so that
    tests can create several services in one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.steps_read = Counter(
            "bear_snapshotter_steps_read", "Engine step records read from shared memory", registry=r
        )
        self.steps_skipped = Counter(
            "bear_snapshotter_steps_skipped",
            "Step records overwritten in the ring before they were read",
            registry=r,
        )
        self.pool_described = Counter(
            "bear_snapshotter_pool_described",
            "Snapshots that describe the block pool block by block (BEAR_SNAPSHOT_BLOCK_OPS=1)",
            registry=r,
        )
        self.pool_describe = Histogram(
            "bear_snapshotter_pool_describe_seconds",
            "Processor time to describe the block pool on one snapshot (grows with the cached "
            "blocks: bear bench pool)",
            buckets=(1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1),
            registry=r,
        )
        self.pool_superseded = Counter(
            "bear_snapshotter_pool_superseded",
            "Snapshots published without the pool's description: a newer step was read with them "
            "while describing took longer than --describe-superseded-below-ms",
            registry=r,
        )
        self.torn_retries = Counter(
            "bear_snapshotter_torn_read_retries", "Reads retried because the writer was mid-write", registry=r
        )
        self.publisher = PublisherMetrics(r)  # snapshots and batch records published / dropped
        self.engine_restarts = Counter(
            "bear_snapshotter_engine_generations",
            "Shared-memory regions (engine starts) attached",
            registry=r,
        )
        self.engine_up = Gauge(
            "bear_snapshotter_engine_up", "1 while the engine's writer is alive", registry=r
        )
        self.records = Counter(
            "bear_snapshotter_records",
            "Plugin records decoded, by kind (delta, or why the plugin wrote a full record)",
            ["kind"],
            registry=r,
        )
        self.delta_mismatches = Counter(
            "bear_snapshotter_delta_mismatches",
            "Steps where the state mirrored from the plugin's deltas disagreed with vLLM "
            "(checked on every delta, compared in full on periodic/verify records)",
            registry=r,
        )
        self.steps_undecodable = Counter(
            "bear_snapshotter_steps_undecodable",
            "Delta records that could not be applied (no full record yet, a lost record, or a "
            "mismatch): not published; the snapshotter asks the plugin for a full record",
            registry=r,
        )
        self.resync_requests = Counter(
            "bear_snapshotter_resync_requests", "Full records asked from the plugin", registry=r
        )
        self.plugin_overhead = Histogram(
            "bear_snapshotter_plugin_overhead_seconds",
            "Wall time the plugin added to one engine step",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.plugin_overhead_cpu = Histogram(
            "bear_snapshotter_plugin_overhead_cpu_seconds",
            "CPU time of the engine thread the plugin added to one engine step",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
