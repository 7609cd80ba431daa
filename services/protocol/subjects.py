"""NATS subject names (design.md §2), built from one configurable prefix."""

from __future__ import annotations

from dataclasses import dataclass

SNAPSHOT_SCHEMA = "bear.snapshot/1"
BATCH_SCHEMA = "bear.batch/1"
CANCEL_SCHEMA = "bear.cancel/1"


@dataclass(frozen=True)
class Subjects:
    """All subjects and bucket names for one deployment prefix (default ``bear``)."""

    prefix: str = "bear"

    def snapshot(self, instance: str) -> str:
        return f"{self.prefix}.snapshot.{instance}"

    def batches(self, instance: str) -> str:
        return f"{self.prefix}.batches.{instance}"

    def dispatch(self, instance: str) -> str:
        return f"{self.prefix}.dispatch.{instance}"

    @property
    def snapshot_all(self) -> str:
        return f"{self.prefix}.snapshot.*"

    @property
    def batches_all(self) -> str:
        return f"{self.prefix}.batches.*"

    @property
    def dispatch_all(self) -> str:
        return f"{self.prefix}.dispatch.*"

    def kv(self, instance: str) -> str:
        """``bear.kv.<instance>``: the instance's prefix-cache events (``bear.kv/1``) and, after a
        resync request, its whole state (``bear.kv.state/1``), in one ordered stream."""
        return f"{self.prefix}.kv.{instance}"

    @property
    def kv_all(self) -> str:
        return f"{self.prefix}.kv.*"

    def kv_resync(self, instance: str) -> str:
        """``bear.kv.resync.<instance>``: a mirror asks the publisher for the whole state."""
        return f"{self.prefix}.kv.resync.{instance}"

    def outcome(self, instance: str) -> str:
        return f"{self.prefix}.outcome.{instance}"

    @property
    def outcome_all(self) -> str:
        return f"{self.prefix}.outcome.*"

    @property
    def predict(self) -> str:
        return f"{self.prefix}.predict"

    @property
    def estimate(self) -> str:
        return f"{self.prefix}.estimate"

    def estimate_shard(self, shard: int, shards: int) -> str:
        """The estimate subject of one shard (``bear.estimate`` when the pool is not sharded)."""
        return self.estimate if shards <= 1 else f"{self.prefix}.estimate.{shard}"

    @property
    def submit(self) -> str:
        return f"{self.prefix}.submit"

    @property
    def cancel(self) -> str:
        """``bear.cancel``: a client gave up on a query (``bear.cancel/1 {query_id}``); every router
        subscribes (no queue group) and the one serving it aborts the generation."""
        return f"{self.prefix}.cancel"

    @property
    def instances_bucket(self) -> str:
        return f"{self.prefix}_instances"

    @property
    def calibration_bucket(self) -> str:
        return f"{self.prefix}_calibration"

    @property
    def tokenizers_bucket(self) -> str:
        """Object store of tokenizer bundles, one object per tokenizer id (``bear.tokenizer``)."""
        return f"{self.prefix}_tokenizers"

    @property
    def queries_bucket(self) -> str:
        """Create-only KV bucket of the query ids routers have claimed (deduplication)."""
        return f"{self.prefix}_queries"

    @staticmethod
    def shard_of(instance: str, shards: int) -> int:
        """The estimator shard that owns ``instance``: FNV-1a (32 bit) of its id modulo the number
        of shards — stable across processes and versions, so routers and workers agree."""
        if shards <= 1:
            return 0
        h = 0x811C9DC5
        for byte in instance.encode():
            h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
        return h % shards

    @staticmethod
    def instance_of(subject: str) -> str:
        """The last token of a per-instance subject (``bear.snapshot.<id>`` → ``<id>``)."""
        return subject.rsplit(".", 1)[-1]
