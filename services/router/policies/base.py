"""The routing plug-in interface shared by the live router and the offline evaluation.

A policy sees one query and its candidate instances, each already annotated with everything the
router knows about it (predicted accuracy/length/cost from the predictor, TTFT estimates from the
estimator, load counters from snapshots, observed latencies), and picks one. Like llm-d's endpoint
picker it is three stages: ``filter`` (which candidates may be chosen), ``score`` (a number per
remaining candidate, higher is better) and ``pick`` (usually the best score). Policies never do
I/O, so the same object runs in the router and in ``bear eval``, as the last stage of a profile
(``bear.router.decide``: the request filters run before it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class Candidate:
    """One instance as seen for one query."""

    instance: str
    model: str  # the predictor's name of the instance's model
    healthy: bool = True
    served_model: str = ""  # the engine's served model name (what a query's ``model`` may name)
    max_model_len: int | None = None  # the engine's context, when it registered one
    # predictor (per model)
    acc: float = 0.0
    cost: float = 0.0  # micro-USD (USD per million tokens × tokens): the unit λ = 5e-4 is meant for
    out_len: float = 0.0  # predicted output tokens (mean)
    out_p90: float = 0.0
    # estimator (per instance)
    ttft: float = math.inf  # BEA estimate, or the analytic fallback (see ttft_method), from the query's submit
    # of ``ttft``: the time the query had already spent in the router when it was estimated (the
    # estimate's engine part runs from then; 0 in ``bear eval``, whose decisions take no time)
    ttft_elapsed: float = 0.0
    ttft_path: float = 0.0  # the path term in ttft (Calibration.path_s: outside the replayed scheduler)
    ttft_method: str = "none"
    # the β behind ``ttft``: nominal (the instance was never calibrated: the estimate may be off by
    # any factor, so nothing is refused on it), profiled or online (EstimateRow.calibration)
    ttft_calibration: str = "nominal"
    # the instance's BEA error deciles (observed / predicted, Calibration.ttft_ratio_q) when ``ttft``
    # is a calibrated BEA estimate: what P(on time) is read from (bear.router.policies.on_time)
    ttft_ratio_q: tuple[float, ...] | None = None
    ttft_prefill: float = math.inf  # prefill-throughput estimate, paper eq. 8
    # load and history (per instance)
    n_running: int = 0
    n_waiting: int = 0
    pending_prefill_tokens: int = 0
    pending_decode_tokens: float = 0.0
    prefill_tps: float = 0.0  # θ: prefill tokens per second
    tpot: float = 0.0  # seconds per output token when decoding
    throughput_rps: float = 0.0  # completed requests per second (recent)
    observed_ttft_p50: float = 0.0
    observed_ttft_p90: float = 0.0
    observed_ttft_p95: float = 0.0  # 0: no observation yet
    observed_tpot_p90: float = 0.0
    # the prompt there (per instance: its tokenizer, its prefix cache)
    prompt_tokens: int = 0  # the query's prompt length at this instance
    tokens_exact: bool = False  # from the instance's tokenizer (else estimated from the text)
    prefix_hit_tokens: int = 0  # of them, cached there (the estimator's mirror; 0 when unknown)
    block_size: int = 0  # KV block size (0: unknown)
    kv_blocks_used: int = 0  # KV blocks held by requests
    kv_blocks_total: int = 0  # usable KV blocks (0: unknown)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (vLLM's KV usage; 0 when unknown)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total > 0 else 0.0

    @property
    def queue_len(self) -> int:
        return self.n_running + self.n_waiting

    def utility(self, lam: float) -> float:
        """Paper eq. 4: predicted accuracy minus λ times predicted cost."""
        return self.acc - lam * self.cost


@dataclass(frozen=True)
class QueryContext:
    query_id: str
    ttft_target: float  # seconds
    lam: float = 5e-4
    prompt_tokens: int = 0
    session: str | None = None  # the conversation the query belongs to (session-affinity routing)
    model: str | None = None  # only this model's instances (served or predictor name); None: any
    context_tokens: int = 0  # tokens the query needs at least in an instance's context (0: unknown)
    deadline: float | None = None  # the client stops waiting for the first token then (epoch s)


@dataclass
class Decision:
    candidate: Candidate
    policy: str
    score: float
    feasible: bool  # predicted to meet the target (for policies that predict TTFT)
    scores: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # instance → why a request filter dropped it


class Policy:
    """Base policy: healthy candidates, score = utility, pick the max (ties: first)."""

    name: ClassVar[str] = "base"
    # whether the policy reads the estimator's row (TTFT, queue, KV, prefix hit): a policy that
    # does not is decided without asking the estimator at all (its candidates' load is eq. 8's)
    needs_estimate: ClassVar[bool] = True
    # whether a higher TTFT estimate at an instance can only make that instance less likely to be
    # chosen, never another's choice change (bear.router.sequencer: a decision on an exact estimate
    # at the chosen instance and lower bounds elsewhere is then exact); False: every estimate is
    # made exact before the policy decides
    monotone: ClassVar[bool] = False

    def latency_estimate(self, c: Candidate) -> float:
        """The TTFT-like latency this policy believes for ``c`` (nan when it has none): what the
        evaluation's estimator-accuracy experiment compares with the observed TTFT."""
        return math.nan

    def filter(self, q: QueryContext, cands: Sequence[Candidate]) -> list[Candidate]:
        return [c for c in cands if c.healthy]

    def score(self, q: QueryContext, cands: Sequence[Candidate]) -> list[float]:
        return [c.utility(q.lam) for c in cands]

    def pick(self, q: QueryContext, cands: Sequence[Candidate], scores: Sequence[float]) -> int:
        best = 0
        for k in range(1, len(cands)):
            if scores[k] > scores[best]:
                best = k
        return best

    def decide(self, q: QueryContext, cands: Sequence[Candidate]) -> Decision:
        """filter → score → pick. Raises ValueError when no candidate is healthy."""
        kept = self.filter(q, cands)
        if not kept:
            raise ValueError("no healthy candidate instance")
        scores = self.score(q, kept)
        k = self.pick(q, kept, scores)
        chosen = kept[k]
        return Decision(
            candidate=chosen,
            policy=self.name,
            score=scores[k],
            feasible=chosen.ttft <= q.ttft_target,
            scores={c.instance: s for c, s in zip(kept, scores, strict=True)},
        )


def normalized(values: Sequence[float]) -> list[float]:
    """Divide by the largest magnitude (0 stays 0), as RouteBalance / vLLM-SR normalise."""
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    if top == 0.0:
        return [0.0 for _ in values]
    return [v / top if math.isfinite(v) else math.inf for v in values]
