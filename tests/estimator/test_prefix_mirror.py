"""The estimator's prefix mirror over a real local NATS, fed by an instance publisher's KV
stream: the hit of a prompt (its token ids, the instance's hashing) reaches the replay and the
reply; a missed events message makes the worker ask for the whole state, which the publisher
answers; a prompt without token ids, or an instance without a stream, gets no mirrored hit."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from bear import libbea
from bear.estimator.client import EstimatorClient, decode_reply
from bear.estimator.estimate import EstimatorConfig
from bear.estimator.worker import EstimatorWorker
from bear.instance.publisher import InstancePublisher
from bear.prefix.hashing import BlockHasher, HashSpec
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import (
    EstimateCandidate,
    EstimateQuery,
    InstanceRecord,
    KvEvents,
    KvOp,
    PrefixCacheInfo,
    encode,
)
from bear.protocol.subjects import Subjects
from bear.protocol.token_ids import pack
from bear.runtime.kv import ensure_kv
from bear.sim.profile import load_profile

from waiting import wait_until

S = Subjects()
SPEC = HashSpec(block_size=16)
CFG = {**load_profile("qwen3-8b-h100").engine_config(), "block_size": 16, "num_gpu_blocks": 4000,
       "enable_prefix_caching": True}


def snapshot(instance: str, residents: int = 4) -> dict:
    e = libbea.Engine(CFG)
    for k in range(residents):
        e.add(f"{instance}-{k}", 300, 512, 300)
    e.step()
    e.finish_step()
    return e.snapshot(instance, "m", time.time())


async def register(nc, instance: str, events: bool = True) -> None:
    kv = await ensure_kv(nc.jetstream(), S.instances_bucket)
    rec = InstanceRecord(id=instance, model="m", base_url="http://x/v1", heartbeat=time.time(), config=CFG,
                         tokenizer="tok-a", prefix_cache=PrefixCacheInfo(block_size=16, events=events))
    await kv.put(instance, encode(rec))


@pytest.fixture
async def env(nats_server):
    nc = await nats.connect(nats_server.url)
    worker = EstimatorWorker(nc, EstimatorConfig(compensate_staleness=False, use_dispatches=False, arrival_fill=False))
    await worker.start()
    pub = InstancePublisher(nc, "a", S, kv_events=True)
    task = asyncio.create_task(pub.run())
    yield nc, worker, pub, EstimatorClient(nc, try_timeout_s=1.0)
    await pub.close()
    task.cancel()
    await worker.stop()
    await nc.close()


async def test_mirrored_hit_reaches_the_replay(env) -> None:
    nc, worker, pub, client = env
    await register(nc, "a")
    await register(nc, "b", events=False)
    await wait_until(lambda: worker.store.peek("a") is not None and worker.store.peek("a").prefix.synced)
    prompt = list(range(1000, 1000 + 2000))
    pub.kv_events([KvOp("stored", BlockHasher(SPEC).hashes(prompt[:1600]))])
    snap = snapshot("a")
    pub.snapshot(snap)
    await nc.publish(S.snapshot("b"), encode(snapshot("b")))
    await wait_until(lambda: len(worker.store.peek("a").prefix) == 100 and worker.store.peek("b").raw is not None)
    q = EstimateQuery(id="q", prompt_tokens=10, max_tokens=8)
    cands = [EstimateCandidate(instance=i, tokenizer="tok-a") for i in ("a", "b")]
    reply = await client.estimate(q, cands, tokens={"tok-a": prompt})
    a, b = reply.estimates
    assert (a.prefix, a.prefix_hit_tokens, a.tokens) == ("mirror", 1600, "exact")
    assert (b.prefix, b.prefix_hit_tokens, b.tokens) == ("unsynced", 0, "exact")
    assert (a.block_size, a.kv_blocks_total) == (16, 3999) and a.kv_blocks_used > 0
    # the replay got the hit and the exact length: what libbea gives for them on the same snapshot
    s = libbea.Snapshot.from_dict(snap)
    beta = list(worker.store.peek("a").calibration.beta)
    want = libbea.estimate(s, {"id": "q", "prompt_tokens": 2000, "max_tokens": 8, "prefix_hit_tokens": 1600},
                           beta=beta, default_output_tokens=256)["ttft_s"]
    cold = libbea.estimate(s, {"id": "q", "prompt_tokens": 2000, "max_tokens": 8}, beta=beta,
                           default_output_tokens=256)["ttft_s"]
    assert a.ttft_s == pytest.approx(want, rel=1e-9) and a.ttft_s < cold
    # the packed wire form (the router's) gives the same rows as the list form
    packed = await client.estimate(q, cands, tokens={"tok-a": pack(prompt)})
    assert [(r.prefix, r.prefix_hit_tokens, r.tokens, r.ttft_s) for r in packed.estimates] == [
        (r.prefix, r.prefix_hit_tokens, r.tokens, r.ttft_s) for r in reply.estimates]
    # a packed field that is not whole uint32s: one coded error, the worker keeps serving
    raw = encode({"v": "bear.estimate/1", "query": {"id": "q", "prompt_tokens": 10}, "instances": ["a"],
                  "tokens": {"tok-a": pack(prompt)[:-1]}})
    with pytest.raises(BearError) as bad:
        decode_reply((await nc.request(S.estimate, raw, timeout=2.0)).data)
    assert bad.value.code == ErrorCode.BAD_REQUEST and "4 bytes each" in bad.value.message
    # no token ids: the old rule (the query's estimated length, no hit)
    reply = await client.estimate(q, [EstimateCandidate(instance="a", tokenizer="tok-a")])
    assert (reply.estimates[0].tokens, reply.estimates[0].prefix, reply.estimates[0].prefix_hit_tokens) == (
        "estimated", "no_tokens", 0)


async def test_gap_triggers_resync_answered_by_the_publisher(env) -> None:
    nc, worker, pub, _client = env
    await register(nc, "a")
    await wait_until(lambda: worker.store.peek("a") is not None and worker.store.peek("a").prefix.synced)
    pub.kv_events([KvOp("stored", [1, 2, 3])])
    await wait_until(lambda: len(worker.store.peek("a").prefix) == 3)
    # the publisher's stream moves on without the worker hearing seq 1 (lost on the way)
    pub.kv.mirror.apply(KvEvents(instance="a", epoch=pub.kv.epoch, seq=1, t=0.0, ops=[KvOp("stored", [4])]))
    asked = worker.m.kv_resync_requests._value.get()  # type: ignore[attr-defined]
    pub.kv_events([KvOp("removed", [1])])  # seq 2: the worker sees the gap
    await wait_until(lambda: pub.kv.resyncs >= 1)
    await wait_until(lambda: worker.store.peek("a").prefix.synced and worker.store.peek("a").prefix.seq == 2)
    assert worker.store.peek("a").prefix.counts == pub.kv.mirror.counts == {2: 1, 3: 1, 4: 1}
    assert worker.m.kv_resync_requests._value.get() > asked  # type: ignore[attr-defined]
