"""``bear.prefix.tracked_pool.PoolTable``: the tracked-block table kept step by step (issue 28).
A consumer that starts from the first full table and applies each step's change holds, at every
step of random engine runs, exactly the table written in full — and that table says what
``TrackedPool.describe`` says (every entry's place in the free queue and key, the cached blocks'
order, each running request's tracked blocks, every request's keys)."""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
from pool_sim import PoolSim, replay_state, snap_of

from bear.prefix.tracked_pool import PoolTable, TrackedPool


class Consumer:
    """What a worker holds, the rules of contract.md §2 ("The table in stable form") in Python."""

    def __init__(self, snap: dict[str, Any]) -> None:
        rows = snap["pool_table"]
        self.table = {rows[k]: tuple(rows[k + 1:k + 4]) for k in range(0, len(rows), 4)}
        self.tracked = {r["id"]: list(r.get("tracked_ids", ())) for r in snap["running"]}
        self.keys = {r["id"]: list(r["block_keys"]) for r in chain(snap["running"], snap["waiting"]) if "block_keys" in r}

    def apply(self, snap: dict[str, Any], change: dict[str, Any]) -> None:
        running = [r["id"] for r in snap["running"]]
        here = set(running) | {r["id"] for r in snap["waiting"]}
        self.tracked = {rid: self.tracked.get(rid, []) for rid in running}  # waiting requests hold nothing
        self.keys = {rid: v for rid, v in self.keys.items() if rid in here}
        put = change.get("put", [])
        for k in range(0, len(put), 4):
            self.table[put[k]] = tuple(put[k + 1:k + 4])
        for b in change.get("drop", []):
            del self.table[b]
        rows = change.get("tracked", [])
        k = 0
        while k < len(rows):
            pos, start, n = rows[k:k + 3]
            t = self.tracked[running[pos]]
            assert start <= len(t)
            self.tracked[running[pos]] = t[:start] + rows[k + 3:k + 3 + n]
            k += 3 + n
        rows = change.get("keys", [])
        ids = [*running, *(r["id"] for r in snap["waiting"])]
        k = 0
        while k < len(rows):
            pos, n = rows[k:k + 2]
            self.keys[ids[pos]] = rows[k + 2:k + 2 + n]
            k += 2 + n

    def state(self) -> tuple[Any, ...]:
        return (self.table, {r: t for r, t in self.tracked.items() if t}, self.keys)

    def expand(self) -> dict[str, Any]:
        """The table as ``describe`` writes it, by block: free blocks' tickets ranked into queue
        positions, free blocks nobody named left out, cached blocks in stamp order."""
        free = sorted((e[0], b) for b, e in self.table.items() if e[0] >= 0)
        pos = {b: i for i, (_, b) in enumerate(free)}
        entries = {b: (pos.get(b, -1), e[1]) for b, e in self.table.items() if not (e[0] >= 0 and e[1] < 0)}
        cached = [b for _, b in sorted((e[2], b) for b, e in self.table.items() if e[1] >= 0)]
        return {"entries": entries, "cached": cached, "tracked": {r: t for r, t in self.tracked.items() if t},
                "keys": self.keys}


def full_state(snap: dict[str, Any]) -> tuple[Any, ...]:
    c = Consumer(snap)
    return c.state()


def described(pool: TrackedPool, snap: dict[str, Any]) -> dict[str, Any]:
    """``describe``'s table by block: index -> block from the replica's names, then from the
    running requests' blocks."""
    assert pool.describe(snap)
    block = list(pool.replica.names)
    for r in snap["running"]:
        for j, t in enumerate(r["tracked"]):
            b = pool.holders[r["id"]][j]
            if t >= len(block):
                block.extend([None] * (t + 1 - len(block)))  # type: ignore[list-item]
            if block[t] is None:
                block[t] = b
            assert block[t] == b
    entries = {b: (p, k) for b, p, k in zip(block, snap["tracked_blocks"], snap["tracked_keys"], strict=True)}
    cached = [b for b, k in zip(block, snap["tracked_keys"], strict=True) if k >= 0]
    tracked = {r["id"]: [block[t] for t in r["tracked"]] for r in snap["running"] if r["tracked"]}
    keys = {r["id"]: r["block_keys"] for r in chain(snap["running"], snap["waiting"]) if "block_keys" in r}
    return {"entries": entries, "cached": cached, "tracked": tracked, "keys": keys}


@pytest.mark.parametrize("seed", range(8))
def test_the_changes_rebuild_the_full_table_and_it_says_what_describe_says(seed: int) -> None:
    sim = PoolSim(48 if seed % 2 else 300, seed, readmit=seed % 4 < 2)
    pool = TrackedPool(sim.n)
    table = PoolTable(pool)
    consumer: Consumer | None = None
    changed = 0
    for _ in range(400):
        step = sim.step()
        assert pool.step(step), pool.problem
        snap = snap_of(step)
        change = table.update(snap)
        full = snap_of(step)
        table.full(full)
        if change is None:  # the first state: the consumer starts from the full table
            assert consumer is None
            consumer = Consumer(full)
        else:
            assert consumer is not None
            consumer.apply(snap, change)
            changed += bool(change)
        assert consumer.state() == full_state(full), step["seq"]
        assert consumer.expand() == described(pool, snap_of(step)), step["seq"]
    assert changed > 300


