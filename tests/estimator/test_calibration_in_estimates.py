"""What the calibration hands the replay (issue 24, item 4): the reply says which β it used, and
an instance's length scale acts exactly as if the router had announced the scaled lengths."""

from __future__ import annotations

import time

import msgspec
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
from bear.router.decide import Refused, screen
from bear.router.filters import REQUEST_FILTERS
from bear.router.policies import Candidate, QueryContext
from bear.sim.profile import load_profile

CFG = EstimatorConfig(compensate_staleness=False, arrival_fill=False)
BETA = (4e-3, 2e-6, 5e-8, 7e-10)


def pressured_store(predicted: dict[str, int], t0: float, ahead: dict[str, int] | None = None) -> StateStore:
    """One instance whose KV cache its residents nearly fill (a new query waits for them to leave),
    with the router's predictions of their lengths, and dispatches not yet shown."""
    engine = {**load_profile("qwen3-0.6b-h100").engine_config(), "num_gpu_blocks": 700, "block_size": 16}
    e = libbea.Engine(engine)
    for rid in predicted:
        e.add(rid, 1200, 4096, 4000)
    for _ in range(3):
        e.step()
        e.finish_step()
    store = StateStore()
    st = store.get("i")
    st.on_registry(InstanceRecord(id="i", model="m", base_url="http://x/v1", heartbeat=t0, config=engine))
    for rid, n in predicted.items():
        st.on_dispatch(Dispatch(request_id=rid, prompt_tokens=1200, predicted_output_tokens=n, max_tokens=4096,
                                t=t0 - 5.0))
    store.offer("i", encode(e.snapshot("i", "m", t0)), t0)
    for rid, n in (ahead or {}).items():
        st.on_dispatch(Dispatch(request_id=rid, prompt_tokens=900, predicted_output_tokens=n, max_tokens=4096,
                                t=t0 + 0.001))
    return store


def one(store: StateStore, now: float):
    q = EstimateQuery(id="q", prompt_tokens=2000, max_tokens=64)
    return estimate(q, [EstimateCandidate(instance="i")], store, now, CFG)[0]


def test_a_length_scale_is_the_scaled_announcement() -> None:
    t0 = time.time()
    predicted = {f"r{k}": 600 + 40 * k for k in range(8)}
    ahead = {"d1": 500, "d2": 300}
    scaled = pressured_store(predicted, t0, ahead)
    cal = Calibration(beta=BETA, length_scale=0.4)
    st = scaled.get("i")
    st.ensure_parsed()
    st.set_calibration(cal)
    assert dict(st.lengths) == {rid: round(n * 0.4) for rid, n in {**predicted, **ahead}.items()}
    assert [r["predicted_output"] for r in st.ahead(CFG.dispatch_grace_s)] == [200, 120]
    reference = pressured_store({rid: round(n * 0.4) for rid, n in predicted.items()}, t0,
                                {rid: round(n * 0.4) for rid, n in ahead.items()})
    reference.get("i").set_calibration(msgspec.structs.replace(cal, length_scale=None))
    now = t0 + 0.01
    got, want = one(scaled, now), one(reference, now)
    assert got.ttft_s == want.ttft_s and got.n_batches == want.n_batches and got.ahead == want.ahead == 2
    # the scale is what made the difference: the same state unscaled waits longer for the residents
    unscaled = pressured_store(predicted, t0, ahead)
    unscaled.get("i").set_calibration(msgspec.structs.replace(cal, length_scale=None))
    assert one(unscaled, now).ttft_s > got.ttft_s
    # back to no scale: every prediction as announced
    st.set_calibration(None)
    assert dict(st.lengths) == {**predicted, **ahead} and st.length_scale == 1.0


def test_the_reply_says_which_beta_it_used() -> None:
    t0 = time.time()
    store = pressured_store({"r0": 100}, t0)
    assert one(store, t0).calibration == "nominal"
    profiled = Calibration(beta=BETA, source="profiled")
    store.get("i").set_calibration(profiled)
    assert one(store, t0).calibration == "profiled"
    store.get("i").set_calibration(msgspec.structs.replace(profiled, source="online", scale=1.1))
    assert one(store, t0).calibration == "online"


def test_nothing_is_refused_on_a_nominal_estimate() -> None:
    a = Candidate(instance="a", model="m", ttft=9.0, ttft_calibration="online")
    b = Candidate(instance="b", model="m", ttft=4.0, ttft_calibration="profiled")
    q = QueryContext("q", 1.0, deadline=103.0)  # 3 s from now: both calibrated estimates come after it
    refused = screen(REQUEST_FILTERS, q, [a, b], 100.0)
    assert isinstance(refused, Refused) and refused.filter == "deadline" and "4000 ms" in refused.message
    c = Candidate(instance="c", model="m", ttft=30.0, ttft_calibration="nominal")
    assert screen(REQUEST_FILTERS, q, [a, b, c], 100.0) == [c]  # β nominal: off by any factor, kept


def test_calibration_fields_are_checked() -> None:
    with pytest.raises(ValueError):
        Calibration(beta=BETA, length_scale=float("nan"))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"beta": list(BETA), "length_scale": -1.0}), type=Calibration)


def running_snapshot(generated: int) -> libbea.Snapshot:
    """Eight residents that have each generated ``generated`` tokens (0: still waiting), in a KV
    cache they nearly fill."""
    engine = {**load_profile("qwen3-0.6b-h100").engine_config(), "num_gpu_blocks": 700, "block_size": 16}
    e = libbea.Engine(engine)
    for k in range(8):
        e.add(f"r{k}", 1200, 4096, 4000)
    for _ in range(generated + 1 if generated else 0):  # two prefill steps (9,600 tokens), then a token a step
        e.step()
        e.finish_step()
    return libbea.Snapshot.from_msgpack(encode(e.snapshot("i", "m", 0.0)))


def test_conditioned_lengths_leave_fresh_residents_at_their_prediction_and_grow_with_what_they_generated() -> None:
    q = {"id": "q", "prompt_tokens": 2000, "max_tokens": 64}
    lengths = {f"r{k}": 100 for k in range(8)}

    def ttft(snap: libbea.Snapshot, sigma: float) -> float:
        return float(libbea.estimate(snap, q, beta=list(BETA), lengths=lengths, length_sigma=sigma)["ttft_s"])

    waiting = running_snapshot(0)
    assert ttft(waiting, 0.0) == ttft(waiting, 0.8) == ttft(waiting, 3.0)  # nothing generated: the prediction
    midway = running_snapshot(50)  # half their predicted 100: a longer answer is now more likely
    got = [ttft(midway, s) for s in (0.0, 0.3, 0.8, 2.0)]
    assert got == sorted(got) and got[0] < got[-1]
    for bad in (-0.1, float("nan"), 9.0):
        with pytest.raises(ValueError):
            libbea.estimate(midway, q, beta=list(BETA), length_sigma=bad)
