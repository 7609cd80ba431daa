"""Property tests over random valid snapshots (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bear import libbea

BETA = [1e-3, 1e-5, 1e-7, 1e-9]


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


@SETTINGS
@given(states())
def test_deterministic_and_collapse_exact(case) -> None:
    snap_d, query, lengths = case
    s = libbea.Snapshot.from_dict(snap_d)
    a = libbea.estimate(s, query, beta=BETA, lengths=lengths)
    b = libbea.estimate(libbea.Snapshot.from_dict(snap_d), query, beta=BETA, lengths=lengths)
    assert a == b
    c = libbea.estimate(s, query, beta=BETA, lengths=lengths, collapse=False)
    assert c["n_batches"] == a["n_batches"] and c["status"] == a["status"]
    if a["status"] == "ok":
        assert abs(c["ttft_s"] - a["ttft_s"]) <= 1e-9 * max(1.0, a["ttft_s"])


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
