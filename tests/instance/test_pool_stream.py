"""The publisher's stream with the block table kept step by step (issue 28; ``StateStream``'s
table rules): whatever the mix of deltas, periodic full snapshots, resync answers and states that
must go out in full without the table, a consumer that installs what it receives (libbea) holds
at every step either exactly the table the publisher keeps, or — for the one state after a
counts-only full snapshot — counts only, never a wrong table."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pool_sim import PoolSim, replay_state

from bear import libbea
from bear.instance.delta import StateStream, encode_delta
from bear.prefix.tracked_pool import PoolTable, TrackedPool
from bear.protocol.codec import pack


@pytest.mark.parametrize("seed", range(4))
def test_a_consumer_holds_the_publishers_table_or_counts_never_a_wrong_one(seed: int) -> None:
    rng = random.Random(seed)
    sim = PoolSim(64, seed + 20)
    pool = TrackedPool(sim.n)
    table = PoolTable(pool)
    stream = StateStream(full_every=rng.choice([0, 5, 17]))
    held: Any = None
    fulls = with_table = counts_only = 0
    for _ in range(200):
        step = sim.step()
        pool.step(step)
        snap = replay_state(sim, step)
        last = stream.last
        change = encode_delta(last, snap) if last is not None and last["seq"] == snap["seq"] - 1 else None
        pc = table.update(snap)
        if pc is not None and change is not None:
            change = {**change, "pool": pc}
        resync = rng.random() < 0.05
        stream.with_table(snap, change, table.full)
        full, delta = stream.encode(snap, change)
        want = replay_state(sim, step)
        table.full(want)
        if delta is not None and held is not None and not held.broken:
            try:
                held.apply_delta(libbea.Delta.from_msgpack(delta))
            except ValueError:
                held = None  # a delta for another state: a gap, the full snapshot heals it
        if full is not None:
            fulls += 1
            held = libbea.Snapshot.from_msgpack(full)
            with_table += held.tracked_blocks > 0
        if resync:  # a consumer asked: the newest state sent, in full (the publisher's resync_reply)
            if "pool_table" not in stream.last:
                stream.want_table()
            held = libbea.Snapshot.from_msgpack(pack(stream.last))
        if held is None:
            continue
        if held.tracked_blocks == 0:  # counts only: the lists are still the step's
            counts_only += 1
            bare = {k: v for k, v in want.items() if k != "pool_table"}
            for r in (*bare["running"], *bare["waiting"]):
                r.pop("tracked_ids", None)
                r.pop("block_keys", None)
            assert libbea.snapshot_difference(held, libbea.Snapshot.from_dict(bare)) is None, step["seq"]
        else:
            assert libbea.snapshot_difference(held, libbea.Snapshot.from_dict(want)) is None, step["seq"]
    assert fulls > 0 and with_table > 0
    assert counts_only < 40  # a counts-only state is followed by one with the table
