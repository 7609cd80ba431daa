"""The sim engine's block-level prefix cache (libbea sim/prefix_cache): hits on shared prefixes,
LRU eviction of freed cached blocks (a request's last blocks first), KV events that rebuild the
cache exactly, and free counts that stay those of the scheduler's model."""

from __future__ import annotations

from collections import Counter

from bear import libbea
from bear.prefix.hashing import BlockHasher, HashSpec
from bear.sim.profile import load_profile

H = BlockHasher(HashSpec(block_size=16))


def engine(blocks: int) -> libbea.Engine:
    cfg = {**load_profile("qwen3-8b-h100").engine_config(), "enable_prefix_caching": True, "num_gpu_blocks": blocks,
           "max_num_batched_tokens": 2048, "max_num_scheduled_tokens": 2048}
    return libbea.Engine(cfg)


def run(e: libbea.Engine, mirror: Counter) -> list[list[tuple]]:
    steps = []
    while e.has_work:
        b = e.step()
        if not b:
            break
        steps.append(b)
        e.finish_step()
        for kind, hashes in e.take_kv_events():
            for h in hashes:
                mirror[h] += 1 if kind == "stored" else -1
    return steps


def add(e: libbea.Engine, rid: str, toks: list[int], out: int) -> None:
    ids = toks + [7_000_000 + k for k in range(out)]  # the answer's ids
    e.add(rid, len(toks), out, out, 0.0, 0, block_hashes=H.hashes(ids))


def test_shared_prefix_hits_and_events_mirror_the_cache() -> None:
    e, m = engine(400), Counter()
    system = list(range(1000, 1320))  # 20 blocks
    add(e, "a", system + list(range(50)), 4)
    run(e, m)
    add(e, "b", system + list(range(60, 90)), 4)
    add(e, "c", list(range(5000, 5100)), 4)
    steps = run(e, m)
    assert e.prefix_hit_tokens("a") == 0 and e.prefix_hit_tokens("b") == 320 and e.prefix_hit_tokens("c") == 0
    assert steps[0][0][:3] == ("b", 350 - 320, 320)  # its prefill starts after the hit
    assert {h for h, n in m.items() if n > 0} == set(e.cached_blocks()) and all(n in (0, 1) for n in m.values())
    # the whole conversation again (prompt + answer + a new turn): the answer's blocks hit too
    conv = system + list(range(50)) + [7_000_000 + k for k in range(4)] + list(range(9000, 9040))
    add(e, "a2", conv, 2)
    run(e, m)
    assert e.prefix_hit_tokens("a2") == 368  # 23 full blocks of the 374-token history were cached


def test_eviction_takes_the_least_recently_freed_and_the_tail_first() -> None:
    e, m = engine(40), Counter()  # 40 blocks of 16 tokens
    old = list(range(0, 320))  # 20 blocks, freed first
    new = list(range(10_000, 10_320))  # 20 blocks, freed later
    add(e, "old", old, 1)
    run(e, m)
    add(e, "new", new, 1)
    run(e, m)
    assert e.free_blocks == 40 and len(e.cached_blocks()) == 40
    add(e, "x", list(range(50_000, 50_160)), 1)  # 10 fresh blocks: evicted from the front of the queue
    run(e, m)
    gone = set(H.hashes(old)) - set(e.cached_blocks())
    assert gone == set(H.hashes(old)[-10:])  # "old"'s last 10 blocks: its tail goes first
    assert set(H.hashes(new)) <= set(e.cached_blocks())
    add(e, "old2", [*old, 1], 1)
    run(e, m)
    assert e.prefix_hit_tokens("old2") == 160  # the surviving leading half
    assert {h for h, n in m.items() if n > 0} == set(e.cached_blocks())


def test_hits_held_by_running_requests_cost_no_free_blocks() -> None:
    e = engine(100)
    system = list(range(320))
    add(e, "long", system + list(range(400, 416)), 400)  # keeps decoding, holds the system blocks
    e.step()
    e.finish_step()
    free0 = e.free_blocks
    add(e, "b", system + list(range(500, 516)), 1)
    e.step()
    # b shares 20 held blocks: it takes 2 fresh ones (its tail and the next token's), not 22
    assert e.prefix_hit_tokens("b") == 320
    assert free0 - e.free_blocks <= 3
