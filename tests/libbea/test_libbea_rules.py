"""Each scheduling rule of docs/replay-rules.md §15 on small hand-worked states."""

from __future__ import annotations

import math

import pytest

from bear import libbea

from bea_helpers import decoding, req, snapshot

UNIT = [1.0, 0.0, 0.0, 0.0]  # every batch costs 1 s: TTFT counts batches


def run(snap: dict, query: dict, lengths: dict | None = None, **kw) -> dict:
    s = libbea.Snapshot.from_dict(snap)
    return libbea.estimate(s, query, beta=kw.pop("beta", UNIT), lengths=lengths or {}, trace=True, **kw)


def q(p: int, **kw) -> dict:
    return {"id": "T", "prompt_tokens": p, "max_tokens": 100, **kw}


def test_worked_example_11_4_sync() -> None:
    # §11.4: A decodes, X is mid-prefill, T (3000 tokens) arrives. B=16, budget 2048, free 1000.
    a = req("A", 100, c=109, o=10, blocks=7)
    x = req("X", 5000, c=2048, blocks=128)
    res = run(snapshot([a, x], free=1000), q(3000), {"A": 500, "X": 500})
    assert res["batches"] == [{"A": 1, "X": 2047}, {"A": 1, "X": 905, "T": 1142}, {"A": 1, "X": 1, "T": 1858}]
    assert [s["free_blocks"] for s in res["steps"]] == [872, 743, 627]
    assert res["ttft_s"] == pytest.approx(3.0)


def test_worked_example_async_has_same_batches_here() -> None:
    # No batch in flight at the snapshot: async schedules the same compositions (placeholders keep
    # A decoding every step), and T's token comes at the end of the third batch.
    a = req("A", 100, c=109, o=10, blocks=7)
    x = req("X", 5000, c=2048, blocks=128)
    res = run(snapshot([a, x], free=1000, async_scheduling=True), q(3000), {"A": 500, "X": 500})
    assert res["batches"] == [{"A": 1, "X": 2047}, {"A": 1, "X": 905, "T": 1142}, {"A": 1, "X": 1, "T": 1858}]
    assert res["ttft_s"] == pytest.approx(3.0)


def test_async_inflight_batch_delays_admission_by_one_schedule() -> None:
    # R's in-flight step produces its 5th (last predicted) token; the next schedule() already ran
    # before that update, so R takes a wasted slot and T (max_num_seqs 1) waits one more batch.
    r = decoding("R", 50, 4, placeholders=1)
    r["computed_tokens"] += 1  # C counts the in-flight token
    inflight = {"started": 100.0, "items": [{"id": "R", "n": 1, "context": 53}]}
    res = run(snapshot([r], inflight=inflight, max_num_seqs=1, async_scheduling=True), q(10), {"R": 5})
    assert res["batches"] == [{"R": 1}, {"T": 10}]
    assert res["ttft_s"] == pytest.approx(3.0)  # in-flight (1) + wasted R slot (1) + T (1)


def test_async_skip_when_inflight_step_reaches_max_tokens() -> None:
    r = decoding("R", 50, 4, placeholders=1, max_tokens=5)
    r["computed_tokens"] += 1
    inflight = {"started": 100.0, "items": [{"id": "R", "n": 1, "context": 53}]}
    res = run(snapshot([r], inflight=inflight, max_num_seqs=1, async_scheduling=True), q(10), {"R": 5})
    assert res["batches"] == [{"T": 10}]
    assert res["ttft_s"] == pytest.approx(2.0)


def test_sync_same_state_admits_after_finish() -> None:
    r = decoding("R", 50, 4)
    res = run(snapshot([r], max_num_seqs=1), q(10), {"R": 5})
    assert res["batches"] == [{"R": 1}, {"T": 10}]


def test_nobody_to_starve_switches_lpt_off_when_alone() -> None:
    res = run(snapshot([], max_num_batched_tokens=384, long_prefill_token_threshold=200), q(971))
    assert res["batches"] == [{"T": 384}, {"T": 384}, {"T": 203}]
    other = decoding("A", 20, 1)
    res = run(snapshot([other], max_num_batched_tokens=384, long_prefill_token_threshold=200), q(450), {"A": 100})
    assert res["batches"] == [{"A": 1, "T": 200}, {"A": 1, "T": 200}, {"A": 1, "T": 50}]


