"""P(on time): the probability that a query's first token comes within its target at an instance,
from the BEA estimate there and the instance's TTFT error distribution (observed / predicted at
fixed levels: ``Calibration.ttft_ratio_q``, ``bear.calibrator.ttft_error``).

The query is on time when observed ≤ target, i.e. when the ratio observed / predicted is at most
target / predicted, so P(on time) is the ratio's distribution function there — linear between the
published levels, linear to 0 below the first (a ratio of 0 is impossible) and towards 1 above the
last."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bear.protocol.messages import TTFT_RATIO_LEVELS


def p_on_time(ttft: float, target: float, ratio_q: Sequence[float]) -> float:
    """P(observed TTFT ≤ ``target``) for an estimate ``ttft`` at an instance whose error deciles are
    ``ratio_q``."""
    if not math.isfinite(ttft) or target <= 0:
        return 0.0
    if ttft <= 0:
        return 1.0
    x = target / ttft
    levels, q = TTFT_RATIO_LEVELS, ratio_q
    if x < q[0]:
        return levels[0] * x / q[0]
    if x >= q[-1]:
        return levels[-1] + (1.0 - levels[-1]) * (1.0 - q[-1] / x)
    for k in range(1, len(q)):
        if x < q[k]:
            lo, hi = q[k - 1], q[k]
            return levels[k - 1] + (levels[k] - levels[k - 1]) * ((x - lo) / (hi - lo) if hi > lo else 1.0)
    return levels[-1]
