"""``bear.prefix.tracked_pool``: a pool followed from the block-op log and described on a
snapshot for libbea's tracked-block replay — checked field by field on a hand-made log, and by
replaying the description against the count model's answer where they must differ."""

from __future__ import annotations

import copy
import random

import pytest

from bear import libbea
from bear.prefix.pool_replica import OP_APPEND, OP_CACHE, OP_DUMP, OP_NAMES, OP_POP, OP_PREPEND
from bear.prefix.tracked_pool import KEY_MASK, TrackedPool, keys_of, unpack_names


def _hex(names: list[int]) -> str:
    return b"".join(n.to_bytes(8, "big") for n in names).hex()


def _snap(running: list[dict], waiting: list[dict], free: int) -> dict:
    return {"schema": "bear.snapshot/1", "instance": "i", "model": "m", "seq": 1, "time": 0.0,
            "config": {"max_num_batched_tokens": 256, "max_num_seqs": 8, "block_size": 16, "num_gpu_blocks": 12,
                       "max_model_len": 2048, "enable_prefix_caching": True},
            "free_blocks": free, "running": running, "waiting": waiting}


def _req(rid: str, prompt: int, computed: int, blocks: int, **kw) -> dict:
    return {"id": rid, "prompt_tokens": prompt, "computed_tokens": computed, "output_tokens": 0, "max_tokens": 4,
            "blocks": blocks, "exclusive_blocks": blocks, "preemptions": 0, "arrival": 0.0, "priority": 0, **kw}


def test_names_round_trip_and_keys_fit_libbea() -> None:
    names = [0, 1, (1 << 64) - 1, 0x8000_0000_0000_0001]
    assert unpack_names(_hex(names)) == names
    assert keys_of(names) == [0, 1, KEY_MASK, 1] and all(0 <= k <= KEY_MASK for k in keys_of(names))


def test_describe_needs_a_dump_and_says_where_every_cached_block_is() -> None:
    pool = TrackedPool(12)
    step = {"seq": 0, "free_blocks": 11, "block_ops": [], "running": [], "waiting": []}
    assert pool.step(step) is False and pool.describe(_snap([], [], 11)) is False  # no dump seen yet
    # the engine's first record: every block free, nothing cached
    dump = (OP_DUMP, list(range(1, 12)), [], [])
    # A (40 tokens: 2 full blocks and a partial one) arrives and runs: takes blocks 1-3, caches 1-2; B arrives
    ops = [dump, (OP_NAMES, "A", _hex([101, 102])), (OP_POP, [1, 2, 3]), (OP_CACHE, [1, 2], [101, 102]),
           (OP_NAMES, "B", _hex([101, 102, 203]))]
    assert pool.step({"seq": 1, "free_blocks": 8, "block_ops": ops, "block_ids": {"A": [1, 2, 3]},
                      "running": [["A"]], "waiting": [["B"]]})
    snap = _snap([_req("A", 40, 40, 3)], [_req("B", 60, 0, 0)], 8)
    assert pool.describe(snap)
    assert snap["tracked_blocks"] == [-1, -1] and snap["tracked_keys"] == [101, 102]  # held, keyed
    assert snap["running"][0]["tracked"] == [0, 1]  # its leading blocks up to the last tracked
    assert snap["running"][0]["block_keys"] == [101, 102] and snap["waiting"][0]["block_keys"] == [101, 102, 203]
    # A finishes: vLLM frees its blocks in reverse, the uncached one to the front, the cached
    # ones to the back (LRU)
    assert pool.step({"seq": 2, "free_blocks": 11, "block_ops": [(OP_PREPEND, [3]), (OP_APPEND, [2, 1])],
                      "block_ids": {}, "running": [], "waiting": [["B"]]})
    snap = _snap([], [_req("B", 60, 0, 0)], 11)
    assert pool.describe(snap)
    assert snap["tracked_blocks"] == [10, 9] and snap["tracked_keys"] == [101, 102]  # queue: 3, 4..11, 2, 1
    # a free count that disagrees (a lost op) stops the description until a dump
    assert pool.step({"seq": 3, "free_blocks": 10, "block_ops": [], "block_ids": {}, "running": [],
                      "waiting": [["B"]]}) is False
    assert pool.describe(_snap([], [], 10)) is False and "free blocks" in (pool.problem or "")
    assert pool.step({"seq": 4, "free_blocks": 11, "block_ops": [
        (OP_DUMP, [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 1], [1, 2], [101, 102])], "block_ids": {},
        "running": [], "waiting": [["B"]]})
    assert pool.names["B"] == [101, 102, 203]  # names outlive a resync


def test_the_description_replays_a_hit_on_free_blocks_as_vllm_charges_it() -> None:
    """B's two hit blocks sit free in the queue. vLLM charges them against the free count when it
    admits B; the count model treats a hit as held by others."""
    pool = TrackedPool(12)
    pool.step({"seq": 0, "free_blocks": 4, "block_ops": [
        (OP_DUMP, [5, 6, 2, 1], [1, 2], [101, 102]), (OP_NAMES, "B", _hex([101, 102, 203, 204]))],
        "block_ids": {"R": [3, 4, 7, 8, 9, 10, 11]}, "running": [["R"]], "waiting": [["B"]]})
    r = _req("R", 90, 90, 7, output_tokens=1)
    b = _req("B", 70, 0, 0, prefix_hit_tokens=32)
    snap = _snap([r], [b], 4)
    counts = copy.deepcopy(snap)
    assert pool.describe(snap)
    assert snap["tracked_blocks"] == [3, 2] and snap["running"][0]["tracked"] == []
    beta = [1e-3, 0.0, 0.0, 0.0]
    lengths = {"R": 40, "B": 2}
    q = {"id": "Q", "prompt_tokens": 8, "max_tokens": 1}
    got = libbea.estimate(libbea.Snapshot.from_dict(snap), q, beta=beta, lengths=lengths, trace=True)
    plain = libbea.estimate(libbea.Snapshot.from_dict(counts), q, beta=beta, lengths=lengths, trace=True)
    # 4 free: the count model admits B with 3 new blocks (its 32-token hit "held"); vLLM also
    # charges the 2 free hit blocks it touches: 5 > 4, B waits
    assert "B" in plain["batches"][0] and "B" not in got["batches"][0]


