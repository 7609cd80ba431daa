"""Latency- and accuracy-agnostic load balancers used as baselines (paper §5.1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from bear.router.policies.base import Candidate, Policy, QueryContext


class RoundRobinPolicy(Policy):
    """Cycle over the healthy instances in a fixed (sorted) order."""

    name: ClassVar[str] = "round-robin"
    needs_estimate: ClassVar[bool] = False

    def __init__(self) -> None:
        self._next = 0

    def filter(self, q: QueryContext, cands: Sequence[Candidate]) -> list[Candidate]:
        return sorted(super().filter(q, cands), key=lambda c: c.instance)

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        k = self._next % len(cands)
        self._next += 1
        return [1.0 if i == k else 0.0 for i in range(len(cands))]


class ShortestQueuePolicy(Policy):
    """Join the shortest queue: fewest resident (running + waiting) requests."""

    name: ClassVar[str] = "shortest-queue"

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [-float(c.queue_len) for c in cands]


class LMDeployPolicy(Policy):
    """LMDeploy's proxy: smallest unfinished requests / measured throughput (requests/s)."""

    name: ClassVar[str] = "lmdeploy"

    def latency_estimate(self, c: Candidate) -> float:
        return c.queue_len / c.throughput_rps if c.throughput_rps > 0 else math.inf

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [-self.latency_estimate(c) if c.throughput_rps > 0 else -float(c.queue_len) * 1e3 for c in cands]


class LatencyAgnosticPolicy(Policy):
    """Accuracy–cost router without latency: max utility (eq. 4)."""

    name: ClassVar[str] = "latency-agnostic"
    needs_estimate: ClassVar[bool] = False  # accuracy and cost: the predictor's
