"""The block pool of a recorded run, step by step, rebuilt from the plugin's block-op log
(``BEAR_SNAPSHOT_BLOCK_OPS=1``): each replay case described for libbea's tracked-block replay
under KV pressure by the code the live snapshotter runs (``bear.prefix.tracked_pool``;
docs/estimator.md, "What an exact replay under KV pressure needs").

For the case of request R whose snapshot is the state after step s: the pool after step s
(every cached block, its place in the free queue, its name as a key), the running requests'
blocks, and block keys for every request — the names the engine logged at their arrival, or,
for runs recorded before the plugin logged them, the names of their recorded prompts. R's own
keys are its prompt's block names as the estimator computes them from the token ids (vLLM's
hashing, as the KV-event mirror does): the replay finds R's hit from them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from bear.prefix.hashing import HashSpec
from bear.prefix.hits import Hashers
from bear.prefix.tracked_pool import TrackedPool, keys_of
from bear.protocol.codec import pack
from bear.protocol.subjects import SNAPSHOT_SCHEMA
from bear.replay.recorded_cache import find_prompt
from bear.snapshotter.records import to_snapshot


def logged(steps: Sequence[dict[str, Any]]) -> bool:
    """Whether a generation's steps carry the block-op log (and who holds which block)."""
    return bool(steps) and steps[0].get("block_ops") is not None


def add_tracked_blocks(cases: list[dict[str, Any]], meta: dict[str, Any], steps: Sequence[dict[str, Any]],
                       spec: HashSpec, prompts: dict[str, list[int]]) -> int:
    """Describe each case whose request's prompt is known (module doc), in place: the snapshot's
    ``tracked_blocks``/``tracked_keys``, each running request's ``tracked``, ``block_keys`` for
    every request whose names are known. Returns how many cases were described."""
    pool = TrackedPool(int(meta["config"]["num_gpu_blocks"]))
    hasher = Hashers().get(spec)
    B = spec.block_size

    def names(rid: str) -> list[int] | None:
        toks = find_prompt(prompts, rid)
        return None if toks is None else list(hasher.names(toks, len(toks) // B))

    done = nxt = 0
    for k in sorted(range(len(cases)), key=lambda k: cases[k]["snapshot"]["seq"]):
        c = cases[k]
        s = c["snapshot"]["seq"]
        while nxt < len(steps) and steps[nxt]["seq"] <= s:
            pool.step(steps[nxt])
            nxt += 1
        req = c["request"]
        mine = names(req["id"])
        if mine is None:
            continue
        snap = c["snapshot"]
        extra = {r["id"]: n for r in (*snap["running"], *snap["waiting"])
                 if r["id"] not in pool.names and (n := names(r["id"])) is not None}
        if not pool.describe(snap, extra):
            continue
        req["block_keys"] = keys_of(mine)
        done += 1
    return done


def published_states(meta: dict[str, Any], steps: Sequence[dict[str, Any]], *, instance: str,
                     model: str = "", generation: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(seq, bear.snapshot/1 bytes)`` for each step of a recorded run, as the snapshotter
    publishes them in full (``Snapshotter._drain``: the state, then its pool block by block while
    the pool is known), every step described — what a live estimator receives from a snapshotter
    that keeps up (the recorded real-vLLM KV-pressure test replays from these). A gap in the
    seqs (records the snapshotter lost) makes the pool unknown until the next dump, as live."""
    pool = TrackedPool(int(meta["config"]["num_gpu_blocks"]))
    for st in steps:
        snap = to_snapshot(st, meta.get("config", {}), instance=instance, model=model)
        if st.get("block_ops") is not None:
            pool.step(st)
            pool.describe(snap)
        snap.update(v=SNAPSHOT_SCHEMA, instance=instance, generation=generation)
        yield int(st["seq"]), pack(snap)


def published_stream(meta: dict[str, Any], steps: Sequence[dict[str, Any]], *, instance: str, model: str = "",
                     generation: int = 0, full_every: int = 256,
                     ) -> Iterator[tuple[dict[str, Any], bytes | None, bytes | None]]:  # fmt: skip
    """``(state, full bytes or None, delta bytes or None)`` for each step of a recorded run, as a
    snapshotter with ``--pool-deltas`` publishes them: the block table kept step by step
    (``PoolTable``), its change in each step's ``bear.delta/1``, the whole table in the full
    snapshots (the first state, every ``full_every``, after the pool was lost) — the same
    ``StateStream`` rules the live publisher follows. The steps' list changes are computed from
    the two states (``encode_delta``: what the plugin's delta says)."""
    from bear.instance.delta import StateStream, encode_delta
    from bear.prefix.tracked_pool import PoolTable

    pool = TrackedPool(int(meta["config"]["num_gpu_blocks"]))
    table = PoolTable(pool)
    stream = StateStream(full_every=full_every)
    for st in steps:
        snap = to_snapshot(st, meta.get("config", {}), instance=instance, model=model)
        snap.update(v=SNAPSHOT_SCHEMA, instance=instance, generation=generation)
        last = stream.last
        change = encode_delta(last, snap) if last is not None and last["seq"] == snap["seq"] - 1 else None
        fill = None
        if st.get("block_ops") is not None:
            pool.step(st)
            pc = table.update(snap)
            if pool.synced:
                fill = table.full
                if pc is not None and change is not None:
                    change = {**change, "pool": pc}
        stream.with_table(snap, change, fill)
        full, delta = stream.encode(snap, change)
        yield snap, full, delta
