"""BEAR (paper eq. 5): the best utility among instances predicted to meet the TTFT target;
if none is predicted to, the instance with the least predicted TTFT.

``overflow=1`` (this project's extension, the default): a query no instance is predicted to start
in time goes where its own prefill costs least (uncached prompt tokens / θ), not where it starts
soonest. It earns nothing wherever it runs, so it should take the least capacity from the queries
that can still be on time; the least-TTFT rule sent such long prompts to the big models, where
each held the engine for seconds of prefill and made every later query late (docs/evaluation.md
§7.1). Chosen on the tuning seed, like the baselines' parameters. ``overflow=0`` is the paper's
rule (the evaluation's ``bear`` and ``bear+ext`` entries pin it).

``confidence`` > 0: an instance is feasible when the query's probability of being on time there
is at least that (``bear.router.policies.on_time``: the estimate and the instance's published
error distribution), not when the estimate alone is within the target; 0 (the default) is the
point test. Instances without an error distribution yet keep the point test."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from bear.router.policies.base import Candidate, Decision, Policy, QueryContext
from bear.router.policies.on_time import p_on_time


class BearPolicy(Policy):
    name: ClassVar[str] = "bear"
    uses_error_distribution: ClassVar[bool] = True  # the ratio deciles describe this rule's estimate (BEA)
    monotone: ClassVar[bool] = True  # a later estimate only shrinks the feasible set (P(on time) falls with it)

    def __init__(self, overflow: float = 1.0, confidence: float = 0.0) -> None:
        if overflow not in (0, 1):
            raise ValueError("overflow must be 0 (least predicted TTFT, the paper) or 1 (least own prefill work)")
        if not 0.0 <= confidence < 1.0:
            raise ValueError("confidence must be in [0, 1): 0 is the point test (predicted TTFT <= target)")
        self.overflow = bool(overflow)
        self.confidence = confidence

    def latency(self, c: Candidate) -> float:
        """Which TTFT estimate the rule trusts: BEA (or its fallback) here."""
        return c.ttft

    def on_time(self, q: QueryContext, c: Candidate) -> bool:
        """The feasibility test: the estimate within the target — or, with ``confidence`` > 0 and
        the instance's error distribution known, P(on time) at least ``confidence``."""
        if self.confidence > 0 and self.uses_error_distribution and c.ttft_ratio_q is not None:
            return p_on_time(self.latency(c), q.ttft_target, c.ttft_ratio_q) >= self.confidence
        return self.latency(c) <= q.ttft_target

    @staticmethod
    def prefill_work(c: Candidate) -> float:
        """Seconds of prefill the query itself costs there (its uncached tokens at θ)."""
        return max(1, c.prompt_tokens - c.prefix_hit_tokens) / c.prefill_tps if c.prefill_tps > 0 else math.inf

    def latency_estimate(self, c: Candidate) -> float:
        return self.latency(c)

    def decide(self, q: QueryContext, cands: Sequence[Candidate]) -> Decision:
        healthy = self.filter(q, cands)
        if not healthy:
            raise ValueError("no healthy candidate instance")
        feasible = [c for c in healthy if self.on_time(q, c)]
        if feasible:
            scores = self.score(q, feasible)
            k = self.pick(q, feasible, scores)
            return Decision(feasible[k], self.name, scores[k], True,
                            {c.instance: s for c, s in zip(feasible, scores, strict=True)})
        lat = [self.latency(c) for c in healthy]
        if self.overflow:
            work = [self.prefill_work(c) for c in healthy]
            k = min(range(len(healthy)), key=lambda i: (work[i], lat[i], i))
        else:
            k = min(range(len(healthy)), key=lambda i: (lat[i], i))
        return Decision(healthy[k], self.name, -lat[k], False, {c.instance: -t for c, t in zip(healthy, lat, strict=True)})


class PrefillThroughputPolicy(BearPolicy):
    """The BEAR rule fed with the prefill-throughput TTFT estimate (paper eq. 8) instead of BEA:
    isolates what the estimator contributes (paper Fig. 16)."""

    name: ClassVar[str] = "prefill-throughput"
    uses_error_distribution: ClassVar[bool] = False

    def latency(self, c: Candidate) -> float:
        return c.ttft_prefill


class BearLagrangePolicy(Policy):
    """Paper eq. 7: maximise utility − δ·TTFT; δ traces the utility–latency trade-off."""

    name: ClassVar[str] = "bear-lagrange"

    def __init__(self, delta: float = 0.5) -> None:
        if delta < 0:
            raise ValueError("delta must be >= 0")
        self.delta = delta

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [c.utility(q.lam) - self.delta * c.ttft for c in cands]

    def latency_estimate(self, c: Candidate) -> float:
        return c.ttft
