"""Routing policies: filter → score → pick on hand-built candidates."""

from __future__ import annotations

import math

import pytest

from bear.router.policies import BASELINES, PREFIX_BASELINES, REGISTRY, Candidate, QueryContext, make_policy


def pool() -> list[Candidate]:
    # small: cheap, weak, idle; mid: good, a little busy; big: best, expensive, congested.
    return [
        Candidate("small", "Qwen3-0.6B", acc=0.40, cost=10.0, out_len=300, ttft=0.05, ttft_prefill=0.04,
                  n_running=2, n_waiting=0, throughput_rps=8.0, tpot=0.005, prefill_tps=50_000,
                  pending_prefill_tokens=0, pending_decode_tokens=200, observed_ttft_p50=0.05, observed_ttft_p90=0.08,
                  observed_ttft_p95=0.09, observed_tpot_p90=0.006),
        Candidate("mid", "Qwen3-8B", acc=0.80, cost=60.0, out_len=300, ttft=0.25, ttft_prefill=0.10,
                  n_running=10, n_waiting=1, throughput_rps=4.0, tpot=0.012, prefill_tps=20_000,
                  pending_prefill_tokens=2000, pending_decode_tokens=3000, observed_ttft_p50=0.2, observed_ttft_p90=0.4,
                  observed_ttft_p95=0.5, observed_tpot_p90=0.014),
        Candidate("big", "Qwen3-32B", acc=0.92, cost=150.0, out_len=300, ttft=0.90, ttft_prefill=0.15,
                  n_running=20, n_waiting=6, throughput_rps=2.0, tpot=0.030, prefill_tps=8_000,
                  pending_prefill_tokens=8000, pending_decode_tokens=9000, observed_ttft_p50=0.6, observed_ttft_p90=1.5,
                  observed_ttft_p95=1.9, observed_tpot_p90=0.035),
    ]


Q = QueryContext("q1", ttft_target=0.3, lam=5e-4)


def pick(name: str, q: QueryContext = Q, cands: list[Candidate] | None = None, **kw) -> str:
    return make_policy(name, **kw).decide(q, cands or pool()).candidate.instance


def test_registry_has_design_policies() -> None:
    assert {"bear", "bear-lagrange", "prefill-throughput", *BASELINES, *PREFIX_BASELINES} == set(REGISTRY)
    with pytest.raises(ValueError):
        make_policy("nope")


def test_bear_best_feasible_utility() -> None:
    assert pick("bear") == "mid"  # big is better but predicted to miss 300 ms
    assert pick("bear", QueryContext("q", ttft_target=1.0)) == "big"
    # nothing feasible: least predicted TTFT
    assert pick("bear", QueryContext("q", ttft_target=0.01)) == "small"
    d = make_policy("bear").decide(QueryContext("q", ttft_target=0.01), pool())
    assert not d.feasible


def test_bear_overflow_sends_an_infeasible_query_where_its_prefill_costs_least() -> None:
    """overflow=1: with no instance feasible, the least uncached prompt / θ wins, not the least
    predicted TTFT; a feasible instance is still chosen by utility."""
    cands = pool()
    for c in cands:
        c.prompt_tokens = 12_000
    cands[0].ttft, cands[1].ttft, cands[2].ttft = 3.0, 2.0, 2.5  # small is the latest to start...
    late = QueryContext("q", ttft_target=0.1)
    assert pick("bear", late, cands, overflow=0) == "mid"  # the paper: the soonest start
    assert pick("bear", late, cands) == "small"  # the default: the overflow rule
    assert pick("bear", late, cands, overflow=1) == "small"  # ...but its prefill costs least (12k / 50k tok/s)
    cands[1].prefix_hit_tokens = 11_900  # mid holds the prompt: 100 tokens to compute there
    assert pick("bear", late, cands, overflow=1) == "mid"
    assert pick("bear", QueryContext("q", ttft_target=1.0), pool(), overflow=1) == "big"
    with pytest.raises(ValueError):
        make_policy("bear", overflow=2)


def test_bear_skips_unhealthy_and_fails_loudly_when_none() -> None:
    cands = pool()
    cands[1].healthy = False
    assert pick("bear", cands=cands) == "small"
    for c in cands:
        c.healthy = False
    with pytest.raises(ValueError):
        make_policy("bear").decide(Q, cands)


def test_prefill_throughput_rule_trusts_eq8() -> None:
    # eq. 8 thinks big meets 300 ms (0.15 s), BEA knows it does not.
    assert pick("prefill-throughput") == "big"


def test_lagrange_trades_utility_for_latency() -> None:
    assert pick("bear-lagrange", delta=0.0) == "big"  # δ = 0: latency-agnostic
    assert pick("bear-lagrange", delta=100.0) == "small"  # δ → ∞: fastest
    assert pick("bear-lagrange", delta=0.5) == "mid"


def test_baselines() -> None:
    assert pick("latency-agnostic") == "big"
    assert pick("shortest-queue") == "small"
    assert pick("lmdeploy") == "small"  # 2/8 < 11/4 < 26/2
    assert pick("semantic-router") == "small"
    rr = make_policy("round-robin")
    assert [rr.decide(Q, pool()).candidate.instance for _ in range(4)] == ["big", "mid", "small", "big"]
    assert pick("score", gamma=0.0) == "big"
    assert pick("score", gamma=1.0) == "small"  # big: 0.92-0.075-(1+9)=... heavily penalised
    assert pick("routebalance", w_latency=0.0, w_cost=0.0) == "big"
    assert pick("routebalance", w_latency=2.0) == "small"


def test_semantic_router_as_vllm_sr_scores() -> None:
    """mean(TPOT_p90 / min, TTFT_p95 / min) over the candidates with data, lowest wins; without
    data a candidate is skipped; with none, the first candidate."""
    cands = pool()
    cands[0].observed_ttft_p95 = 0.40  # small: slow to first token, fast per token
    cands[1].observed_ttft_p95, cands[1].observed_tpot_p90 = 0.20, 0.020
    # small: (0.006/0.006 + 0.40/0.20)/2 = 1.5; mid: (0.020/0.006 + 1)/2 = 2.17; big: worse
    assert pick("semantic-router", cands=cands) == "small"
    scores = make_policy("semantic-router").decide(Q, cands).scores
    assert scores["small"] == pytest.approx(-1.5) and scores["mid"] == pytest.approx(-(0.020 / 0.006 + 1) / 2)
    cands[0].observed_tpot_p90 = 0.0  # no TPOT seen at small: skipped, not preferred
    assert pick("semantic-router", cands=cands) == "mid"
    for c in cands:
        c.observed_ttft_p95 = c.observed_tpot_p90 = 0.0
    assert pick("semantic-router", cands=cands) == "small"  # no data anywhere: the first


def test_utility_eq4() -> None:
    c = pool()[0]
    assert c.utility(5e-4) == pytest.approx(0.40 - 5e-4 * 10.0)
    assert math.isinf(Candidate("x", "m").ttft)
