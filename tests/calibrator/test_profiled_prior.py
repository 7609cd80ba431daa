"""Calibration before serving and the online refit of a profiled instance (issue 24, item 4):
the profile (bear.sim.profiling) prices every batch its engine runs, the refit rescales it rather
than fitting freely, the calibrator reads it from the bucket, and the lengths' scale."""

from __future__ import annotations

import math
import time

import msgspec
import nats
import numpy as np
import pytest

from bear.calibrator.fit import (
    ANCHOR_MAX_TOKENS,
    anchored_fit_arrays,
    design_matrix,
    mape,
    predict,
    refit_arrays,
    rescale_fit_arrays,
    robust_fit,
)
from bear.calibrator.lengths import MAX_FACTOR, MIN_LENGTHS, LengthWindow
from bear.calibrator.service import OnlineCalibrator
from bear.protocol.batch import BatchRecord
from bear.protocol.messages import Calibration, Outcome, decode, encode
from bear.protocol.subjects import Subjects
from bear.runtime.kv import ensure_kv
from bear.sim.profile import load_profile
from bear.sim.profiling import profile_records
from bear.sim.roofline import RooflineModel
from bear.stack.stack import profiled_calibrations

from waiting import wait_until

S = Subjects()
PROFILE = "qwen3-32b-2xh100-tp2"


def prefill_rows(profile_name: str, prompt: int) -> tuple[np.ndarray, float]:
    """Eq. 12 rows of one prompt's chunked prefill alone in the engine, and the roofline's time."""
    p = load_profile(profile_name)
    roof = RooflineModel(p)
    budget = int(p.engine_config()["max_num_batched_tokens"])
    rows, truth, ctx = [], 0.0, 0
    while ctx < prompt:
        n = min(budget, prompt - ctx)
        rows.append([1.0, n, 0.0, n * ctx + n * (n + 1) / 2.0])
        truth += roof.mean_time([(n, ctx)])
        ctx += n
    return np.array(rows), truth


