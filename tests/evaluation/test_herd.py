"""Bursty arrivals and what a decision sees of the ones beside it (issue 39): batch arrivals put N
queries at one instant; sequenced decisions each see every one before them, concurrent ones (the
old live herd) none of their own group's; the reliability figures on constructed input. All in
virtual time: nothing depends on the host's timing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_evaluation import calib, tiny_queries

from bear.estimator.estimate import EstimatorConfig
from bear.evaluation import reliability as rel
from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec, Verdict
from bear.evaluation.experiments import batch_arrivals
from bear.load.metrics import Outcome
from bear.router.policies import make_policy


def test_batch_arrivals_put_n_queries_at_one_instant() -> None:
    t = batch_arrivals(8.0, 20, 1000, np.random.default_rng(3))
    assert len(t) == 1000 and np.all(np.diff(t) >= 0)
    instants, counts = np.unique(t, return_counts=True)
    assert len(instants) == 50 and set(counts) == {20}
    assert 1000 / t[-1] == pytest.approx(8.0, rel=0.35)  # the mean rate (50 Poisson gaps)
    assert np.array_equal(t, batch_arrivals(8.0, 20, 1000, np.random.default_rng(3)))
    last = batch_arrivals(8.0, 20, 1010, np.random.default_rng(3))
    assert np.unique(last, return_counts=True)[1][-1] == 10  # the last batch cut to n


def _batch_run(decisions: str, n: int = 6) -> tuple[Cluster, list[str]]:
    """``n`` queries at t = 1 on an idle pool, then one more at t = 1.5; BEAR reading every row."""
    qs = tiny_queries(n + 1, seed=4)
    times = np.array([1.0] * n + [1.5])
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    cl = Cluster(specs, calib(), seed=2, estimator=EstimatorConfig(), decisions=decisions)
    cl.rows = {}
    cl.run(qs, times, np.full(n + 1, 0.25), make_policy("bear"), 5e-4)
    return cl, qs.ids


def _known(cl: Cluster, rid: str) -> int:
    """Requests the estimator counted ahead of the query, over the pool (snapshots + dispatches)."""
    return sum(r.n_running + r.n_waiting + r.ahead for r in cl.rows[rid].values())


def test_sequenced_decisions_each_see_every_one_before() -> None:
    cl, ids = _batch_run("sequenced")
    assert [_known(cl, rid) for rid in ids[:6]] == [0, 1, 2, 3, 4, 5]


def test_concurrent_decisions_see_none_of_their_own_batch() -> None:
    cl, ids = _batch_run("concurrent")
    assert [_known(cl, rid) for rid in ids[:6]] == [0] * 6  # one view: the idle pool
    assert _known(cl, ids[6]) >= 1  # the next decision sees the batch (its dispatches, then its snapshots)


def test_groups_are_the_same_instant_or_the_window() -> None:
    specs = [InstanceSpec.from_profile(PAPER_POOL[0])]
    times = np.array([0.0, 0.0, 0.004, 0.011, 0.02, 0.02])
    assert [list(g) for g in Cluster(specs, calib(), seed=1).groups(times)] == [[0], [1], [2], [3], [4], [5]]
    conc = Cluster(specs, calib(), seed=1, decisions="concurrent")
    assert [list(g) for g in conc.groups(times)] == [[0, 1], [2], [3], [4, 5]]
    win = Cluster(specs, calib(), seed=1, decisions="concurrent", window_s=0.005)
    assert [list(g) for g in win.groups(times)] == [[0, 1, 2], [3], [4, 5]]
    with pytest.raises(ValueError):
        Cluster(specs, calib(), seed=1, window_s=0.005)  # a window only for concurrent decisions
    with pytest.raises(ValueError):
        Cluster(specs, calib(), seed=1, decisions="joint")


def test_reliability_bins_on_constructed_input() -> None:
    pts = [(0.05, False), (0.05, True), (0.1, True), (0.95, True), (1.0, True), (0.9, False), (math.nan, True)]
    t = rel.tally(pts)
    assert t["n"] == [2, 1, 0, 0, 0, 0, 0, 0, 0, 3]  # 0.1 opens bin 1; 1.0 closes the last; nan skipped
    assert t["on_time"] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    assert t["sum_p"][0] == pytest.approx(0.1) and t["sum_p"][9] == pytest.approx(2.85)
    c = rel.curve(rel.pooled([t, t]))
    assert c[0] == {"lo": 0.0, "hi": 0.1, "n": 4, "mean_p": pytest.approx(0.05), "on_time_share": 0.5}
    assert c[9]["n"] == 6 and c[9]["mean_p"] == pytest.approx(0.95) and c[9]["on_time_share"] == pytest.approx(2 / 3)
    assert math.isnan(c[5]["mean_p"]) and c[5]["n"] == 0


def test_feasible_counts() -> None:
    outs = [Outcome(f"q{k}", "alpaca", "i", "m", target_s=0.2, ttft_s=ttft, utility=0.5, predicted_ttft_s=0.1)
            for k, ttft in enumerate([0.1, 0.3, 0.1, 0.5])]
    v = {"q0": Verdict(True, 0.95), "q1": Verdict(True, math.nan), "q2": Verdict(False, 0.2), "q3": Verdict(True, 0.92)}
    f = rel.feasible_counts(outs, v)
    assert f == {"n": 3, "on_time": 1, "n_with_p": 2, "on_time_with_p": 1, "n_queries": 4}
    assert rel.share(f) == pytest.approx(1 / 3) and rel.share(f, with_p=True) == 0.5
