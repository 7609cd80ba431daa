"""The residents' output lengths drawn (``EstimatorConfig.length_draws``, docs/estimator.md,
"Output lengths drawn"): the estimate is the median TTFT over replays with each resident's
length drawn around its prediction — deterministic, the point estimate when nothing is drawn
or the spread vanishes, and different from it where the query waits for residents to leave."""

from __future__ import annotations

import time

import pytest

from bear import libbea
from bear.benchmarks.estimator import BETA, synthetic_snapshot
from bear.estimator.estimate import EstimatorConfig, estimate, replay_inputs
from bear.protocol.messages import Calibration, EstimateCandidate, EstimateQuery
from tests.estimator.test_calibration_in_estimates import BETA as BETA_PRESSURED
from tests.estimator.test_calibration_in_estimates import pressured_store

QUERY = {"prompt_tokens": 8192, "max_tokens": 256}


def admission_bound() -> libbea.Snapshot:
    """64 running, 32 waiting at max_num_seqs 64: the query waits for residents to finish."""
    snap_d, lengths = synthetic_snapshot(64, 32, prompt=8192, budget=8192, block_size=16, max_num_seqs=64)
    snap = libbea.Snapshot.from_dict(snap_d)
    snap.set_output_lengths(lengths)
    return snap


def test_no_draws_is_the_point_estimate_and_draws_are_deterministic() -> None:
    snap = admission_bound()
    point = libbea.estimate(snap, QUERY, beta=BETA)
    assert libbea.estimate(snap, QUERY, beta=BETA, length_sigma=0.5, length_draws=0)["ttft_s"] == pytest.approx(
        libbea.estimate(snap, QUERY, beta=BETA, length_sigma=0.5)["ttft_s"])
    assert libbea.estimate(snap, QUERY, beta=BETA, length_sigma=0.0, length_draws=15)["ttft_s"] == point["ttft_s"]
    first = libbea.estimate(snap, QUERY, beta=BETA, length_sigma=0.5, length_draws=15)
    again = libbea.estimate(snap, QUERY, beta=BETA, length_sigma=0.5, length_draws=15)
    assert first == again
    many = libbea.estimate_many([snap, snap], QUERY, [BETA, BETA], length_sigmas=[0.5, 0.0], length_draws=15)
    assert many[0][0] == first["ttft_s"] and many[1][0] == point["ttft_s"]


def test_where_the_query_waits_for_residents_their_drawn_lengths_move_it_and_a_vanishing_spread_does_not() -> None:
    snap = admission_bound()
    point = libbea.estimate(snap, QUERY, beta=BETA)["ttft_s"]
    drawn = libbea.estimate(snap, QUERY, beta=BETA, length_sigma=0.6, length_draws=15)["ttft_s"]
    assert drawn != pytest.approx(point, rel=1e-3)
    # σ → 0: every draw is the prediction (the log-normal's mean), within the token the ceiling adds
    tight = libbea.estimate(snap, QUERY, beta=BETA, length_sigma=1e-6, length_draws=15)["ttft_s"]
    assert tight == pytest.approx(point, rel=0.01)


def test_nothing_to_wait_for_leaves_the_estimate_alone() -> None:
    snap_d, lengths = synthetic_snapshot(8, 0, prompt=1024, budget=2048, block_size=16, max_num_seqs=256)
    snap = libbea.Snapshot.from_dict(snap_d)
    snap.set_output_lengths(lengths)
    q = {"prompt_tokens": 1024, "max_tokens": 256}
    assert libbea.estimate(snap, q, beta=BETA, length_sigma=0.6, length_draws=15)["ttft_s"] == pytest.approx(
        libbea.estimate(snap, q, beta=BETA)["ttft_s"], rel=1e-9)


@pytest.mark.parametrize("draws", [-1, 1026])
def test_a_draw_count_out_of_range_is_refused(draws: int) -> None:
    with pytest.raises(ValueError, match="length_draws"):
        libbea.estimate(admission_bound(), QUERY, beta=BETA, length_sigma=0.5, length_draws=draws)


def test_the_estimator_draws_with_the_calibrations_spread_by_default() -> None:
    t0 = time.time()
    store = pressured_store({f"r{k}": 600 + 40 * k for k in range(8)}, t0)
    st = store.get("i")
    st.ensure_parsed()
    st.set_calibration(Calibration(beta=BETA_PRESSURED, length_sigma=0.42))
    assert replay_inputs(st, t0, EstimatorConfig()).length_sigma == 0.42
    assert replay_inputs(st, t0, EstimatorConfig(length_draws=0)).length_sigma == 0.0
    q = EstimateQuery(id="q", prompt_tokens=2000, max_tokens=64)
    cfg = EstimatorConfig(compensate_staleness=False, arrival_fill=False)
    drawn = estimate(q, [EstimateCandidate(instance="i")], store, t0, cfg)[0].ttft_s
    point = estimate(q, [EstimateCandidate(instance="i")], store, t0,
                     EstimatorConfig(compensate_staleness=False, arrival_fill=False, length_draws=0))[0].ttft_s
    assert drawn == libbea.estimate(st.snap, {"id": "q", "prompt_tokens": 2000, "max_tokens": 64}, beta=BETA_PRESSURED,
                                    length_sigma=0.42, length_draws=cfg.length_draws)["ttft_s"]
    assert point == libbea.estimate(st.snap, {"id": "q", "prompt_tokens": 2000, "max_tokens": 64},
                                    beta=BETA_PRESSURED)["ttft_s"]
    assert drawn != point
