"""``bear bench pool``: what describing the block pool costs the snapshotter per published step
(``BEAR_SNAPSHOT_BLOCK_OPS=1``, ``TrackedPool.describe``) as the pool grows toward GPU sizes, and
what it adds to the snapshot on the wire. The pools are synthetic and shaped like a busy engine's:
``cached_frac`` of the blocks hold a name, ``free_frac`` wait in the free queue (in random
order), ``running`` requests hold the rest, the first ``shared`` blocks of each of them one
common system prompt's. Medians and p99 over ``reps`` runs."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from bear.prefix.tracked_pool import TrackedPool
from bear.protocol.codec import pack


def synthetic_pool(num_gpu_blocks: int, *, cached_frac: float = 0.8, free_frac: float = 0.6, running: int = 64,
                   shared: int = 8, waiting: int = 16,
                   seed: int = 0) -> tuple[TrackedPool, dict[str, Any]]:  # fmt: skip
    """A synced pool and the snapshot of its step (running requests holding blocks, waiting ones
    with logged names) — what ``describe`` is given."""
    rng = random.Random(seed)
    pool = TrackedPool(num_gpu_blocks)
    blocks = list(range(1, num_gpu_blocks))
    rng.shuffle(blocks)
    n_free = int(free_frac * len(blocks))
    free, held = blocks[:n_free], blocks[n_free:]
    rep = pool.replica
    rep.queue = OrderedDict.fromkeys(free)
    named = rng.sample(blocks, int(cached_frac * len(blocks)))
    rep.names = {b: rng.getrandbits(64) for b in named}
    common, rest = held[:shared], held[shared:]
    per = max(1, len(rest) // max(1, running))
    snap: dict[str, Any] = {"running": [], "waiting": []}
    for k in range(running):
        rid = f"r{k}"
        pool.holders[rid] = common + rest[k * per:(k + 1) * per]
        snap["running"].append({"id": rid})
    for k in range(waiting):
        rid = f"w{k}"
        pool.names[rid] = [rng.getrandbits(64) for _ in range(rng.randint(1, 64))]
        snap["waiting"].append({"id": rid})
    pool.synced, pool.problem = True, None
    return pool, snap


def _fresh(snap: dict[str, Any]) -> dict[str, Any]:
    return {"running": [{"id": r["id"]} for r in snap["running"]], "waiting": [{"id": r["id"]} for r in snap["waiting"]]}


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e3
    return {"p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)), "n": len(xs)}


def run_pool_bench(sizes: tuple[int, ...] = (1_000, 10_000, 50_000), reps: int = 20, seed: int = 0) -> dict[str, Any]:
    """Per pool size: ``describe`` (the table, the running requests' tracked blocks, every
    request's keys), and the described snapshot's msgpack size and encoding time."""
    out: dict[str, Any] = {"reps": reps, "sizes": {}}
    for n in sizes:
        pool, snap = synthetic_pool(n, seed=seed)
        times, enc = [], []
        described: dict[str, Any] = {}
        size = 0
        for _ in range(reps):
            described = _fresh(snap)
            t = time.perf_counter()
            pool.describe(described)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            size = len(pack(described))
            enc.append(time.perf_counter() - t)
        out["sizes"][str(n)] = {"describe": _stats(times), "encode": _stats(enc), "bytes": size,
                                "table_entries": len(described["tracked_blocks"])}
    return out
