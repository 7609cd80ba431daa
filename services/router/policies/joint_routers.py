"""Joint quality–cost–latency routers from the literature, as the paper implements them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from bear.router.policies.base import Candidate, Policy, QueryContext, normalized


def _queue_delay(c: Candidate) -> float:
    """Time to clear the prompt work already queued at the instance (eq. 8's waiting term)."""
    return c.pending_prefill_tokens / c.prefill_tps if c.prefill_tps > 0 else 0.0


class ScorePolicy(Policy):
    """SCORE: utility − γ·(queueing delay + predicted output length × per-token time)."""

    name: ClassVar[str] = "score"

    def __init__(self, gamma: float = 0.05) -> None:
        self.gamma = gamma

    def latency(self, c: Candidate) -> float:
        return _queue_delay(c) + c.out_len * c.tpot

    def latency_estimate(self, c: Candidate) -> float:
        return self.latency(c)

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [c.utility(q.lam) - self.gamma * self.latency(c) for c in cands]


class RouteBalancePolicy(Policy):
    """RouteBalance: quality, cost and latency each normalised across the candidates, latency from
    TPOT × (pending decode tokens per active sequence + the query's predicted length)."""

    name: ClassVar[str] = "routebalance"

    def __init__(self, w_cost: float = 0.2, w_latency: float = 0.5) -> None:
        self.w_cost = w_cost
        self.w_latency = w_latency

    def latency(self, c: Candidate) -> float:
        backlog = c.pending_decode_tokens / max(1, c.n_running)
        return c.tpot * (backlog + c.out_len)

    def latency_estimate(self, c: Candidate) -> float:
        return self.latency(c)

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        acc = normalized([c.acc for c in cands])
        cost = normalized([c.cost for c in cands])
        lat = normalized([self.latency(c) for c in cands])
        return [a - self.w_cost * k - self.w_latency * t for a, k, t in zip(acc, cost, lat, strict=True)]


class SemanticRouterLatencyPolicy(Policy):
    """vLLM semantic-router's latency mode: the instance whose observed TTFT percentiles
    (p50, p90 over a rolling window), normalised across candidates, are lowest."""

    name: ClassVar[str] = "semantic-router"
    uses_history: ClassVar[bool] = True

    def latency_estimate(self, c: Candidate) -> float:
        return c.observed_ttft_p50

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        p50 = normalized([c.observed_ttft_p50 for c in cands])
        p90 = normalized([c.observed_ttft_p90 for c in cands])
        return [-(a + b) / 2 for a, b in zip(p50, p90, strict=True)]