def test_a_dump_or_a_lost_pool_asks_for_the_table_in_full() -> None:
    sim = PoolSim(64, 3)
    pool = TrackedPool(sim.n)
    table = PoolTable(pool)
    steps = [sim.step() for _ in range(5)]
    for st in steps[:3]:
        pool.step(st)
        got = table.update(snap_of(st))
        assert (got is None) == (st["seq"] == 0)
    pool.step(steps[4])  # step 3 never seen: the pool is lost until a dump
    assert table.update(snap_of(steps[4])) is None and not table.known


def test_a_step_changes_what_it_touched_not_the_pool() -> None:
    """A big pool, one request growing by a block: the change names a handful of blocks."""
    from bear.benchmarks.pool import synthetic_steps

    pool, snaps, steps = synthetic_steps(5_000, steps=5, seed=1)
    table = PoolTable(pool)
    assert table.update(snaps[0]) is None
    for st, snap in zip(steps, snaps[1:], strict=True):
        assert pool.step(st)
        change = table.update(snap)
        assert change is not None and 0 < len(change.get("put", ())) // 4 + len(change.get("drop", ())) < 64




@pytest.mark.parametrize("seed", range(4))
def test_libbea_applies_the_changes_to_the_full_table_and_estimates_as_from_it(seed: int) -> None:
    """libbea's ``Snapshot.apply_delta`` with the table's change, step by step: the state equals
    the one read from the full snapshot at every step, and so do estimates from it — which equal
    those from the table as ``describe`` writes it (positions and indices: libbea derives them)."""
    from bear import libbea
    from bear.instance.delta import encode_delta
    from bear.protocol.codec import pack

    sim = PoolSim(48 if seed % 2 else 300, seed + 10)
    pool = TrackedPool(sim.n)
    table = PoolTable(pool)
    live = None
    prev: dict[str, Any] | None = None
    applied = 0
    for _ in range(250):
        step = sim.step()
        assert pool.step(step)
        cur = replay_state(sim, step)
        change = table.update(cur)
        full = replay_state(sim, step)
        table.full(full)
        if change is None:
            live = libbea.Snapshot.from_dict(full)
        else:
            assert live is not None and prev is not None
            d = encode_delta(prev, cur)
            assert d is not None
            d["pool"] = change
            live.apply_delta(libbea.Delta.from_msgpack(pack(d)))
            applied += 1
        want = libbea.Snapshot.from_dict(full)
        assert libbea.snapshot_difference(live, want) is None, step["seq"]
        q = {"id": "Q", "prompt_tokens": 40, "max_tokens": 2, "block_keys": [sim.systems[0][0] & ((1 << 63) - 1)]}
        a = libbea.estimate(live, q, beta=[1e-3, 1e-5, 0.0, 0.0])
        b = libbea.estimate(want, q, beta=[1e-3, 1e-5, 0.0, 0.0])
        assert a == b
        old = replay_state(sim, step)  # the same step described as before (positions, indices)
        assert pool.describe(old)
        assert libbea.estimate(libbea.Snapshot.from_dict(old), q, beta=[1e-3, 1e-5, 0.0, 0.0], trace=True) == \
            libbea.estimate(want, q, beta=[1e-3, 1e-5, 0.0, 0.0], trace=True)
        prev = cur
    assert applied == 249


def test_a_delta_without_the_table_drops_it_and_one_for_a_state_without_it_keeps_counts() -> None:
    """A delta without ``pool`` (the snapshotter lost the pool) leaves the replay to counts; a
    table change for a state that holds none (a resync answered with counts) changes nothing
    but the lists, until a full snapshot brings the table."""
    from bear import libbea
    from bear.instance.delta import encode_delta
    from bear.protocol.codec import pack

    sim = PoolSim(64, 1)
    pool = TrackedPool(sim.n)
    table = PoolTable(pool)
    s0 = sim.step()
    pool.step(s0)
    st0 = replay_state(sim, s0)
    assert table.update(st0) is None
    full = replay_state(sim, s0)
    table.full(full)
    s1 = sim.step()
    pool.step(s1)
    st1 = replay_state(sim, s1)
    change = table.update(st1)
    d = encode_delta(st0, st1)
    assert d is not None and change is not None
    bare = libbea.Snapshot.from_dict(st0)
    bare.apply_delta(libbea.Delta.from_msgpack(pack({**d, "pool": change})))
    assert bare.tracked_blocks == 0 and libbea.snapshot_difference(bare, libbea.Snapshot.from_dict(st1)) is None
    with pytest.raises(ValueError, match=r"delta\.pool\.put"):  # still checked
        libbea.Snapshot.from_dict(st0).apply_delta(libbea.Delta.from_msgpack(pack({**d, "pool": {"put": [1, 2]}})))
    live = libbea.Snapshot.from_dict(full)
    live.apply_delta(libbea.Delta.from_msgpack(pack(d)))  # the snapshotter lost the pool: counts only
    assert libbea.snapshot_difference(live, libbea.Snapshot.from_dict(st1)) is None
