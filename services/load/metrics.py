"""Outcome metrics of a routing run (paper eq. 6 and the figures' companions)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Outcome:
    """One routed query, after the fact."""

    query_id: str
    task: str
    instance: str
    model: str
    target_s: float
    ttft_s: float  # observed (inf if it never got a first token)
    utility: float  # realised acc − λ·cost of the chosen model
    predicted_ttft_s: float  # the policy's own latency estimate for the chosen instance (nan: none)
    # which stage decided (bear.router.selection): "every" (every instance replayed), "selected"
    # (the cheap first stage cut some model's instances), "none" (no estimate asked); "" unknown
    stage: str = ""
    considered: int = 0  # candidate instances the decision considered
    replayed: int = 0  # of them, estimated by the exact replay

    @property
    def on_time(self) -> bool:
        return self.ttft_s <= self.target_s


def on_time_utility(outcomes: Sequence[Outcome]) -> float:
    """Paper eq. 6: mean realised utility, counting 0 for queries that missed their TTFT target."""
    if not outcomes:
        return 0.0
    return sum(o.utility for o in outcomes if o.on_time) / len(outcomes)


def slo_attainment(outcomes: Sequence[Outcome]) -> float:
    return sum(o.on_time for o in outcomes) / len(outcomes) if outcomes else 0.0


def mean_utility(outcomes: Sequence[Outcome]) -> float:
    return sum(o.utility for o in outcomes) / len(outcomes) if outcomes else 0.0


def mean_ttft(outcomes: Sequence[Outcome]) -> float:
    finite = [o.ttft_s for o in outcomes if math.isfinite(o.ttft_s)]
    return sum(finite) / len(finite) if finite else math.inf


def composition(outcomes: Sequence[Outcome]) -> dict[str, dict[str, float]]:
    """Per instance: share of queries routed there, and the share of those that met their target."""
    n = len(outcomes) or 1
    routed = Counter(o.instance for o in outcomes)
    met = Counter(o.instance for o in outcomes if o.on_time)
    return {i: {"share": routed[i] / n, "on_time_share": met[i] / routed[i]} for i in sorted(routed)}


def ttft_prediction_error(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """MAPE and median signed relative error of the policy's latency estimate vs observed TTFT."""
    pairs = [(o.predicted_ttft_s, o.ttft_s) for o in outcomes
             if math.isfinite(o.predicted_ttft_s) and math.isfinite(o.ttft_s) and o.ttft_s > 0]
    if not pairs:
        return {"mape": math.nan, "median_rel_error": math.nan, "n": 0}
    rel = sorted((p - t) / t for p, t in pairs)
    return {"mape": sum(abs(r) for r in rel) / len(rel), "median_rel_error": rel[len(rel) // 2], "n": len(rel)}


def summary(outcomes: Sequence[Outcome]) -> dict[str, object]:
    return {
        "on_time_utility": on_time_utility(outcomes),
        "slo_attainment": slo_attainment(outcomes),
        "mean_utility": mean_utility(outcomes),
        "mean_ttft_s": mean_ttft(outcomes),
        "composition": composition(outcomes),
        "ttft_prediction": ttft_prediction_error(outcomes),
        "n": len(outcomes),
    }
