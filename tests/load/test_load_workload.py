"""Arrival processes and TTFT targets checked against their definitions."""

from __future__ import annotations

import numpy as np
import pytest

from bear.load.arrivals import Mmpp2, arrivals, poisson_arrivals
from bear.load.targets import ttft_target_s


def test_poisson_rate_and_exponential_gaps() -> None:
    t = poisson_arrivals(8.0, 40_000, np.random.default_rng(1))
    gaps = np.diff(t)
    assert np.all(gaps > 0)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # c_a² = 1


@pytest.mark.parametrize(("mean", "ratio", "low", "high"), [(6, 3, 4.29, 12.86), (7, 3, 5.00, 15.00),
                                                             (8, 6, 4.00, 24.00)])
def test_mmpp_table3_rates(mean: float, ratio: float, low: float, high: float) -> None:
    m = Mmpp2(mean, ratio)
    assert m.p_high == pytest.approx(0.2)
    assert m.rate_low == pytest.approx(low, abs=0.01)
    assert m.rate_high == pytest.approx(high, abs=0.01)


def test_mmpp_long_run_rate_and_state_fractions() -> None:
    m = Mmpp2(7.0, 6.0)
    t, s = m.arrivals(120_000, np.random.default_rng(2))
    assert len(t) / t[-1] == pytest.approx(7.0, rel=0.04)
    # arrivals in the high state: p_H α_H / ᾱ of all arrivals
    assert s.mean() == pytest.approx(m.p_high * m.rate_high / 7.0, rel=0.05)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() > 1.2  # burstier than Poisson


def test_arrivals_by_name_is_seeded() -> None:
    assert np.array_equal(arrivals("poisson", 5, 100, seed=3), arrivals("poisson", 5, 100, seed=3))
    assert not np.array_equal(arrivals("mmpp", 5, 100, seed=3), arrivals("mmpp", 5, 100, seed=4))
    with pytest.raises(ValueError):
        arrivals("uniform", 5, 10, seed=0)


def test_ttft_targets_follow_a2() -> None:
    rng = np.random.default_rng(0)
    p = rng.integers(10, 10_000, size=20_000)
    tau = ttft_target_s(p, rng) * 1e3
    assert tau.min() >= 150 and tau.max() <= 1120
    mid = (p > 500) & (p < 200_000 / 3.5 / 100)
    assert np.mean(tau[mid] - (158 + 3.5e-3 * p[mid])) == pytest.approx(0.0, abs=1.0)
    assert ttft_target_s(10, rng)[0] == pytest.approx(0.158, abs=0.01)
    assert ttft_target_s(1_000_000, rng)[0] == pytest.approx(1.12)
