"""Joint quality–cost–latency routers from the literature, as the paper implements them."""

from __future__ import annotations

import math
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
    """vLLM semantic-router's ``latency_aware`` selection (vllm-project/semantic-router,
    pkg/selection/latency_aware.go): score = mean(TPOT_p / min TPOT_p, TTFT_p / min TTFT_p) over the
    candidates that have both percentiles (TTFT p95, TPOT p90, the recipe's values, over the last
    1,000 observations), lowest wins; candidates without data are skipped, and with none having
    data the first candidate is taken."""

    name: ClassVar[str] = "semantic-router"
    needs_estimate: ClassVar[bool] = False  # observed latencies only

    def latency_estimate(self, c: Candidate) -> float:
        return c.observed_ttft_p95 if c.observed_ttft_p95 > 0 else math.nan

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        have = [c.observed_ttft_p95 > 0 and c.observed_tpot_p90 > 0 for c in cands]
        if not any(have):
            return [1.0 if k == 0 else 0.0 for k in range(len(cands))]
        ttft_min = min(c.observed_ttft_p95 for c, h in zip(cands, have, strict=True) if h)
        tpot_min = min(c.observed_tpot_p90 for c, h in zip(cands, have, strict=True) if h)
        return [-(c.observed_tpot_p90 / tpot_min + c.observed_ttft_p95 / ttft_min) / 2 if h else -math.inf
                for c, h in zip(cands, have, strict=True)]