def test_adaptive_lpt_floors_at_fair_share() -> None:
    other = decoding("A", 20, 1)
    snap = snapshot([other], max_num_batched_tokens=1000, long_prefill_token_threshold=100,
                    long_prefill_token_threshold_adaptive=True)
    res = run(snap, q(1200), {"A": 100})
    assert res["batches"][0] == {"A": 1, "T": 500}  # max(100, 1000 // 2)


def test_running_before_waiting_in_list_order_and_budget() -> None:
    # A long partial prefill early in the list takes the whole budget: later residents get nothing.
    x = req("X", 5000, c=100, blocks=7)
    a = decoding("A", 30, 2)
    res = run(snapshot([x, a], max_num_batched_tokens=512), q(10), {"A": 100})
    assert res["batches"][0] == {"X": 512}


def test_max_num_seqs_blocks_admission_until_a_finish() -> None:
    r = decoding("R", 40, 7)
    res = run(snapshot([r], max_num_seqs=1), q(30), {"R": 10})
    assert res["batches"] == [{"R": 1}, {"R": 1}, {"R": 1}, {"T": 30}]


def test_chunked_prefill_off_needs_whole_prompt_in_leftover() -> None:
    r = decoding("R", 40, 1)
    fits = run(snapshot([r], max_num_batched_tokens=100, enable_chunked_prefill=False), q(99), {"R": 3})
    assert fits["batches"] == [{"R": 1, "T": 99}]
    blocked = run(snapshot([r], max_num_batched_tokens=100, enable_chunked_prefill=False), q(100), {"R": 3})
    assert blocked["batches"] == [{"R": 1}, {"R": 1}, {"T": 100}]


def test_full_sequence_gate_and_first_chunk_allocation() -> None:
    # 64 free blocks of 16: the whole 2000-token prompt needs 125, its first 512-token chunk only 32.
    r = decoding("R", 16, 1, blocks=1)
    gated = run(snapshot([r], free=64, max_num_batched_tokens=513), q(2000), {"R": 3})
    assert gated["batches"][:2] == [{"R": 1}, {"R": 1}]
    assert gated["status"] == "unschedulable"  # it can never fit: R's 2 blocks would not be enough
    open_gate = run(snapshot([r], free=64, max_num_batched_tokens=513, scheduler_reserve_full_isl=False),
                    q(2000), {"R": 3})
    assert open_gate["batches"][0] == {"R": 1, "T": 512}


def test_watermark_applies_only_when_something_runs() -> None:
    alone = run(snapshot([], free=10, watermark_blocks=5), q(16 * 9))
    assert alone["batches"] == [{"T": 144}]
    r = decoding("R", 16, 1, blocks=1)
    with_r = run(snapshot([r], free=10, watermark_blocks=5), q(16 * 9), {"R": 2})
    # 9 blocks + watermark 5 > 10 while R runs; after R finishes (frees 1 → 11 free) nobody runs.
    assert with_r["batches"] == [{"R": 1}, {"T": 144}]


def test_fcfs_preemption_takes_the_tail_and_skips_admission() -> None:
    # A and B both need a new block (C % 16 == 0); one free block: A gets it, B is preempted.
    a = decoding("A", 16, 1, blocks=1)
    b = decoding("B", 16, 1, blocks=1)
    res = run(snapshot([a, b], free=1), q(4), {"A": 3, "B": 3})
    first = res["batches"][0]
    assert first == {"A": 1}  # B preempted, T not admitted in a step with a preemption
    # B (17 tokens to recompute) needs 2 blocks, only its 1 came back: the full-sequence gate holds
    # it — and T behind it — until A finishes; then B (front of waiting) goes before T.
    assert res["batches"][1:] == [{"A": 1}, {"B": 17, "T": 4}]


def test_priority_preemption_victim_is_lowest_priority_anywhere() -> None:
    a = decoding("A", 16, 1, blocks=1, priority=5, arrival=1.0)
    b = decoding("B", 16, 1, blocks=1, priority=0, arrival=2.0)
    res = run(snapshot([a, b], free=1, policy="priority"), q(4), {"A": 3, "B": 3})
    assert res["batches"][0] == {"B": 1}  # A (priority 5) is preempted although it is first


def test_priority_orders_waiting_queue() -> None:
    w1 = req("W1", 100, arrival=1.0, priority=3)
    snap = snapshot([], [w1], max_num_batched_tokens=64, policy="priority")
    res = run(snap, q(10, priority=0, arrival=5.0), {"W1": 5})
    assert res["batches"][0] == {"T": 10, "W1": 54}


