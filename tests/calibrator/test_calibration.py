"""NNLS calibration recovers known coefficients and is robust to bad records."""

from __future__ import annotations

import numpy as np
import pytest

from bear.calibrator.fit import Fit, fit_beta, prefill_throughput
from bear.protocol.batch import BatchRecord


def synthetic_records(beta, n=400, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        items = [{"n": 1, "context": int(rng.integers(10, 4000)), "decode": True} for _ in range(rng.integers(0, 30))]
        if rng.random() < 0.6:
            items.append({"n": int(rng.integers(1, 512)), "context": int(rng.integers(0, 2000)), "decode": False})
        if not items:
            continue
        tok = sum(i["n"] for i in items)
        dec = sum(i["context"] for i in items if i["decode"])
        pre = sum(i["n"] * i["context"] + i["n"] * (i["n"] + 1) / 2 for i in items if not i["decode"])
        t = beta[0] + beta[1] * tok + beta[2] * dec + beta[3] * pre
        recs.append(BatchRecord(items=items, duration_s=t * (1 + noise * rng.normal())))
    return recs


def test_recovers_exact_coefficients() -> None:
    beta = (5e-3, 2e-5, 1e-7, 3e-9)
    cal = fit_beta(synthetic_records(beta))
    assert cal.mape < 1e-6
    assert np.allclose(cal.beta, beta, rtol=1e-4)


def test_noisy_fit_and_skips_null_durations() -> None:
    beta = (5e-3, 2e-5, 1e-7, 3e-9)
    recs = synthetic_records(beta, noise=0.05)
    recs += [BatchRecord(items=[{"n": 5, "context": 0, "decode": False}], duration_s=None)] * 50
    cal = fit_beta(recs)
    assert cal.n == len(recs) - 50
    assert 0.02 < cal.mape < 0.08
    assert all(b >= 0 for b in cal.beta)


def test_too_few_records() -> None:
    with pytest.raises(ValueError):
        fit_beta([])


def test_calibration_json_round_trip_and_validation() -> None:
    c = Fit(beta=(1.0, 2.0, 3.0, 4.0), mape=0.1, n=5)
    assert Fit.from_json(c.to_json()) == c
    with pytest.raises(ValueError):
        Fit.from_json({"beta": [1, 2, -3, 4]})


def test_prefill_throughput() -> None:
    recs = [BatchRecord(items=[{"n": 100, "context": 0, "decode": False}, {"n": 1, "context": 5, "decode": True}],
                        duration_s=0.5),
            BatchRecord(items=[{"n": 1, "context": 5, "decode": True}], duration_s=0.1)]
    assert prefill_throughput(recs) == pytest.approx(200.0)


@pytest.mark.parametrize(("trace", "batches"), [("public-e", "batches_e"), ("public-f", "batches_f")])
def test_default_objective_fits_ttft_better_than_batch_mape(traces_dir, cases, trace, batches) -> None:
    """β is used to sum batch times into a TTFT: least squares on the durations (unbiased means)
    beats the relative fit on the engines' TTFTs of the public real-vLLM traces, though the
    relative fit has the lower batch-time MAPE on public-f."""
    from bear.calibrator.fit import DEFAULT_OBJECTIVE, design_matrix, fit_arrays, read_records
    from bear.replay.cases import ttft_errors

    x, y = design_matrix(read_records([traces_dir / f"{batches}.jsonl.gz"]))
    mine = [c for c in cases if c["trace"] == trace]
    chosen, _, n = ttft_errors(mine, fit_arrays(x, y, DEFAULT_OBJECTIVE).beta)
    absolute, _, _ = ttft_errors(mine, fit_arrays(x, y, "absolute").beta)
    relative, rel_bias, _ = ttft_errors(mine, fit_arrays(x, y, "relative").beta)
    assert n == len(mine) and chosen <= absolute and chosen < relative
    assert rel_bias < -0.05  # the relative fit's TTFTs come out low


def test_unknown_objective_is_refused() -> None:
    from bear.calibrator.fit import fit_arrays

    with pytest.raises(ValueError, match="unknown objective"):
        fit_arrays(np.ones((5, 4)), np.ones(5), "median")


def test_the_refit_window_keeps_half_for_prefill_batches() -> None:
    """At light load nearly every batch is a decode: the window still holds the newest prefills."""
    from bear.calibrator.fit import BatchWindow

    w: BatchWindow[int] = BatchWindow(10)
    for k in range(3):
        w.add(-k - 1, True)
    for k in range(100):
        w.add(k, False)
    assert len(w) == 8 and w.new == 103
    assert w.batches() == [95, 96, 97, 98, 99, -1, -2, -3]  # the newest decodes, then every prefill
    for k in range(7):
        w.add(-10 - k, True)
    assert [b for b in w.batches() if b < 0] == [-12, -13, -14, -15, -16]


def _features(n: int, seed: int) -> np.ndarray:
    """Eq. 12 rows of varied batches: decodes only, small and large prefills."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        decodes = int(rng.integers(0, 64))
        prefill = int(rng.choice([0, rng.integers(1, 64), rng.integers(64, 8192)]))
        tokens = decodes + prefill
        if tokens == 0:
            decodes = tokens = 1
        rows.append((1.0, float(tokens), float(decodes * rng.integers(50, 4000)), prefill * (prefill + 1) / 2.0))
    return np.array(rows)


def test_the_roofline_is_found_where_one_line_cannot_follow_and_only_there() -> None:
    from bear.calibrator.fit import fit_roofline, predict
    from bear.protocol.messages import Calibration, decode, encode

    x = _features(1500, 1)
    rng = np.random.default_rng(2)
    noise = np.exp(rng.normal(0.0, 0.03, len(x)))
    memory = np.array([6e-3, 2e-7, 6e-8, 0.0])  # weights and KV reads: flat in tokens
    compute = np.array([1e-3, 4e-5, 0.0, 2e-9])  # dense layers and prefill attention
    kinked = np.maximum(x @ memory, x @ compute) * noise
    roof = fit_roofline(x, kinked)
    assert roof.gamma is not None and roof.mape < 0.04  # the noise floor (σ = 3 %)
    assert fit_roofline(x, kinked).coefficients == roof.coefficients  # deterministic
    eq12 = fit_beta_arrays(x, kinked)
    assert roof.mape <= 0.9 * eq12.mape
    np.testing.assert_allclose(predict(roof.coefficients, x), np.maximum(x @ np.array(roof.beta),
                                                                          x @ np.array(roof.gamma)))
    straight = (x @ compute + 5e-3) * noise  # one line is the truth: no second line
    assert fit_roofline(x, straight).gamma is None
    cal = Calibration(beta=roof.beta, gamma=roof.gamma, mape=roof.mape, n=roof.n)
    back = decode(Calibration, encode(cal))
    assert back.gamma == roof.gamma and back.coefficients == roof.coefficients and len(back.coefficients) == 8
    with pytest.raises(ValueError, match="non-negative"):
        Calibration(beta=roof.beta, gamma=(-1.0, 0.0, 0.0, 0.0))


def fit_beta_arrays(x: np.ndarray, y: np.ndarray):
    from bear.calibrator.fit import fit_arrays

    return fit_arrays(x, y)
