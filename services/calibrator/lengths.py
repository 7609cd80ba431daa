"""How long an instance's answers turn out against the lengths the router predicted for them: one
factor per instance, Σ actual / Σ predicted over its recent finished queries.

Why: under KV pressure a query waits for residents to finish and free their blocks, so its TTFT
follows the residents' output lengths — which the replay takes from the router's predictions. A
predictor trained on another distribution than what the model now generates shifts every such
estimate by the same factor: on ``bear up``'s 0.6B at 50 q/s the predictions were 2–3× the
answers and the replay put first tokens 3–4× too late (docs/estimator.md, "Output lengths as
they turn out"). The factor is the ratio of sums: the replay sums the residents' tokens (KV
blocks held, steps until they leave), and that sum is what must come out right (on ``bear
eval``'s seed 7301 in the pool it did marginally better than the geometric mean, 10.0 % against
10.6 % mean chosen-instance MAPE over the paper rates). σ of log(actual / predicted) is published
too: the replay draws the residents' lengths with it and takes the median TTFT over the draws
(libbea's ``length_sigma`` and ``length_draws``, ``EstimatorConfig.length_draws``). Both are measured where they
are applied, per instance, from the outcomes routers publish, by ``bear calibrator`` (published
with the instance's calibration) and by ``bear eval``'s simulated calibrator alike.
"""

from __future__ import annotations

import math
from collections import deque

MIN_LENGTHS = 30  # finished queries before a factor is published (fewer: None, the predictions as they are)
MAX_FACTOR = 8.0  # the factor is kept within [1/8, 8]: beyond, something else is wrong


class LengthWindow:
    """The last ``window`` (actual, predicted) output lengths of one instance's finished queries."""

    def __init__(self, window: int = 500) -> None:
        self.pairs: deque[tuple[int, int]] = deque(maxlen=window)

    def add(self, actual: int, predicted: int) -> None:
        if actual >= 0 and predicted > 0:
            self.pairs.append((actual, predicted))

    def __len__(self) -> int:
        return len(self.pairs)

    def _logs(self) -> list[float] | None:
        if len(self.pairs) < MIN_LENGTHS:
            return None
        return [math.log(max(a, 1) / p) for a, p in self.pairs]

    def scale(self) -> float | None:
        """Σ actual / Σ predicted, within [1/MAX_FACTOR, MAX_FACTOR]; None below MIN_LENGTHS."""
        if len(self.pairs) < MIN_LENGTHS:
            return None
        actual = sum(a for a, _ in self.pairs)
        predicted = sum(p for _, p in self.pairs)
        return min(MAX_FACTOR, max(1.0 / MAX_FACTOR, actual / predicted))

    def sigma(self) -> float | None:
        """σ of log(actual / predicted) (sample standard deviation, at most 8); None below MIN_LENGTHS."""
        logs = self._logs()
        if logs is None:
            return None
        m = sum(logs) / len(logs)
        return min(8.0, math.sqrt(sum((x - m) ** 2 for x in logs) / (len(logs) - 1)))