def test_prefix_hit_block_aligned_and_capped() -> None:
    res = run(snapshot([], enable_prefix_caching=True), q(300, prefix_hit_tokens=256))
    assert res["batches"] == [{"T": 44}]
    full = run(snapshot([], enable_prefix_caching=True), q(256, prefix_hit_tokens=256))
    assert full["batches"] == [{"T": 16}]  # at least one token recomputed: a whole block here
    off = run(snapshot([], enable_prefix_caching=False), q(300, prefix_hit_tokens=256))
    assert off["batches"] == [{"T": 300}]


def test_siblings_hit_the_first_childs_blocks_unless_prompt_logprobs_skip_the_cache() -> None:
    # n = 3: children 0_T, 1_T, 2_T queue together; 1_T and 2_T hit 0_T's 18 full blocks (288 of
    # 300 tokens), so they compute 12 each; budget 2048 takes all three in one step
    cached = run(snapshot([], enable_prefix_caching=True), q(300, sequences=3))
    assert cached["batches"] == [{"0_T": 300, "1_T": 12, "2_T": 12}]
    # prompt logprobs (vLLM's skip_reading_prefix_cache): every child computes the whole prompt,
    # and the query's own hit is ignored
    skip = run(snapshot([], enable_prefix_caching=True),
               q(300, sequences=3, prefix_hit_tokens=256, skip_reading_prefix_cache=True))
    assert skip["batches"] == [{"0_T": 300, "1_T": 300, "2_T": 300}]
    off = run(snapshot([], enable_prefix_caching=False), q(300, sequences=2))
    assert off["batches"] == [{"0_T": 300, "1_T": 300}]
    # siblings of a request ahead take budget before the query
    ahead = run(snapshot([], enable_prefix_caching=False, max_num_batched_tokens=512), q(100),
                ahead=[{"id": "A", "prompt_tokens": 200, "sequences": 2}])
    assert ahead["batches"] == [{"0_A": 200, "1_A": 200, "T": 100}] and ahead["ttft_s"] == pytest.approx(1.0)
    later = run(snapshot([], enable_prefix_caching=False, max_num_batched_tokens=512), q(100),
                ahead=[{"id": "A", "prompt_tokens": 200, "sequences": 3}])
    assert later["batches"][0] == {"0_A": 200, "1_A": 200, "2_A": 112} and later["ttft_s"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="sequences"):
        run(snapshot([]), q(10, sequences=0))


def test_max_model_len_clamps_running_chunks() -> None:
    x = req("X", 1000, c=100, blocks=7)
    res = run(snapshot([x], max_model_len=1000, max_num_batched_tokens=4096), q(10), {"X": 1})
    assert res["batches"][0]["X"] == 899  # min(900, max_model_len - C - 1)


def test_shared_blocks_are_not_returned_on_finish() -> None:
    # R holds 10 blocks of which only 4 are its own; T needs 5.
    shared = decoding("R", 150, 10, blocks=10, excl=4)
    res = run(snapshot([shared], free=0), q(80), {"R": 11})
    assert res["status"] == "unschedulable"
    own = decoding("R", 150, 10, blocks=10, excl=5)
    res = run(snapshot([own], free=0), q(80), {"R": 11})
    assert res["batches"] == [{"R": 1}, {"T": 80}]


def test_predictions_capped_by_max_tokens_and_overrun_rule() -> None:
    r = decoding("R", 40, 2, max_tokens=3)
    res = run(snapshot([r], max_num_seqs=1), q(5), {"R": 1000})
    assert res["batches"] == [{"R": 1}, {"T": 5}]
    past = decoding("R", 40, 20)  # predicted 10, already at 20: half the prediction again
    res = run(snapshot([past], max_num_seqs=1), q(5), {"R": 10})
    assert len(res["batches"]) == 6


def test_unknown_residents_use_default_length() -> None:
    r = decoding("R", 40, 2, max_tokens=50)
    res = run(snapshot([r], max_num_seqs=1), q(5), None, default_output_tokens=4)
    assert len(res["batches"]) == 3
    res = run(snapshot([r], max_num_seqs=1), q(5), None)
    assert len(res["batches"]) == 49  # unknown and no default: runs to max_tokens