def decode_records(profile_name: str, n: int, seed: int, slower: float = 1.0) -> list[BatchRecord]:
    """What a fresh instance's first serving window holds: decodes and short prefills only."""
    roof = RooflineModel(load_profile(profile_name), seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        items = [(1, int(rng.integers(20, 600))) for _ in range(int(rng.integers(1, 24)))]
        if rng.random() < 0.3:
            items.append((int(rng.integers(8, 96)), 0))
        out.append(BatchRecord(seq=k, duration_s=slower * roof.sample(items),
                               items=[{"n": a, "context": c, "decode": a == 1} for a, c in items]))
    return out


def test_profiling_is_seeded_and_sweeps_long_prompts() -> None:
    p = load_profile(PROFILE)
    a, b = profile_records(p, seed=3), profile_records(p, seed=3)
    assert a == b and a != profile_records(p, seed=4)
    budget = int(p.engine_config()["max_num_batched_tokens"])
    # later chunks of long prompts were run (the quadratic attention term is seen)
    assert any(not it["decode"] and it["context"] >= budget for r in a for it in r["items"])
    assert all(r["duration_s"] is None or r["duration_s"] > 0 for r in a)


@pytest.mark.parametrize("name", ["qwen3-0.6b-h100", "qwen3-8b-h100", PROFILE])
def test_the_profiled_fit_prices_a_long_prefill_as_the_engine_runs_it(name: str) -> None:
    cal = robust_fit(profile_records(load_profile(name), seed=0), name)
    x, truth = prefill_rows(name, 36_864)
    assert float(predict(cal.coefficients, x).sum()) == pytest.approx(truth, rel=0.05)


def test_a_free_refit_of_a_first_window_underprices_long_prompts_and_the_rescale_does_not() -> None:
    """The live failure: the 32B's first online fits saw decodes and short prefills only; NNLS
    zeroed the prefill-attention term and priced a long prompt's prefill at a fraction of its
    time. The refit of a profiled instance sees the free fit contradict the profile and rescales
    the profile instead: its shape, and the one factor the window shows."""
    prior = msgspec.structs.replace(robust_fit(profile_records(load_profile(PROFILE), seed=0), PROFILE),
                                    source="profiled")
    recs = decode_records(PROFILE, 300, seed=5, slower=1.3)  # the engine now runs 1.3× its profile
    x_w, y_w = design_matrix(recs)
    pf = np.array([sum(it["n"] for it in r["items"] if not it["decode"]) for r in recs], dtype=float)
    x, truth = prefill_rows(PROFILE, 20_000)
    free = refit_arrays(x_w, y_w, pf, PROFILE)  # no prior: a free fit
    assert float(predict(free.coefficients, x).sum()) < 0.5 * 1.3 * truth
    got = refit_arrays(x_w, y_w, pf, PROFILE, prior=prior)
    assert got.source == "online"
    assert float(predict(got.coefficients, x).sum()) == pytest.approx(1.3 * truth, rel=0.06)
    scaled = rescale_fit_arrays(x_w, y_w, pf, prior, PROFILE)
    assert scaled.source == "online" and scaled.scale == pytest.approx(1.3, rel=0.03)
    assert float(predict(scaled.coefficients, x).sum()) == pytest.approx(1.3 * truth, rel=0.06)
    assert scaled.beta == pytest.approx(tuple(b * scaled.scale for b in prior.beta))
    with pytest.raises(ValueError):
        rescale_fit_arrays(x_w[:3], y_w[:3], pf[:3], prior)


def test_the_refit_of_a_short_window_prices_its_own_steps_freely_and_long_prompts_by_the_profile() -> None:
    """A window of decodes and short prefills (the 32B in bear eval's pool, sent short prompts
    only): the rescaled profile's one shape misses the window's own steps — the steps a short
    query's TTFT is made of — while the free fit misprices long prompts. The published refit is
    the free fit anchored by the rescaled profile's prices of the chunks beyond the window: the
    window's steps as the free fit prices them, a long prompt as the profile does."""
    prior = msgspec.structs.replace(robust_fit(profile_records(load_profile(PROFILE), seed=0), PROFILE),
                                    source="profiled")
    recs = decode_records(PROFILE, 300, seed=5, slower=1.3)
    x_w, y_w = design_matrix(recs)
    pf = np.array([sum(it["n"] for it in r["items"] if not it["decode"]) for r in recs], dtype=float)
    x, truth = prefill_rows(PROFILE, 20_000)
    got = refit_arrays(x_w, y_w, pf, PROFILE, prior=prior)
    scaled = rescale_fit_arrays(x_w, y_w, pf, prior, PROFILE)
    assert got.gamma is not None  # a roofline of the window's line and the anchors'
    assert got.scale == pytest.approx(scaled.scale) and got.profile == pytest.approx(tuple(prior.coefficients))
    assert mape(predict(got.coefficients, x_w), y_w) < 0.6 * mape(predict(scaled.coefficients, x_w), y_w)
    assert got.mape == pytest.approx(mape(predict(got.coefficients, x_w), y_w)) and got.n == len(y_w)
    assert float(predict(got.coefficients, x).sum()) == pytest.approx(1.3 * truth, rel=0.06)
    assert got.theta == pytest.approx(float(pf.sum()) / float(y_w[pf > 0].sum()))  # the window's θ, no anchor's
    # a window that already holds chunks as large as the largest anchor: nothing to anchor
    assert anchored_fit_arrays(x_w, y_w, np.full_like(pf, ANCHOR_MAX_TOKENS), scaled, PROFILE) is None


def test_a_window_that_spans_what_the_engine_runs_is_fitted_freely() -> None:
    prior = msgspec.structs.replace(robust_fit(profile_records(load_profile(PROFILE), seed=0), PROFILE),
                                    source="profiled")
    recs = [r for r in profile_records(load_profile(PROFILE), seed=1) if r["duration_s"]]
    x_w, y_w = design_matrix(recs)
    pf = np.array([sum(it["n"] for it in r["items"] if not it["decode"]) for r in recs], dtype=float)
    got = refit_arrays(x_w, y_w, pf, PROFILE, prior=prior)
    assert got.scale is None and got.source == "online"
    assert got.beta == pytest.approx(robust_fit(recs, PROFILE).beta)


def test_bear_up_profiles_each_sim_instance() -> None:
    cals = profiled_calibrations({"a": "qwen3-0.6b-h100", "b": PROFILE})
    assert sorted(cals) == ["a", "b"] and all(c.source == "profiled" and c.instance == k for k, c in cals.items())
    back = decode(Calibration, encode(cals["b"]))
    assert back == cals["b"]


def test_length_window_is_a_log_normal_fit_within_bounds() -> None:
    w = LengthWindow(window=100)
    for _ in range(MIN_LENGTHS - 1):
        w.add(100, 300)
    assert w.scale() is None and w.sigma() is None  # too few finished queries: the predictions as they are
    w.add(400, 300)
    logs = [math.log(100 / 300)] * (MIN_LENGTHS - 1) + [math.log(400 / 300)]
    assert w.scale() == pytest.approx((100 * (MIN_LENGTHS - 1) + 400) / (300 * MIN_LENGTHS))
    assert w.sigma() == pytest.approx(float(np.std(logs, ddof=1)))
    w.add(5, 0)  # no prediction: nothing to compare
    assert len(w) == MIN_LENGTHS
    for _ in range(100):
        w.add(0, 1000)  # an empty answer counts as one token
    assert w.scale() == 1.0 / MAX_FACTOR and w.sigma() == pytest.approx(0.0, abs=1e-9)


async def test_the_calibrator_rescales_the_profile_in_the_bucket_and_publishes_the_length_scale(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    prior = profiled_calibrations({"p-1": PROFILE})["p-1"]
    kv = await ensure_kv(nc.jetstream(), S.calibration_bucket)
    await kv.put("p-1", encode(prior))
    cal = OnlineCalibrator(nc, window=500, min_records=50, refit_s=3600)
    await cal.start()
    try:
        await nc.publish(S.batches("p-1"), encode(decode_records(PROFILE, 200, seed=9, slower=1.2)))
        await nc.publish(S.batches("free-1"), encode(decode_records(PROFILE, 200, seed=9)))
        for k in range(MIN_LENGTHS):  # answers a third of what the router predicted
            await nc.publish(S.outcome("p-1"), encode(Outcome(instance="p-1", t=time.time(), output_tokens=100 + k,
                                                              predicted_output_tokens=3 * (100 + k))))
        await nc.flush()
        await wait_until(lambda: len(cal.records.get("p-1", ())) == 200 and len(cal.records.get("free-1", ())) == 200
                         and len(cal.lengths.get("p-1", ())) == MIN_LENGTHS, what="records and outcomes")
        assert sorted(await cal.refit_once()) == ["free-1", "p-1"]
        got = decode(Calibration, (await kv.get("p-1")).value)
        assert got.source == "online" and got.scale == pytest.approx(1.2, rel=0.03)
        assert got.profile == pytest.approx(tuple(prior.coefficients))  # anchored by it: the profile kept
        assert got.length_scale == pytest.approx(1 / 3) and got.length_sigma == pytest.approx(0.0, abs=1e-9)
        assert cal.fits["free-1"].scale is None  # never profiled: a free fit
        # A restarted calibrator finds the profile again in its own rescaled entry.
        again = OnlineCalibrator(nc)
        again._kv = kv
        recovered = await again.prior("p-1")
        assert recovered is not None and recovered.source == "profiled"
        assert recovered.beta == pytest.approx(prior.beta) and recovered.scale is None
        assert recovered.gamma == pytest.approx(prior.gamma) and recovered.profile is None
        # … and from a rescaled profile (no `profile`: its β over its scale)
        rescaled = msgspec.structs.replace(prior, beta=tuple(b * 1.5 for b in prior.beta), source="online",
                                           gamma=None if prior.gamma is None else tuple(g * 1.5 for g in prior.gamma),
                                           scale=1.5)
        await kv.put("p-2", encode(rescaled))
        back = await again.prior("p-2")
        assert back is not None and back.beta == pytest.approx(prior.beta) and back.source == "profiled"
        assert await again.prior("free-1") is None
    finally:
        await cal.stop()
        await nc.close()
