"""``bear bench pool``: what describing the block pool costs the snapshotter per published step
(``BEAR_SNAPSHOT_BLOCK_OPS=1``, ``TrackedPool.describe``) as the pool grows toward GPU sizes, and
what it adds to the snapshot on the wire. The pools are synthetic and shaped like a busy engine's:
``cached_frac`` of the blocks hold a name, ``free_frac`` wait in the free queue (in random
order), ``running`` requests hold the rest, the first ``shared`` blocks of each of them one
common system prompt's. Medians and p99 over ``reps`` runs."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from bear.prefix.pool_replica import OP_APPEND, OP_CACHE, OP_DUMP, OP_NAMES, OP_POP, OP_PREPEND, OP_TOUCH
from bear.prefix.tracked_pool import PoolTable, TrackedPool, keys_of
from bear.protocol.codec import pack
from bear.protocol.schemas import SNAPSHOT


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
    named = rng.sample(blocks, int(cached_frac * len(blocks)))
    rep.apply((OP_DUMP, free, named, [rng.getrandbits(64) for _ in named]))
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


def _us(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"p50_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)), "n": len(xs)}


BETA = [1e-3, 1e-5, 0.0, 0.0]
DRAWS = {"length_sigma": 0.5, "length_draws": 15, "draw_shortcut": False}


class _States:
    """bear.snapshot/1 maps of the synthetic steps (static fields fixed per request), for libbea."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.n = num_gpu_blocks
        self.prompt: dict[str, int] = {}

    def state(self, seq: int, snap: dict[str, Any], holders: dict[str, list[int]], free: int) -> dict[str, Any]:
        def req(rid: str, held: int) -> dict[str, Any]:
            p = self.prompt.setdefault(rid, 16 * (held + 64))
            return {"id": rid, "prompt_tokens": p, "computed_tokens": min(p, 16 * held), "output_tokens": 0,
                    "max_tokens": 256, "blocks": held, "exclusive_blocks": held, "preemptions": 0,
                    "arrival": 0.0, "priority": 0}

        return {"v": SNAPSHOT, "instance": "bench", "model": "m", "seq": seq, "time": float(seq),
                "config": {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "block_size": 16,
                           "num_gpu_blocks": self.n, "max_model_len": 16 * (self.n + 64),
                           "enable_prefix_caching": True},
                "free_blocks": free,
                "running": [req(r["id"], len(holders.get(r["id"]) or ())) for r in snap["running"]],
                "waiting": [req(r["id"], 0) for r in snap["waiting"]]}


def busy_pool_state(num_gpu_blocks: int, steps: int = 0, seed: int = 0) -> tuple[dict[str, Any], TrackedPool]:
    """The synthetic busy pool after ``steps`` of its steps, as the full state a worker holds
    (the table in stable form), and the pool (its requests' block names: a query's keys)."""
    pool, snaps, st = synthetic_steps(num_gpu_blocks, steps=max(steps, 1), seed=seed)
    table, states = PoolTable(pool), _States(num_gpu_blocks)
    table.update(states.state(0, snaps[0], pool.holders, pool.replica.free_blocks))
    seq, snap, free = 0, snaps[0], pool.replica.free_blocks
    for step, after in list(zip(st, snaps[1:], strict=True))[:steps]:
        pool.step(step)
        seq, snap, free = step["seq"], after, step["free_blocks"]
        table.update(states.state(seq, snap, pool.holders, free))
    last = states.state(seq, snap, pool.holders, free)
    table.full(last)
    return last, pool