def test_unschedulable_query_is_reported() -> None:
    res = run(snapshot([], free=3, num_gpu_blocks=4), q(200))
    assert res["status"] == "unschedulable"
    assert math.isinf(res["ttft_s"])


def test_batch_time_model_eq12() -> None:
    beta = [0.5, 0.01, 0.001, 0.0001]
    a = req("A", 100, c=109, o=10, blocks=7)
    res = run(snapshot([a]), q(20), {"A": 50}, beta=beta)
    # One step: A decodes on 109 context; T prefills 20 tokens from 0.
    expected = 0.5 + 0.01 * 21 + 0.001 * 109 + 0.0001 * (20 * 21 / 2)
    assert res["ttft_s"] == pytest.approx(expected)
    assert libbea.batch_features([{"n": 1, "context": 109, "decode": True}, {"n": 20, "context": 0, "decode": False}]) == (
        21.0, 109.0, 210.0)


def test_roofline_takes_the_larger_line_step_by_step_and_in_folds() -> None:
    beta = [0.5, 0.01, 0.001, 0.0001]
    a = req("A", 100, c=109, o=10, blocks=7)
    low = [0.0, 0.0, 0.0, 0.0]  # a second line below the first everywhere: eq. 12 itself
    assert run(snapshot([a]), q(20), {"A": 50}, beta=[*beta, *low])["ttft_s"] == pytest.approx(
        run(snapshot([a]), q(20), {"A": 50}, beta=beta)["ttft_s"])
    steep = [0.1, 0.05, 0.0, 0.0]  # compute-bound above 10 tokens a step: 0.1 + 0.05 · 21 tokens
    res = run(snapshot([a]), q(20), {"A": 50}, beta=[*beta, *steep])
    assert res["ttft_s"] == pytest.approx(max(0.5 + 0.01 * 21 + 0.001 * 109 + 0.0001 * 210, 0.1 + 0.05 * 21))
    # eight decodes run 40 folded steps while T waits for a free slot; their contexts grow until
    # the second line (flatter in context) is the smaller: the fold splits at the crossing
    decoders = [decoding(f"D{k}", 100, 1) for k in range(8)]
    snap = snapshot(decoders, max_num_seqs=8)
    lengths = {f"D{k}": 41 if k == 0 else 200 for k in range(8)}
    roof = [1e-3, 1e-5, 1e-6, 0.0, 2e-3, 1e-5, 0.0, 0.0]
    folded = libbea.estimate(libbea.Snapshot.from_dict(snap), q(10), beta=roof, lengths=lengths)
    stepwise = libbea.estimate(libbea.Snapshot.from_dict(snap), q(10), beta=roof, lengths=lengths, collapse=False)
    assert folded["n_batches"] == stepwise["n_batches"] == 41  # 40 decode steps, then T's prefill
    assert folded["ttft_s"] == pytest.approx(stepwise["ttft_s"], rel=1e-12)
    with pytest.raises(ValueError, match="8"):
        run(snapshot([a]), q(20), beta=[*beta, 0.1])


def test_estimate_many_matches_single_estimates() -> None:
    a = libbea.Snapshot.from_dict(snapshot([decoding("A", 100, 3)]))
    b = libbea.Snapshot.from_dict(snapshot([req("X", 5000, c=100, blocks=7)]))
    for s in (a, b):
        s.set_output_lengths({"A": 10, "X": 10})
    query = libbea.Query(prompt_tokens=300, max_tokens=20)
    many = libbea.estimate_many([a, b], query, [UNIT, [0.1, 0.0, 0.0, 0.0]])
    assert many[0][0] == libbea.estimate(a, query, beta=UNIT)["ttft_s"]
    assert many[1][0] == pytest.approx(libbea.estimate(b, query, beta=[0.1, 0.0, 0.0, 0.0])["ttft_s"])


