"""Candidate selection: the first stage of a decision over a large pool. From cheap signals held
for every instance (no replay), pick per model the few instances worth an exact BEA replay; the
policy then decides on those alone. Pure: ``bear eval`` (``bear.evaluation.cluster``) calls it,
and so may the live router, on the same inputs.

The cheap bound of an instance is eq. 8 of the paper (Mind the Delay, arXiv 2607.18253): the
prefill tokens queued there (the load counters every estimate row carries, plus the dispatches
made there that no snapshot has shown yet) and the query's own uncached prompt, at the
instance's θ. It reads no running batch, so it misses decode interference: it orders instances,
it does not predict TTFT.

The rule, per model (``SelectionConfig``):
  * a model with at most ``k_max`` instances: all of them (no selection; every pool of up to
    ``k_max`` instances per model — the paper's, one per model — is decided exactly as before);
  * else the instances in order of bound (ties: pool order); the first ``k_min`` always; then
    each next one while its bound is within ``max(slack_s, rel · best)`` of the best bound — the
    bounds cannot tell those apart, so the replay decides among them — up to ``k_max``.
The selected instances keep their pool order (the policy's tie-break is the pool's, as with every
instance a candidate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from bear import libbea

STAGE_EVERY = "every"  # every instance replayed: no model had more than k_max
STAGE_SELECTED = "selected"  # some model's instances were cut to the k its cheap bounds chose


@dataclass(frozen=True)
class SelectionConfig:
    k_max: int = 4  # replays per model at most; a model with no more instances is not selected
    k_min: int = 2  # replays per model at least (where it has that many)
    slack_s: float = 0.05  # bounds within this of the best cannot be told apart …
    rel: float = 0.25  # … nor within this share of the best

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError("selection: need 1 <= k_min <= k_max")
        if self.slack_s < 0 or self.rel < 0:
            raise ValueError("selection: slack_s and rel must be >= 0")


@dataclass(frozen=True)
class Cheap:
    """One instance's cheap signals for one query."""

    instance: str
    model: str
    pending_prefill_tokens: int  # queued prefill there: the load counters plus unseen dispatches
    prompt_tokens: int  # the query's prompt there
    prefix_hit_bound: int = 0  # at most this many of them cached there (0: none assumed)
    prefill_tps: float = 0.0  # θ (0: unknown → the bound is infinite)

    @property
    def bound(self) -> float:
        """Eq. 8 over the queue and the query's uncached prompt (seconds)."""
        if not self.prefill_tps > 0 or not math.isfinite(self.prefill_tps):
            return math.inf
        own = max(1, self.prompt_tokens - self.prefix_hit_bound)
        return float(libbea.prefill_throughput_ttft(self.pending_prefill_tokens, own, self.prefill_tps))


@dataclass
class Selection:
    """Which instances the replay stage gets, and why: ``stage`` (``every`` or ``selected``),
    how many were considered and replayed, and k per model."""

    replay: list[str]
    considered: int
    stage: str
    k: dict[str, int] = field(default_factory=dict)

    @property
    def replayed(self) -> int:
        return len(self.replay)

    def record(self) -> dict[str, object]:
        """What an outcome record carries of the selection."""
        return {"stage": self.stage, "considered": self.considered, "replayed": self.replayed, "k": dict(self.k)}


def choose_k(bounds: Sequence[float], cfg: SelectionConfig) -> int:
    """How many of a model's instances, their bounds sorted ascending, to replay (the rule above)."""
    n = len(bounds)
    if n <= cfg.k_max:
        return n
    best = bounds[0]
    k = min(cfg.k_min, n)
    margin = max(cfg.slack_s, cfg.rel * best)
    while k < cfg.k_max and bounds[k] <= best + margin:
        k += 1
    return k


def select(cheap: Sequence[Cheap], cfg: SelectionConfig) -> Selection:
    """The instances to replay, in pool order (``cheap``'s order), by the rule above."""
    by_model: dict[str, list[int]] = {}
    for i, c in enumerate(cheap):
        by_model.setdefault(c.model, []).append(i)
    keep: set[int] = set()
    ks: dict[str, int] = {}
    cut = False
    for model, idx in by_model.items():
        if len(idx) <= cfg.k_max:
            keep.update(idx)
            ks[model] = len(idx)
            continue
        bounds = {i: cheap[i].bound for i in idx}
        order = sorted(idx, key=lambda i: (bounds[i], i))
        k = choose_k([bounds[i] for i in order], cfg)
        keep.update(order[:k])
        ks[model] = k
        cut = cut or k < len(idx)
    return Selection([c.instance for i, c in enumerate(cheap) if i in keep], len(cheap),
                     STAGE_SELECTED if cut else STAGE_EVERY, ks)
