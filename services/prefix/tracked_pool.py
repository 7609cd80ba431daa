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

``PoolTable`` keeps the same inputs step by step in the table's stable form (block ids, free-queue
tickets; contract.md §2), for deltas that carry the table's change (``bear snapshotter
--pool-deltas``, issue 28): a step costs what it changed, not the pool.
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


class PoolTable:
    """The tracked-block table kept step by step for deltas (docs/contract.md §2, "The table in
    stable form"): the same inputs ``TrackedPool.describe`` writes, keyed by block id rather than by
    an index that moves, each free block's place as a ticket rather than a position that every pop
    shifts. Each step costs what the step changed (its block ops, the blocks the running requests
    gained), not the pool: ``change`` gives the step's change, ``full`` the whole table (a full
    snapshot: the first state, every ``--full-every`` states, a resync).

    An entry per block that is cached, free (in the queue, named or not: a free block's place is
    its ticket's rank among the free blocks' tickets) or held by a running request ahead of the
    last tracked block it holds (``describe``'s rule) — ``[id, ticket or -1 (held), key or -1,
    stamp or -1]``, the stamp ordering the cached blocks as ``describe`` lists them."""

    def __init__(self, pool: TrackedPool) -> None:
        self.pool = pool
        self.entries: dict[int, tuple[int, int, int]] = {}  # block -> (ticket, key, stamp): what was sent
        self.refs: dict[int, int] = {}  # block -> times the running requests hold it
        self.held: dict[str, list[int]] = {}  # running request -> its blocks, as of the last step
        self.preemptions: dict[str, int] = {}  # running request -> its preemptions, as of the last step
        self.tracked: dict[str, int] = {}  # running request -> how many of its leading blocks are tracked
        self.inpre: dict[int, int] = {}  # block -> running requests that track it
        self.keyed: set[str] = set()  # residents whose block keys were sent
        self.known = False  # whether a consumer could hold the table (a full one went out since the last loss)

    def _core(self, b: int) -> bool:
        return b in self.pool.replica.names or self.refs.get(b, 0) > 1

    def _hold(self, bl: list[int], d: int, dirty: set[int]) -> None:
        refs = self.refs
        for b in bl:
            n = refs.get(b, 0) + d
            if n > 0:
                refs[b] = n
            else:
                del refs[b]
            dirty.add(b)

    def _prefix(self, bl: list[int], lo: int, hi: int, d: int, dirty: set[int]) -> None:
        inpre = self.inpre
        for b in bl[lo:hi]:
            n = inpre.get(b, 0) + d
            if n > 0:
                inpre[b] = n
            else:
                del inpre[b]
            dirty.add(b)

    def _entry(self, b: int) -> tuple[int, int, int] | None:
        rep = self.pool.replica
        t = rep.ticket.get(b, -1)
        name = rep.names.get(b)
        if name is None:
            if t < 0 and self.refs.get(b, 0) < 2 and b not in self.inpre:
                return None
            return (t, -1, -1)
        return (t, name & KEY_MASK, rep.stamp[b])

    def update(self, snap: dict[str, Any]) -> dict[str, Any] | None:
        """Follow the step ``TrackedPool.step`` applied (``snap``: its ``bear.snapshot/1``); the
        table's change since the step before (a delta's ``pool``), or None when the consumer needs
        the table in full (the first state, a dump, a reset, the pool lost since)."""
        pool, rep = self.pool, self.pool.replica
        if not pool.synced:
            self.known = False
            return None
        dirty = rep.touched
        rebuilt = rep.rebuilt or not self.known
        rep.touched, rep.rebuilt = set(), False
        running = snap["running"]
        holders = pool.holders
        now: dict[str, list[int]] = {}
        seen: dict[str, int] = {}
        grown: dict[str, int] = {}  # request -> how many of its blocks it held before (0: all new)
        for r in running:
            rid = r["id"]
            bl = holders.get(rid) or []
            now[rid] = bl
            old = self.held.get(rid)
            if old is bl:
                continue
            pre = r.get("preemptions", 0)
            seen[rid] = pre
            # vLLM only appends to a running request's blocks; a preemption (its count moved: it was
            # preempted and admitted again between the two steps) gives it new ones
            if (old is not None and self.preemptions.get(rid) == pre and len(bl) >= len(old)
                    and (not old or bl[len(old) - 1] == old[-1])):
                self._hold(bl[len(old):], 1, dirty)  # vLLM appends to a running request's blocks
                grown[rid] = len(old)
            else:
                if old is not None:
                    self._hold(old, -1, dirty)
                    self._prefix(old, 0, self.tracked.pop(rid, 0), -1, dirty)
                self._hold(bl, 1, dirty)
                grown[rid] = 0
        for rid, old in self.held.items():
            if rid not in now:  # finished or preempted: its blocks are no longer its
                self._hold(old, -1, dirty)
                self._prefix(old, 0, self.tracked.pop(rid, 0), -1, dirty)
        self.held, self.preemptions = now, seen
        rows: list[int] = []  # the running requests' tracked blocks: [pos, start, n, n block ids]
        for k, r in enumerate(running):
            rid = r["id"]
            bl = now[rid]
            had = self.tracked.get(rid, 0)
            last = len(bl) - 1  # its leading blocks up to the last core one (cached or shared)
            while last >= had and not self._core(bl[last]):
                last -= 1
            if last < had and had and not self._core(bl[had - 1]):  # its last tracked block is no longer core
                while last >= 0 and not self._core(bl[last]):
                    last -= 1
            n = last + 1
            if n != had:
                if n > had:
                    self._prefix(bl, had, n, 1, dirty)
                else:
                    self._prefix(bl, n, had, -1, dirty)
                if n:
                    self.tracked[rid] = n
                else:
                    self.tracked.pop(rid, None)
            if rid in grown and grown[rid] == 0 and not rebuilt:  # newly running, or its blocks replaced
                rows += (k, 0, n, *bl[:n])
            elif n != had and not rebuilt:
                start = min(n, had)
                rows += (k, start, n - start, *bl[start:n])
        if rebuilt:
            self.entries, self.keyed = {}, set()
            for b in chain(rep.ticket, rep.names, self.refs):
                e = self._entry(b)
                if e is not None:
                    self.entries[b] = e
            self._keys(snap, full=True)
            self.known = True
            return None
        put: list[int] = []
        drop: list[int] = []
        entries = self.entries
        for b in dirty:
            e = self._entry(b)
            if e is None:
                if entries.pop(b, None) is not None:
                    drop.append(b)
            elif entries.get(b) != e:
                entries[b] = e
                put += (b, *e)
        change: dict[str, Any] = {}
        if put:
            change["put"] = put
        if drop:
            change["drop"] = drop
        if rows:
            change["tracked"] = rows
        keys = self._keys(snap, full=False)
        if keys:
            change["keys"] = keys
        return change

    def _keys(self, snap: dict[str, Any], *, full: bool) -> list[int]:
        """Block keys of the residents whose names the consumer lacks: ``[pos, n, n keys]`` rows."""
        names = self.pool.names
        out: list[int] = []
        here: set[str] = set()
        for k, r in enumerate(chain(snap["running"], snap["waiting"])):
            rid = r["id"]
            here.add(rid)
            if rid in self.keyed and not full:
                continue
            got = names.get(rid)
            if got:
                self.keyed.add(rid)
                out += (k, len(got), *keys_of(got))
        self.keyed &= here
        return out

    def full(self, snap: dict[str, Any]) -> None:
        """Write the whole table on ``snap`` (in place: ``pool_table``, each running request's
        ``tracked_ids``, each resident's ``block_keys``): the state ``update`` left, in full."""
        rows: list[int] = []
        for b, e in self.entries.items():
            rows += (b, *e)
        snap["pool_table"] = rows
        names = self.pool.names
        for r in snap["running"]:
            n = self.tracked.get(r["id"], 0)
            r["tracked_ids"] = self.held.get(r["id"], [])[:n]
        for r in chain(snap["running"], snap["waiting"]):
            got = names.get(r["id"])
            if got:
                r["block_keys"] = keys_of(got)
