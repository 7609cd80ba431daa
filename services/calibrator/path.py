"""The path around the replayed scheduler, per instance, from the outcomes routers publish.

Why: BEA replays the engine's scheduler from the estimator's clock, so its TTFT leaves out
everything around it — the HTTP hop, the engine's API server, tokenisation, the engine core's IPC,
detokenisation and the relay back to the router. Live on CPU vLLM that was 17.8 ms p50 on an idle
instance (57 % MAPE, every estimate low); on the sim stack 7–14 ms (issue 39). The router knows
both ends: an outcome carries the observed TTFT (from submit), the time the query had spent in the
router when the estimator was asked (``elapsed_s``) and the estimate's engine part
(``engine_ttft_s``), so the residual ``r = ttft − elapsed − engine`` is the path plus the replay's
own error.

The model is ``r = a + b · prompt_tokens`` (tokenisation and the prompt's transfer grow with the
prompt), fitted robustly over the last ``window`` outcomes: b is the Theil–Sen slope (median of
pairwise slopes, clipped at ≥ 0), a the median of ``r − b · n``. Where the prompts span fewer than
MIN_SPAN tokens the slope is not identifiable and b = 0 (a is the median residual). Nothing is
published below MIN_PATH outcomes. The same fit serves ``bear calibrator`` and any replay of an
outcome log (``bear diagnose-live``).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

MIN_PATH = 30  # outcomes before a path is published (fewer: None, the estimate without it)
MIN_SPAN = 64  # prompt tokens the window must span (p90 − p10) before a slope is fitted
MAX_PAIRS = 4000  # pairwise slopes Theil–Sen takes (a fixed-seed sample beyond; bounded work)
MAX_PATH_S = 10.0  # residuals beyond ±10 s are not the path (a stall, a clock jump): dropped


@dataclass(frozen=True)
class PathFit:
    """``a + b · prompt tokens`` seconds, fitted over ``n`` outcomes."""

    a: float
    b: float
    n: int

    def at(self, prompt_tokens: float) -> float:
        return max(0.0, self.a + self.b * max(0.0, prompt_tokens))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2.0


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def fit_path(points: list[tuple[float, float]], min_count: int = MIN_PATH) -> PathFit | None:
    """The path model over (prompt tokens, residual seconds) points; None below ``min_count``."""
    pts = [(n, r) for n, r in points if math.isfinite(n) and math.isfinite(r) and abs(r) <= MAX_PATH_S]
    if len(pts) < min_count:
        return None
    ns = [n for n, _ in pts]
    b = 0.0
    if _quantile(ns, 0.9) - _quantile(ns, 0.1) >= MIN_SPAN:
        pairs = [(i, j) for i in range(len(pts)) for j in range(i + 1, len(pts)) if pts[i][0] != pts[j][0]]
        if len(pairs) > MAX_PAIRS:
            pairs = random.Random(len(pts)).sample(pairs, MAX_PAIRS)
        if pairs:
            b = max(0.0, _median([(pts[j][1] - pts[i][1]) / (pts[j][0] - pts[i][0]) for i, j in pairs]))
    a = _median([r - b * n for n, r in pts])
    return PathFit(a=a, b=b, n=len(pts))


class PathWindow:
    """The last ``window`` (prompt tokens, residual) pairs of one instance's BEA outcomes."""

    def __init__(self, window: int = 500) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, prompt_tokens: int, observed_s: float, elapsed_s: float, engine_s: float) -> None:
        """One finished query: observed TTFT from submit, its time in the router before the
        estimate, the estimate's engine part."""
        self.points.append((float(prompt_tokens), observed_s - elapsed_s - engine_s))

    def __len__(self) -> int:
        return len(self.points)

    def fit(self) -> PathFit | None:
        return fit_path(list(self.points))
