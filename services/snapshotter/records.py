"""The plugin's raw per-step records: their positions, full records decoded on their own, and the
decoded steps turned into ``bear.snapshot/1`` and ``bear.batch/1`` maps.

The plugin writes positional tuples (cheapest on the engine thread); this module and
``step_decoder`` (delta-only records, which need the state before them) are the only places that
know the positions. Stdlib only: the offline vLLM driver imports it beside the plugin (and reads
the schema ids from ``protocol/schemas.py``'s file there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

try:
    from ..protocol import schemas
except ImportError:  # imported on its own beside the plugin (the offline vLLM driver, in vLLM's venv
    # without the bear package): the one list of schema ids, read from its file (stdlib only too)
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location("bear_schemas", Path(__file__).parent.parent / "protocol" / "schemas.py")
    assert _spec is not None and _spec.loader is not None
    schemas = importlib.util.module_from_spec(_spec)  # type: ignore[assignment]
    _spec.loader.exec_module(schemas)  # type: ignore[union-attr]

SNAPSHOT_SCHEMA = schemas.SNAPSHOT
BATCH_SCHEMA = schemas.BATCH
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


def check_record(raw: Any) -> None:
    if not isinstance(raw, tuple | list) or len(raw) != len(STEP_FIELDS) or raw[0] != RECORD_VERSION:
        v = raw[0] if isinstance(raw, tuple | list) and raw else None
        raise RecordError(f"unexpected raw record (version {v!r}, expected {RECORD_VERSION})")


def make_step(raw: Any, sched: dict[str, int], new_reqs: dict[str, int], cached: dict[str, int],
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
    writes). A delta-only record needs the state before it: use ``step_decoder.StepDecoder``."""
    check_record(raw)
    if raw[15] is None:
        raise RecordError("a delta-only record cannot be decoded on its own (use step_decoder.StepDecoder)")
    step = make_step(
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
                return f"{k}[{i}]: from deltas {x[i]!r} != full {y[i]!r}"
            return f"{k}: from deltas {x!r:.300} != full {y!r:.300}"
    return None


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
            rec = {  # bear.protocol.batch.BatchRecord's fields (tests/protocol/test_batch.py checks them)
                "v": BATCH_SCHEMA,
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
