"""``bear.delta/1``: the change between two ``bear.snapshot/1`` states of one instance, and the
choice, per published state, between a delta and the full snapshot (docs/contract.md §2, §5).

A publisher that knows the step's change forwards it (``forward_delta``: the snapshotter, whose
decoder turns the vLLM plugin's per-step delta into a ``bear.delta/1`` body,
``bear.snapshotter.step_decoder``); one that holds only states (the sim engine's exports, an async
engine's full records, steps coalesced or dropped in between) has it computed from the two states
(``encode_delta``). Both write the same deltas. libbea's ``Snapshot.apply_delta`` is the one
definition of what a delta means; ``encode_delta`` writes exactly what it reads:

1. ``removed`` (positions in the base state's running ++ waiting) leave, order kept;
2. ``preempted`` (positions in running after 1) move to the front of waiting, in running order;
3. ``added`` (full request maps) join the end of waiting;
4. the first ``admitted`` of waiting move to the end of running (or, a list: those positions of
   waiting, in that order); ``waiting_order`` (a permutation) reorders what is left (a priority
   queue);
5. ``advance`` ``[m, dc, do]``: the first ``m`` running get ``computed += dc``, ``output += do``;
6. ``set``: rows of 8 integers ``pos, computed, output, blocks, exclusive, preemptions, prefix hit,
   placeholders`` give those fields of the resident at ``pos`` (in the new running ++ waiting).

A change that these rules cannot express (running requests reordered, a static field that changed,
another generation or config) gets no delta: the publisher sends the full state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from bear.protocol.codec import pack
from bear.protocol.subjects import DELTA_SCHEMA


def _mutable(r: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """A request's fields that a step changes, with bear.snapshot/1's defaults."""
    blocks = r["blocks"]
    return (r["computed_tokens"], r["output_tokens"], blocks, r.get("exclusive_blocks", blocks),
            r.get("preemptions", 0), r.get("prefix_hit_tokens", 0), r.get("placeholders", 0))


def _static(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["prompt_tokens"], r["max_tokens"], r.get("priority", 0), r.get("arrival", 0.0))


def encode_delta(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any] | None:
    """The ``bear.delta/1`` map that turns state ``prev`` into ``cur`` (both ``bear.snapshot/1``
    maps), or None when the rules above cannot express the change."""
    if prev.get("generation", 0) != cur.get("generation", 0) or cur["seq"] <= prev["seq"]:
        return None  # another engine, or a state that is not a later step (an engine's initial state)
    if "tracked_blocks" in cur or "pool_table" in cur:
        return None  # the pool described block by block: only its publisher knows the table's change
    if prev["config"] is not cur["config"] and prev["config"] != cur["config"]:
        return None
    old_r, old_w = prev["running"], prev["waiting"]
    new_r, new_w = cur["running"], cur["waiting"]
    new_ids = {r["id"] for r in new_r}
    new_ids.update(r["id"] for r in new_w)
    old_rows: dict[str, dict[str, Any]] = {}
    removed: list[int] = []
    pos = 0
    for lst in (old_r, old_w):
        for r in lst:
            rid = r["id"]
            old_rows[rid] = r
            if rid not in new_ids:
                removed.append(pos)
            pos += 1
    r0 = [r["id"] for r in old_r if r["id"] in new_ids] if removed else [r["id"] for r in old_r]
    w0 = [r["id"] for r in old_w if r["id"] in new_ids] if removed else [r["id"] for r in old_w]
    # 2. preempted: requests that were running and now wait
    r0_pos = {rid: k for k, rid in enumerate(r0)}
    new_w_ids = [r["id"] for r in new_w]
    preempted = sorted(k for rid in new_w_ids if (k := r0_pos.get(rid)) is not None)
    if preempted:
        gone = set(preempted)
        q = [r0[k] for k in preempted] + w0
        r1 = [rid for k, rid in enumerate(r0) if k not in gone]
    else:
        q, r1 = w0, r0
    # 3. arrivals, in their order in the new state
    added = [r for r in new_r if r["id"] not in old_rows] + [r for r in new_w if r["id"] not in old_rows]
    if added:
        q = q + [r["id"] for r in added]
    # 4. admissions: running = r1 + the admitted, waiting = the rest of the queue (in its order, or
    # in the order given: a priority queue)
    new_r_ids = [r["id"] for r in new_r]
    m = len(r1)
    if new_r_ids[:m] != r1:
        return None
    adm_ids = new_r_ids[m:]
    admitted: int | list[int] = len(adm_ids)
    rest = q[len(adm_ids):]
    if q[:len(adm_ids)] != adm_ids:
        q_pos = {rid: i for i, rid in enumerate(q)}
        if any(rid not in q_pos for rid in adm_ids):
            return None
        admitted = [q_pos[rid] for rid in adm_ids]
        taken = set(admitted)
        rest = [rid for i, rid in enumerate(q) if i not in taken]
    order: list[int] | None = None
    if rest != new_w_ids:
        rest_pos = {rid: i for i, rid in enumerate(rest)}
        if len(rest) != len(new_w_ids) or any(rid not in rest_pos for rid in new_w_ids):
            return None
        order = [rest_pos[rid] for rid in new_w_ids]
    # 5./6. field changes
    adv = (0, 0)
    if m:
        counts = Counter((r["computed_tokens"] - old_rows[r["id"]]["computed_tokens"],
                          r["output_tokens"] - old_rows[r["id"]]["output_tokens"]) for r in new_r[:m])
        adv = max(counts.items(), key=lambda kv: kv[1])[0]
        if adv[0] < 0 or adv[1] < 0:
            adv = (0, 0)
    sets: list[int] = []
    for p, r in enumerate(new_r + new_w if new_w else new_r):
        old = old_rows.get(r["id"])
        if old is None:
            continue
        if _static(r) != _static(old):
            return None
        now = _mutable(r)
        was = _mutable(old)
        if p < m:
            was = (was[0] + adv[0], was[1] + adv[1], *was[2:])
        if now != was:
            sets.append(p)
            sets.extend(now)
    d: dict[str, Any] = {"v": DELTA_SCHEMA, "instance": cur.get("instance", ""),
                         "generation": cur.get("generation", 0), "base": prev["seq"],
                         "base_time": prev.get("time", 0.0), "seq": cur["seq"],
                         "time": cur["time"], "free_blocks": cur["free_blocks"]}
    if removed:
        d["removed"] = removed
    if preempted:
        d["preempted"] = preempted
    if added:
        d["added"] = added
    if admitted:
        d["admitted"] = admitted
    if order is not None:
        d["waiting_order"] = order
    if m and adv != (0, 0):
        d["advance"] = [m, adv[0], adv[1]]
    if sets:
        d["set"] = sets
    if cur.get("idle"):
        d["idle"] = True
    inflight = cur.get("inflight")
    if inflight:
        d["inflight"] = _inflight(inflight, new_r, new_w)
    return d


def forward_delta(prev: dict[str, Any], cur: dict[str, Any], change: dict[str, Any]) -> dict[str, Any] | None:
    """The ``bear.delta/1`` map from state ``prev`` to ``cur`` given the body of the change from
    the step before ``cur`` (``change``: its ``removed`` … ``set``), or None when ``prev`` is not
    that step (steps coalesced or dropped in between, another generation or config) or ``cur``
    carries what a delta cannot (the tracked-block table, an in-flight batch)."""
    if (prev.get("generation", 0) != cur.get("generation", 0) or prev["seq"] != cur["seq"] - 1
            or "tracked_blocks" in cur or "pool_table" in cur or cur.get("inflight") or cur.get("idle")):
        return None
    if prev["config"] is not cur["config"] and prev["config"] != cur["config"]:
        return None
    d: dict[str, Any] = {"v": DELTA_SCHEMA, "instance": cur.get("instance", ""),
                         "generation": cur.get("generation", 0), "base": prev["seq"],
                         "base_time": prev.get("time", 0.0), "seq": cur["seq"],
                         "time": cur["time"], "free_blocks": cur["free_blocks"]}
    d.update(change)
    return d


def _inflight(inflight: dict[str, Any], new_r: list[dict[str, Any]], new_w: list[dict[str, Any]]) -> dict[str, Any]:
    """The in-flight batch with residents by position and the others (orphans) by id."""
    where = {r["id"]: k for k, r in enumerate(new_r + new_w)}
    orphans: list[str] = []
    items: list[int] = []
    for it in inflight.get("items", ()):
        ref = where.get(it["id"])
        if ref is None:
            orphans.append(it["id"])
            ref = -len(orphans)
        items += (ref, it["n"], it["context"])
    out: dict[str, Any] = {"items": items}
    if "started" in inflight:
        out["started"] = inflight["started"]
    if orphans:
        out["orphans"] = orphans
    return out


class StateStream:
    """What a publisher sends for each new state of its instance: the delta against the state it
    sent before (``deltas``), and the full snapshot every ``full_every`` states (1: every state,
    0: never), when no delta can express the change, and after ``want_full()`` (a consumer asked
    to resync). ``last`` is the newest state sent: the one a resync is answered with.

    The block table kept step by step (``bear.prefix.tracked_pool.PoolTable``; contract.md §2,
    "The table in stable form"): a state's change carries the table's change (``pool``), and a
    state that goes out in full carries the whole table (``pool_table``), written by
    ``with_table`` when the state is queued — the table then is that state's. A state that must go
    out in full without it (the state before it was not sent, a resync answer) goes out with counts
    only, and the next state carries the table in full."""

    def __init__(self, *, deltas: bool = True, full_every: int = 256) -> None:
        self.deltas = deltas
        self.full_every = full_every
        self.last: dict[str, Any] | None = None
        self.forwarded = 0  # deltas forwarded from a known change (not computed from two states)
        self._since_full = 0
        self._want_full = False
        self._table_wanted = False
        self._queued = 0  # states queued since the last one given the table (with_table)

    def want_full(self) -> None:
        self._want_full = True

    def want_table(self) -> None:
        """A state went out without the table (a resync answer): the next one carries it."""
        self._table_wanted = True

    def with_table(self, snap: dict[str, Any], change: dict[str, Any] | None,
                   table: Callable[[dict[str, Any]], None] | None, *, ahead: int = 0, force: bool = False) -> None:  # fmt: skip
        """Write the whole table on ``snap`` (``table(snap)``, now: the caller's table is this
        state's) when it will go out in full: the first state (none sent, none queued: ``ahead``),
        no table change known, every ``full_every``-th state queued (``encode`` then sends it in
        full), one asked for (``want_full``, ``want_table``)."""
        if table is None:
            return
        self._queued += 1
        if (force or self._table_wanted or self._want_full or change is None or "pool" not in change
                or not self.deltas or (self.last is None and not ahead)
                or (self.full_every > 0 and self._queued >= self.full_every)):
            table(snap)
            self._table_wanted = False
            self._queued = 0

    def encode(self, snap: dict[str, Any], change: dict[str, Any] | None = None) -> tuple[bytes | None, bytes | None]:
        """``(full, delta)`` msgpack payloads for ``snap`` (either may be None), and ``snap``
        becomes the newest state sent. ``change``: the step's ``bear.delta/1`` body, when the
        caller knows it (forwarded if the state sent before is the step before ``snap``); with
        only ``pool`` (the block table's change; the lists' change unknown), the lists' change is
        computed from the two states."""
        delta = None
        if self.deltas and self.last is not None:
            if change is not None and change.keys() == {"pool"}:  # the table's change alone: the lists' from the states
                if self.last["seq"] == snap["seq"] - 1 and self.last.get("generation", 0) == snap.get("generation", 0):
                    delta = encode_delta(self.last, snap)
                    if delta is not None:
                        delta["pool"] = change["pool"]
            elif change is not None:
                delta = forward_delta(self.last, snap, change)
                self.forwarded += delta is not None
            if delta is None:
                delta = encode_delta(self.last, snap)
        self._since_full += 1
        full = None
        want = (delta is None or self._want_full or not self.deltas
                or (self.full_every > 0 and self._since_full >= self.full_every))
        if want and change is not None and "pool" in change and "pool_table" not in snap:
            self._table_wanted = True  # this state's table was not written: the next state carries it
            want = delta is None  # counts only would replace the table a consumer keeps: only when it must
        if want:
            full = pack(snap)
            self._since_full = 0
            self._want_full = False
        self.last = snap
        return full, None if delta is None else pack(delta)

    def sent_full(self, snap: dict[str, Any]) -> None:
        """A full snapshot went out outside ``encode`` (an idle re-send): the state to diff from."""
        self.last = snap
        self._since_full = 0
