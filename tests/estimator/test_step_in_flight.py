"""The step in flight (issue 24): a sync engine publishes its state at each step boundary, so a
held state whose step should have ended by now — by eq. 12 — and no newer one means the engine
is still in that step (it runs longer than predicted): the query joins the next step. Before, the
replay ran a phantom step after the predicted end and put the query behind it."""

from __future__ import annotations

import time

import pytest

from bear import libbea
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.estimator.state import StateStore
from bear.protocol.messages import (
    Calibration,
    Dispatch,
    EstimateCandidate,
    EstimateQuery,
    InstanceRecord,
    encode,
)
from bear.sim.profile import load_profile

CFG = EstimatorConfig(arrival_fill=False)
BETA = (4e-3, 2e-6, 5e-8, 7e-10)


def store_at(t0: float) -> StateStore:
    """One instance with eight residents decoding, its state captured at t0."""
    engine = load_profile("qwen3-0.6b-h100").engine_config()
    e = libbea.Engine(engine)
    for k in range(8):
        e.add(f"r{k}", 300, 4096, 4000)
    for _ in range(3):
        e.step()
        e.finish_step()
    store = StateStore()
    st = store.get("i")
    st.on_registry(InstanceRecord(id="i", model="m", base_url="http://x/v1", heartbeat=t0, config=engine))
    for k in range(8):
        st.on_dispatch(Dispatch(request_id=f"r{k}", prompt_tokens=300, predicted_output_tokens=2000, max_tokens=4096,
                                t=t0 - 5.0))
    store.offer("i", encode(e.snapshot("i", "m", t0)), t0)
    st.set_calibration(Calibration(beta=BETA))
    return store


def ttft(now_after: float, cfg: EstimatorConfig = CFG, in_steps: bool = True) -> float:
    """The estimate of a 10-token query arriving ``now_after`` step times (eq. 12's, of the step
    run from the held state) after the capture."""
    t0 = time.time()
    store = store_at(t0)
    st = store.get("i")
    st.ensure_parsed()
    step = st.step_in_flight_s(cfg)
    assert step > 0
    q = EstimateQuery(id="q", prompt_tokens=10, max_tokens=64)
    row = estimate(q, [EstimateCandidate(instance="i")], store, t0 + now_after * step, cfg)[0]
    assert row.method == "bea" and row.ttft_s is not None
    return row.ttft_s / step if in_steps else row.ttft_s


def test_a_query_after_the_predicted_end_of_the_step_in_flight_joins_the_next_step() -> None:
    # just before the predicted end: the rest of the step, then the next one (the query's)
    before = ttft(0.999)
    assert before == pytest.approx(1.0, abs=0.02)  # a step as long as the one in flight, and a hair
    # past the predicted end, the engine still in the step: the next step too, not one more before it
    assert ttft(1.1) == pytest.approx(before, rel=1e-3)
    assert ttft(1.2) == pytest.approx(before, rel=1e-3)
    # without the rule: a phantom step ended at the predicted time and the query waits for another
    off = EstimatorConfig(arrival_fill=False, step_overrun=0.0)
    assert ttft(1.1, off) == pytest.approx(1.9, abs=0.02)
    # far past it (beyond the overrun the rule allows) a newer state is more likely on its way than
    # the step that long: the replay ages the state as before
    assert ttft(1.5) == pytest.approx(ttft(1.5, off), rel=1e-9)