def run_delta_bench(num_gpu_blocks: int, steps: int = 200, seed: int = 0) -> dict[str, Any]:
    """The table kept step by step (``PoolTable``) on ``steps`` realistic steps (``_Engine``: a
    handful of block ops each): the snapshotter's per-step cost — applying the step's ops
    (``TrackedPool.step``, paid by the full description too) and the table's change
    (``PoolTable.update``) —, the change's msgpack bytes, and the worker's ingest of the step's
    ``bear.delta/1`` with the change (``libbea.Delta.from_msgpack`` + ``Snapshot.apply_delta``);
    then the full table's cost (a full snapshot), what the first estimate of a state pays for
    deriving positions from tickets and the ledger's start (``prepare``, once per state: the first
    estimate's time less the second's), and an estimate from the prepared state — point lengths,
    and the estimator's 15 lengths drawn without the shortcut (every draw replayed)."""
    from bear import libbea
    from bear.instance.delta import encode_delta

    pool, snaps, st = synthetic_steps(num_gpu_blocks, steps=steps, seed=seed)
    table = PoolTable(pool)
    states = _States(num_gpu_blocks)
    prev = states.state(0, snaps[0], pool.holders, pool.replica.free_blocks)
    if table.update(prev) is not None:
        raise AssertionError("the first state must go out in full")
    first = states.state(0, snaps[0], pool.holders, pool.replica.free_blocks)
    t = time.perf_counter()
    table.full(first)
    full_s = time.perf_counter() - t
    full_bytes = pack(first)
    live = libbea.Snapshot.from_dict(first)
    ops_t, upd_t, step_t, ingest_t, change_bytes, delta_bytes = [], [], [], [], [], []
    est_t, again_t, drawn_t = [], [], []
    q = {"id": "Q", "prompt_tokens": 256, "max_tokens": 2, "block_keys": keys_of(pool.names.get("w0", [])[:4])}
    for k, (step, snap) in enumerate(zip(st, snaps[1:], strict=True)):
        t0 = time.perf_counter()
        pool.step(step)
        t1 = time.perf_counter()
        cur = states.state(step["seq"], snap, pool.holders, step["free_blocks"])
        t2 = time.perf_counter()
        change = table.update(cur)
        t3 = time.perf_counter()
        if change is None:
            raise AssertionError("a synthetic step lost the table")
        ops_t.append(t1 - t0)
        upd_t.append(t3 - t2)
        step_t.append(t1 - t0 + t3 - t2)
        change_bytes.append(len(pack(change)))
        d = encode_delta(prev, cur)
        if d is None:
            raise AssertionError("a synthetic step has no delta")
        d["pool"] = change
        body = pack(d)
        delta_bytes.append(len(body))
        t = time.perf_counter()
        live.apply_delta(libbea.Delta.from_msgpack(body))
        ingest_t.append(time.perf_counter() - t)
        if k % 10 == 0:  # the first estimate of a state prepares it; the later ones find it prepared
            t = time.perf_counter()
            libbea.estimate(live, q, beta=BETA)
            t1 = time.perf_counter()
            libbea.estimate(live, q, beta=BETA)
            t2 = time.perf_counter()
            est_t.append(max(0.0, 2 * t1 - t - t2))
            again_t.append(t2 - t1)
            libbea.estimate(live, q, beta=BETA, **DRAWS)  # its prepared form with lengths drawn
            t = time.perf_counter()
            libbea.estimate(live, q, beta=BETA, **DRAWS)
            drawn_t.append(time.perf_counter() - t)
        prev = cur
    last = states.state(st[-1]["seq"], snaps[-1], pool.holders, st[-1]["free_blocks"])
    table.full(last)
    diff = libbea.snapshot_difference(live, libbea.Snapshot.from_dict(last))
    if diff is not None:
        raise AssertionError(f"the deltas did not rebuild the table: {diff}")
    return {"steps": steps, "table_entries": len(table.entries),
            "snapshotter_step": _us(step_t), "apply_ops": _us(ops_t), "table_change": _us(upd_t),
            "change_bytes_p50": float(np.median(change_bytes)), "delta_bytes_p50": float(np.median(delta_bytes)),
            "worker_ingest": _us(ingest_t), "prepare_per_state": _us(est_t),
            "estimate_prepared": _us(again_t), "estimate_drawn_prepared": _us(drawn_t),
            "full_table": {"ms": full_s * 1e3, "bytes": len(full_bytes)}}


def run_pool_bench(sizes: tuple[int, ...] = (1_000, 10_000, 50_000), reps: int = 20, seed: int = 0,
                   steps: int = 200) -> dict[str, Any]:  # fmt: skip
    """Per pool size: ``describe`` (the table, the running requests' tracked blocks, every
    request's keys), and the described snapshot's msgpack size and encoding time — each step in
    full, as before issue 28 —; and the table kept step by step (``run_delta_bench``)."""
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
                                "table_entries": len(described["tracked_blocks"]),
                                "deltas": run_delta_bench(n, steps=steps, seed=seed)}
    return out



