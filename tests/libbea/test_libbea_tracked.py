"""The replay's tracked-block ledger, one free-queue rule per test on hand-worked snapshots
(libbea core/tracked_ledger.h; docs/estimator.md), and its input validation. The sim-engine oracle
over random workloads is tests/sim/test_tracked_ledger_oracle.py."""

from __future__ import annotations

import pytest

from bear import libbea

from bea_helpers import decoding, req, snapshot

UNIT = [1.0, 0.0, 0.0, 0.0]
PC = {"enable_prefix_caching": True, "num_gpu_blocks": 1000}


def tsnap(running: list[dict], waiting: list[dict], free: int, table: list[int], **cfg) -> dict:
    """A snapshot with a tracked-block table (prefix caching on unless told)."""
    return {**snapshot(running, waiting, free=free, **{**PC, **cfg}), "tracked_blocks": table}


def run(snap: dict, query: dict, lengths: dict | None = None) -> dict:
    return libbea.estimate(libbea.Snapshot.from_dict(snap), query, beta=UNIT, lengths=lengths or {}, trace=True)


def test_a_hit_on_free_blocks_is_charged_to_the_free_count() -> None:
    # W's 10 hit blocks sit in the free queue (positions 0-9): touching them takes 10 free blocks,
    # plus 1 fresh block for its last token. With 10 free that does not fit; with 11 it does.
    table = list(range(10))
    w = req("W", 161, hit_blocks=list(range(10)))
    a = decoding("A", 16, 1, blocks=2)
    fits = run(tsnap([a], [w], 11, table), {"id": "Q", "prompt_tokens": 8}, {"A": 2})
    assert fits["batches"][0] == {"A": 1, "W": 1}  # admitted with its 160-token hit
    assert fits["steps"][0]["free_blocks"] == 0  # 10 touched + 1 taken
    short = run(tsnap([a], [w], 10, table), {"id": "Q", "prompt_tokens": 8}, {"A": 2})
    assert short["batches"][0] == {"A": 1}  # 11 > 10: it waits
    # today's count model treats the same hit as blocks held by running requests: no charge
    counts = run(snapshot([a], [req("W", 161, prefix_hit_tokens=160)], free=10, **PC), {"id": "Q", "prompt_tokens": 8},
                 {"A": 2})
    assert counts["batches"][0] == {"A": 1, "W": 1, "Q": 8} and counts["steps"][0]["free_blocks"] == 8


def test_blocks_taken_from_the_front_evict_the_cached_blocks_there() -> None:
    # W2 (no hit) takes 4 fresh blocks from the front of the queue: positions 0-3. The query's
    # chain is [pos 6, pos 2, pos 8]: its second block is evicted, so its hit is one block.
    table = [6, 2, 8]
    w2 = req("W2", 64, hit_blocks=[])
    res = run(tsnap([], [w2], 20, table),
              {"id": "Q", "prompt_tokens": 161, "max_tokens": 4, "hit_blocks": [0, 1, 2]}, {"W2": 4})
    assert res["batches"][0] == {"W2": 64, "Q": 161 - 16}
    # the same chain further back in the queue survives W2's pops: a 3-block hit
    res = run(tsnap([], [w2], 20, [6, 5, 8]),
              {"id": "Q", "prompt_tokens": 161, "max_tokens": 4, "hit_blocks": [0, 1, 2]}, {"W2": 4})
    assert res["batches"][0] == {"W2": 64, "Q": 161 - 48}


def test_a_touch_moves_the_blocks_behind_it_up() -> None:
    # W's hit block sits at position 1, the query's at 5. W touches its block (the query's moves
    # up to 4) and takes 2 fresh blocks (it is at 2); W2 takes 3 more: positions 0-2, so the
    # query's block is evicted and the query finds no hit.
    w = req("W", 33, hit_blocks=[0])
    w2 = req("W2", 48, hit_blocks=[])
    res = run(tsnap([], [w, w2], 10, [1, 5]), {"id": "Q", "prompt_tokens": 33, "max_tokens": 4, "hit_blocks": [1]},
              {"W": 2, "W2": 2})
    assert res["batches"][0] == {"W": 33 - 16, "W2": 48, "Q": 33}
    assert res["steps"][0]["free_blocks"] == 1


@pytest.mark.parametrize(("prompt", "hit"), [(20, 16), (31, 0)])
def test_a_release_prepends_uncached_blocks_and_appends_cached_ones(prompt: int, hit: int) -> None:
    # One seat. R decodes its last token and frees its 2 blocks; W2 then takes 4 blocks from the
    # front; the query's one hit block sits at position 3. R's partial last block (prompt 20: 21
    # tokens, one full block) goes to the front and pushes the hit block to position 4, beyond
    # W2's pops; with prompt 31 both of R's blocks are full and cached, go to the back, and W2's
    # pops evict the hit block.
    r = decoding("R", prompt, 1, blocks=2, max_tokens=2)
    w2 = req("W2", 64, hit_blocks=[])
    res = run(tsnap([r], [w2], 4, [3], max_num_seqs=1),
              {"id": "Q", "prompt_tokens": 33, "max_tokens": 4, "hit_blocks": [0]}, {"R": 2, "W2": 1})
    assert res["batches"][:3] == [{"R": 1}, {"W2": 64}, {"Q": 33 - hit}]


