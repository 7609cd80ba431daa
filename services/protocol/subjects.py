"""NATS subject names (design.md §2), built from one configurable prefix."""

from __future__ import annotations

from dataclasses import dataclass

SNAPSHOT_SCHEMA = "bear.snapshot/1"
BATCH_SCHEMA = "bear.batch/1"


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

    @property
    def submit(self) -> str:
        return f"{self.prefix}.submit"

    @property
    def instances_bucket(self) -> str:
        return f"{self.prefix}_instances"

    @property
    def calibration_bucket(self) -> str:
        return f"{self.prefix}_calibration"

    @property
    def queries_bucket(self) -> str:
        """Create-only KV bucket of the query ids routers have claimed (deduplication)."""
        return f"{self.prefix}_queries"

    @staticmethod
    def instance_of(subject: str) -> str:
        """The last token of a per-instance subject (``bear.snapshot.<id>`` → ``<id>``)."""
        return subject.rsplit(".", 1)[-1]