class _Engine:
    """Steps of a busy engine on a synthetic pool, as the plugin logs them (a handful of ops per
    step): ``grow`` running requests fill a block (cached under a new name) and take the next free
    one; now and then (``finish``) one finishes (its blocks freed in vLLM's order) and a new request
    is admitted with a hit on the first blocks of the one that finished before (touched off the
    free queue). Steps are generated on a pool of their own and checked there (``TrackedPool.step``
    compares the free count)."""

    def __init__(self, pool: TrackedPool, snap: dict[str, Any], *, grow: int, finish: float, seed: int) -> None:
        self.pool, self.rng = pool, random.Random(seed + 1)
        self.running = {r["id"]: list(pool.holders[r["id"]]) for r in snap["running"]}
        self.waiting = [r["id"] for r in snap["waiting"]]
        self.refs: dict[int, int] = {}
        for bl in self.running.values():
            for b in bl:
                self.refs[b] = self.refs.get(b, 0) + 1
        self.grow, self.finish = grow, finish
        self.freed: list[int] = []
        self.seq = 0
        self.count = 0

    def step(self) -> tuple[dict[str, Any], dict[str, Any]]:
        rng, rep = self.rng, self.pool.replica
        self.seq += 1
        ops: list[Any] = []
        finishing = self.running and rng.random() < self.finish
        hit = [b for b in self.freed[:4] if b in rep.names and b in rep.queue] if finishing else []
        if hit:
            ops.append((OP_TOUCH, hit))
        front = (b for b in rep.queue if b not in hit)
        popped: list[int] = []
        cached: set[int] = set()
        for rid in rng.sample(sorted(self.running), min(self.grow, len(self.running))):
            bl = self.running[rid]
            last = bl[-1]
            if last not in rep.names and self.refs.get(last) == 1 and last not in popped:
                ops.append((OP_CACHE, [last], [rng.getrandbits(64)]))
                cached.add(last)
            b = next(front)
            popped.append(b)
            self.refs[b] = 1
            self.running[rid] = [*bl, b]
        if finishing:
            rid = rng.choice(sorted(self.running))
            bl = self.running.pop(rid)
            new = f"n{self.count}"
            self.count += 1
            ops.append((OP_NAMES, new, "".join(f"{rng.getrandbits(64):016x}" for _ in range(8))))
            for b in hit:
                self.refs[b] = self.refs.get(b, 0) + 1
            mine = [next(front) for _ in range(8 - len(hit))]
            for b in mine:
                self.refs[b] = 1
            popped += mine
            self.running[new] = hit + mine
        if popped:
            ops.append((OP_POP, popped))
        freed = 0
        if finishing:
            gone = set(popped)
            back: list[int] = []
            ahead: list[int] = []
            for b in reversed(bl):
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    del self.refs[b]
                    (back if b in cached or (b in rep.names and b not in gone) else ahead).append(b)
            if ahead:
                ops.append((OP_PREPEND, ahead))
            if back:
                ops.append((OP_APPEND, back))
            freed = len(ahead) + len(back)
            self.freed = bl
        step = {"seq": self.seq, "block_ops": ops, "free_blocks": rep.free_blocks - len(hit) - len(popped) + freed,
                "block_ids": {r: list(bl) for r, bl in self.running.items()},
                "running": [[r] for r in self.running], "waiting": [[r] for r in self.waiting]}
        snap = {"running": [{"id": r} for r in self.running], "waiting": [{"id": r} for r in self.waiting]}
        return step, snap


def synthetic_steps(num_gpu_blocks: int, *, steps: int, grow: int = 4, finish: float = 0.3,
                    seed: int = 0) -> tuple[TrackedPool, list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """A synced synthetic pool, its first snapshot and ``steps`` realistic steps (``_Engine``,
    checked on a pool of its own): ``(the pool before the first step, snapshots, steps)``."""
    pool, snap = synthetic_pool(num_gpu_blocks, seed=seed)
    shadow, _ = synthetic_pool(num_gpu_blocks, seed=seed)
    eng = _Engine(shadow, snap, grow=grow, finish=finish, seed=seed)
    out, snaps = [], [_fresh(snap)]
    pool.seq = shadow.seq = 0
    for _ in range(steps):
        st, sn = eng.step()
        if not shadow.step(st):
            raise AssertionError(f"synthetic step {st['seq']}: {shadow.problem}")
        out.append(st)
        snaps.append(sn)
    return pool, snaps, out
