"""The estimator keys the query — and the dispatches queued ahead of it — by their prompts'
block names where the instance's snapshot describes its pool block by block (tracked_blocks),
so that libbea finds their hits in the pool itself; elsewhere nothing changes."""

from __future__ import annotations

import numpy as np

from bear.estimator.estimate import EstimatorConfig, plan
from bear.estimator.state import StateStore
from bear.instance.delta import encode_delta
from bear.prefix.hashing import BlockHasher, HashSpec
from bear.prefix.tracked_pool import keys_of
from bear.protocol.codec import pack
from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery, InstanceRecord, PrefixCacheInfo
from bear.protocol.token_ids import pack as pack_ids

CONFIG = {"max_num_batched_tokens": 256, "max_num_seqs": 8, "block_size": 16, "num_gpu_blocks": 64,
          "max_model_len": 4096, "enable_prefix_caching": True}


def _snapshot(seq: int, tracked: bool) -> dict:
    snap = {"schema": "bear.snapshot/1", "instance": "a", "model": "m", "seq": seq, "time": 100.0,
            "config": CONFIG, "free_blocks": 60, "running": [], "waiting": []}
    if tracked:
        snap["tracked_blocks"] = [0, 1]
        snap["tracked_keys"] = [5, 6]
    return snap


def _store(tracked: bool) -> StateStore:
    store = StateStore()
    st = store.get("a")
    st.on_registry(InstanceRecord(id="a", model="m", base_url="http://x/v1", heartbeat=100.0, config=CONFIG,
                                  tokenizer="tok", prefix_cache=PrefixCacheInfo(block_size=16, events=True)))
    store.offer("a", pack(_snapshot(1, tracked)), 100.0)
    return store


def test_query_and_dispatches_ahead_are_keyed_only_for_a_described_pool() -> None:
    rng = np.random.default_rng(3)
    query_ids = [int(x) for x in rng.integers(0, 50_000, 100)]
    ahead_ids = [int(x) for x in rng.integers(0, 50_000, 40)]
    want_q = keys_of(BlockHasher(HashSpec(block_size=16)).hashes(query_ids, 100 // 16))
    want_a = keys_of(BlockHasher(HashSpec(block_size=16)).hashes(ahead_ids, 40 // 16))
    for tracked in (True, False):
        store = _store(tracked)
        st = store.get("a")
        st.on_dispatch(Dispatch(query_id="d", request_id="d", prompt_tokens=40, predicted_output_tokens=4,
                                t=100.5, tokens=pack_ids(ahead_ids)), 100.5)
        p = plan(EstimateQuery(id="q", prompt_tokens=100, max_tokens=4),
                 [EstimateCandidate(instance="a", tokenizer="tok")], store, 100.6, EstimatorConfig(),
                 tokens={"tok": pack_ids(query_ids)})
        (job,) = p.jobs
        (ahead,) = job.inputs.ahead
        assert ahead["id"] == "d"  # named in traces as the engine will know it
        # the row tells the router whether its dispatches there should carry the prompt's ids
        assert p.rows[0].pool_keyed is tracked
        if tracked:
            assert job.keys == want_q and len(want_q) == 6
            assert ahead["block_keys"] == want_a and len(want_a) == 2
        else:
            assert job.keys is None and "block_keys" not in ahead
    # a query without token ids has no keys to give, described pool or not
    p = plan(EstimateQuery(id="q", prompt_tokens=100, max_tokens=4), [EstimateCandidate(instance="a")],
             _store(True), 100.6, EstimatorConfig())
    assert p.jobs[0].keys is None


def test_a_described_pool_goes_out_in_full() -> None:
    """Deltas do not carry the table: a state that describes its pool is never a delta."""
    assert encode_delta(_snapshot(1, False), _snapshot(2, False)) is not None
    assert encode_delta(_snapshot(1, False), _snapshot(2, True)) is None


def test_dispatches_carry_the_ids_only_where_the_pool_is_described() -> None:
    from bear.protocol.messages import EstimateRow
    from bear.router.candidates import dispatch_tokens

    ids = {"tok": pack_ids([1, 2, 3])}
    keyed, counted = EstimateRow(instance="a", pool_keyed=True), EstimateRow(instance="a")
    assert dispatch_tokens(ids, "tok", keyed) == ids["tok"]
    assert dispatch_tokens(ids, "tok", counted) is None  # no replay reads them there
    assert dispatch_tokens(ids, "tok", None) is None  # no estimate for the instance
    assert dispatch_tokens(ids, None, keyed) is None and dispatch_tokens(ids, "other", keyed) is None


def test_dispatches_ahead_without_ids_are_counted_where_the_pool_is_described() -> None:
    """A dispatch from a router that did not tokenise has no keys: at a described pool it is
    replayed by counts, and the plan counts it (``bear_estimator_unkeyed_dispatches_total``)."""
    for tracked in (True, False):
        store = _store(tracked)
        st = store.get("a")
        st.on_dispatch(Dispatch(query_id="k", request_id="k", prompt_tokens=40, predicted_output_tokens=4,
                                t=100.4, tokens=pack_ids(list(range(40)))), 100.4)
        st.on_dispatch(Dispatch(query_id="u", request_id="u", prompt_tokens=40, predicted_output_tokens=4,
                                t=100.5), 100.5)
        p = plan(EstimateQuery(id="q", prompt_tokens=100, max_tokens=4),
                 [EstimateCandidate(instance="a", tokenizer="tok")], store, 100.6, EstimatorConfig(),
                 tokens={"tok": pack_ids(list(range(100)))})
        assert [a["id"] for a in p.jobs[0].inputs.ahead] == ["k", "u"]
        assert p.unkeyed_ahead == (1 if tracked else 0)
