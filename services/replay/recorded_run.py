"""Turn a recorded run (the snapshotter's ``--record-to`` step log) into replay cases and batch
records in the format of ``shared/data/vllm-cpu-traces/``.

Case semantics (documented in docs/snapshotter.md): for each request R, let step s be the first
engine step whose scheduler had seen R (R scheduled in s, or present in the state after s). The
case's snapshot is the state after step s-1 — the last state without R, exactly what the next
``schedule()`` started from — plus, as waiting requests, the other requests that reached the
scheduler in the same gap and arrived before R (they are ahead of R in the FCFS queue).
``expected_batches`` are the steps s, s+1, … up to the one that completes R's prompt, restricted
to the requests of the case (``cap_by_later_arrival``: vLLM caps a prefill chunk at
``--long-prefill-token-threshold`` only while more than one request is running or waiting, so
a request that arrives after R can shorten R's chunks — something no replay from the state
before R can know; such cases are counted apart); ``engine_ttft_s`` runs from the start of step s's scheduling to the
end of the update of that last step (engine clock).

Prefix-cache hits: by default a case's request carries the hit the engine itself found at its
admission. Given the prompts' token ids (``prompts``: client request id → ids) and a log with the
engine's KV events, every hit in the case is the mirror's instead — the request's and those of
the snapshot's waiting requests — computed from the cache as it was after step s−1
(``recorded_cache``), exactly what an estimator mirroring the instance would know; the engine's
own admission hit stays beside it (``engine_prefix_hit_tokens``). A log that also carries the
plugin's block-op log (``BEAR_SNAPSHOT_BLOCK_OPS=1``) gives each case the blocks of those hits and
their places in the free queue (``recorded_pool``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bear.protocol.jsonl import read_jsonl, write_jsonl
from bear.replay.recorded_cache import (
    RecordedCache,
    find_prompt,
    kv_batches,
    spec_of,
    split_by_generation,
)
from bear.replay.recorded_pool import add_tracked_blocks, logged
from bear.snapshotter.records import batches_of, context_before, request_map, to_snapshot


def read_steps(path: str | Path) -> Iterator[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """(meta or None, step) from a step log; meta comes with each engine generation's step 0."""
    for obj in read_jsonl(path):
        if "meta" in obj:
            yield obj["meta"], obj["step"]
        elif "kv" not in obj:  # KV event batches are read by recorded_cache
            yield None, obj


