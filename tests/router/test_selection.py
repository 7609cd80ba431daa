"""Candidate selection (``bear.router.selection``, issue 45): with k_max at least a model's instance
count it is every instance, in pool order; otherwise it keeps each model's best cheap bound, between
k_min and k_max instances, in pool order; k grows with how close the bounds are; and where the
cheap bound orders the estimates as the replay does, BEAR on the selected instances makes the
decision it makes on every instance (the model it picks, its feasibility, and in the overflow case
the instance)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bear.router.policies import Candidate, QueryContext, make_policy
from bear.router.selection import STAGE_EVERY, STAGE_SELECTED, Cheap, SelectionConfig, choose_k, select

MODELS = ("S", "M", "L")
THETA = {"S": 40_000.0, "M": 12_000.0, "L": 4_000.0}


@st.composite
def pools(draw: st.DrawFn, max_size: int = 40) -> list[Cheap]:
    n = draw(st.integers(1, max_size))
    out = []
    for k in range(n):
        m = draw(st.sampled_from(MODELS))
        out.append(Cheap(f"i{k}", m, draw(st.integers(0, 60_000)), draw(st.integers(1, 8_000)),
                         prefill_tps=THETA[m]))
    return out


def counts(cheap: list[Cheap]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in cheap:
        out[c.model] = out.get(c.model, 0) + 1
    return out


@settings(max_examples=200, deadline=None)
@given(pools(), st.integers(1, 6))
def test_k_max_at_least_every_models_count_is_every_instance(cheap: list[Cheap], k_min: int) -> None:
    k_max = max(k_min, max(counts(cheap).values()))
    s = select(cheap, SelectionConfig(k_max=k_max, k_min=k_min))
    assert s.replay == [c.instance for c in cheap]  # every instance, in pool order
    assert s.stage == STAGE_EVERY and s.considered == s.replayed == len(cheap)


@settings(max_examples=300, deadline=None)
@given(pools(), st.integers(1, 4), st.integers(0, 4))
def test_selection_keeps_each_models_best_bound_between_k_min_and_k_max(cheap: list[Cheap], k_min: int,
                                                                        extra: int) -> None:
    cfg = SelectionConfig(k_max=k_min + extra, k_min=k_min)
    s = select(cheap, cfg)
    kept = set(s.replay)
    assert s.replay == [c.instance for c in cheap if c.instance in kept]  # pool order
    assert s.considered == len(cheap)
    for m, n in counts(cheap).items():
        mine = [c for c in cheap if c.model == m]
        chosen = [c for c in mine if c.instance in kept]
        assert len(chosen) == s.k[m]
        assert (len(chosen) == n) if n <= cfg.k_max else (min(cfg.k_min, n) <= len(chosen) <= cfg.k_max)
        best = min(c.bound for c in mine)
        assert any(c.bound == best for c in chosen)  # the best cheap bound is always replayed
        # every one left out is bounded no better than every one kept
        assert all(o.bound >= max(c.bound for c in chosen) for o in mine if o.instance not in kept) or \
            len(chosen) == n
    assert s.stage == (STAGE_SELECTED if s.replayed < len(cheap) else STAGE_EVERY)


def test_k_follows_how_close_the_bounds_are() -> None:
    cfg = SelectionConfig(k_max=6, k_min=2, slack_s=0.05, rel=0.25)
    assert choose_k([0.1] * 10, cfg) == 6  # indistinguishable: k_max
    assert choose_k([0.1, 0.2, 1.0, 2.0, 3.0, 4.0, 5.0], cfg) == 2  # clearly apart: k_min
    assert choose_k([1.0, 1.1, 1.2, 1.25, 1.5, 2.0, 3.0], cfg) == 4  # within 25 % of the best
    assert choose_k([0.5, 0.9], cfg) == 2  # no more instances than k_max: all
    with pytest.raises(ValueError):
        SelectionConfig(k_max=1, k_min=2)


def test_the_bound_is_eq8_over_the_queue_and_the_uncached_prompt() -> None:
    c = Cheap("a", "S", pending_prefill_tokens=3_000, prompt_tokens=1_200, prefix_hit_bound=200, prefill_tps=4_000.0)
    assert c.bound == pytest.approx((3_000 + 1_000) / 4_000.0)
    assert Cheap("b", "S", 0, 10, prefill_tps=0.0).bound == float("inf")  # θ unknown: never preferred


def candidates(cheap: list[Cheap], slowdown: float, util: dict[str, float]) -> list[Candidate]:
    """Candidates whose replayed TTFT orders the instances as the cheap bound does (a monotone
    function of it), the utility per model."""
    return [Candidate(c.instance, c.model, acc=util[c.model], ttft=0.01 + slowdown * c.bound, prompt_tokens=c.prompt_tokens,
                      prefill_tps=c.prefill_tps) for c in cheap]


@settings(max_examples=300, deadline=None)
@given(pools(), st.floats(0.5, 3.0), st.floats(0.05, 2.0), st.integers(0, 1),
       st.permutations([0.3, 0.6, 0.9]))
def test_bear_on_the_selection_decides_as_on_every_instance(cheap: list[Cheap], slowdown: float, target: float,
                                                            overflow: int, accs: list[float]) -> None:
    # one prompt length per model (the predictor's count), as in bear eval
    plen = {m: 1 + (sum(map(ord, m)) * 997) % 6_000 for m in MODELS}
    cheap = [dataclasses.replace(c, prompt_tokens=plen[c.model]) for c in cheap]
    util = dict(zip(MODELS, accs, strict=True))
    every = candidates(cheap, slowdown, util)
    policy = make_policy("bear", overflow=overflow)
    q = QueryContext("q", target, lam=0.0)
    s = select(cheap, SelectionConfig(k_max=3, k_min=1))
    kept = set(s.replay)
    d_all = policy.decide(q, every)
    d_sel = policy.decide(q, [c for c in every if c.instance in kept])
    assert d_sel.feasible == d_all.feasible
    assert d_sel.candidate.model == d_all.candidate.model
    if not d_all.feasible:  # the overflow / least-TTFT rule picks by the bound's own order: the same instance
        assert d_sel.candidate.instance == d_all.candidate.instance
    if d_all.candidate.instance in kept:  # the every-instance choice, when selected, is still the choice
        assert d_sel.candidate.instance == d_all.candidate.instance


def test_record_says_which_stage_decided() -> None:
    cheap = [Cheap(f"i{k}", "S", 1_000 * k, 100, prefill_tps=10_000.0) for k in range(10)]
    s = select(cheap, SelectionConfig(k_max=4, k_min=2))
    assert s.record() == {"stage": STAGE_SELECTED, "considered": 10, "replayed": 2, "k": {"S": 2}}
    assert s.replay == ["i0", "i1"]