def test_estimate_many_takes_one_request_per_snapshot() -> None:
    """One call for candidates with different prompt lengths and prefix hits (the estimator's
    exact tokens and mirrored hits): each result is that snapshot's single estimate."""
    a = libbea.Snapshot.from_dict(snapshot([decoding("A", 100, 3)]))
    b = libbea.Snapshot.from_dict(snapshot([req("X", 5000, c=100, blocks=7)]))
    for s in (a, b):
        s.set_output_lengths({"A": 10, "X": 10})
    beta = [0.01, 0.0001, 0.0, 0.0]  # step time grows with its tokens: a hit shortens the prefill
    qs = [{"id": "q", "prompt_tokens": 3000, "max_tokens": 20, "prefix_hit_tokens": 2800},
          {"id": "q", "prompt_tokens": 6000, "max_tokens": 20, "prefix_hit_tokens": 0}]
    many = libbea.estimate_many([a, b], qs, [beta, beta], ages=[0.0, 0.01])
    single = [libbea.estimate(s, q, beta=beta, age_s=age) for s, q, age in ((a, qs[0], 0.0), (b, qs[1], 0.01))]
    assert [m[0] for m in many] == [r["ttft_s"] for r in single]
    assert many[0][0] != libbea.estimate(a, qs[1], beta=beta)["ttft_s"]  # not one request for both
    assert libbea.estimate_many([a, b], tuple(qs), [beta, beta], ages=[0.0, 0.01]) == many
    with pytest.raises(ValueError, match="one request per snapshot"):
        libbea.estimate_many([a, b], qs[:1], [beta, beta])


def test_analytic_estimators() -> None:
    assert libbea.prefill_throughput_ttft(1000, 500, 1500) == pytest.approx(1.0)
    # eq. 13 with k=1 is M/M/1's waiting time rho / (mu - alpha).
    assert libbea.lps_wait(3.0, 4.0, 1) == pytest.approx(0.75 / 1.0)
    assert libbea.lps_wait(1.0, 2.0, 25) == pytest.approx(0.5**25 / 1.0)
    assert math.isinf(libbea.lps_wait(4.0, 4.0, 5))
    assert libbea.lps_ttft(1.0, 2.0, 1, 100, 1000) == pytest.approx(0.5 + 0.1)
    # eq. 15 reduces to eq. 13 for Poisson arrivals and exponential service (c² = 1).
    assert libbea.lps_wait_corrected(1.0, 0.5, 3, 1.0, 1.0) == pytest.approx(libbea.lps_wait(1.0, 2.0, 3))
    with pytest.raises(ValueError):
        libbea.lps_wait(1.0, 0.0, 1)
    snap = libbea.Snapshot.from_dict(snapshot([req("X", 500, c=100, blocks=7), decoding("A", 40, 3)],
                                              [req("W", 70)]))
    assert snap.pending_prefill_tokens() == 400 + 70


def test_arrival_fill_charges_the_expected_tokens_or_the_median_count_of_prompts() -> None:
    # T (200 tokens) prefills in chunks of 64, 64, 64 and 8 (steps of 1 s + 1 ms a token): the
    # last step, starting at 3.192 s, leaves 56 tokens of budget to whoever arrived since
    beta = [1.0, 1e-3, 0.0, 0.0]
    snap = snapshot([], max_num_batched_tokens=64)
    alone = run(snap, q(200), beta=beta)
    assert [b["T"] for b in alone["batches"]] == [64, 64, 64, 8] and alone["ttft_s"] == pytest.approx(4.2)
    # expected tokens: 10 tok/s x 3.192 s = 31.9 → 31 tokens more in the last step
    mean = run(snap, q(200), beta=beta, arrival_tokens_per_s=10.0)
    assert mean["ttft_s"] == pytest.approx(4.2 + 0.031)
    # as whole prompts of 40 tokens (0.25 arrivals/s): the median count by 3.192 s (mean 0.8) is 1
    median = run(snap, q(200), beta=beta, arrival_tokens_per_s=10.0, arrival_prompt_tokens=40.0)
    assert median["ttft_s"] == pytest.approx(4.2 + 0.040)
    fast = libbea.estimate(libbea.Snapshot.from_dict(snap), q(200), beta=beta, arrival_tokens_per_s=10.0,
                           arrival_prompt_tokens=40.0)  # no trace: the fast path
    assert fast["ttft_s"] == pytest.approx(median["ttft_s"])
    # prompts of 100 tokens (mean count 0.32 < ln 2): the median is none
    none = run(snap, q(200), beta=beta, arrival_tokens_per_s=10.0, arrival_prompt_tokens=100.0)
    assert none["ttft_s"] == pytest.approx(4.2)
    with pytest.raises(ValueError, match="arrival_prompt_tokens"):
        run(snap, q(200), beta=beta, arrival_tokens_per_s=10.0, arrival_prompt_tokens=-1.0)