def _reference_describe(pool: TrackedPool, snap: dict) -> None:
    """The table as first written (a call per block): the bulk version must give the same table,
    entry for entry (``block_keys`` are checked apart)."""
    rep = pool.replica
    pos = {b: i for i, b in enumerate(rep.queue)}
    index: dict[int, int] = {}
    table: list[int] = []
    keys: list[int] = []

    def entry(b: int) -> int:
        t = index.get(b)
        if t is None:
            t = index[b] = len(table)
            table.append(pos.get(b, -1))
            name = rep.names.get(b)
            keys.append(-1 if name is None else int(name) & KEY_MASK)
        return t

    for b in rep.names:
        entry(b)
    held = [pool.holders.get(r["id"], []) for r in snap["running"]]
    count: dict[int, int] = {}
    for bl in held:
        for b in bl:
            count[b] = count.get(b, 0) + 1
    for b, n in count.items():
        if n > 1:
            entry(b)
    for r, bl in zip(snap["running"], held, strict=True):
        last = max((i for i, b in enumerate(bl) if b in index), default=-1)
        r["tracked"] = [entry(b) for b in bl[: last + 1]]
    snap["tracked_blocks"] = table
    snap["tracked_keys"] = keys


@pytest.mark.parametrize("seed", range(6))
def test_the_bulk_description_equals_the_block_by_block_one(seed: int) -> None:
    """Random pools (a shared system prompt held by every running request, held blocks not yet
    named ahead of named ones, a request whose names come from ``extra``, names above 2^63)."""
    from bear.benchmarks.pool import synthetic_pool

    rng = random.Random(seed)
    pool, snap = synthetic_pool(rng.choice([16, 200, 3000]), cached_frac=rng.random(), free_frac=rng.random(),
                                running=rng.randint(0, 20), shared=rng.randint(0, 6), waiting=rng.randint(0, 5),
                                seed=seed)  # fmt: skip
    snap["waiting"].append({"id": "recorded"})
    # two requests sharing only blocks nobody named (forked after the last named one)
    unnamed = [b for b in range(1, pool.replica.num_gpu_blocks) if b not in pool.replica.names][:2]
    for rid in ("fork-a", "fork-b"):
        pool.holders[rid] = unnamed
        snap["running"].append({"id": rid})
    extra = {"recorded": [rng.getrandbits(64) for _ in range(5)]}
    want, got = copy.deepcopy(snap), copy.deepcopy(snap)
    _reference_describe(pool, want)
    assert pool.describe(got, extra)
    for r in (*got["running"], *got["waiting"]):  # every request whose names are known, logged or not
        names = pool.names.get(r["id"]) or extra.get(r["id"])
        assert r.pop("block_keys", None) == (keys_of(names) if names else None), r["id"]
    assert got == want
    assert len(got["tracked_blocks"]) == len(got["tracked_keys"]) >= len(pool.replica.names)


def test_the_pool_benchmark_reports_every_size() -> None:
    from bear.benchmarks.pool import run_pool_bench

    res = run_pool_bench((64, 256), reps=2, steps=5)
    small, large = res["sizes"]["64"], res["sizes"]["256"]
    assert 0 < small["table_entries"] < large["table_entries"] and 0 < small["bytes"] < large["bytes"]
    assert all(v["describe"]["n"] == 2 and v["describe"]["p50_ms"] > 0 for v in (small, large))
    for v in (small, large):  # the table kept step by step (the bench checks libbea's state against the full table)
        d = v["deltas"]
        assert d["snapshotter_step"]["n"] == d["worker_ingest"]["n"] == 5
        assert 0 < d["change_bytes_p50"] < d["delta_bytes_p50"] < d["full_table"]["bytes"]


def test_a_gap_in_the_steps_loses_the_pool_until_the_next_dump() -> None:
    """Steps the snapshotter never saw (the ring overwrote them) took their block ops with them:
    the pool is not described again until a record carries a dump (a resync)."""
    pool = TrackedPool(12)
    dump = (OP_DUMP, list(range(1, 12)), [], [])
    assert pool.step({"seq": 4, "free_blocks": 11, "block_ops": [dump], "running": [], "waiting": []})
    assert pool.step({"seq": 5, "free_blocks": 11, "block_ops": [], "running": [], "waiting": []})
    # seq 6 and 7 lost: a step that applies cleanly is still not trusted
    assert not pool.step({"seq": 8, "free_blocks": 11, "block_ops": [], "running": [], "waiting": []})
    assert pool.problem == "steps 6 to 7 were not seen" and not pool.describe(_snap([], [], 11))
    assert pool.step({"seq": 9, "free_blocks": 11, "block_ops": [dump], "running": [], "waiting": []})
    assert pool.describe(_snap([], [], 11))