def test_a_held_block_is_appended_when_its_last_holder_lets_go() -> None:
    # R1 and R2 share their first block t (held, tracked). R1 finishes first: t stays held; R2
    # finishes later and t goes to the back of the queue, behind the blocks W2 then takes from
    # the front; the query finds it there (a free hit: charged, not evicted).
    r1 = decoding("R1", 20, 1, blocks=2, max_tokens=2, tracked=[0])
    r2 = decoding("R2", 20, 1, blocks=2, max_tokens=4, tracked=[0])
    w2 = req("W2", 48, hit_blocks=[])
    res = run(tsnap([r1, r2], [w2], 1, [-1], max_num_seqs=2),
              {"id": "Q", "prompt_tokens": 40, "max_tokens": 4, "hit_blocks": [0]}, {"R1": 2, "R2": 4, "W2": 1})
    first_q = next(step for step in res["batches"] if "Q" in step)
    assert first_q["Q"] == 40 - 16  # the 16-token hit survived W2's pops


def test_a_preempted_request_hits_its_own_blocks_at_readmission() -> None:
    # R1 needs a new block with none free and preempts R2 (40 computed of 41 tokens: 2 full
    # blocks cached, 1 partial). R2's partial block goes to the front, where R1's new block comes
    # from; its 2 cached blocks go to the back as its own chain: re-admitted once R1 has finished,
    # R2 recomputes 41 - 32 = 9 tokens.
    r1 = decoding("R1", 32, 17, blocks=3, max_tokens=19)
    r2 = decoding("R2", 40, 1, blocks=3)
    res = run(tsnap([r1, r2], [], 0, [-1]), {"id": "Q", "prompt_tokens": 8},
              {"R1": 19, "R2": 5})
    assert res["batches"][0] == {"R1": 1}  # R2 preempted
    readmitted = next(step for step in res["batches"][1:] if "R2" in step)
    assert readmitted["R2"] == 9


def test_without_a_table_nothing_changes() -> None:
    snap = snapshot([decoding("A", 100, 3)], [req("W", 300, prefix_hit_tokens=160)], **PC)
    base = run(snap, {"id": "Q", "prompt_tokens": 200}, {"A": 9})
    again = run({**snap, "tracked_blocks": []}, {"id": "Q", "prompt_tokens": 200, "hit_blocks": []}, {"A": 9})
    assert base == again


@pytest.mark.parametrize(("patch", "match"), [
    ({"tracked_blocks": 3}, "tracked_blocks"),
    ({"tracked_blocks": [0, 0]}, "position given twice"),
    ({"tracked_blocks": [50]}, r"tracked_blocks\[0\]"),
    ({"tracked_blocks": [-2]}, r"tracked_blocks\[0\]"),
    ({"tracked_blocks": ["x"]}, r"tracked_blocks\[0\]"),
    ({"run": {"tracked": [5]}}, r"running\[0\].tracked\[0\].*not an index"),
    ({"run": {"tracked": [0, 0]}}, "twice"),
    ({"run": {"tracked": [1]}}, "free queue is not held"),
    ({"run": {"hit_blocks": [0]}}, "only waiting requests"),
    ({"wait": {"tracked": [0]}}, "holds no blocks"),
    ({"wait": {"hit_blocks": [7]}}, r"waiting\[0\].hit_blocks\[0\]"),
    ({"wait": {"block_keys": [-1]}}, r"waiting\[0\].block_keys\[0\]"),
    ({"wait": {"block_keys": 5}}, "block_keys"),
    ({"off": True}, "enable_prefix_caching"),
    ({"tracked_keys": [1]}, "one key per tracked block"),
    ({"tracked_keys": [1, -2]}, r"tracked_keys\[1\]"),
    ({"tracked_keys": 3}, "tracked_keys"),
])
def test_bad_tracked_fields_are_named(patch: dict, match: str) -> None:
    run_r = decoding("A", 16, 1, blocks=2, **patch.get("run", {}))
    wait_r = req("W", 40, **patch.get("wait", {}))
    table = patch.get("tracked_blocks", [-1, 3])
    snap = tsnap([run_r], [wait_r], 10, table, enable_prefix_caching=not patch.get("off", False))
    if "tracked_keys" in patch:
        snap["tracked_keys"] = patch["tracked_keys"]
    with pytest.raises(ValueError, match=match):
        libbea.Snapshot.from_dict(snap)


