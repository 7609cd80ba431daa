"""Decode the plugin's raw per-step records into ``bear.snapshot/1`` and ``bear.batch/1`` maps.

The plugin writes positional tuples (cheapest on the engine thread); this module is the one place
that knows the positions, and turns them into the schemas of design.md §3 on the snapshotter side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SNAPSHOT_SCHEMA = "bear.snapshot/1"
BATCH_SCHEMA = "bear.batch/1"
RECORD_VERSION = 3

STEP_FIELDS = (
    "version", "seq", "t_sched0", "t_sched1", "t_upd0", "t_upd1", "wall", "busy_after",
    "sched_ids", "sched_ns", "new_reqs", "cached_ids", "cached_computed", "preempted",
    "free_blocks", "running", "waiting", "overhead_ns", "inflight", "overhead_cpu_ns",
    "full_reason", "delta", "block_ops",
)  # fmt: skip
ROW_FIELDS = (
    "id", "prompt_tokens", "computed_tokens", "output_tokens", "max_tokens", "blocks",
    "exclusive_blocks", "preemptions", "arrival", "priority",
)  # fmt: skip
# full_reason: why the plugin wrote a full record (0 = a delta-only record); see bear_vllm_plugin
FULL_REASONS = {0: "delta", 1: "first", 2: "periodic", 3: "resync", 4: "check", 5: "mode", 6: "verify"}
# fields of a decoded step that make up the published state and the batch record
COMPARED = ("running", "waiting", "sched", "new_reqs", "cached_computed", "preempted", "free_blocks")


class RecordError(ValueError):
    """A raw record that does not have the expected shape (wrong plugin version)."""


class DeltaMismatch(ValueError):
    """The mirrored state disagrees with the plugin's record (or cannot apply it)."""


def _check(raw: Any) -> None:
    if not isinstance(raw, tuple | list) or len(raw) != len(STEP_FIELDS) or raw[0] != RECORD_VERSION:
        v = raw[0] if isinstance(raw, tuple | list) and raw else None
        raise RecordError(f"unexpected raw record (version {v!r}, expected {RECORD_VERSION})")


def _step(raw: Any, sched: dict[str, int], new_reqs: dict[str, int], cached: dict[str, int],
          running: list[list[Any]], waiting: list[list[Any]]) -> dict[str, Any]:  # fmt: skip
    """The decoded step: what ``--record-to`` writes and everything downstream reads."""
    step = dict(zip(STEP_FIELDS, raw, strict=True))
    for k in ("sched_ids", "sched_ns", "cached_ids", "delta"):
        del step[k]
    step["record"] = FULL_REASONS.get(step.pop("full_reason"), "?")  # delta, or why it was full
    step["running"] = running
    step["waiting"] = waiting
    step["sched"] = sched
    step["new_reqs"] = new_reqs
    step["cached_computed"] = cached
    step["preempted"] = list(step["preempted"])
    return step


def parse_step(raw: Any) -> dict[str, Any]:
    """A full raw plugin record → a dict with named fields (JSON-able; what ``--record-to``
    writes). A delta-only record needs the state before it: use ``StepDecoder``."""
    _check(raw)
    if raw[15] is None:
        raise RecordError("a delta-only record cannot be decoded on its own (use StepDecoder)")
    step = _step(
        raw,
        dict(zip(raw[8], raw[9], strict=True)),
        {rid: c for rid, c in raw[10]},
        dict(zip(raw[11], raw[12], strict=True)),
        expand_rows(raw[15]),
        expand_rows(raw[16]),
    )
    cols = raw[15]
    if raw[22] is not None and len(cols) > 4 and cols[4] is not None:  # block ids (delta mode), pool logged
        step["block_ids"] = {row[0]: list(bids) for row, bids in zip(cols[0], cols[4], strict=True)}
    return step


def expand_rows(cols: Any) -> list[list[Any]]:
    """The plugin's columns (rows, output counts, block counts, shared-prefix blocks[, block ids])
    → one list per request in ROW_FIELDS order."""
    rows, outs, nbs, shared = cols[:4]
    shared = shared or {}
    return [
        [rid, p, c, o, m, nb, nb - shared.get(i, 0), pre, arr, pri]
        for i, ((rid, p, c, m, pre, arr, pri), o, nb) in enumerate(zip(rows, outs, nbs, strict=True))
    ]