def generations(path: str | Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Split a step log into engine generations (one per vLLM start), each with its metadata."""
    out: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for meta, step in read_steps(path):
        if meta is not None:
            out.append((meta, []))
        if not out:
            continue  # a log that starts mid-generation has no config: skip until the next start
        out[-1][1].append(step)
    return out


def _rows(step: dict[str, Any]) -> Iterator[list[Any]]:
    yield from step["running"]
    yield from step["waiting"]


def final_output_lengths(steps: list[dict[str, Any]]) -> dict[str, int]:
    """Total output tokens of every request that finished within the log (sync engine: at most one
    token per request per step; the finishing step is the one after its last appearance)."""
    last_out: dict[str, tuple[int, int, int]] = {}  # id → (step index, output tokens, prompt)
    for i, st in enumerate(steps):
        for r in _rows(st):
            last_out[r[0]] = (i, r[3], r[1])
    lengths: dict[str, int] = {}
    prev_computed: dict[str, int] = {}
    for i, st in enumerate(steps):
        for rid, n in st["sched"].items():
            info = last_out.get(rid)
            if info is not None and info[0] != i - 1:
                continue  # not the step right after its last appearance
            ctx = context_before(st, rid, prev_computed)
            if info is None:
                continue  # finished in its very first step: prompt length unknown from the log
            _, out, prompt = info
            if ctx + int(n) >= prompt + out:
                lengths[rid] = out + 1
        prev_computed = {r[0]: r[2] for r in _rows(st)}
    return lengths


def build_cases(
    meta: dict[str, Any], steps: list[dict[str, Any]], *, trace: str, instance: str | None = None,
    prompts: dict[str, list[int]] | None = None, kv: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    config = meta["config"]
    inst = instance or trace
    by_seq = {st["seq"]: st for st in steps}
    lengths = final_output_lengths(steps)
    first: dict[str, int] = {}
    info: dict[str, list[Any]] = {}
    for st in steps:
        for rid in st["sched"]:
            first.setdefault(rid, st["seq"])
        for r in _rows(st):
            first.setdefault(r[0], st["seq"])
            info.setdefault(r[0], r)
    by_first: dict[int, list[str]] = {}
    for rid, s in first.items():
        by_first.setdefault(s, []).append(rid)
    cases: list[dict[str, Any]] = []
    for rid, s in sorted(first.items(), key=lambda kv: (kv[1], info.get(kv[0], [0] * 10)[8])):
        prev = by_seq.get(s - 1)
        if prev is None or rid not in info:
            continue
        row = info[rid]
        ahead = [
            o for o in by_first[s]
            if o != rid and o in info and (info[o][8], o) < (row[8], rid)
        ]  # fmt: skip
        snap = to_snapshot(prev, config, instance=inst, model=meta.get("model", ""))
        snap.pop("model", None)
        for o in sorted(ahead, key=lambda x: info[x][8]):
            r = request_map(info[o])
            r.update(computed_tokens=0, output_tokens=0, blocks=0, exclusive_blocks=0, preemptions=0)
            snap["waiting"].append(r)
        members = {r["id"] for r in snap["running"]} | {r["id"] for r in snap["waiting"]} | {rid}
        if any(m not in lengths for m in members):
            continue  # someone's total output length is not known (still running at the end)
        expected: list[dict[str, int]] = []
        prompt = int(row[1])
        prev_computed = {r[0]: r[2] for r in _rows(prev)}
        seq = s
        done = False
        preempt = False
        lifted = False  # a request outside the case made vLLM cap R's prefill chunk (module doc)
        capped = int(config.get("long_prefill_token_threshold") or 0) > 0
        prev_ids = {r[0] for r in _rows(prev)}
        t_start = by_seq[s]["t_sched0"] if s in by_seq else None
        t_end = None
        while seq in by_seq:
            st = by_seq[seq]
            expected.append({k: int(v) for k, v in st["sched"].items() if k in members})
            preempt = preempt or bool(set(st["preempted"]) & members)
            if capped and rid in st["sched"] and not lifted:
                here = prev_ids | set(st["sched"])  # in the engine when this step was scheduled
                lifted = len(here & members) <= 1 < len(here)
            if rid in st["sched"]:
                ctx = context_before(st, rid, prev_computed)
                if ctx + int(st["sched"][rid]) >= prompt:
                    done, t_end = True, st["t_upd1"]
                    break
            prev_computed = {r[0]: r[2] for r in _rows(st)}
            prev_ids = set(prev_computed)
            seq += 1
        if not done or t_start is None or t_end is None:
            continue
        hit = int(by_seq[_first_sched(by_seq, rid, s)]["new_reqs"].get(rid, 0))
        cases.append({
            "trace": trace,
            "snapshot": snap,
            "request": {"id": rid, "prompt_tokens": prompt, "max_tokens": int(row[4]), "prefix_hit_tokens": hit},
            "output_lengths": {m: int(lengths[m]) for m in sorted(members)},
            "expected_batches": expected,
            "engine_ttft_s": t_end - t_start,
            "preemption_in_horizon": preempt,
            "cap_by_later_arrival": lifted,
        })  # fmt: skip
    spec = spec_of(meta)
    if prompts is not None and kv is not None and spec is not None:
        _mirror_hits(cases, RecordedCache(spec, kv, steps), prompts)
        if logged(steps):  # the pool was logged block by block: the hits' blocks and where they sit
            add_tracked_blocks(cases, meta, steps, spec, prompts)
    return cases


def _mirror_hits(cases: list[dict[str, Any]], cache: RecordedCache, prompts: dict[str, list[int]]) -> None:
    """Replace every hit in the cases by the mirror's (module doc); cases whose request's prompt
    is unknown are marked ``prefix_source: engine``."""
    need: list[tuple[dict[str, Any], str, int, list[int]]] = []
    for c in cases:
        s = c["snapshot"]["seq"]
        req = c["request"]
        toks = find_prompt(prompts, req["id"])
        c["prefix_source"] = "mirror" if toks is not None else "engine"
        if toks is None:
            continue
        need.append((req, "request", s, toks))
        for w in c["snapshot"]["waiting"]:
            wt = find_prompt(prompts, w["id"])
            if wt is not None and w.get("computed_tokens", 0) == 0:
                need.append((w, "waiting", s, wt))
    hits = cache.hits((s, toks) for _, _, s, toks in need)
    for (obj, kind, _, _), h in zip(need, hits, strict=True):
        if kind == "request":
            obj["engine_prefix_hit_tokens"] = obj["prefix_hit_tokens"]
        obj["prefix_hit_tokens"] = h


def hit_agreement(meta: dict[str, Any], steps: list[dict[str, Any]], kv: list[dict[str, Any]],
                  prompts: dict[str, list[int]]) -> dict[str, Any]:
    """The mirror's hit against the engine's ``num_cached_tokens`` (its computed tokens at first
    admission) for every admitted request whose prompt is known: the cache after the step before
    the admission step."""
    spec = spec_of(meta)
    if spec is None:
        return {"admitted": 0, "equal": 0, "rate": None, "why": "prefix caching off or not recorded"}
    adm = [(st["seq"] - 1, rid, int(c), toks) for st in steps for rid, c in st["new_reqs"].items()
           if (toks := find_prompt(prompts, rid)) is not None]
    hits = RecordedCache(spec, kv, steps).hits((s, toks) for s, _, _, toks in adm)
    diffs = [{"id": rid, "engine": c, "mirror": h, "step": s + 1} for (s, rid, c, _), h in zip(adm, hits, strict=True)
             if h != c]
    return {"admitted": len(adm), "equal": len(adm) - len(diffs), "rate": 1 - len(diffs) / len(adm) if adm else None,
            "with_hit": sum(1 for _, _, c, _ in adm if c > 0), "mismatches": diffs[:50]}


def _first_sched(by_seq: dict[int, dict[str, Any]], rid: str, s: int) -> int:
    seq = s
    while seq in by_seq and rid not in by_seq[seq]["sched"]:
        seq += 1
    return seq if seq in by_seq else s


def read_prompts(path: str | Path) -> dict[str, list[int]]:
    """Prompt token ids by client request id: JSONL lines ``{"id": ..., "prompt_token_ids": [...]}``."""
    return {str(o["id"]): [int(t) for t in o["prompt_token_ids"]] for o in read_jsonl(path)}


def record_run(
    step_logs: Iterable[str | Path], *, trace: str, out_dir: str | Path, prompts: dict[str, list[int]] | None = None,
    agreement: list[dict[str, Any]] | None = None,
) -> tuple[Path, Path, int, int]:
    """Write ``cases.jsonl.gz`` and ``batches_<trace>.jsonl.gz`` into ``out_dir``; returns the paths
    and the counts of cases and batch records. With ``prompts``, hits are the mirror's (module
    doc) and ``agreement`` (when given) gets one ``hit_agreement`` per engine generation."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    for log in step_logs:
        gens = generations(log)
        kvs = split_by_generation(kv_batches(log), gens) if prompts is not None else [None] * len(gens)
        for (meta, steps), kv in zip(gens, kvs, strict=True):
            cases.extend(build_cases(meta, steps, trace=trace, prompts=prompts, kv=kv))
            batches.extend(batches_of(steps, trace))
            if prompts is not None and agreement is not None and kv is not None:
                agreement.append(hit_agreement(meta, steps, kv, prompts))
    cpath, bpath = out / "cases.jsonl.gz", out / f"batches_{trace}.jsonl.gz"
    write_jsonl(cpath, cases)
    write_jsonl(bpath, batches)
    return cpath, bpath, len(cases), len(batches)
