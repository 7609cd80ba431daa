"""The estimator's replays of one query: one libbea call for all its BEA candidates, each with
its own exact prompt length and mirrored hit, giving what a single estimate per candidate gives."""

from __future__ import annotations

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
