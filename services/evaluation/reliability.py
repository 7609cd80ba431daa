"""Is "feasible" likely on time? The reliability of the P(on time) a policy reads
(``bear.router.policies.on_time``): the chosen instances' predicted P, binned, against the share of
those queries that were on time, and the on-time share among the queries the policy marked
feasible. Kept as counts and sums, so that cells (seeds, rates) pool exactly."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bear.evaluation.cluster import Verdict
from bear.load.metrics import Outcome

BINS = 10  # equal-width bins of predicted P: [0, 0.1), …, [0.9, 1.0]


def bin_of(p: float, bins: int = BINS) -> int:
    """The bin of a probability: [k/bins, (k+1)/bins), the last one closed at 1."""
    return min(bins - 1, max(0, math.floor(p * bins)))


def tally(points: Iterable[tuple[float, bool]], bins: int = BINS) -> dict[str, list[float]]:
    """Per bin: queries, Σ predicted P, on-time queries (nan P is skipped: no prediction)."""
    n, sp, hit = [0] * bins, [0.0] * bins, [0] * bins
    for p, on_time in points:
        if not math.isfinite(p):
            continue
        k = bin_of(p, bins)
        n[k] += 1
        sp[k] += p
        hit[k] += int(on_time)
    return {"n": [float(x) for x in n], "sum_p": sp, "on_time": [float(x) for x in hit]}


def pooled(tallies: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, list[float]]:
    """Sum of tallies (cells of several seeds or rates)."""
    keys = ("n", "sum_p", "on_time")
    return {k: [float(sum(t[k][b] for t in tallies)) for b in range(len(tallies[0]["n"]))] for k in keys}


def curve(t: Mapping[str, Sequence[float]]) -> list[dict[str, float]]:
    """Per bin: its edges, the queries in it, their mean predicted P and observed on-time share
    (nan where the bin is empty)."""
    bins = len(t["n"])
    return [{"lo": b / bins, "hi": (b + 1) / bins, "n": int(t["n"][b]),
             "mean_p": t["sum_p"][b] / t["n"][b] if t["n"][b] else math.nan,
             "on_time_share": t["on_time"][b] / t["n"][b] if t["n"][b] else math.nan} for b in range(bins)]


def feasible_counts(outcomes: Sequence[Outcome], verdicts: Mapping[str, Verdict]) -> dict[str, float]:
    """Queries the policy marked feasible and those of them on time; the same for the ones marked
    feasible with a published error distribution (P known: at a confidence level, by its test)."""
    f = [(o, verdicts[o.query_id]) for o in outcomes if verdicts[o.query_id].feasible]
    with_p = [o for o, v in f if math.isfinite(v.p_on_time)]
    return {"n": float(len(f)), "on_time": float(sum(o.on_time for o, _ in f)),
            "n_with_p": float(len(with_p)), "on_time_with_p": float(sum(o.on_time for o in with_p)),
            "n_queries": float(len(outcomes))}


def share(c: Mapping[str, float], with_p: bool = False) -> float:
    n, k = (c["n_with_p"], c["on_time_with_p"]) if with_p else (c["n"], c["on_time"])
    return k / n if n else math.nan


def summarise(outcomes: Sequence[Outcome], verdicts: Mapping[str, Verdict]) -> dict[str, Any]:
    """A cell's reliability figures: the feasible counts and the binned tally."""
    return {"feasible": feasible_counts(outcomes, verdicts),
            "reliability": tally((verdicts[o.query_id].p_on_time, o.on_time) for o in outcomes)}
