"""The analytic TTFT fallback (paper eq. 13-15) used when an instance's snapshot is missing or
stale: limited processor sharing with the instance's measured dispatch rate α, concurrency k,
service rate μ and prefill throughput θ (docs/estimator.md, "Fallback")."""

from __future__ import annotations

import math

from bear import libbea
from bear.estimator.state import InstanceState
from bear.protocol.messages import NOMINAL_PROMPT_TOKENS

DEFAULT_K = 25.0  # the paper's measured concurrency (Qwen3-0.6B, one H100) when nothing is known
DEFAULT_PROMPT = NOMINAL_PROMPT_TOKENS
DEFAULT_OUTPUT = 256.0


def analytic_ttft(st: InstanceState, prompt_tokens: int, now: float) -> float:
    """Eq. 14 (Poisson) or eq. 15 + prefill (when ≥ 20 inter-arrival gaps give c_a²)."""
    theta = st.calibration.prefill_tps()
    k = st.mean_running or DEFAULT_K
    if st.max_num_seqs:
        k = min(k, float(st.max_num_seqs))
    k = max(k, 1.0)
    p = st.mean_prompt or DEFAULT_PROMPT
    o = st.mean_output or DEFAULT_OUTPUT
    b0, b1, b2, _ = st.calibration.beta
    step = b0 + b1 * k + b2 * k * (p + o / 2.0)  # one decode step with k requests sharing it
    service = o * step + p / theta  # one query's residence when k share the instance
    mu = k / service if service > 0 else math.inf  # LPS capacity, queries/s
    alpha, ca2 = st.arrival_stats(now)
    if alpha <= 0:
        wait = 0.0
    elif ca2 is None:
        wait = libbea.lps_wait(alpha, mu, k)
    else:
        wait = libbea.lps_wait_corrected(alpha, 1.0 / mu, k, ca2, 1.0)
    return wait + prompt_tokens / theta
