"""BEAR (paper eq. 5): the best utility among instances predicted to meet the TTFT target;
if none is predicted to, the instance with the least predicted TTFT."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from bear.router.policies.base import Candidate, Decision, Policy, QueryContext


class BearPolicy(Policy):
    name: ClassVar[str] = "bear"
    uses_ttft: ClassVar[bool] = True

    def latency(self, c: Candidate) -> float:
        """Which TTFT estimate the rule trusts: BEA (or its fallback) here."""
        return c.ttft

    def latency_estimate(self, c: Candidate) -> float:
        return self.latency(c)

    def decide(self, q: QueryContext, cands: Sequence[Candidate]) -> Decision:
        healthy = self.filter(q, cands)
        if not healthy:
            raise ValueError("no healthy candidate instance")
        feasible = [c for c in healthy if self.latency(c) <= q.ttft_target]
        if feasible:
            scores = self.score(q, feasible)
            k = self.pick(q, feasible, scores)
            return Decision(feasible[k], self.name, scores[k], True,
                            {c.instance: s for c, s in zip(feasible, scores, strict=True)})
        lat = [self.latency(c) for c in healthy]
        k = min(range(len(healthy)), key=lambda i: (lat[i], i))
        return Decision(healthy[k], self.name, -lat[k], False, {c.instance: -t for c, t in zip(healthy, lat, strict=True)})


class PrefillThroughputPolicy(BearPolicy):
    """The BEAR rule fed with the prefill-throughput TTFT estimate (paper eq. 8) instead of BEA:
    isolates what the estimator contributes (paper Fig. 16)."""

    name: ClassVar[str] = "prefill-throughput"

    def latency(self, c: Candidate) -> float:
        return c.ttft_prefill


class BearLagrangePolicy(Policy):
    """Paper eq. 7: maximise utility − δ·TTFT; δ traces the utility–latency trade-off."""

    name: ClassVar[str] = "bear-lagrange"
    uses_ttft: ClassVar[bool] = True

    def __init__(self, delta: float = 0.5) -> None:
        if delta < 0:
            raise ValueError("delta must be >= 0")
        self.delta = delta

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [c.utility(q.lam) - self.delta * c.ttft for c in cands]

    def latency_estimate(self, c: Candidate) -> float:
        return c.ttft
