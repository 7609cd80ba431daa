"""What routers observe of one instance from the outcome events every router publishes
(``bear.outcome.<instance>``): recent TTFTs and TPOTs (their percentiles feed vLLM
semantic-router's latency mode), the time per output token (SCORE, RouteBalance) and the
completion rate (LMDeploy's throughput). ``bear eval`` feeds the same class from its simulated
completions."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Observations kept per instance: vLLM semantic-router's latency cache keeps the last 1,000 per
# model (vllm-project/semantic-router src/semantic-router/pkg/latency/cache.go).
HISTORY = 1000
# The percentiles of the semantic-router recipe (config/fragments/algorithm/selection/latency-aware.yaml).
SR_TTFT_PERCENTILE = 0.95
SR_TPOT_PERCENTILE = 0.90
RATE_WINDOW_S = 60.0
EWMA = 0.1


@dataclass
class Observations:
    observed: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    tpots: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    tpot: float = 0.0  # s per output token, EWMA; 0: none seen yet
    completions: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    _pcts: tuple[float, float] | None = field(default=None, repr=False)
    _tail: tuple[float, float] | None = field(default=None, repr=False)

    def add_outcome(self, t: float, ttft_s: float | None, tpot_s: float | None, completed: bool) -> None:
        """One finished query: its TTFT, its time per output token, and when it completed."""
        if ttft_s is not None and math.isfinite(ttft_s):
            self.observed.append(ttft_s)
            self._pcts = self._tail = None
        if tpot_s is not None and tpot_s > 0 and math.isfinite(tpot_s):
            self.tpot = tpot_s if self.tpot == 0 else (1 - EWMA) * self.tpot + EWMA * tpot_s
            self.tpots.append(tpot_s)
            self._tail = None
        if completed:
            c = self.completions
            c.append(max(t, c[-1]) if c else t)  # in time order, up to clock skew between routers

    def throughput_rps(self, now: float) -> float:
        """Completions per second over the last RATE_WINDOW_S. Called per query per instance, so
        it drops what left the window from the left (amortised O(1)); ``now`` must not go back."""
        c = self.completions
        while c and now - c[0] > RATE_WINDOW_S:
            c.popleft()
        if len(c) < 2:
            return 0.0
        return len(c) / max(now - c[0], 1e-3)

    def percentiles(self) -> tuple[float, float]:
        """(p50, p90) of the observed TTFTs; sorted once per new observation, not per query."""
        if self._pcts is None:
            if not self.observed:
                return 0.0, 0.0
            xs = sorted(self.observed)
            self._pcts = (_pct(xs, 0.5), _pct(xs, 0.9))
        return self._pcts

    def semantic_router_percentiles(self) -> tuple[float, float]:
        """(TTFT p95, TPOT p90) as vLLM semantic-router's latency cache gives them: the mean below
        3 observations, 0.0 (no data) when there are none."""
        if self._tail is None:
            self._tail = (_sr_pct(self.observed, SR_TTFT_PERCENTILE), _sr_pct(self.tpots, SR_TPOT_PERCENTILE))
        return self._tail


def _sr_pct(values: deque[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) < 3:
        return sum(values) / len(values)
    return _pct(sorted(values), q)


def _pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of sorted values."""
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
