"""Decode the plugin's raw per-step records into ``bear.snapshot/1`` and ``bear.batch/1`` maps.

The plugin writes positional tuples (cheapest on the engine thread); this module is the one place
that knows the positions, and turns them into the schemas of design.md §3 on the snapshotter side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SNAPSHOT_SCHEMA = "bear.snapshot/1"
BATCH_SCHEMA = "bear.batch/1"
RECORD_VERSION = 1

STEP_FIELDS = (
    "version", "seq", "t_sched0", "t_sched1", "t_upd0", "t_upd1", "wall", "busy_after",
    "sched_ids", "sched_ns", "new_reqs", "cached_ids", "cached_computed", "preempted",
    "free_blocks", "running", "waiting", "overhead_ns", "inflight", "overhead_cpu_ns",
)  # fmt: skip
ROW_FIELDS = (
    "id", "prompt_tokens", "computed_tokens", "output_tokens", "max_tokens", "blocks",
    "exclusive_blocks", "preemptions", "arrival", "priority",
)  # fmt: skip


class RecordError(ValueError):
    """A raw record that does not have the expected shape (wrong plugin version)."""


def parse_step(raw: Any) -> dict[str, Any]:
    """Raw plugin tuple → a dict with named fields (JSON-able; what ``--record-to`` writes)."""
    if not isinstance(raw, tuple | list) or len(raw) != len(STEP_FIELDS) or raw[0] != RECORD_VERSION:
        raise RecordError(f"unexpected raw record (version {raw[0] if raw else None!r})")
    step = dict(zip(STEP_FIELDS, raw, strict=True))
    step["running"] = expand_rows(step["running"])
    step["waiting"] = expand_rows(step["waiting"])
    step["sched"] = dict(zip(step.pop("sched_ids"), step.pop("sched_ns"), strict=True))
    step["new_reqs"] = {rid: c for rid, c in step["new_reqs"]}
    step["cached_computed"] = dict(zip(step.pop("cached_ids"), step["cached_computed"], strict=True))
    step["preempted"] = list(step["preempted"])
    return step


def expand_rows(cols: Any) -> list[list[Any]]:
    """The plugin's columns (rows, output counts, block counts, shared-prefix blocks) → one list
    per request in ROW_FIELDS order."""
    rows, outs, nbs, shared = cols
    shared = shared or {}
    return [
        [rid, p, c, o, m, nb, nb - shared.get(i, 0), pre, arr, pri]
        for i, ((rid, p, c, m, pre, arr, pri), o, nb) in enumerate(zip(rows, outs, nbs, strict=True))
    ]


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
