"""P(on time) (issue 24, item 5): the instance's TTFT error deciles, the probability read from them,
and BEAR's feasibility test at a confidence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bear.calibrator.ttft_error import MIN_PAIRS, ratio_quantiles
from bear.protocol.messages import TTFT_RATIO_LEVELS, Calibration
from bear.router.policies import Candidate, QueryContext, make_policy
from bear.router.policies.on_time import p_on_time

BETA = (4e-3, 2e-6, 5e-8, 7e-10)


def test_the_deciles_are_those_of_observed_over_predicted() -> None:
    rng = np.random.default_rng(4)
    pred = rng.uniform(0.05, 2.0, 400)
    ratio = rng.lognormal(0.1, 0.3, 400)
    pairs = [*zip(pred, pred * ratio, strict=True), (0.0, 1.0), (1.0, 0.0)]  # the last two say nothing
    got = ratio_quantiles(pairs)
    assert got == pytest.approx(tuple(np.quantile(ratio, TTFT_RATIO_LEVELS)))
    assert ratio_quantiles(pairs[:MIN_PAIRS - 1]) is None
    Calibration(beta=BETA, ttft_ratio_q=got)  # a valid calibration field
    for bad in (got[:-1], (*got[:-1], math.nan), tuple(reversed(got)), (0.0, *got[1:])):
        with pytest.raises(ValueError):
            Calibration(beta=BETA, ttft_ratio_q=bad)


def test_p_on_time_is_the_ratios_distribution_function_at_target_over_estimate() -> None:
    q = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4, 1.8)
    assert p_on_time(1.0, 1.0, q) == pytest.approx(0.5)  # the median ratio is 1: the point test's odds
    assert p_on_time(1.0, 1.3, q) == pytest.approx(0.75)  # halfway between the 0.7 and 0.8 levels
    assert p_on_time(2.0, 1.2, q) == pytest.approx(0.1)  # target / estimate = 0.6, the first decile
    assert p_on_time(1.0, 0.3, q) == pytest.approx(0.05)  # below it: linear to 0
    assert p_on_time(1.0, 3.6, q) == pytest.approx(0.95)  # above the last: towards 1
    grid = [p_on_time(1.0, t, q) for t in np.linspace(0.01, 10.0, 500)]
    assert grid == sorted(grid) and 0.0 < grid[0] and grid[-1] < 1.0
    assert p_on_time(math.inf, 1.0, q) == 0.0 and p_on_time(0.0, 1.0, q) == 1.0


def test_bear_demands_the_confidence_where_the_error_is_known() -> None:
    ctx = QueryContext("q", 1.0, 5e-4, 100)
    slow_tail = (0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2, 3.0)  # this instance runs late often
    risky = Candidate(instance="risky", model="m", acc=0.9, ttft=0.9, ttft_ratio_q=slow_tail, prefill_tps=1e4,
                      prompt_tokens=100)
    safe = Candidate(instance="safe", model="m", acc=0.5, ttft=0.5, prefill_tps=1e4, prompt_tokens=100)
    point = make_policy("bear")
    assert point.decide(ctx, [risky, safe]).candidate.instance == "risky"  # 0.9 s ≤ 1 s: feasible
    sure = make_policy("bear", confidence=0.8)
    d = sure.decide(ctx, [risky, safe])
    assert d.candidate.instance == "safe" and d.feasible  # P(on time) at risky ≈ 0.2
    unknown = Candidate(instance="unknown", model="m", acc=0.9, ttft=0.9, prefill_tps=1e4, prompt_tokens=100)
    assert sure.decide(ctx, [unknown, safe]).candidate.instance == "unknown"  # no distribution: the point test
    # eq. 8's estimate is not what the deciles describe: the ablation keeps the point test
    abl = make_policy("prefill-throughput", confidence=0.8)
    r2 = Candidate(instance="risky", model="m", acc=0.9, ttft_prefill=0.9, ttft_ratio_q=slow_tail)
    assert abl.decide(ctx, [r2, Candidate(instance="s", model="m", acc=0.5, ttft_prefill=0.5)]).candidate.instance \
        == "risky"
    with pytest.raises(ValueError):
        make_policy("bear", confidence=1.0)
