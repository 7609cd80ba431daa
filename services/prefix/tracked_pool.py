"""An engine's block pool described for libbea's tracked-block replay, step by step: the inputs
an exact replay under KV pressure needs (docs/estimator.md, "What an exact replay under KV
pressure needs"; contract.md §2), built from the plugin's block-op log
(``BEAR_SNAPSHOT_BLOCK_OPS=1``).

``TrackedPool`` follows the log (``BlockPoolReplica``: the free queue in order, every cached
block's name) and the block names of every request it saw arrive (``OP_NAMES``). ``describe``
adds to one step's ``bear.snapshot/1``:

* ``tracked_blocks`` / ``tracked_keys``: every cached block — its place in the free queue (−1:
  held) and its name as a key — and every block two running requests share;
* per running request, ``tracked``: its leading blocks up to the last one in the table;
* per request whose arrival was logged, ``block_keys``: its prompt's block names as keys.

With the table keyed by content, a waiting request's and the query's hit need no chain: the
replay finds each block by its key (``block_keys`` of the query: ``keys_of`` its names). The
snapshotter describes every step it publishes this way (the live path); the recorded cases are
described by the same code (``bear.replay.recorded_pool``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any

from bear.prefix.pool_replica import OP_DUMP, OP_NAMES, BlockPoolReplica, ReplicaMismatch

KEY_MASK = (1 << 63) - 1  # libbea's keys are int64 ≥ 0: a name's low 63 bits


def keys_of(names: Iterable[int]) -> list[int]:
    """Block names (vLLM's digests' low 64 bits) as the replay's block keys."""
    return [int(n) & KEY_MASK for n in names]


def unpack_names(data: str) -> list[int]:
    """``OP_NAMES``' names (16 hex digits each: the plugin's log is JSON-able, as steps are
    recorded) as ints."""
    return [int(data[k:k + 16], 16) for k in range(0, len(data) - len(data) % 16, 16)]


class TrackedPool:
    """One engine generation's pool and its requests' block names, from the block-op log."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.replica = BlockPoolReplica(num_gpu_blocks)
        self.names: dict[str, list[int]] = {}  # request id -> its prompt's block names
        self.holders: dict[str, list[int]] = {}  # running request id -> its block ids, in order
        self.synced = False  # known from a dump (the engine's first record, or a resync record) on
        self.problem: str | None = "no dump of the pool yet"
        self.seq: int | None = None  # the last step applied: a gap means records were lost

    def lose(self, why: str) -> None:
        """Records were lost (or did not apply): wait for the next dump before describing again."""
        self.synced, self.problem = False, why

    def step(self, step: dict[str, Any]) -> bool:
        """Apply one decoded step's block ops (its ``block_ops``, ``block_ids``, ``free_blocks``);
        whether the pool is known after it."""
        seq = int(step.get("seq", -1))
        if self.seq is not None and seq != self.seq + 1 and self.synced:
            self.lose(f"steps {self.seq + 1} to {seq - 1} were not seen")  # their ops are gone: wait for a dump
        self.seq = seq
        ops: Sequence[Any] = step.get("block_ops") or ()
        for op in ops:
            code = op[0]
            if code == OP_NAMES:
                self.names[str(op[1])] = unpack_names(op[2])
                continue
            if code == OP_DUMP:
                self.synced, self.problem = True, None
            if not self.synced:
                continue
            try:
                self.replica.apply(op)
            except ReplicaMismatch as exc:
                self.lose(str(exc))
        if self.synced:
            try:
                self.replica.check_free(int(step["free_blocks"]))
            except ReplicaMismatch as exc:
                self.lose(str(exc))
        self.holders = step.get("block_ids") or {}
        if len(self.names) > 4 * (len(step.get("running") or ()) + len(step.get("waiting") or ())) + 1024:
            here = {r[0] for r in step.get("running") or ()} | {r[0] for r in step.get("waiting") or ()}
            self.names = {k: v for k, v in self.names.items() if k in here}  # requests gone
        return self.synced

    def describe(self, snap: dict[str, Any], extra: dict[str, list[int]] | None = None) -> bool:
        """Add the tracked-block inputs to ``snap`` (this step's ``bear.snapshot/1``, in place);
        ``extra``: block names of requests whose arrival was not logged (recorded prompts). False
        (``snap`` untouched) while the pool is not known. Runs once per published step in the
        snapshotter, over every cached block: the table is built by bulk operations, not a call
        per block (``bear bench pool``)."""
        if not self.synced:
            return False
        rep = self.replica
        pos = rep.positions()
        # every cached block (any hit may name it), in the replica's order: entry = its index
        blocks = list(rep.names)
        index = dict(zip(blocks, range(len(blocks)), strict=True))
        table = [pos.get(b, -1) for b in blocks]
        keys = [n & KEY_MASK for n in rep.names.values()]
        held = [self.holders.get(r["id"], []) for r in snap["running"]]
        counts = Counter(chain.from_iterable(held))
        for b, n in counts.items():
            if n > 1 and b not in index:  # shared blocks must be tracked (contract.md §2)
                index[b] = len(table)
                table.append(pos.get(b, -1))
                name = rep.names.get(b)
                keys.append(-1 if name is None else name & KEY_MASK)
        for r, bl in zip(snap["running"], held, strict=True):
            last = len(bl) - 1  # its leading blocks up to the last one in the table
            while last >= 0 and bl[last] not in index:
                last -= 1
            r["tracked"] = [index[b] if b in index else _new_entry(b, index, table, keys, pos) for b in bl[: last + 1]]
        for r in (*snap["running"], *snap["waiting"]):
            names = self.names.get(r["id"])
            if names is None and extra is not None:
                names = extra.get(r["id"])
            if names:
                r["block_keys"] = keys_of(names)
        snap["tracked_blocks"] = table
        snap["tracked_keys"] = keys
        return True


def _new_entry(b: int, index: dict[int, int], table: list[int], keys: list[int], pos: dict[int, int]) -> int:
    """A running request's block ahead of its last tracked one that is neither cached nor shared
    (a block vLLM holds but has not named yet): a table entry of its own, held and unkeyed."""
    t = index[b] = len(table)
    table.append(pos.get(b, -1))
    keys.append(-1)
    return t
