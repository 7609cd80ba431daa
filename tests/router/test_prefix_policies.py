"""The prefix-locality baselines on hand-built candidates: llm-d's default scorer set, Dynamo's
KV-router cost and sticky sessions, each from the same Candidate fields build_candidates fills."""

from __future__ import annotations

from bear.router.policies import Candidate, QueryContext, make_policy
from bear.router.policies.prefix_locality import DynamoKvPolicy, SessionAffinityPolicy


def cand(name: str, *, hit: int = 0, waiting: int = 0, used: int = 0, pending: int = 0) -> Candidate:
    return Candidate(name, "m", prompt_tokens=1600, prefix_hit_tokens=hit, n_waiting=waiting, block_size=16,
                     kv_blocks_used=used, kv_blocks_total=1000, pending_prefill_tokens=pending)


Q = QueryContext("q", ttft_target=1.0)


def test_llmd_weighs_prefix_3_against_queue_2_and_kv_2() -> None:
    p = make_policy("llm-d")
    # a, full hit but the longest queue and half the cache in use: 2·0 + 2·0.5 + 3·(99/100) = 3.97
    # b, no hit, idle, empty cache: 2·1 + 2·1 + 0 = 4.0 → b
    a, b = cand("a", hit=1584, waiting=4, used=500), cand("b")
    s = p.score(Q, [a, b])
    assert abs(s[0] - (1.0 + 3 * 99 / 100)) < 1e-9 and s[1] == 4.0
    assert p.decide(Q, [a, b]).candidate.instance == "b"
    a.kv_blocks_used = 0  # with an empty cache the hit wins
    assert p.decide(Q, [a, b]).candidate.instance == "a"


def test_llmd_breaks_ties_at_random_but_reproducibly() -> None:
    cs = [cand("a"), cand("b"), cand("c")]
    picks = [make_policy("llm-d", seed=3).decide(Q, cs).candidate.instance for _ in range(3)]
    assert len(set(picks)) == 1
    p = make_policy("llm-d", seed=1)
    assert len({p.decide(Q, cs).candidate.instance for _ in range(30)}) > 1


def test_dynamo_cost_credits_cached_blocks() -> None:
    p = DynamoKvPolicy()
    a = cand("a", hit=1280, used=300, pending=800)  # (800 + 1600 − 1280)/16 + 300 + 100 = 470
    b = cand("b", used=100, pending=0)  # 1600/16 + 100 + 100 = 300
    assert p.cost(a) == 470 and p.cost(b) == 300
    assert make_policy("dynamo-kv").decide(Q, [a, b]).candidate.instance == "b"
    a.kv_blocks_used = 100
    assert make_policy("dynamo-kv").decide(Q, [a, b]).candidate.instance == "a"  # 270 < 300


def test_session_affinity_is_sticky_and_moves_only_the_lost_instance() -> None:
    cs = [cand(n) for n in "abcd"]
    p = make_policy("session-affinity")
    where = {s: p.decide(QueryContext("q", 1.0, session=f"s{s}"), cs).candidate.instance for s in range(200)}
    assert len(set(where.values())) == 4  # spread over the pool
    again = {s: p.decide(QueryContext("q2", 1.0, session=f"s{s}"), cs).candidate.instance for s in range(200)}
    assert again == where
    fewer = [c for c in cs if c.instance != "b"]
    moved = {s for s in range(200) if p.decide(QueryContext("q", 1.0, session=f"s{s}"), fewer).candidate.instance
             != where[s]}
    assert moved == {s for s, i in where.items() if i == "b"}
    busy = [cand("a", waiting=3), cand("b", waiting=1)]
    busy[0].n_running = busy[1].n_running = 0
    assert p.decide(Q, busy).candidate.instance == "b"  # no session: the shortest queue
    assert SessionAffinityPolicy.weight("s", "a") == SessionAffinityPolicy.weight("s", "a")
