"""No single message steers an estimator: a snapshot stamped in the future is refused (it used to
outlive every real snapshot after it), ids that are not UTF-8 are a malformed snapshot (not an
internal error with the bad state installed), a β no engine could have is refused, and a flood of
made-up instance ids cannot grow a worker without bound."""

from __future__ import annotations

import time

import msgspec
import nats
import pytest
from test_estimator_service import busy_snapshot

from bear import libbea
from bear.estimator.client import EstimatorClient
from bear.estimator.estimate import EstimatorConfig
from bear.estimator.state import MAX_CLOCK_SKEW_S, InstanceState, StateStore
from bear.estimator.worker import EstimatorWorker
from bear.protocol.codec import pack
from bear.protocol.errors import BearError
from bear.protocol.messages import Calibration, decode, encode
from bear.protocol.subjects import Subjects

from waiting import wait_until

S = Subjects()


def test_future_snapshot_is_refused_and_real_ones_keep_coming() -> None:
    st = InstanceState("i")
    now = time.time()
    st.offer_snapshot(pack(busy_snapshot("i", at=now)), now)
    assert st.ensure_parsed() is True
    forged = dict(busy_snapshot("i", seed=3, at=now + 3600), seq=10**12)
    st.offer_snapshot(pack(forged), now)
    assert st.ensure_parsed() is False and st.snap_time == pytest.approx(now)
    real = dict(busy_snapshot("i", seed=4, at=now + 0.05), seq=5)
    st.offer_snapshot(pack(real), now + 0.05)
    assert st.ensure_parsed() is True and st.snap.seq == 5
    # a clock slightly ahead (within the skew bound) is fine
    st.offer_snapshot(pack(dict(real, seq=6, time=now + 0.05 + MAX_CLOCK_SKEW_S / 2)), now + 0.05)
    assert st.ensure_parsed() is True


def test_ids_that_are_not_utf8_make_a_malformed_snapshot() -> None:
    good = busy_snapshot("u", at=time.time())
    raw = pack(good)
    rid = good["running"][0]["id"].encode()
    bad = raw.replace(rid, b"\xff\xfe" + rid[2:], 1)  # same length: still valid msgpack, invalid UTF-8
    assert bad != raw
    st = InstanceState("u")
    st.offer_snapshot(raw, time.time())
    assert st.ensure_parsed() is True
    held = st.snap
    st.offer_snapshot(bad, time.time())
    assert st.ensure_parsed() is False and st.snap is held


def test_implausible_beta_is_refused() -> None:
    for beta in ((0.0, 0.0, 0.0, 0.0), (100.0, 0.0, 0.0, 0.0), (1e-9, 1e-12, 0.0, 0.0)):
        with pytest.raises(BearError):
            decode(Calibration, msgspec.msgpack.encode({"v": "bear.calibration/1", "beta": list(beta)}))
    ok = decode(Calibration, encode(Calibration(beta=(3e-3, 2e-5, 5e-8, 4e-9))))
    assert ok.beta == (3e-3, 2e-5, 5e-8, 4e-9)


def test_store_is_bounded_in_instances() -> None:
    store = StateStore(max_instances=100)
    for k in range(1000):
        store.get(f"fake-{k}")
    assert len(store.instances) == 100 and store.evicted == 900
    store.get("fake-950")  # recently mentioned ones stay
    store.get("new")
    assert "fake-950" in store.instances and "fake-900" not in store.instances and "new" in store.instances


async def test_worker_keeps_estimating_through_forgeries(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    worker = EstimatorWorker(nc, EstimatorConfig(max_age_s=5.0, arrival_fill=False))
    await worker.start()
    try:
        now = time.time()
        await nc.publish(S.snapshot("v"), pack(busy_snapshot("v", at=now)))
        await nc.flush()
        await wait_until(lambda: worker.store.peek("v") is not None)
        client = EstimatorClient(nc, try_timeout_s=1.0)
        first = (await client.estimate({"prompt_tokens": 400}, ["v"])).estimates[0]
        assert first.method == "bea"
        # forged: a huge seq, a far-future time and an empty (idle) state
        idle = libbea.Engine(busy_snapshot("v")["config"]).snapshot("v", "m", now + 3600)
        await nc.publish(S.snapshot("v"), pack(dict(idle, seq=10**12)))
        await nc.flush()
        await wait_until(lambda: worker.store.get("v").raw is not None)
        again = (await client.estimate({"prompt_tokens": 400}, ["v"])).estimates[0]
        assert again.method == "bea" and again.n_running == first.n_running > 0
        assert worker.m.snapshots_malformed._value.get() >= 1
    finally:
        await worker.stop()
        await nc.close()
