"""A small engine for tests: random steps of vLLM's block pool as the plugin logs them (block ops,
each running request's blocks), with prefix hits on a few shared prompts, growth, finishes,
preemptions, evictions and forks (two running requests holding a block nobody named)."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from bear.prefix.pool_replica import (
    OP_APPEND,
    OP_CACHE,
    OP_DUMP,
    OP_EVICT,
    OP_NAMES,
    OP_POP,
    OP_PREPEND,
    OP_TOUCH,
)


def _hex(names: list[int]) -> str:
    return b"".join(n.to_bytes(8, "big") for n in names).hex()


class PoolSim:
    def __init__(self, num_gpu_blocks: int, seed: int, *, readmit: bool = False) -> None:
        self.readmit = readmit  # a request preempted may be admitted again in the same step (vLLM's does not)
        self.rng = random.Random(seed)
        self.n = num_gpu_blocks
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.names: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.running: dict[str, list[int]] = {}
        self.waiting: list[str] = []
        self.prompts: dict[str, list[int]] = {}
        self.systems = [[self.rng.getrandbits(64) for _ in range(self.rng.randint(1, 6))] for _ in range(3)]
        self.seq = -1
        self.count = 0
        self.preemptions: dict[str, int] = {}

    def _pop(self, k: int, ops: list[Any]) -> list[int] | None:
        if k > len(self.queue):
            return None
        got = [self.queue.popitem(last=False)[0] for _ in range(k)]
        for b in got:
            self.names.pop(b, None)
            self.refs[b] = 1
        ops.append((OP_POP, got))
        return got

    def _release(self, bl: list[int], ops: list[Any]) -> None:
        front: list[int] = []
        back: list[int] = []
        for b in reversed(bl):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                (back if b in self.names else front).append(b)
        if front:
            ops.append((OP_PREPEND, front))
            for b in reversed(front):
                self.queue[b] = None
                self.queue.move_to_end(b, last=False)
        if back:
            ops.append((OP_APPEND, back))
            for b in back:
                self.queue[b] = None

    def _admit(self, rid: str, ops: list[Any]) -> bool:
        names = self.prompts[rid]
        by_name: dict[int, int] = {}
        for b, nm in self.names.items():
            by_name.setdefault(nm, b)
        hit: list[int] = []
        for nm in names:
            b = by_name.get(nm)
            if b is None:
                break
            hit.append(b)
        free_hit = [b for b in hit if b in self.queue]
        need = len(names) + 1 - len(hit)
        if need + len(free_hit) > len(self.queue):
            return False
        if free_hit:
            ops.append((OP_TOUCH, free_hit))
            for b in free_hit:
                del self.queue[b]
        for b in hit:
            self.refs[b] = self.refs.get(b, 0) + 1
        new = self._pop(need, ops)
        assert new is not None
        bl = hit + new
        fresh = [(b, nm) for b, nm in zip(bl, names, strict=False) if b not in self.names]
        if fresh and self.rng.random() < 0.9:
            ops.append((OP_CACHE, [b for b, _ in fresh], [nm for _, nm in fresh]))
            self.names.update(fresh)
        self.running[rid] = bl
        return True

    def step(self) -> dict[str, Any]:
        rng = self.rng
        self.seq += 1
        ops: list[Any] = []
        if self.seq == 0:
            ops.append((OP_DUMP, list(self.queue), [], []))
        for _ in range(rng.randint(0, 2)):  # arrivals
            rid = f"q{self.count}"
            self.count += 1
            sys_p = rng.choice(self.systems)
            names = sys_p[: rng.randint(0, len(sys_p))] + [rng.getrandbits(64) for _ in range(rng.randint(0, 4))]
            self.prompts[rid] = names
            ops.append((OP_NAMES, rid, _hex(names)))
            self.waiting.append(rid)
        preempted = False
        for rid in list(self.running):
            x = rng.random()
            bl = self.running[rid]
            if x < 0.12:  # finishes
                self._release(bl, ops)
                del self.running[rid]
            elif x < 0.16:  # preempted
                self._release(bl, ops)
                del self.running[rid]
                self.waiting.insert(0, rid)
                self.preemptions[rid] = self.preemptions.get(rid, 0) + 1
                preempted = True
            elif x < 0.5:  # a block filled: cached, and a new one taken
                last = bl[-1]
                if last not in self.names and self.refs.get(last) == 1 and rng.random() < 0.8:
                    nm = rng.getrandbits(64)
                    ops.append((OP_CACHE, [last], [nm]))
                    self.names[last] = nm
                got = self._pop(1, ops)
                if got is not None:
                    self.running[rid] = bl + got
        while self.waiting and len(self.running) < 12 and rng.random() < 0.7 and (self.readmit or not preempted):
            if not self._admit(self.waiting[0], ops):
                break
            self.waiting.pop(0)
        if len(self.running) >= 2 and rng.random() < 0.05:  # a fork: two requests share an unnamed block
            a, b = rng.sample(sorted(self.running), 2)
            blk = self.running[a][-1]
            if blk not in self.names:
                self.refs[blk] += 1
                self.running[b] = self.running[b] + [blk]
        if rng.random() < 0.1:  # evict a free cached block
            cand = [b for b in list(self.queue)[:20] if b in self.names]
            if cand:
                ops.append((OP_EVICT, cand[:1]))
                del self.names[cand[0]]
        return {"seq": self.seq, "free_blocks": len(self.queue), "block_ops": ops,
                "block_ids": {r: list(bl) for r, bl in self.running.items()},
                "running": [[r, self.preemptions.get(r, 0)] for r in self.running],
                "waiting": [[r, self.preemptions.get(r, 0)] for r in self.waiting]}


def snap_of(step: dict[str, Any]) -> dict[str, Any]:
    return {"running": [{"id": r[0], "preemptions": r[1]} for r in step["running"]],
            "waiting": [{"id": r[0], "preemptions": r[1]} for r in step["waiting"]]}


def replay_state(sim: PoolSim, step: dict[str, Any]) -> dict[str, Any]:
    """The step as a bear.snapshot/1 map (the fields a replay needs; static fields stay put)."""
    def req(rid: str, bl: list[int] | None) -> dict[str, Any]:
        p = 16 * len(sim.prompts[rid]) + 8
        held = len(bl or ())
        return {"id": rid, "prompt_tokens": p, "computed_tokens": min(p, 16 * held), "output_tokens": 0,
                "max_tokens": 64, "blocks": held, "exclusive_blocks": held,
                "preemptions": sim.preemptions.get(rid, 0), "arrival": 0.0, "priority": 0}

    return {"v": "bear.snapshot/1", "instance": "i", "model": "m", "generation": 0, "seq": step["seq"],
            "time": float(step["seq"]),
            "config": {"max_num_batched_tokens": 256, "max_num_seqs": 16, "block_size": 16,
                       "num_gpu_blocks": sim.n, "max_model_len": 4096, "enable_prefix_caching": True},
            "free_blocks": step["free_blocks"],
            "running": [req(r[0], step["block_ids"][r[0]]) for r in step["running"]],
            "waiting": [req(r[0], None) for r in step["waiting"]]}
