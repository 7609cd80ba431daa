"""vLLM's BlockPool, block by block, rebuilt from the plugin's block-op log
(``BEAR_SNAPSHOT_BLOCK_OPS=1``, the records' ``block_ops``): the free queue in order and the
hash of every cached block.

The prefix mirror (``mirror.py``) knows *which* blocks are cached; what an exact replay under KV
pressure also needs is *where* each cached block waits in the free queue (how many allocations
evict it) and whether it is free at all (a hit on a free block costs a free block at admission):
docs/estimator.md, "What an exact replay under KV pressure needs". This replica answers both,
and checks itself against the engine on every op it applies: a pop must take the queue's front,
a touch or an eviction must find a cached block, the free count must equal the engine's.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

# the plugin's op codes (bear.snapshotter.plugin_block_ops.OP_*; the plugin imports nothing of bear)
OP_POP, OP_TOUCH, OP_PREPEND, OP_APPEND, OP_CACHE, OP_EVICT, OP_RESET, OP_DUMP, OP_NAMES = range(9)

# Free blocks' tickets start here: blocks freed to the front count down from it, to the back up;
# neither end comes near 0 or 2^63 (the table's -1 means held; libbea's tickets are int64).
TICKET_BASE = 1 << 61


class ReplicaMismatch(ValueError):
    """An op the replica cannot apply: it and the engine disagree (or an op was lost)."""


class BlockPoolReplica:
    """One engine's block pool, from its first record's dump (or from engine start)."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        self.num_gpu_blocks = num_gpu_blocks
        # vLLM's free queue starts with every block in id order; block 0 is popped as the null block
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.names: dict[int, int] = {}  # cached block id -> its name (the digest's low 64 bits)
        self.ops = 0
        # Order-preserving ranks for the table in deltas (tracked_pool.PoolTable): each free block's
        # ticket (entering at the back: one above every other, at the front: one below), so that
        # sorting by ticket gives the queue's order and a pop moves no other block's ticket; each
        # cached block's stamp (when it got its name: the names' order, which vLLM's lookups follow).
        self.ticket: dict[int, int] = {b: TICKET_BASE + b for b in range(1, num_gpu_blocks)}
        self._front, self._back = TICKET_BASE + 1, TICKET_BASE + num_gpu_blocks
        self.stamp: dict[int, int] = {}
        self._stamps = 0
        self.touched: set[int] = set()  # blocks whose ticket or name changed since the caller cleared it
        self.rebuilt = False  # a dump or a reset since the caller cleared it: every block may have changed

    @property
    def free_blocks(self) -> int:
        return len(self.queue)

    def apply_all(self, ops: Iterable[Sequence[Any]]) -> None:
        for op in ops:
            self.apply(op)

    def apply(self, op: Sequence[Any]) -> None:
        self.ops += 1
        code = op[0]
        if code == OP_POP:
            for b in op[1]:
                front = next(iter(self.queue), None)
                if front != b:
                    raise ReplicaMismatch(f"op {self.ops}: the engine took block {b}, the replica's front is {front}")
                self.queue.popitem(last=False)
                del self.ticket[b]
                if self.names.pop(b, None) is not None:  # a cached block taken for new content is evicted
                    del self.stamp[b]
                self.touched.add(b)
        elif code == OP_TOUCH:
            for b in op[1]:
                if b not in self.queue or b not in self.names:
                    raise ReplicaMismatch(f"op {self.ops}: a hit took block {b}, not a free cached block here")
                del self.queue[b]
                del self.ticket[b]
                self.touched.add(b)
        elif code in (OP_PREPEND, OP_APPEND):
            for b in op[1]:
                if b in self.queue or not 0 < b < self.num_gpu_blocks:
                    raise ReplicaMismatch(f"op {self.ops}: block {b} freed but already free (or out of range)")
            if code == OP_APPEND:
                for b in op[1]:
                    self.queue[b] = None
                    self.ticket[b] = self._back
                    self._back += 1
            else:
                for b in reversed(op[1]):  # the first one ends up at the front
                    self.queue[b] = None
                    self.queue.move_to_end(b, last=False)
                    self._front -= 1
                    self.ticket[b] = self._front
            self.touched.update(op[1])
        elif code == OP_CACHE:
            for b, name in zip(op[1], op[2], strict=True):
                if not 0 < b < self.num_gpu_blocks:
                    raise ReplicaMismatch(f"op {self.ops}: block {b} cached but out of range")
                if b not in self.names:  # a name given again keeps its place (as the dict does)
                    self.stamp[b] = self._stamps
                    self._stamps += 1
                self.names[b] = int(name)
                self.touched.add(b)
        elif code == OP_EVICT:
            for b in op[1]:
                if self.names.pop(b, None) is not None:
                    del self.stamp[b]
                self.touched.add(b)
        elif code == OP_RESET:
            self.names.clear()
            self.stamp.clear()
            self.rebuilt = True
        elif code == OP_NAMES:
            pass  # a request's block names: no change to the pool (TrackedPool keeps them)
        elif code == OP_DUMP:
            self.queue = OrderedDict.fromkeys(op[1])
            self.names = {int(b): int(n) for b, n in zip(op[2], op[3], strict=True)}
            self.ticket = dict(zip(self.queue, range(TICKET_BASE, TICKET_BASE + len(self.queue)), strict=True))
            self._front, self._back = TICKET_BASE, TICKET_BASE + len(self.queue)
            self.stamp = dict(zip(self.names, range(len(self.names)), strict=True))
            self._stamps = len(self.names)
            self.rebuilt = True
        else:
            raise ReplicaMismatch(f"op {self.ops}: unknown op code {code!r}")

    def check_free(self, engine_free: int) -> None:
        if engine_free != len(self.queue):
            raise ReplicaMismatch(f"after op {self.ops}: {len(self.queue)} free blocks here, {engine_free} in the engine")

    def cached_names(self) -> Counter[int]:
        """Every cached block's name, counted (what a KV-event mirror holds)."""
        return Counter(self.names.values())

    def positions(self) -> dict[int, int]:
        """Free block id -> its place in the queue (0: the next allocation takes it)."""
        return dict(zip(self.queue, range(len(self.queue)), strict=True))

    def chain(self, names: Sequence[int], max_blocks: int) -> list[int]:
        """The blocks of the longest run of ``names`` (a prompt's block names, in order) cached now,
        at most ``max_blocks``: the hit vLLM would find, as block ids (the lowest id where two
        blocks hold one name; vLLM takes any)."""
        by_name: dict[int, int] = {}
        for b, n in self.names.items():
            if n not in by_name or b < by_name[n]:
                by_name[n] = b
        out: list[int] = []
        for n in names[:max_blocks]:
            b = by_name.get(int(n))
            if b is None:
                break
            out.append(b)
        return out
