"""The estimator's replays of one query: one libbea call for all its BEA candidates, each with
its own exact prompt length and mirrored hit, giving what a single estimate per candidate gives."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bear import libbea
from bear.benchmarks.prefix_micro import candidate_store
from bear.estimator import estimate as est
from bear.estimator.estimate import EstimatorConfig, plan, run_jobs
from bear.prefix.hashing import BlockHasher, HashSpec
from bear.protocol.messages import EstimateCandidate, EstimateQuery
from bear.protocol.token_ids import pack

SPEC = HashSpec(block_size=16)


def test_one_native_call_per_query_with_distinct_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [int(x) for x in np.random.default_rng(3).integers(0, 150_000, 4000)]
    store, t0 = candidate_store(BlockHasher(SPEC).hashes(ids[:3200]), SPEC)  # a holds 200 of the 250 blocks
    cfg, now = EstimatorConfig(), t0 + 0.005
    q = EstimateQuery(id="q", prompt_tokens=10, max_tokens=4)
    cands = [EstimateCandidate(instance=i, tokenizer="tok-bench") for i in ("a", "b", "c")]
    p = plan(q, cands, store, now, cfg, tokens={"tok-bench": pack(ids)})
    assert [(j.prompt_tokens, j.hit) for j in p.jobs] == [(4000, 3200), (4000, 0), (4000, 0)]
    calls: list[int] = []
    real = libbea.estimate_many

    def counted(snaps, *a, **kw):
        calls.append(len(snaps))
        return real(snaps, *a, **kw)

    monkeypatch.setattr(libbea, "estimate_many", counted)
    got = run_jobs(p, cfg)
    assert calls == [3]
    want = [est._one(j, {"id": "q", "prompt_tokens": j.prompt_tokens, "max_tokens": 4,
                         "prefix_hit_tokens": j.hit, "priority": 0}, cfg) for j in p.jobs]
    assert got == want
    assert got[0][0] < got[1][0]  # the hit shortens a's prefill
    assert run_jobs(plan(q, [], store, now, cfg), cfg) == []


def _pooled_snapshot(num_gpu_blocks: int) -> libbea.Snapshot:
    """A busy synthetic pool of ``num_gpu_blocks`` described block by block (bear bench pool's)."""
    from bear.benchmarks.pool import busy_pool_state

    return libbea.Snapshot.from_dict(busy_pool_state(num_gpu_blocks)[0])


def test_a_gpu_sized_table_not_built_yet_is_built_off_the_event_loop() -> None:
    """A state's first estimate builds its tracked table (~10 ms at 50,000 blocks): the worker
    runs such replays in the executor, however few the residents; once built, the state's next
    queries are replayed on the loop again (their replays cost what they touch)."""
    cfg = EstimatorConfig(executor_table_blocks=4096)
    big, small = _pooled_snapshot(6000), _pooled_snapshot(1000)
    assert big.table_blocks > cfg.executor_table_blocks >= small.table_blocks > 0
    assert big.n_running + big.n_waiting <= cfg.executor_residents
    q = EstimateQuery(id="q", prompt_tokens=64, max_tokens=4)

    def plan_of(*snaps: libbea.Snapshot) -> est.Plan:
        return est.Plan(query=q, rows=[], jobs=[SimpleNamespace(snap=s) for s in snaps])  # type: ignore[misc]

    assert not plan_of().off_loop(cfg)
    assert not plan_of(small).off_loop(cfg)
    assert plan_of(big).off_loop(cfg) and plan_of(small, big).off_loop(cfg)
    libbea.estimate(big, {"id": "q", "prompt_tokens": 64, "max_tokens": 4})
    assert big.table_ready and big.table_builds == 1
    assert not plan_of(small, big).off_loop(cfg)
    assert plan_of(small, big).off_loop(EstimatorConfig(executor_residents=0))
