"""The one decoder of the plugin's per-step deltas. ``EngineState`` applies a delta-only record to
the snapshotter's copy of the engine's scheduler state and returns, from the same pass, the decoded
step (what ``--record-to`` writes and the batch records and full snapshots are made from) and the
step's change as a ``bear.delta/1`` body (``change``: what the publisher forwards and libbea
applies). No full state is diffed against the one before it: the plugin's delta says what moved,
this module says it in the wire format. ``StepDecoder`` takes every record of one engine
generation, full or delta, in order.

Stdlib only: the offline vLLM driver imports it beside the plugin (``records`` as a sibling).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

if __package__:
    from .records import ROW_FIELDS, check_record, diff_steps, expand_rows, make_step, parse_step
else:  # imported as a top-level module from PYTHONPATH=services/snapshotter
    from records import ROW_FIELDS, check_record, diff_steps, expand_rows, make_step, parse_step  # type: ignore[no-redef]


class DeltaMismatch(ValueError):
    """The state kept from the deltas disagrees with the plugin's record (or cannot apply it)."""


_UNCHANGED: Any = object()  # a resident the step did not touch (``old`` has no entry for it)


def _mutable(row: list[Any]) -> tuple[int, int, int, int, int]:
    """A row's fields a step changes: computed, output, blocks, exclusive, preemptions (a vLLM row has
    no prefix-hit or placeholder count: bear.snapshot/1's default 0)."""
    return row[2], row[3], row[5], row[6], row[7]


