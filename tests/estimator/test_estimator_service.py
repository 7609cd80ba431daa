"""Estimator workers over a real local NATS: estimates equal an offline libbea run on the same
snapshot, analytic fallback for stale instances, coded errors, and online calibration."""

from __future__ import annotations

import math
import time
from typing import Any

import nats
import numpy as np
import pytest

from bear import libbea
from bear.calibrator.fit import predict, robust_fit
from bear.calibrator.service import OnlineCalibrator
from bear.estimator.client import EstimatorClient
from bear.estimator.estimate import EstimatorConfig
from bear.estimator.worker import EstimatorWorker
from bear.protocol.batch import BatchRecord
from bear.protocol.codec import pack, unpack_map
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import NOMINAL_BETA, EstimateReply, Outcome, encode
from bear.protocol.subjects import Subjects
from bear.runtime.kv import ensure_kv
from bear.sim.profile import load_profile
from bear.sim.roofline import RooflineModel

from waiting import wait_until

S = Subjects()
BETA = [6e-3, 3e-5, 2e-8, 1e-10]
MAX_AGE_S, DOWN_AFTER_S = 30.0, 120.0  # the env fixture's worker
STALE_S = 40.0  # a snapshot this old: stale (analytic), not down


def busy_snapshot(instance: str, residents: int = 40, seed: int = 0, at: float | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    cfg = {**load_profile("qwen3-8b-h100").engine_config(), "num_gpu_blocks": 3000, "max_num_seqs": 32}
    e = libbea.Engine(cfg)
    for k in range(residents):
        e.add(f"{instance}-{k}", int(rng.integers(100, 2000)), 2048, int(rng.integers(20, 1500)))
    for _ in range(int(rng.integers(3, 30))):
        if e.step():
            e.finish_step()
    return e.snapshot(instance, "m", time.time() if at is None else at)


@pytest.fixture
async def env(nats_server):
    nc = await nats.connect(nats_server.url)
    # Plain replays (no staleness compensation, no dispatches ahead, no arrival fill): exact match
    # with libbea called directly. The replay inputs are tested in tests/estimator/test_replay_inputs.py.
    # A snapshot is fresh for MAX_AGE_S: far longer than any test takes to use one (the stale and
    # dead ones are stamped that far in the past), so "fresh" never depends on the host's speed.
    worker = EstimatorWorker(nc, EstimatorConfig(max_age_s=MAX_AGE_S, down_after_s=DOWN_AFTER_S,
                                                 default_output_tokens=256,
                                                 compensate_staleness=False, use_dispatches=False,
                                                 arrival_fill=False))
    await worker.start()
    yield nc, worker, EstimatorClient(nc, try_timeout_s=1.0)
    await worker.stop()
    await nc.close()


async def test_estimates_match_offline_libbea(env) -> None:
    nc, worker, client = env
    snaps = [busy_snapshot(f"inst-{k}", seed=k) for k in range(3)]
    captured = min(s["time"] for s in snaps)
    # β for one instance from the calibration bucket; the others keep the nominal β.
    kv = await ensure_kv(nc.jetstream(), S.calibration_bucket)
    await kv.put("inst-1", pack({"v": "bear.calibration/1", "beta": BETA, "mape": 0.03, "n": 500}))
    # Predicted lengths of some residents, as the router announces them.
    lengths = {}
    for s in snaps:
        for r in (s["running"] + s["waiting"])[::3]:
            lengths[r["id"]] = 77
            await nc.publish(S.dispatch(s["instance"]), pack({"query_id": "q", "request_id": r["id"], "prompt_tokens":
                                                              r["prompt_tokens"], "predicted_output_tokens": 77,
                                                              "t": time.time()}))
    for s in snaps:
        await nc.publish(S.snapshot(s["instance"]), pack(s))
    await nc.flush()
    await wait_until(lambda: worker.store.peek("inst-1") is not None and worker.store.get("inst-1").calibrated)
    await wait_until(lambda: all(worker.store.peek(s["instance"]) is not None for s in snaps))
    await wait_until(lambda: sum(len(worker.store.get(s["instance"]).lengths) for s in snaps) == len(lengths))
    query = {"id": "new-q", "prompt_tokens": 1500, "max_tokens": 300}
    reply = await client.estimate(query, [s["instance"] for s in snaps])
    since_capture = time.time() - captured
    assert isinstance(reply, EstimateReply) and reply.query_id == "new-q"
    for s, row in zip(snaps, reply.estimates, strict=True):
        beta = BETA if s["instance"] == "inst-1" else list(NOMINAL_BETA)
        offline = libbea.estimate(libbea.Snapshot.from_dict(s), query, beta=beta, lengths=lengths,
                                  default_output_tokens=256)
        assert row.instance == s["instance"] and row.method == "bea" and not row.stale
        assert row.ttft_s == pytest.approx(offline["ttft_s"], rel=1e-12)
        held = libbea.Snapshot.from_dict(s)
        held.set_output_lengths({k: v for k, v in lengths.items() if k in set(held.request_ids)})
        assert (row.n_running, row.n_waiting) == (len(s["running"]), len(s["waiting"]))
        assert row.pending_prefill_tokens == held.pending_prefill_tokens() > 0
        assert row.pending_decode_tokens == held.pending_decode_tokens(256) > 0
        assert row.n_batches == offline["n_batches"] and row.status == "ok"
        assert 0 <= row.age_s <= since_capture  # the age is the time since the capture, no more
    # The unannounced residents really used the default: a different default changes the answer.
    other = libbea.estimate(libbea.Snapshot.from_dict(snaps[0]), query, beta=list(NOMINAL_BETA), lengths=lengths,
                            default_output_tokens=5)
    assert other["ttft_s"] != reply.estimates[0].ttft_s


async def test_stale_down_and_unknown_instances(env) -> None:
    nc, worker, client = env
    await nc.publish(S.snapshot("fresh"), pack(busy_snapshot("fresh")))
    t_stale = time.time()
    await nc.publish(S.snapshot("stale"), pack(busy_snapshot("stale", at=t_stale - STALE_S)))
    await nc.publish(S.snapshot("dead"), pack(busy_snapshot("dead", at=time.time() - 5 * DOWN_AFTER_S)))
    for k in range(30):  # dispatch history gives the fallback an arrival rate
        await nc.publish(S.dispatch("stale"), pack({"request_id": f"d{k}", "prompt_tokens": 500,
                                                     "predicted_output_tokens": 200, "t": time.time() - 3 + k * 0.1}))
    await nc.flush()
    await wait_until(lambda: all(worker.store.peek(i) is not None for i in ("fresh", "stale", "dead")))
    reply = await client.estimate({"prompt_tokens": 800, "max_tokens": 10}, ["fresh", "stale", "dead", "never-seen"])
    stale_age = time.time() - t_stale + STALE_S  # the most the stale snapshot can have aged
    rows = {r.instance: r for r in reply.estimates}
    assert rows["fresh"].method == "bea" and not rows["fresh"].stale
    st = rows["stale"]
    assert st.method == "analytic" and st.stale and st.status == "stale"
    assert STALE_S <= st.age_s <= stale_age and st.ttft_s is not None and st.ttft_s > 0
    assert rows["dead"].method == "none" and rows["dead"].ttft_s is None and rows["dead"].status == "down"
    assert rows["never-seen"].method == "none" and rows["never-seen"].age_s is None
    # A registry heartbeat keeps an instance without a fresh snapshot alive (analytic, not down).
    kv = await ensure_kv(nc.jetstream(), S.instances_bucket)
    await kv.put("dead", pack({"v": "bear.instance/1", "id": "dead", "heartbeat": time.time()}))
    await wait_until(lambda: worker.store.get("dead").registry_heartbeat > 0)
    reply = await client.estimate({"prompt_tokens": 800}, ["dead"])
    assert reply.estimates[0].method == "analytic" and reply.estimates[0].stale


async def test_bad_requests_get_coded_errors(env) -> None:
    nc, worker, client = env

    async def raw(payload: bytes) -> dict[str, Any]:
        return unpack_map((await nc.request(S.estimate, payload, timeout=2.0)).data)

    assert (await raw(b"\xc1garbage"))["error"]["code"] == "bad_request"
    assert (await raw(pack([1, 2])))["error"]["code"] == "bad_request"
    assert (await raw(pack({"query": {"prompt_tokens": 10}})))["error"]["code"] == "bad_request"
    assert (await raw(pack({"query": {"prompt_tokens": -5}, "instances": ["a"]})))["error"]["code"] == "bad_request"
    assert (await raw(pack({"query": {"prompt_tokens": 5}, "instances": ["a"] * 65})))["error"]["code"] == "too_large"
    assert (await raw(pack({"query": {"prompt_tokens": 5}, "instances": [{"instance": "a", "prefix_hit_tokens": -1}]})
                  ))["error"]["code"] == "bad_request"
    with pytest.raises(BearError) as exc:
        await client.estimate({"prompt_tokens": "many"}, ["a"])
    assert exc.value.code == ErrorCode.BAD_REQUEST
    # A query longer than the instance's max_model_len: that instance answers "error", no crash.
    await nc.publish(S.snapshot("small"), pack(busy_snapshot("small")))
    await nc.flush()
    await wait_until(lambda: worker.store.peek("small") is not None)
    rep = await client.estimate({"prompt_tokens": 10**6}, ["small"])
    assert rep.estimates[0].status == "error" and rep.estimates[0].ttft_s is None
    # Past its deadline: dropped without a reply (the caller's own timeout fires; the worker
    # counts the drop, so the silence is the drop, not a slow answer).
    dropped = worker.m.deadline_dropped._value.get()
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request(S.estimate, pack({"query": {"prompt_tokens": 5}, "instances": ["a"],
                                           "deadline": time.time() - 1}), timeout=0.3)
    await wait_until(lambda: worker.m.deadline_dropped._value.get() == dropped + 1, what="the drop counted")
    assert worker.handled >= 8  # the client itself refused the query with a string prompt_tokens


async def test_malformed_snapshots_are_counted_and_dropped(env) -> None:
    nc, worker, client = env
    good = busy_snapshot("m1")
    await nc.publish(S.snapshot("m1"), pack(good))
    await nc.flush()
    await wait_until(lambda: worker.store.peek("m1") is not None)
    first = await client.estimate({"prompt_tokens": 300}, ["m1"])
    before = worker.m.snapshots_malformed._value.get()
    bad = dict(good, free_blocks=-3)
    await nc.publish(S.snapshot("m1"), pack(bad))
    await nc.publish(S.dispatch("m1"), b"\x00not msgpack map")
    await nc.flush()
    await wait_until(lambda: worker.store.get("m1").raw is not None)
    again = await client.estimate({"prompt_tokens": 300}, ["m1"])
    assert worker.m.snapshots_malformed._value.get() == before + 1
    assert again.estimates[0].ttft_s == first.estimates[0].ttft_s  # previous snapshot kept


async def test_only_the_newest_snapshot_is_parsed(env) -> None:
    nc, worker, client = env
    dropped, kept = worker.m.snapshots_dropped._value.get(), worker.m.snapshots_kept._value.get()
    for k in range(20):
        await nc.publish(S.snapshot("burst"), pack(dict(busy_snapshot("burst", residents=5, seed=k), seq=k)))
    await nc.flush()
    # all 20 received: each after the first replaced an unparsed one (nothing asked for an estimate)
    await wait_until(lambda: worker.m.snapshots_dropped._value.get() == dropped + 19, what="the 20 snapshots")
    await client.estimate({"prompt_tokens": 300}, ["burst"])
    assert worker.store.get("burst").snap.seq == 19
    assert worker.m.snapshots_kept._value.get() == kept + 1  # the newest parsed, the 19 others never


def roofline_records(n: int, seed: int, outliers: float = 0.0) -> list[BatchRecord]:
    m = RooflineModel(load_profile("qwen3-8b-h100"), seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        items = [(1, int(rng.integers(50, 4000))) for _ in range(int(rng.integers(1, 64)))]
        if rng.random() < 0.4:
            items.append((int(rng.integers(32, 4096)), 0))
        d = m.sample(items)
        if rng.random() < outliers:
            d *= 8.0
        out.append(BatchRecord(seq=k, duration_s=d,
                               items=[{"n": n_, "context": c, "decode": n_ == 1} for n_, c in items]))
    return out


def test_robust_fit_ignores_outliers() -> None:
    clean = robust_fit(roofline_records(600, 1))
    dirty = robust_fit(roofline_records(600, 1, outliers=0.05))
    theta = dirty.theta
    x = np.array([[1.0, 64.0, 64 * 2000.0, 0.0], [1.0, 2048.0, 0.0, 2048 * 2049 / 2]])
    assert np.allclose(predict(dirty.coefficients, x), predict(clean.coefficients, x), rtol=0.1)
    assert dirty.n < 600 and theta is not None and theta > 1000


async def test_online_calibrator_publishes_beta(env) -> None:
    nc, worker, _ = env
    cal = OnlineCalibrator(nc, window=500, min_records=50, refit_s=3600)
    await cal.start()
    try:
        recs = roofline_records(300, 2, outliers=0.02)
        for k in range(0, 300, 50):
            await nc.publish(S.batches("cal-a"), encode(recs[k:k + 50]))
        await nc.publish(S.batches("cal-a"), pack([1, 2, {"items": "x"}]))  # a list of non-records
        await nc.flush()
        await wait_until(lambda: len(cal.records.get("cal-a", ())) == 300)
        assert cal.malformed == 3
        assert await cal.refit_once() == ["cal-a"]
        await wait_until(lambda: worker.store.peek("cal-a") is not None and worker.store.get("cal-a").calibrated)
        got = worker.store.get("cal-a").calibration
        assert got.beta == pytest.approx(cal.fits["cal-a"].beta) and got.theta and math.isfinite(got.mape)
        assert got.mape < 0.15 and got.ttft_n == 0 and got.ttft_mape is None
        # Routers' outcome events carry BEA's prediction beside the observed TTFT: the next fit
        # publishes the instance's recent TTFT error (only BEA estimates count).
        pairs = [(0.10, 0.12), (0.20, 0.18), (0.30, 0.33), (0.05, 0.05)]
        for pred, obs in pairs:
            await nc.publish(S.outcome("cal-a"), encode(Outcome(instance="cal-a", ttft_s=obs, predicted_ttft_s=pred,
                                                                method="bea", t=time.time())))
        await nc.publish(S.outcome("cal-a"), encode(Outcome(instance="cal-a", ttft_s=1.0, predicted_ttft_s=0.1,
                                                            method="analytic", t=time.time())))
        await nc.publish(S.batches("cal-a"), encode(recs[:50]))
        await nc.flush()
        await wait_until(lambda: len(cal.ttft.get("cal-a", ())) == len(pairs) and "cal-a" in cal.records and cal.records["cal-a"].new == 50)
        assert await cal.refit_once() == ["cal-a"]
        await wait_until(lambda: worker.store.get("cal-a").calibration.ttft_n == len(pairs))
        rel = [(p - o) / o for p, o in pairs]
        got = worker.store.get("cal-a").calibration
        assert got.ttft_mape == pytest.approx(float(np.mean(np.abs(rel))))
        assert got.ttft_bias == pytest.approx(float(np.median(rel)))
    finally:
        await cal.stop()


def test_advance_snapshot_follows_the_engine() -> None:
    """Staleness compensation runs the residents alone: k advanced steps = k engine steps."""
    cfg = {"max_num_batched_tokens": 256, "max_num_seqs": 6, "block_size": 16, "num_gpu_blocks": 200,
           "max_model_len": 4096}
    rng = np.random.default_rng(11)
    e = libbea.Engine(cfg)
    truth = {}
    for k in range(10):
        truth[f"a{k}"] = int(rng.integers(2, 40))
        e.add(f"a{k}", int(rng.integers(20, 300)), 64, truth[f"a{k}"])
    for _ in range(3):
        e.step()
        e.finish_step()
    raw = pack(e.snapshot("adv", "m", 100.0))
    beta = [1e-3, 1e-5, 0.0, 0.0]
    for age in (1e-6, 0.004, 0.02):
        d, join, lo, hi, steps = libbea.advance_snapshot(raw, truth, age, beta, 256, 0.5)
        assert lo < age <= hi and join == hi and steps >= 1 and d["time"] == pytest.approx(100.0 + join)
        # replaying the same engine k steps further gives the advanced state
        clone = _clone_engine(e, cfg, truth)
        for _ in range(steps):
            clone.step()
            clone.finish_step()
        got = clone.snapshot("adv", "m", 0.0)
        key = ("id", "computed_tokens", "output_tokens", "blocks")
        assert [tuple(r[k] for k in key) for r in d["running"]] == [tuple(r[k] for k in key) for r in got["running"]]
        assert [r["id"] for r in d["waiting"]] == [r["id"] for r in got["waiting"]]
    with pytest.raises(ValueError):
        libbea.advance_snapshot(raw, None, -1.0, beta)


def _clone_engine(e: libbea.Engine, cfg: dict, truth: dict[str, int]) -> libbea.Engine:
    """Rebuild an engine from scratch by replaying the same adds and steps (deterministic)."""
    rng = np.random.default_rng(11)
    c = libbea.Engine(cfg)
    for k in range(10):
        rng.integers(2, 40)
        c.add(f"a{k}", int(rng.integers(20, 300)), 64, truth[f"a{k}"])
    for _ in range(e.seq):
        c.step()
        c.finish_step()
    return c


async def test_staleness_compensation_in_the_worker(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    worker = EstimatorWorker(nc, EstimatorConfig(compensate_staleness=True, max_age_s=5.0, arrival_fill=False))
    await worker.start()
    try:
        snap = busy_snapshot("comp", at=time.time() - 0.05)
        await nc.publish(S.snapshot("comp"), pack(snap))
        await nc.flush()
        await wait_until(lambda: worker.store.peek("comp") is not None)
        client = EstimatorClient(nc)
        query = {"id": "cq", "prompt_tokens": 900, "max_tokens": 20}
        row = (await client.estimate(query, ["comp"])).estimates[0]
        d, join, lo, hi, _ = libbea.advance_snapshot(pack(snap), {}, row.age_s, list(NOMINAL_BETA), 256, 0.5)
        offline = libbea.estimate(libbea.Snapshot.from_dict(d), query, beta=list(NOMINAL_BETA), default_output_tokens=256)
        assert row.method == "bea" and lo < row.age_s <= hi
        assert row.ttft_s == pytest.approx(offline["ttft_s"] + join - row.age_s, rel=1e-9)
        plain = libbea.estimate(libbea.Snapshot.from_dict(snap), query, beta=list(NOMINAL_BETA), default_output_tokens=256)
        assert row.ttft_s != pytest.approx(plain["ttft_s"], rel=1e-6)
    finally:
        await worker.stop()
        await nc.close()