def test_table_keys_let_a_hit_find_its_blocks_by_content() -> None:
    # The query's three hit blocks sit at positions 6, 2, 8 of the free queue and W2 pops 0-3.
    # Named by hit_blocks (indices) or by block_keys alone against the table's keys, the replay
    # is the same: the second block is evicted, a one-block hit.
    table, keys = [6, 2, 8], [70, 71, 72]
    w2 = req("W2", 64, hit_blocks=[])
    by_index = run(tsnap([], [w2], 20, table),
                   {"id": "Q", "prompt_tokens": 161, "max_tokens": 4, "hit_blocks": [0, 1, 2]}, {"W2": 4})
    by_key = run({**tsnap([], [w2], 20, table), "tracked_keys": keys},
                 {"id": "Q", "prompt_tokens": 161, "max_tokens": 4, "block_keys": [70, 71, 72, 99]}, {"W2": 4})
    assert by_key["batches"] == by_index["batches"] and by_key["batches"][0] == {"W2": 64, "Q": 161 - 16}
    # a waiting request finds its hit the same way (a free hit is charged at its admission)
    w = req("W", 161, block_keys=[70, 71, 72])
    got = run({**tsnap([], [w], 20, table), "tracked_keys": keys}, {"id": "Q", "prompt_tokens": 8}, {"W": 2})
    assert got["batches"][0] == {"W": 161 - 48, "Q": 8}
    # keys of no block (-1) and unknown keys find nothing
    none = run({**tsnap([], [], 20, table), "tracked_keys": [-1, -1, -1]},
               {"id": "Q", "prompt_tokens": 161, "block_keys": [70, 71, 72]})
    assert none["batches"][0] == {"Q": 161}
    # the same from the wire form the estimator receives
    from bear.protocol.codec import pack

    wire = libbea.Snapshot.from_msgpack(pack({**tsnap([], [w2], 20, table), "tracked_keys": keys}))
    again = libbea.estimate(wire, {"id": "Q", "prompt_tokens": 161, "max_tokens": 4, "block_keys": [70, 71, 72]},
                            beta=UNIT, lengths={"W2": 4}, trace=True)
    assert again["batches"] == by_key["batches"]


def test_bad_query_chains_are_named() -> None:
    tracked = libbea.Snapshot.from_dict(tsnap([], [], 10, [1]))
    plain = libbea.Snapshot.from_dict(snapshot([], [], free=10, **PC))
    with pytest.raises(ValueError, match=r"request.hit_blocks\[0\]"):
        libbea.estimate(tracked, {"prompt_tokens": 40, "hit_blocks": [1]}, beta=UNIT)
    with pytest.raises(ValueError, match="no tracked_blocks"):
        libbea.estimate(plain, {"prompt_tokens": 40, "hit_blocks": [0]}, beta=UNIT)
    with pytest.raises(ValueError, match="hit_blocks"):
        libbea.estimate(tracked, {"prompt_tokens": 40, "hit_blocks": [0, 0]}, beta=UNIT)
    with pytest.raises(ValueError, match=r"ahead\[0\].hit_blocks\[0\]"):
        libbea.estimate(tracked, {"prompt_tokens": 40}, beta=UNIT, ahead=[{"prompt_tokens": 8, "hit_blocks": [3]}])
    assert libbea.Query.from_dict({"prompt_tokens": 40, "hit_blocks": [0]}).hit_blocks == [0]


def test_the_table_round_trips_and_a_delta_drops_it() -> None:
    from bear.instance.delta import encode_delta
    from bear.protocol.codec import pack

    e = libbea.Engine({"max_num_batched_tokens": 256, "max_num_seqs": 4, "block_size": 16, "num_gpu_blocks": 40,
                       "max_model_len": 2048, "enable_prefix_caching": True})
    hashes = list(range(1, 20))
    e.add("a", 100, 4, 4, block_hashes=hashes)
    e.step()
    e.finish_step()
    plain0 = e.snapshot("i", "m", 0.0)
    snap, q = e.tracked_snapshot("i", "m", 0.0, hashes[:3])
    assert snap["tracked_blocks"] == [-1] * 3 and snap["running"][0]["tracked"] == [0, 1, 2]
    assert q["hit_blocks"] == [0, 1, 2] and q["block_keys"] == [0, 1, 2]
    mirror = libbea.Snapshot.from_dict(snap)
    assert libbea.estimate(mirror, {"prompt_tokens": 60, **q}, beta=UNIT)["status"] == "ok"
    e.step()
    e.finish_step()
    d = encode_delta(plain0, e.snapshot("i", "m", 1.0))
    assert d is not None
    mirror.apply_delta(libbea.Delta.from_msgpack(pack(d)))
    with pytest.raises(ValueError, match="no tracked_blocks"):  # the table went with the delta
        libbea.estimate(mirror, {"prompt_tokens": 60, **q}, beta=UNIT)