def diff_steps(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first difference between two decoded steps in the published fields (None: equal)."""
    for k in COMPARED:
        x, y = a.get(k), b.get(k)
        if k == "preempted":
            x, y = sorted(x or ()), sorted(y or ())
        elif k == "sched":
            x, y = list((x or {}).items()), list((y or {}).items())
        if x != y:
            if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
                i = next(i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v)
                return f"{k}[{i}]: mirrored {x[i]!r} != full {y[i]!r}"
            return f"{k}: mirrored {x!r:.300} != full {y!r:.300}"
    return None


class StateMirror:
    """The snapshotter's copy of one engine's scheduler state (sync scheduler, FCFS), advanced by
    the plugin's per-step deltas with the updates vLLM applies itself: ``computed += n`` for every
    scheduled request, one output token for a request whose chunk reached the end of its known
    tokens, blocks appended from vLLM's own new-block ids, preempted requests to the front of the
    waiting queue (in running order) with computed 0 and no blocks, admitted requests from its
    front, finished requests removed. Exclusive blocks come from a reference count of the block ids
    held by the resident requests. Every step is checked against what the plugin read from vLLM
    (queue lengths, outputs emitted, blocks in use = base − free); any disagreement raises
    ``DeltaMismatch``."""

    def __init__(self, raw: Any) -> None:
        """From a full record whose columns carry block ids (delta mode)."""
        self.seq = int(raw[1])
        self.rows: dict[str, list[Any]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.ref: dict[int, int] = {}
        self.run: list[str] = []
        self.wait: list[str] = []
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

    def _exclusive(self, rids: Any) -> None:
        ref, rows, blocks = self.ref, self.rows, self.blocks
        for rid in rids:
            bl = blocks[rid]
            k = 0
            for b in bl:
                if ref[b] <= 1:
                    break
                k += 1
            row = rows[rid]
            row[5] = len(bl)
            row[6] = len(bl) - k

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
        """Advance by one record (delta-only or full-with-delta) and return the decoded step. On
        ``DeltaMismatch`` the mirror is left in an undefined state: drop it."""
        if raw[21] is None:
            raise DeltaMismatch("record without a delta")
        if int(raw[1]) != self.seq + 1:
            raise DeltaMismatch(f"step {raw[1]} after {self.seq}: a record is missing")
        (arr_rows, arr_outs, fin_before, fin_mid, fin_upd, adm, sched, ns, nbids, emitted, n_run,
         n_wait) = raw[21]  # fmt: skip
        rows, blocks = self.rows, self.blocks
        crossed: set[int] = set()
        changed: list[str] = []
        for (rid, p, c, m, pre, arr, pri), o in zip(arr_rows, arr_outs, strict=True):
            if rid in rows:
                raise DeltaMismatch(f"arrival {rid} is already resident")
            rows[rid] = [rid, p, c, o, m, 0, 0, pre, arr, pri]
            blocks[rid] = []
            self.wait.append(rid)
        self._remove(set(fin_before), crossed)
        preempted = raw[13]
        if preempted:
            pset = set(preempted)
            front = [r for r in self.run if r in pset]
            if len(front) != len(pset):
                raise DeltaMismatch(f"preempted {sorted(pset - set(front))} not running")
            self.run = [r for r in self.run if r not in pset]
            for rid in front:
                self._release(rid, crossed)
                row = rows[rid]
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
            rows[rid][2] = c0
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
            raise DeltaMismatch(f"{emitted} requests got output, the mirror expected {expect}")
        if len(self.run) != n_run or len(self.wait) != n_wait:
            raise DeltaMismatch(f"running/waiting {len(self.run)}/{len(self.wait)}, vLLM {n_run}/{n_wait}")
        free = int(raw[14])
        if free + len(self.ref) != self.base:
            raise DeltaMismatch(f"{len(self.ref)} blocks held + {free} free != {self.base}")
        if crossed:
            self._exclusive(self.run)
            self._exclusive(self.wait)
        else:
            self._exclusive([r for r in changed if r in rows])
        self.seq = int(raw[1])
        step = _step(
            raw, sched_d, new_reqs, cached,
            [list(rows[r]) for r in self.run], [list(rows[r]) for r in self.wait],
        )  # fmt: skip
        if raw[22] is not None:  # the pool is being logged block by block: say who holds which block
            step["block_ids"] = {r: list(blocks[r]) for r in self.run}
        return step


class StepDecoder:
    """Raw plugin records (full or delta) of one engine generation → decoded steps, in order.

    A full record is decoded on its own and (in delta mode) resets the mirror; when it carries the
    delta too (periodic / verify records) the mirror first applies the delta and the result is
    compared with the full state: a difference counts as a mismatch. A delta-only record is applied
    to the mirror; without a mirror (no full record seen yet, a record was lost, or a mismatch) it
    cannot be decoded: ``decode`` returns None and the caller asks the plugin for a full record.
    ``stats``: records by kind, deltas checked against a full state (``verified``), mismatches
    (the mirror disagreed), undecodable deltas, and gaps (records lost before this reader got them,
    e.g. a starved reader whose ring wrapped: not a mismatch)."""

    def __init__(self) -> None:
        self.mirror: StateMirror | None = None
        self.stats = {"full": 0, "delta": 0, "verified": 0, "mismatches": 0, "undecodable": 0, "gaps": 0}
        self.last_problem: str | None = None

    def reset(self) -> None:
        """Forget the state (records were lost)."""
        self.mirror = None

    def decode(self, raw: Any) -> dict[str, Any] | None:
        _check(raw)
        self.last_problem = None
        if raw[15] is not None:
            truth = parse_step(raw)
            self.stats["full"] += 1
            problem: str | None = "no mirror"
            if self.mirror is not None and int(raw[1]) != self.mirror.seq + 1:
                self.stats["gaps"] += 1
                self.mirror = None
            if raw[21] is not None and self.mirror is not None:
                self.stats["verified"] += 1
                try:
                    problem = diff_steps(self.mirror.apply(raw), truth)
                except DeltaMismatch as exc:
                    problem = str(exc)
                if problem is not None:
                    self.stats["mismatches"] += 1
                    self.last_problem = problem
            cols = raw[15]
            if problem is not None:  # keep a mirror that matched: the chain of deltas stays tested
                self.mirror = StateMirror(raw) if len(cols) > 4 and cols[4] is not None else None
            return truth
        if self.mirror is not None and int(raw[1]) != self.mirror.seq + 1:  # records lost: not a mismatch
            self.stats["gaps"] += 1
            self.last_problem = None
            self.mirror = None
        if self.mirror is None:
            self.stats["undecodable"] += 1
            return None
        try:
            step = self.mirror.apply(raw)
        except DeltaMismatch as exc:
            self.stats["mismatches"] += 1
            self.last_problem = str(exc)
            self.mirror = None
            return None
        self.stats["delta"] += 1
        return step


def request_map(row: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(ROW_FIELDS, row, strict=True))


def to_snapshot(step: dict[str, Any], config: dict[str, Any], *, instance: str, model: str) -> dict[str, Any]:
    """``bear.snapshot/1`` of the state right after ``step`` (design.md §3)."""
    inflight = None
    if step.get("inflight"):
        started, ids, ns, new, cids, cctx = step["inflight"]
        ctx = {**dict(zip(cids, cctx, strict=False)), **{rid: c for rid, c in new}}
        inflight = {
            "started": started,
            "items": [
                {"id": rid, "n": n, "context": ctx.get(rid, 0)} for rid, n in zip(ids, ns, strict=True)
            ],
        }
    return {
        "schema": SNAPSHOT_SCHEMA,
        "instance": instance,
        "model": model,
        "seq": step["seq"],
        "time": step["wall"],
        "config": config,
        "free_blocks": step["free_blocks"],
        "running": [request_map(r) for r in step["running"]],
        "waiting": [request_map(r) for r in step["waiting"]],
        "inflight": inflight,
    }


def context_before(step: dict[str, Any], rid: str, prev_computed: dict[str, int]) -> int:
    """Computed tokens of ``rid`` before ``step`` ran (vLLM's own value where it reports one)."""
    if rid in step["new_reqs"]:
        return int(step["new_reqs"][rid])
    if rid in step["cached_computed"]:
        return int(step["cached_computed"][rid])
    return int(prev_computed.get(rid, 0))


def is_decode(n: int, context: int, prompt_tokens: int | None) -> bool:
    """Same definition as ``libbea.is_decode``: one token for a request whose prompt is done."""
    return prompt_tokens is not None and n == 1 and context >= prompt_tokens


class BatchBuilder:
    """Turns consecutive steps into ``bear.batch/1`` records. A step's ``duration_s`` is known only
    when the next step starts (loop period), so each record is released one step late, or at once
    when the engine went idle after it (``duration_s`` null)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self._prompt: dict[str, int] = {}
        self._computed: dict[str, int] = {}
        self._held: dict[str, Any] | None = None
        self._held_t0 = 0.0

    def reset(self) -> None:
        self._prompt.clear()
        self._computed.clear()
        self._held = None

    def feed(self, step: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._held is not None:
            if step["seq"] == self._held["seq"] + 1:
                self._held["duration_s"] = step["t_sched0"] - self._held_t0
            out.append(self._held)
            self._held = None
        prompts = {r[0]: r[1] for r in step["running"]} | {r[0]: r[1] for r in step["waiting"]}
        items = []
        for rid, n in step["sched"].items():
            ctx = context_before(step, rid, self._computed)
            p = prompts.get(rid, self._prompt.get(rid))
            items.append({"n": int(n), "context": ctx, "decode": is_decode(int(n), ctx, p)})
        self._prompt = prompts
        self._computed = {r[0]: r[2] for r in step["running"]} | {r[0]: r[2] for r in step["waiting"]}
        if items:
            rec = {
                "schema": BATCH_SCHEMA,
                "instance": self.instance,
                "seq": step["seq"],
                "duration_s": None,
                "exec_s": step["t_upd0"] - step["t_sched1"],
                "items": items,
            }
            if step["busy_after"]:
                self._held, self._held_t0 = rec, step["t_sched0"]
            else:
                out.append(rec)
        return out

    def flush(self) -> list[dict[str, Any]]:
        held, self._held = self._held, None
        return [held] if held is not None else []


def batches_of(steps: Iterable[dict[str, Any]], instance: str) -> list[dict[str, Any]]:
    b = BatchBuilder(instance)
    out: list[dict[str, Any]] = []
    for s in steps:
        out.extend(b.feed(s))
    out.extend(b.flush())
    return out
