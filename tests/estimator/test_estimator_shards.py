"""Sharded estimators: workers of shard k follow only the instances the registry lists whose id
hashes to k, answer on their shard's subject (a queue group of replicas each), the router asks only
the shards that own a candidate and merges — and the merged rows equal an unsharded worker's."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import nats
import pytest
from test_estimator_service import busy_snapshot

from bear.estimator.client import EstimatorClient
from bear.estimator.estimate import EstimatorConfig
from bear.estimator.worker import EstimatorWorker
from bear.instance.record import instance_record
from bear.protocol.codec import pack
from bear.protocol.messages import EstimateQuery, encode
from bear.protocol.subjects import Subjects
from bear.router.predict import ask_estimator
from bear.runtime.kv import ensure_kv

from waiting import wait_until

S = Subjects()
SHARDS = 2
# Time-invariant estimates (no staleness compensation, no arrival fill): equal across workers.
BASE = EstimatorConfig(max_age_s=60.0, compensate_staleness=False, arrival_fill=False)


def test_shard_of_is_stable_and_spreads() -> None:
    ids = [f"inst-{k}" for k in range(200)]
    shards = [Subjects.shard_of(i, 4) for i in ids]
    assert shards == [Subjects.shard_of(i, 4) for i in ids]  # deterministic (no per-process hash seed)
    h = 0x811C9DC5
    for b in b"inst-0":
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    assert Subjects.shard_of("inst-0", 4) == h % 4
    assert min(shards.count(k) for k in range(4)) > 30
    assert Subjects.shard_of("anything", 1) == 0 and S.estimate_shard(0, 1) == "bear.estimate"
    assert S.estimate_shard(1, 2) == "bear.estimate.1"


async def test_sharded_replicas_route_like_one_worker(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    workers = [EstimatorWorker(nc, dataclasses.replace(BASE, shards=SHARDS, shard=k, worker_name=f"s{k}r{r}"))
               for k in range(SHARDS) for r in range(2)]
    whole = EstimatorWorker(nc, dataclasses.replace(BASE, worker_name="whole"))
    try:
        for w in [*workers, whole]:
            await w.start()
        instances = [f"sh-{k}" for k in range(6)]
        owners = {i: Subjects.shard_of(i, SHARDS) for i in instances}
        assert set(owners.values()) == {0, 1}
        kv = await ensure_kv(nc.jetstream(), S.instances_bucket)
        for i in instances:
            rec = instance_record(i, "m", "http://127.0.0.1:1/v1")
            await kv.put(i, encode(msgspec.structs.replace(rec, heartbeat=time.time() + 3600)))
        await wait_until(lambda: all(set(w._owned) == {i for i in instances if owners[i] == w.cfg.shard}
                                     and all(w._owned.values()) for w in workers))
        for k, i in enumerate(instances):
            await nc.publish(S.snapshot(i), pack(busy_snapshot(i, seed=k)))
        await nc.flush()
        await wait_until(lambda: all(whole.store.peek(i) is not None for i in instances))
        await wait_until(lambda: all(all(w.store.peek(i) is not None for i in instances if owners[i] == w.cfg.shard)
                                     for w in workers))
        for w in workers:  # a shard's workers never receive the other shards' snapshots
            assert {i for i, st in w.store.instances.items() if st.raw is not None or st.snap is not None} \
                <= {i for i in instances if owners[i] == w.cfg.shard}

        clients = [EstimatorClient(nc, S, try_timeout_s=1.0, subject=S.estimate_shard(k, SHARDS))
                   for k in range(SHARDS)]
        plain = EstimatorClient(nc, S, try_timeout_s=1.0)
        for n in range(6):
            q = EstimateQuery(id=f"q{n}", prompt_tokens=300 + 200 * n, max_tokens=64)
            merged = await ask_estimator(clients, q, instances, budget_s=2.0)
            ref = (await plain.estimate(q, instances, budget_s=2.0))
            assert merged is not None and "," in merged.worker
            got = {r.instance: msgspec.structs.replace(r, age_s=None) for r in merged.estimates}
            want = {r.instance: msgspec.structs.replace(r, age_s=None) for r in ref.estimates}
            assert got == want and all(r.method == "bea" for r in got.values())

        # A query whose candidates all live in shard 0 is never sent to shard 1.
        only0 = [i for i in instances if owners[i] == 0]
        before = sum(w.handled for w in workers if w.cfg.shard == 1)
        rep = await ask_estimator(clients, EstimateQuery(id="o", prompt_tokens=500), only0, budget_s=2.0)
        assert rep is not None and {r.instance for r in rep.estimates} == set(only0)
        assert sum(w.handled for w in workers if w.cfg.shard == 1) == before

        # One replica of each shard stops: its twin answers; nothing is lost.
        for k in range(SHARDS):
            await next(w for w in workers if w.cfg.shard == k).stop()
        for n in range(10):
            rep = await ask_estimator(clients, EstimateQuery(id=f"after{n}", prompt_tokens=400), instances,
                                      budget_s=2.0)
            assert rep is not None and len(rep.estimates) == len(instances)
            assert all(r.method == "bea" for r in rep.estimates)
    finally:
        for w in [*workers, whole]:
            await w.stop()
        await asyncio.sleep(0)
        await nc.close()


@pytest.mark.parametrize("bad", [-1, 2])
async def test_a_worker_outside_the_shard_range_does_not_start(nats_server, bad: int) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        with pytest.raises(ValueError, match="shard"):
            await EstimatorWorker(nc, dataclasses.replace(BASE, shards=2, shard=bad)).start()
    finally:
        await nc.close()