class EngineState:
    """The snapshotter's copy of one engine's scheduler state (sync scheduler, FCFS), advanced by
    the plugin's per-step deltas with the updates vLLM applies itself: ``computed += n`` for every
    scheduled request, one output token for a request whose chunk reached the end of its known
    tokens, blocks appended from vLLM's own new-block ids, preempted requests to the front of the
    waiting queue (in running order) with computed 0 and no blocks, admitted requests from its
    front, finished requests removed. Exclusive blocks come from a reference count of the block ids
    held by the resident requests. Every step is checked against what the plugin read from vLLM
    (queue lengths, outputs emitted, blocks in use = base − free); any disagreement raises
    ``DeltaMismatch``.

    ``change`` after ``apply``: the step as a ``bear.delta/1`` body (``removed``, ``preempted``,
    ``added``, ``admitted``, ``advance``, ``set``; docs/contract.md) against the state before it —
    the header (generation, base, times, free blocks) is the publisher's."""

    def __init__(self, raw: Any) -> None:
        """From a full record whose columns carry block ids (delta mode)."""
        self.seq = int(raw[1])
        self.rows: dict[str, list[Any]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.ref: dict[int, int] = {}
        self.run: list[str] = []
        self.wait: list[str] = []
        self.change: dict[str, Any] | None = None
        for cols, order in ((raw[15], self.run), (raw[16], self.wait)):
            if len(cols) < 5 or cols[4] is None:
                raise DeltaMismatch("full record without block ids")
            for row, bids in zip(expand_rows(cols), cols[4], strict=True):
                rid = row[0]
                order.append(rid)
                self.rows[rid] = row
                self.blocks[rid] = list(bids)
                for b in bids:
                    self.ref[b] = self.ref.get(b, 0) + 1
        self.base = int(raw[14]) + len(self.ref)  # free + in use: constant for one engine
        self._exclusive(self.rows)

    # ---- blocks ----------------------------------------------------------------------------------------
    def _hold(self, bids: Any, crossed: set[int]) -> None:
        ref = self.ref
        for b in bids:
            n = ref.get(b, 0) + 1
            ref[b] = n
            if n == 2:
                crossed.add(b)

    def _release(self, rid: str, crossed: set[int]) -> None:
        ref = self.ref
        for b in self.blocks.get(rid, ()):
            n = ref[b] - 1
            if n:
                ref[b] = n
                if n == 1:
                    crossed.add(b)
            else:
                del ref[b]
        self.blocks[rid] = []

    def _exclusive(self, rids: Any, old: dict[str, Any] | None = None) -> None:
        """Recount the blocks and exclusive blocks of ``rids``; a row that changes keeps its values
        before the step in ``old`` (once)."""
        ref, rows, blocks = self.ref, self.rows, self.blocks
        for rid in rids:
            bl = blocks[rid]
            k = 0
            for b in bl:
                if ref[b] <= 1:
                    break
                k += 1
            row = rows[rid]
            nb = len(bl)
            ex = nb - k
            if row[5] != nb or row[6] != ex:
                if old is not None and rid not in old:
                    old[rid] = _mutable(row)
                row[5] = nb
                row[6] = ex

    def _remove(self, gone: set[str], crossed: set[int]) -> None:
        if not gone:
            return
        self.run = [r for r in self.run if r not in gone]
        self.wait = [r for r in self.wait if r not in gone]
        for rid in gone:
            if rid in self.rows:
                self._release(rid, crossed)
                del self.rows[rid]
                del self.blocks[rid]

    # ---- one step --------------------------------------------------------------------------------------
    def apply(self, raw: Any) -> dict[str, Any]:
        """Advance by one record (delta-only or full-with-delta) and return the decoded step; the
        step's ``bear.delta/1`` body is then ``change``. On ``DeltaMismatch`` the state is left
        undefined: drop it."""
        self.change = None
        if raw[21] is None:
            raise DeltaMismatch("record without a delta")
        if int(raw[1]) != self.seq + 1:
            raise DeltaMismatch(f"step {raw[1]} after {self.seq}: a record is missing")
        (arr_rows, arr_outs, fin_before, fin_mid, fin_upd, adm, sched, ns, nbids, emitted, n_run,
         n_wait) = raw[21]  # fmt: skip
        rows, blocks = self.rows, self.blocks
        base_run, base_wait = self.run, self.wait  # never changed in place below: the change's base
        # old values of the residents the step changes (None: arrived in this step)
        old: dict[str, tuple[int, int, int, int, int] | None] = {}
        gone = set(fin_before).union(fin_mid, fin_upd)
        removed = self._base_positions(gone, base_run, base_wait)
        crossed: set[int] = set()
        changed: list[str] = []
        arrived: list[str] = []
        for (rid, p, c, m, pre, arr, pri), o in zip(arr_rows, arr_outs, strict=True):
            if rid in rows:
                raise DeltaMismatch(f"arrival {rid} is already resident")
            rows[rid] = [rid, p, c, o, m, 0, 0, pre, arr, pri]
            blocks[rid] = []
            old[rid] = None
            arrived.append(rid)
        if arrived:
            self.wait = base_wait + arrived
        self._remove(set(fin_before), crossed)
        preempted = raw[13]
        if preempted:
            pset = set(preempted)
            front = [r for r in self.run if r in pset]
            if len(front) != len(pset):
                raise DeltaMismatch(f"preempted {sorted(pset - set(front))} not running")
            self.run = [r for r in self.run if r not in pset]
            for rid in front:
                row = rows[rid]
                if rid not in old:
                    old[rid] = _mutable(row)
                self._release(rid, crossed)
                row[2] = 0
                row[7] += 1
                changed.append(rid)
            self.wait = front + self.wait
        k = len(adm)
        admitted = self.wait[:k]
        info = {a[0]: a for a in adm}
        if set(admitted) != set(info):
            raise DeltaMismatch(f"admitted {sorted(info)} but the queue starts with {admitted}")
        self.wait = self.wait[k:]
        for rid in admitted:
            _, c0, bids = info[rid]
            row = rows[rid]
            if rid not in old:
                old[rid] = _mutable(row)
            row[2] = c0
            self._release(rid, crossed)
            blocks[rid] = list(bids)
            self._hold(bids, crossed)
            changed.append(rid)
        self.run = self.run + admitted
        sids = self.run[:sched] if isinstance(sched, int) else list(sched)
        if isinstance(sched, int) and len(sids) != sched:
            raise DeltaMismatch(f"{sched} scheduled but {len(sids)} running")
        if ns is None:
            nsv: Any = (1,) * len(sids)
        elif ns[0] == "tail":  # all 1 but the admitted requests' counts, which come last
            nsv = (1,) * (len(sids) - len(ns[1])) + tuple(ns[1])
        else:
            nsv = ns
        sched_d = dict(zip(sids, nsv, strict=True))
        adm_set = set(admitted)
        phase1 = [r for r in sids if r not in adm_set]
        new_reqs = {rid: c for rid, c in raw[10]}
        resumed = [r for r in admitted if r not in new_reqs and r in sched_d]
        n_cached, pos, bl_new = (nbids, (), ()) if isinstance(nbids, int) else nbids
        if n_cached != len(phase1):
            raise DeltaMismatch(f"{n_cached} new-block entries for {len(phase1)} running requests")
        cached: dict[str, int] = {}
        expect = 0
        for rid in phase1:
            cached[rid] = rows[rid][2]
        for rid in resumed:
            cached[rid] = rows[rid][2]
        for rid, n in sched_d.items():
            row = rows.get(rid)
            if row is None:
                raise DeltaMismatch(f"scheduled {rid} is not resident")
            if rid not in old:
                old[rid] = _mutable(row)
            c = row[2] + n
            row[2] = c
            if c >= row[1] + row[3] and rid not in fin_mid:  # the chunk reached the end: one token
                row[3] += 1
                expect += 1
        for j, bl in zip(pos, bl_new, strict=True):
            rid = phase1[j]
            blocks[rid].extend(bl)
            self._hold(bl, crossed)
            changed.append(rid)
        self._remove(set(fin_mid) | set(fin_upd), crossed)
        if expect != emitted:
            raise DeltaMismatch(f"{emitted} requests got output, the state expected {expect}")
        if len(self.run) != n_run or len(self.wait) != n_wait:
            raise DeltaMismatch(f"running/waiting {len(self.run)}/{len(self.wait)}, vLLM {n_run}/{n_wait}")
        free = int(raw[14])
        if free + len(self.ref) != self.base:
            raise DeltaMismatch(f"{len(self.ref)} blocks held + {free} free != {self.base}")
        if crossed:
            self._exclusive(self.run, old)
            self._exclusive(self.wait, old)
        else:
            self._exclusive([r for r in changed if r in rows], old)
        self.seq = int(raw[1])
        step = make_step(
            raw, sched_d, new_reqs, cached,
            [list(rows[r]) for r in self.run], [list(rows[r]) for r in self.wait],
        )  # fmt: skip
        if raw[22] is not None:  # the pool is being logged block by block: say who holds which block
            step["block_ids"] = {r: list(blocks[r]) for r in self.run}
        self.change = self._change(removed, base_run, gone, preempted, arrived, admitted, old)
        return step

    def _base_positions(self, gone: set[str], base_run: list[str], base_wait: list[str]) -> list[int]:
        """Positions in the state before the step (running ++ waiting) of the residents that leave."""
        out = []
        rows = self.rows
        for rid in gone:
            if rid in rows:
                try:
                    out.append(base_run.index(rid))
                except ValueError:
                    out.append(len(base_run) + base_wait.index(rid))
        out.sort()
        return out

    def _change(self, removed: list[int], base_run: list[str], gone: set[str], preempted: Any,
                arrived: list[str], admitted: list[str], old: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The step as a ``bear.delta/1`` body, in libbea's order (docs/contract.md): the residents
        that finished leave, the preempted ones go to the front of waiting, the arrivals that did
        not finish join its end, the admitted ones that did not finish move to running; then the
        most common (computed, output) increase of the requests that stayed running (``advance``)
        and a ``set`` row for every resident whose fields are not what that gives. Written as
        ``bear.instance.delta.encode_delta`` would write it from the two full states (the tests
        compare them), without building or comparing those states."""
        rows = self.rows
        body: dict[str, Any] = {}
        if removed:
            body["removed"] = removed
        pre = [r for r in preempted if r not in gone] if preempted else []
        if pre:
            pset = set(pre)
            r0 = [r for r in base_run if r not in gone] if removed else base_run
            body["preempted"] = [k for k, r in enumerate(r0) if r in pset]
        added = [r for r in arrived if r not in gone]
        if added:
            body["added"] = [dict(zip(ROW_FIELDS, rows[r], strict=True)) for r in added]
        n_adm = sum(1 for r in admitted if r not in gone)
        if n_adm:
            body["admitted"] = n_adm
        run, wait = self.run, self.wait
        m = len(run) - n_adm  # the requests that stayed running, in front
        adv = (0, 0)
        if m:
            counts: Counter[tuple[int, int]] = Counter()
            for rid in run[:m]:
                o = old.get(rid)
                if o is None:
                    counts[(0, 0)] += 1
                else:
                    row = rows[rid]
                    counts[(row[2] - o[0], row[3] - o[1])] += 1
            adv = max(counts.items(), key=lambda kv: kv[1])[0]
            if adv[0] < 0 or adv[1] < 0:
                adv = (0, 0)
        sets: list[int] = []
        moved = m and adv != (0, 0)
        for p, rid in enumerate(run):
            o = old.get(rid, _UNCHANGED)
            if o is None:
                continue  # an arrival: ``added`` carries its fields
            if o is _UNCHANGED and not (moved and p < m):
                continue
            row = rows[rid]
            now = (row[2], row[3], row[5], row[6], row[7])
            was = now if o is _UNCHANGED else o
            if p < m:
                was = (was[0] + adv[0], was[1] + adv[1], *was[2:])
            if now != was:
                sets += (p, *now, 0, 0)
        p = len(run)
        for rid in wait:
            o = old.get(rid)
            if o is not None:
                row = rows[rid]
                now = (row[2], row[3], row[5], row[6], row[7])
                if now != o:
                    sets += (p, *now, 0, 0)
            p += 1
        if m and adv != (0, 0):
            body["advance"] = [m, adv[0], adv[1]]
        if sets:
            body["set"] = sets
        return body


class StepDecoder:
    """Raw plugin records (full or delta) of one engine generation → decoded steps, in order, and
    each step's ``bear.delta/1`` body (``change``; None where the record had no delta that
    applied: a full state only).

    A full record is decoded on its own and (in delta mode) resets the engine state; when it
    carries the delta too (periodic / verify records) the state first applies the delta and the
    result is compared with the full state: a difference counts as a mismatch. A delta-only record
    is applied to the state; without one (no full record seen yet, a record was lost, or a
    mismatch) it cannot be decoded: ``decode`` returns None and the caller asks the plugin for a
    full record. ``stats``: records by kind, deltas checked against a full state (``verified``),
    mismatches (the state from the deltas disagreed), undecodable deltas, and gaps (records lost
    before this reader got them, e.g. a starved reader whose ring wrapped: not a mismatch)."""

    def __init__(self) -> None:
        self.state: EngineState | None = None
        self.stats = {"full": 0, "delta": 0, "verified": 0, "mismatches": 0, "undecodable": 0, "gaps": 0}
        self.last_problem: str | None = None
        self.change: dict[str, Any] | None = None

    def reset(self) -> None:
        """Forget the state (records were lost)."""
        self.state = None

    def decode(self, raw: Any) -> dict[str, Any] | None:
        check_record(raw)
        self.last_problem = None
        self.change = None
        if raw[15] is not None:
            truth = parse_step(raw)
            self.stats["full"] += 1
            problem: str | None = "no state"
            if self.state is not None and int(raw[1]) != self.state.seq + 1:
                self.stats["gaps"] += 1
                self.state = None
            if raw[21] is not None and self.state is not None:
                self.stats["verified"] += 1
                try:
                    problem = diff_steps(self.state.apply(raw), truth)
                except DeltaMismatch as exc:
                    problem = str(exc)
                if problem is not None:
                    self.stats["mismatches"] += 1
                    self.last_problem = problem
                else:
                    self.change = self.state.change
            cols = raw[15]
            if problem is not None:  # keep a state that matched: the chain of deltas stays tested
                self.state = EngineState(raw) if len(cols) > 4 and cols[4] is not None else None
            return truth
        if self.state is not None and int(raw[1]) != self.state.seq + 1:  # records lost: not a mismatch
            self.stats["gaps"] += 1
            self.last_problem = None
            self.state = None
        if self.state is None:
            self.stats["undecodable"] += 1
            return None
        try:
            step = self.state.apply(raw)
        except DeltaMismatch as exc:
            self.stats["mismatches"] += 1
            self.last_problem = str(exc)
            self.state = None
            return None
        self.stats["delta"] += 1
        self.change = self.state.change
        return step
