"""Property tests over random valid snapshots (hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bear import libbea

BETA = [1e-3, 1e-5, 1e-7, 1e-9]
# a roofline (two eq. 12 lines, the larger one counts): its kink at ≈ 17 tokens a step, and the
# lines cross inside decode stretches as contexts grow (the folds' closed form splits there)
ROOF = [*BETA, 5e-4, 4e-5, 5e-8, 1e-9]
BETAS = pytest.mark.parametrize("beta", [BETA, ROOF], ids=["eq12", "roofline"])


@st.composite
def states(draw, preemption_possible: bool = True):
    block = draw(st.sampled_from([1, 4, 16, 128]))
    budget = draw(st.integers(8, 4096))
    max_seqs = draw(st.integers(1, 40))
    mml = draw(st.integers(256, 8192))
    chunked = draw(st.booleans())
    if not chunked:
        budget = max(budget, mml)
    lpt = draw(st.sampled_from([0, 0, 16, 200]))
    running, lengths, used = [], {}, 0
    for k in range(draw(st.integers(0, min(max_seqs, 24)))):
        p = draw(st.integers(1, mml // 2))
        if draw(st.booleans()):  # decoding
            o = draw(st.integers(1, 64))
            c = p + o - 1
        else:  # mid-prefill
            o = 0
            c = draw(st.integers(0, p - 1))
        blocks = -(-max(c, 1) // block)
        used += blocks
        rid = f"r{k}"
        running.append({"id": rid, "prompt_tokens": p, "computed_tokens": c, "output_tokens": o,
                        "max_tokens": draw(st.integers(o + 1, o + 200)), "blocks": blocks,
                        "exclusive_blocks": blocks, "arrival": float(k), "priority": draw(st.integers(0, 3))})
        lengths[rid] = draw(st.integers(1, 300))
    waiting = []
    for k in range(draw(st.integers(0, 12))):
        rid = f"w{k}"
        waiting.append({"id": rid, "prompt_tokens": draw(st.integers(1, mml // 2)), "computed_tokens": 0,
                        "output_tokens": 0, "max_tokens": draw(st.integers(1, 200)), "blocks": 0,
                        "exclusive_blocks": 0, "arrival": 100.0 + k, "priority": draw(st.integers(0, 3))})
        lengths[rid] = draw(st.integers(1, 300))
    slack = draw(st.integers(0, 50)) if preemption_possible else 100_000
    need_q = -(-mml // block)
    total = used + max(slack, need_q + 1) + 1
    cfg = {"max_num_batched_tokens": budget, "max_num_scheduled_tokens": budget, "max_num_seqs": max_seqs,
           "long_prefill_token_threshold": lpt, "enable_chunked_prefill": chunked,
           "policy": draw(st.sampled_from(["fcfs", "priority"])) if preemption_possible else "fcfs",
           "block_size": block, "num_gpu_blocks": total, "max_model_len": mml, "enable_prefix_caching": False,
           "async_scheduling": draw(st.booleans()) if preemption_possible else False,
           "scheduler_reserve_full_isl": True, "watermark_blocks": 0}
    snap = {"schema": "bear.snapshot/1", "instance": "h", "seq": 1, "time": 10.0, "config": cfg,
            "free_blocks": total - 1 - used, "running": running, "waiting": waiting, "inflight": None}
    query = {"id": "Q", "prompt_tokens": draw(st.integers(1, mml // 2)), "max_tokens": 16}
    return snap, query, lengths


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(states())
def test_step_invariants(case) -> None:
    snap_d, query, lengths = case
    cfg = snap_d["config"]
    s = libbea.Snapshot.from_dict(snap_d)
    res = libbea.estimate(s, query, beta=BETA, lengths=lengths, trace=True, max_steps=20000)
    assert res["status"] in ("ok", "unschedulable")
    for step, state in zip(res["batches"], res["steps"], strict=True):
        assert sum(step.values()) == state["tokens"] <= cfg["max_num_scheduled_tokens"]
        assert all(n >= 1 for n in step.values())
        assert state["running"] <= cfg["max_num_seqs"]
        assert state["free_blocks"] >= 0


@BETAS
@SETTINGS
@given(states())
def test_deterministic_and_collapse_exact(beta, case) -> None:
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    a = libbea.estimate(s, query, beta=beta, lengths=lengths)
    b = libbea.estimate(libbea.Snapshot.from_dict(snap_d), query, beta=beta, lengths=lengths)
    assert a == b
    c = libbea.estimate(s, query, beta=beta, lengths=lengths, collapse=False)
    assert c["n_batches"] == a["n_batches"] and c["status"] == a["status"]
    if a["status"] == "ok":
        assert abs(c["ttft_s"] - a["ttft_s"]) <= 1e-9 * max(1.0, a["ttft_s"])


@st.composite
def large_states(draw):
    """Hundreds of residents (built from a drawn seed and shape): long waiting queues behind
    max_num_seqs, tight KV pools that force preemption, prefix hits, residents already at their
    stop, all the shapes the fast paths shortcut at large populations."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    block = draw(st.sampled_from([1, 16, 16, 128]))
    budget = draw(st.sampled_from([256, 2048, 2048, 8192]))
    mml = draw(st.sampled_from([4096, 32768]))
    n_running = draw(st.integers(0, 1100))
    n_waiting = draw(st.integers(0, 600))
    regime = draw(st.sampled_from(["admission", "kv", "roomy"]))
    max_seqs = max(1, n_running + (rng.randint(0, 8) if regime == "admission" else rng.randint(0, 600)))
    p_lo, p_hi = draw(st.sampled_from([(1024, 1024), (16, 3000), (1, 200)]))
    p_hi = min(p_hi, mml // 2)
    p_lo = min(p_lo, p_hi)
    running, lengths, used = [], {}, 0
    for k in range(n_running):
        p = rng.randint(p_lo, p_hi)
        if rng.random() < 0.9:  # decoding
            o = rng.randint(1, 400)
            c = p + o - 1
        else:  # mid-prefill
            o, c = 0, rng.randint(0, p - 1)
        blocks = -(-max(c, 1) // block)
        used += blocks
        rid = f"r{k}"
        max_tokens = o if rng.random() < 0.01 else o + rng.randint(1, 600)  # a few already at their stop
        running.append({"id": rid, "prompt_tokens": p, "computed_tokens": c, "output_tokens": o,
                        "max_tokens": max(1, max_tokens), "blocks": blocks, "exclusive_blocks": blocks,
                        "arrival": float(k), "priority": rng.randint(0, 3)})
        if rng.random() < 0.95:
            lengths[rid] = o + rng.randint(1, 600)
    prefix = draw(st.booleans())
    waiting = []
    for k in range(n_waiting):
        rid = f"w{k}"
        p = rng.randint(p_lo, p_hi)
        w = {"id": rid, "prompt_tokens": p, "computed_tokens": 0, "output_tokens": 0,
             "max_tokens": rng.randint(1, 800), "blocks": 0, "exclusive_blocks": 0,
             "arrival": 1000.0 + k, "priority": rng.randint(0, 3)}
        if prefix and rng.random() < 0.5:
            w["prefix_hit_tokens"] = rng.randint(0, p)
        waiting.append(w)
        lengths[rid] = rng.randint(1, 800)
    need_q = -(-mml // block)
    slack = rng.randint(need_q + 1, need_q + 200) if regime == "kv" else 10 * need_q + 200_000
    total = used + slack + 1
    cfg = {"max_num_batched_tokens": budget, "max_num_scheduled_tokens": budget, "max_num_seqs": max_seqs,
           "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 0, 256])),
           "enable_chunked_prefill": True, "policy": draw(st.sampled_from(["fcfs", "fcfs", "priority"])),
           "block_size": block, "num_gpu_blocks": total, "max_model_len": mml, "enable_prefix_caching": prefix,
           "async_scheduling": False, "scheduler_reserve_full_isl": True, "watermark_blocks": 0}
    snap = {"schema": "bear.snapshot/1", "instance": "big", "seq": 1, "time": 10.0, "config": cfg,
            "free_blocks": total - 1 - used, "running": running, "waiting": waiting, "inflight": None}
    query = {"id": "Q", "prompt_tokens": rng.randint(p_lo, p_hi), "max_tokens": 16}
    return snap, query, lengths


LARGE = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _assert_same(fast: dict, slow: dict) -> None:
    assert fast["n_batches"] == slow["n_batches"] and fast["status"] == slow["status"]
    if slow["status"] == "ok":
        assert abs(fast["ttft_s"] - slow["ttft_s"]) <= 1e-9 * max(1.0, slow["ttft_s"])


@BETAS
@LARGE
@given(large_states())
def test_large_populations_fast_equals_stepwise(beta, case) -> None:
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    fast = libbea.estimate(s, query, beta=beta, lengths=lengths, max_steps=300_000)
    slow = libbea.estimate(s, query, beta=beta, lengths=lengths, collapse=False, max_steps=300_000)
    _assert_same(fast, slow)
    again = libbea.estimate(s, query, beta=beta, lengths=lengths, max_steps=300_000)
    assert again == fast  # the snapshot's prepared decode group is reused unchanged


@BETAS
@LARGE
@given(large_states(), st.integers(1, 400))
def test_aged_estimates_fast_equal_stepwise(beta, case, age_units) -> None:
    # The residents age on the fast path (one step at a time) when collapse is on, by the exact
    # scheduler when it is off: the same steps, the same TTFT.
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    age = age_units * 1.37e-3 + 1.1e-7  # off the round numbers batch times are made of
    fast = libbea.estimate(s, query, beta=beta, lengths=lengths, age_s=age, max_steps=300_000)
    slow = libbea.estimate(s, query, beta=beta, lengths=lengths, age_s=age, collapse=False, max_steps=300_000)
    _assert_same(fast, slow)


@BETAS
@SETTINGS
@given(states(preemption_possible=False), st.integers(1, 200))
def test_small_aged_estimates_fast_equal_stepwise(beta, case, age_units) -> None:
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    age = age_units * 7.3e-4 + 1.1e-7
    fast = libbea.estimate(s, query, beta=beta, lengths=lengths, age_s=age, max_steps=20000)
    slow = libbea.estimate(s, query, beta=beta, lengths=lengths, age_s=age, collapse=False, max_steps=20000)
    _assert_same(fast, slow)


def test_resident_at_its_stop_finishes_on_its_next_token() -> None:
    # A decoding resident whose output already reached max_tokens stops with its next token; the
    # decode group used to keep it forever (no finish: "unschedulable" after 2e6 steps).
    a = {"id": "A", "prompt_tokens": 100, "computed_tokens": 109, "output_tokens": 10, "max_tokens": 5,
         "blocks": 7, "exclusive_blocks": 7, "arrival": 0.0}
    b = {"id": "B", "prompt_tokens": 100, "computed_tokens": 102, "output_tokens": 3, "max_tokens": 50,
         "blocks": 7, "exclusive_blocks": 7, "arrival": 1.0}
    w = {"id": "W", "prompt_tokens": 3000, "computed_tokens": 0, "output_tokens": 0, "max_tokens": 100,
         "blocks": 0, "exclusive_blocks": 0, "arrival": 2.0}
    cfg = {"max_num_batched_tokens": 2048, "max_num_seqs": 2, "block_size": 16, "num_gpu_blocks": 100_000,
           "max_model_len": 32768}
    snap = {"config": cfg, "free_blocks": 99_000, "running": [a, b], "waiting": [w]}
    s = libbea.Snapshot.from_dict(snap)
    lengths = {"A": 20, "B": 40, "W": 5}
    fast = libbea.estimate(s, {"prompt_tokens": 50}, beta=[1.0, 0, 0, 0], lengths=lengths)
    slow = libbea.estimate(s, {"prompt_tokens": 50}, beta=[1.0, 0, 0, 0], lengths=lengths, collapse=False)
    assert fast == slow == {"ttft_s": 8.0, "n_batches": 8, "status": "ok"}


def test_aged_real_cases_fast_equal_stepwise(cases: list[dict]) -> None:
    beta = [2.4e-3, 1.2e-5, 3.6e-7, 5.5e-9]
    for c in cases:
        s = libbea.Snapshot.from_dict(c["snapshot"])
        if s.async_scheduling:
            continue
        for age in (0.0031, 0.0427, 0.219):
            fast = libbea.estimate(s, c["request"], beta=beta, lengths=c["output_lengths"], age_s=age)
            slow = libbea.estimate(s, c["request"], beta=beta, lengths=c["output_lengths"], age_s=age, collapse=False)
            _assert_same(fast, slow)


@SETTINGS
@given(states(preemption_possible=False), st.integers(1, 4000), st.integers(1, 300))
def test_adding_a_resident_ahead_never_lowers_ttft(case, extra_prompt, extra_len) -> None:
    snap_d, query, lengths = case
    cfg = snap_d["config"]
    cfg["long_prefill_token_threshold"] = 0  # the nobody-to-starve switch is not monotone (§16)
    extra_prompt = min(extra_prompt, cfg["max_model_len"] // 2)
    base = libbea.estimate(libbea.Snapshot.from_dict(snap_d), query, beta=BETA, lengths=lengths)
    more = dict(snap_d)
    more["waiting"] = [*snap_d["waiting"], {"id": "extra", "prompt_tokens": extra_prompt, "computed_tokens": 0,
                                            "output_tokens": 0, "max_tokens": 300, "blocks": 0,
                                            "exclusive_blocks": 0, "arrival": 500.0}]
    after = libbea.estimate(libbea.Snapshot.from_dict(more), query, beta=BETA, lengths={**lengths, "extra": extra_len})
    assert after["ttft_s"] >= base["ttft_s"] - 1e-12
    assert after["n_batches"] >= base["n_batches"]


@LARGE
@given(large_states())
def test_output_lengths_by_index_equal_validating_path(case) -> None:
    # {id: int} goes through the residents' id index; integral floats take the validating path.
    snap_d, query, lengths = case
    a = libbea.Snapshot.from_dict(snap_d)
    a.set_output_lengths({**lengths, "not-a-resident": 3})
    b = libbea.Snapshot.from_dict(snap_d)
    b.set_output_lengths({k: float(v) for k, v in lengths.items()})
    ra = libbea.estimate(a, query, beta=BETA, max_steps=300_000)
    assert ra == libbea.estimate(b, query, beta=BETA, max_steps=300_000)
    a.set_output_lengths(lengths)  # unchanged predictions: the prepared form is kept
    assert libbea.estimate(a, query, beta=BETA, max_steps=300_000) == ra


@SETTINGS
@given(states(), st.sampled_from([0.05, 0.3, 0.8]), st.integers(0, 60))
def test_length_draws_shortcut_is_exact(case, sigma, age_units) -> None:
    # Where no resident can reach its end (point or drawn) before the query's first token, the
    # draws are skipped for the point replay: the same estimate as replaying every draw.
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    age = 0.0 if snap_d["config"]["async_scheduling"] else age_units * 1.37e-3
    kw = {"beta": BETA, "lengths": lengths, "length_sigma": sigma, "length_draws": 7, "age_s": age,
          "max_steps": 20000}
    short = libbea.estimate(s, query, **kw)
    full = libbea.estimate(s, query, draw_shortcut=False, **kw)
    assert short["status"] == full["status"] and short["n_batches"] == full["n_batches"]
    if full["status"] == "ok":
        assert abs(short["ttft_s"] - full["ttft_s"]) <= 1e-9 * max(1.0, full["ttft_s"])
    assert short == libbea.estimate(libbea.Snapshot.from_dict(snap_d), query, **kw)  # deterministic


@BETAS
@LARGE
@given(large_states(), st.sampled_from([0.05, 0.6]))
def test_length_draws_shortcut_is_exact_at_large_populations(beta, case, sigma) -> None:
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    kw = {"beta": beta, "lengths": lengths, "length_sigma": sigma, "length_draws": 5, "max_steps": 300_000}
    _assert_same(libbea.estimate(s, query, **kw), libbea.estimate(s, query, draw_shortcut=False, **kw))
