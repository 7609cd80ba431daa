"""The TTFT error decomposition (``bear.evaluation.decomposition``): the replay equals the observed
TTFT when every input is exact, so each oracle measures one source; and two estimator faults the
decomposition found — dispatches that stayed "ahead" after their request had come and gone, and
a long step in flight that made a current state look stale."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bear import libbea
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.estimator.state import StateStore
from bear.evaluation.cluster import PAPER_POOL, Cluster, InstanceSpec, Oracle
from bear.evaluation.decomposition import errors
from bear.evaluation.experiments import entries
from bear.protocol.messages import Calibration, EstimateCandidate, EstimateQuery
from bear.router.policies import make_policy
from tests.evaluation.test_evaluation import calib, tiny_queries

SHIPPED = EstimatorConfig(**dict(entries()["bear+overflow"].estimator))


def alone(profile: str, oracle: Oracle, n: int = 150, rate: float = 6.0, cfg: EstimatorConfig = SHIPPED):
    qs = tiny_queries(n, seed=4)
    times = np.cumsum(np.random.default_rng(2).exponential(1 / rate, n))
    cl = Cluster([InstanceSpec.from_profile(profile)], calib(), seed=7, estimator=cfg, oracle=oracle)
    return cl.run(qs, times, np.full(n, 0.5), make_policy("bear"), 5e-4)


@pytest.mark.parametrize("profile", PAPER_POOL)
def test_the_replay_is_exact_when_every_input_is(profile: str) -> None:
    exact = alone(profile, Oracle(lengths=True, step_times=True, arrivals=True))
    assert len(exact) == 150 and all(math.isfinite(o.ttft_s) for o in exact)
    for o in exact:
        assert o.predicted_ttft_s == pytest.approx(o.ttft_s, rel=1e-9, abs=1e-12), o.query_id
    e = errors(exact)
    assert e["n"] == 150 and e["unpredicted"] == 0.0
    shipped = errors(alone(profile, Oracle()))
    assert shipped["mape"] > 1e-3  # the same queries with the shipped inputs are not exact
    # each source handed over alone leaves the others' error
    for one in (Oracle(lengths=True), Oracle(step_times=True), Oracle(arrivals=True)):
        assert errors(alone(profile, one))["n"] == 150


def test_the_arrivals_oracle_needs_one_instance() -> None:
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    with pytest.raises(ValueError, match="one instance"):
        Cluster(specs, calib(), seed=1, oracle=Oracle(arrivals=True))


def test_a_request_that_came_and_went_between_two_queries_is_not_ahead() -> None:
    """A live estimator applies every step's delta and so sees each request; the simulated pool
    used to hand over only the newest state at each decision, and a short request that lived
    between two decisions stayed "ahead" of the next one (+600 % on the 8B's short queries)."""
    spec = InstanceSpec.from_profile(PAPER_POOL[0])
    qs = dataclasses.replace(tiny_queries(2), prompt_tokens=np.full((2, 3), 40), true_output=np.full((2, 3), 2))
    cl = Cluster([spec], calib(), seed=1)
    cl.decide(qs, 0, 0.0, 1.0, make_policy("bear"), 5e-4)
    cl.submit(0, qs.ids[0], 40, 2, 0.0)
    cl.advance_to(0.3)
    assert qs.ids[0] in cl.finished_at
    st = cl.store.get(spec.name)
    assert qs.ids[0] not in st.snap.request_ids  # no state delivered at a decision ever held it
    cl._deliver_snapshots(0.3)
    assert st.ahead(cl.cfg.dispatch_grace_s) == []


def _state_with_a_long_step(step_s: float) -> tuple[StateStore, float]:
    """An instance whose next step (one long prefill) takes ``step_s`` by its eq. 12 fit."""
    spec = InstanceSpec.from_profile(PAPER_POOL[0])
    eng = libbea.Engine(spec.profile.engine_config())
    eng.add("long", 8000, 16, 16, 0.0)
    store = StateStore()
    st = store.get(spec.name)
    st.calibration = Calibration(instance=spec.name, beta=(step_s, 0.0, 0.0, 0.0))
    st.install(libbea.engine_snapshot(eng, spec.name, spec.model, 10.0), 10.0, 10.0)
    return store, 10.0


def test_a_long_step_in_flight_keeps_the_state_current() -> None:
    store, t0 = _state_with_a_long_step(3.0)
    cfg = EstimatorConfig(max_age_s=1.0)
    q = EstimateQuery(id="q", prompt_tokens=100, max_tokens=8)
    cand = [EstimateCandidate(instance=PAPER_POOL[0])]
    assert store.peek(PAPER_POOL[0]).step_in_flight_s(cfg) == pytest.approx(3.0)
    during = estimate(q, cand, store, t0 + 2.5, cfg)[0]  # 2.5 s old, the step still running
    assert (during.method, during.stale) == ("bea", False)
    assert during.ttft_s is not None and during.ttft_s > 0.5  # the rest of the step, then the query's
    after = estimate(q, cand, store, t0 + 4.5, cfg)[0]  # 1.5 s past the step's predicted end
    assert (after.method, after.stale, after.status) == ("analytic", True, "stale")


def test_later_arrivals_are_validated() -> None:
    spec = InstanceSpec.from_profile(PAPER_POOL[0])
    eng = libbea.Engine(spec.profile.engine_config())
    eng.add("r", 500, 16, 16, 0.0)
    snap = libbea.engine_snapshot(eng, spec.name, spec.model, 0.0)
    q = {"id": "q", "prompt_tokens": 100, "max_tokens": 8}
    beta = [[0.01, 1e-5, 0.0, 0.0]]
    later = {"id": "l", "prompt_tokens": 100, "max_tokens": 8, "predicted_output": 4}
    ok = libbea.estimate_many([snap], q, beta, laters=[[{**later, "after_s": 0.0}]])
    assert math.isfinite(ok[0][0])
    for bad, msg in (([{**later, "after_s": 0.2}, {**later, "after_s": 0.1}], "ordered"),
                     ([{**later, "after_s": math.nan}], "finite"), ([later], "after_s"),
                     ([{**later, "after_s": 0.0, "prompt_tokens": 10**9}], "prompt_tokens")):
        with pytest.raises(ValueError, match=msg):
            libbea.estimate_many([snap], q, beta, laters=[bad])
    with pytest.raises(ValueError, match="one later list"):
        libbea.estimate_many([snap], q, beta, laters=[[], []])
