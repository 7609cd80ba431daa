"""What the real-vLLM tests compute from a run, live or recorded (issue 23): the replay's fidelity
to the engine's batches, the block pool rebuilt from the plugin's log, the replay from what a
live estimator holds. Every figure is a function of the recording alone: the live tests report
them and assert only invariants; ``test_recorded_runs.py`` asserts them on the runs shipped in
``tests/data/vllm-recorded/`` (README there), where they do not depend on the host's timing.

A run is recorded with ``BEAR_VLLM_RECORD=DIR pytest -m vllm tests/vllm/...``: each live test
copies its step log (``bear record``'s input) and prompts into ``DIR/<config>/``."""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bear import libbea
from bear.calibrator.fit import fit_beta
from bear.estimator.estimate import EstimatorConfig
from bear.instance.record import instance_record
from bear.prefix.mirror import PrefixMirror
from bear.prefix.tracked_pool import TrackedPool
from bear.protocol.batch import batch_record
from bear.protocol.codec import unpack
from bear.protocol.messages import KvEvents, KvOp, KvState
from bear.replay.recorded_cache import kv_batches
from bear.replay.recorded_pool import published_states, published_stream
from bear.replay.recorded_run import generations, record_run
from bear.snapshotter.records import batches_of
from bear.snapshotter.service import prefix_info

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "data" / "vllm-recorded"
RESULTS = Path(os.environ.get("BEAR_VLLM_RESULTS", "/tmp/bear-vllm-results"))
TOKENIZER_ID = "tok-recorded"  # a recorded run's prompts are ids already: the name only joins them


def save_result(name: str, result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def keep_recording(config: str, step_log: Path, prompts: dict[str, list[int]] | None = None) -> None:
    """With ``BEAR_VLLM_RECORD`` set, copy a live run's step log (and prompts) to
    ``$BEAR_VLLM_RECORD/<config>/`` — how the shipped recordings were made."""
    where = os.environ.get("BEAR_VLLM_RECORD")
    if not where:
        return
    out = Path(where) / config
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(step_log, out / "steps.jsonl.gz")
    if prompts is not None:
        with gzip.open(out / "prompts.json.gz", "wt") as f:
            json.dump(prompts, f)


def read_cases(out: Path) -> list[dict[str, Any]]:
    with gzip.open(out / "cases.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def replay_fidelity(cases: list[dict[str, Any]], batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact-batch-sequence rate, and the TTFT MAPE with β fitted online: each case uses β fitted
    on the batch records that finished before its snapshot (refitted every 100 records)."""
    cases = sorted(cases, key=lambda c: c["snapshot"]["seq"])
    usable = [r for b in batches if (r := batch_record(b)) is not None and r.duration_s is not None]
    exact, errors, beta, fitted_upto = 0, [], None, -1
    known = exact_known = 0  # cases whose batches no request outside them changed (cases.py)
    for c in cases:
        s = libbea.Snapshot.from_dict(c["snapshot"])
        res = libbea.estimate(s, c["request"], beta=[1e-3, 0, 0, 0], lengths=c["output_lengths"], trace=True)
        ok = res["batches"] == c["expected_batches"]
        exact += ok
        if not c.get("cap_by_later_arrival"):
            known += 1
            exact_known += ok
        seq = c["snapshot"]["seq"]
        past = [b for b in usable if b["seq"] <= seq]
        if len(past) >= 50 and (beta is None or len(past) - fitted_upto >= 100):
            beta, fitted_upto = list(fit_beta(past).beta), len(past)
        if beta is not None:
            ttft = libbea.estimate(s, c["request"], beta=beta, lengths=c["output_lengths"])["ttft_s"]
            errors.append(abs(ttft - c["engine_ttft_s"]) / c["engine_ttft_s"])
    return {
        "arrivals": len(cases),
        "exact": exact,
        "exact_frac": exact / max(len(cases), 1),
        # vLLM caps a long prefill's chunks only while others wait or run: a later arrival can
        # shorten the request's chunks, which no replay from the state before it can know
        "later_arrival_cases": len(cases) - known,
        "exact_frac_known": exact_known / max(known, 1),
        "ttft_mape": sum(errors) / len(errors) if errors else None,
        "ttft_mape_n": len(errors),
        "batch_records": len(batches),
        "preemption_cases": sum(c["preemption_in_horizon"] for c in cases),
        "beta_final": list(fit_beta(usable).beta) if len(usable) >= 10 else None,
    }


def pool_replica_agreement(meta: dict[str, Any], steps: list[dict[str, Any]],
                           batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The block pool rebuilt from the plugin's block-op log against the engine: its free count
    after every step it is known (from the first dump on, and again from the next dump after
    steps the snapshotter lost: ``TrackedPool``), and its cached blocks against the KV-event
    mirror's after each such step (the two sources are independent: vLLM's events vs the
    plugin's view of the pool's calls). ``mismatches``: steps where a known pool disagreed
    with the engine — never expected."""
    pool = TrackedPool(int(meta["config"]["num_gpu_blocks"]))
    m = PrefixMirror()
    m.install(KvState(instance="r", epoch="r", seq=-1, t=0.0))
    order = sorted(batches, key=lambda b: (b["ts"], b["seq"]))
    nxt = checked = cache_equal = ops = mismatches = unknown = 0
    first_problem = None
    for st in steps:
        was = pool.synced
        gap = pool.seq is not None and int(st["seq"]) != pool.seq + 1
        known = pool.step(st)
        ops += len(st.get("block_ops") or ())
        if known:
            checked += 1
        else:
            unknown += 1
            if was and not gap:
                mismatches += 1
                first_problem = first_problem or f"step {st['seq']}: {pool.problem}"
        while nxt < len(order) and order[nxt]["ts"] <= st["wall"]:
            b = order[nxt]
            m.apply(KvEvents(instance="r", epoch="r", seq=m.seq + 1, t=b["ts"],
                             ops=[KvOp(kind, list(h)) for kind, h in b["ops"]]))
            nxt += 1
        if known:
            cache_equal += pool.replica.cached_names() == Counter({h: n for h, n in m.counts.items() if n > 0})
    over = [st["overhead_ns"] for st in steps if st["seq"] > 0]
    return {"steps": len(steps), "ops": ops, "checked": checked, "unknown": unknown, "mismatches": mismatches,
            "cache_equal_kv_mirror": cache_equal, "first_problem": first_problem,
            "overhead_us_p50": float(np.percentile(over, 50)) / 1e3 if over else None,
            "overhead_us_p99": float(np.percentile(over, 99)) / 1e3 if over else None}


def keyed_hit(c: dict[str, Any], block_size: int) -> int:
    """The hit the pool's table gives a case's request at its snapshot: the leading run of its
    block keys among the cached blocks' keys (as vLLM caps it: the last token is recomputed)."""
    held = {k for k in c["snapshot"].get("tracked_keys", ()) if k >= 0}
    cap = (c["request"]["prompt_tokens"] - 1) // block_size
    n = 0
    for k in c["request"]["block_keys"][:cap]:
        if k not in held:
            break
        n += 1
    return n * block_size


def _untracked(c: dict[str, Any]) -> None:
    """Drop a case's tracked blocks (its hits become plain token counts)."""
    c["snapshot"].pop("tracked_blocks", None)
    c["snapshot"].pop("tracked_keys", None)
    c["request"].pop("hit_blocks", None)
    c["request"].pop("block_keys", None)
    for r in (*c["snapshot"]["running"], *c["snapshot"]["waiting"]):
        r.pop("hit_blocks", None)
        r.pop("tracked", None)
        r.pop("block_keys", None)


def without_hits(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(cases)
    for c in out:
        _untracked(c)
        c["request"]["prefix_hit_tokens"] = 0
        for w in c["snapshot"]["waiting"]:
            w.pop("prefix_hit_tokens", None)
    return out


def counts_only(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The mirror's hits as token counts only: the count model's replay."""
    out = copy.deepcopy(cases)
    for c in out:
        _untracked(c)
    return out


def with_engine_hits(cases: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases with the engine's own admission hits (its num_cached_tokens), for comparison:
    what the replay does when its hit inputs are the engine's ground truth."""
    adm: dict[str, int] = {}
    for st in steps:
        for rid, c in st["new_reqs"].items():
            adm.setdefault(rid, int(c))
    out = copy.deepcopy(cases)
    for c in out:
        _untracked(c)
        c["request"]["prefix_hit_tokens"] = adm.get(c["request"]["id"], c["request"]["prefix_hit_tokens"])
        for w in c["snapshot"]["waiting"]:
            if w.get("computed_tokens", 0) == 0 and w["id"] in adm:
                w["prefix_hit_tokens"] = adm[w["id"]]
    return out


def live_pool_fidelity(cases: list[dict[str, Any]], published: dict[int, bytes], record: Any,
                       prompts: dict[str, list[int]], tokenizer_id: str) -> dict[str, Any]:
    """The replay from what a live estimator holds: each case's snapshot as the snapshotter
    published it over NATS (its pool block by block: ``bear.prefix.tracked_pool``), parsed by an
    estimator's state store, and the query's block keys as the estimator's plan computes them
    from its token ids — replayed and compared with the engine's batches."""
    from bear.estimator.state import StateStore
    from bear.replay.recorded_cache import find_prompt

    out = {"cases": len(cases), "published": 0, "described": 0, "keyed": 0, "ahead": 0, "exact": 0}
    for c in cases:
        data = published.get(c["snapshot"]["seq"])
        toks = find_prompt(prompts, c["request"]["id"])
        if data is None or toks is None:
            continue
        state = dict(unpack(data))
        out["published"] += 1
        store = StateStore()
        st = store.get(record.id)
        st.on_registry(record)
        t = float(state["time"])  # an idle re-send of this state carries a later time
        store.offer(record.id, data, t)
        st.ensure_parsed()
        out["described"] += "tracked_blocks" in state  # (the engine's first state: an empty table)
        _replay_case(c, state, store, st, record, prompts, tokenizer_id, toks, out)
    out["exact_frac"] = out["exact"] / max(1, out["published"])
    return out


def live_pool_delta_fidelity(cases: list[dict[str, Any]], stream: list[tuple[dict[str, Any], bytes | None, bytes | None]],
                             record: Any, prompts: dict[str, list[int]], tokenizer_id: str) -> dict[str, Any]:
    """``live_pool_fidelity`` from what a live estimator holds when the snapshotter keeps the
    block table step by step (``--pool-deltas``; ``published_stream``): for each case, the
    estimator's state store takes the last full snapshot at or before the case's step and every
    ``bear.delta/1`` after it up to that step (libbea applies the table's changes in place), and
    the case is replayed from that state."""
    from bear.estimator.state import StateStore
    from bear.replay.recorded_cache import find_prompt

    out = {"cases": len(cases), "published": 0, "described": 0, "keyed": 0, "ahead": 0, "exact": 0,
           "deltas_applied": 0, "from_full": 0}
    where = {int(s["seq"]): k for k, (s, _, _) in enumerate(stream)}
    for c in cases:
        k = where.get(c["snapshot"]["seq"])
        toks = find_prompt(prompts, c["request"]["id"])
        if k is None or toks is None:
            continue
        j = k
        while j >= 0 and stream[j][1] is None:
            j -= 1
        if j < 0:
            continue
        state = stream[k][0]
        out["published"] += 1
        out["from_full"] += j == k
        store = StateStore()
        st = store.get(record.id)
        st.on_registry(record)
        t = float(state["time"])
        full = stream[j][1]
        assert full is not None
        store.offer(record.id, full, t)
        st.ensure_parsed()
        for i in range(j + 1, k + 1):
            delta = stream[i][2]
            assert delta is not None, f"seq {stream[i][0]['seq']}: no delta after a full snapshot"
            got = st.offer_delta(delta, t)
            assert got == "applied", (stream[i][0]["seq"], got)
            out["deltas_applied"] += 1
        assert st.snap is not None
        out["described"] += st.snap.tracked_blocks > 0  # (the engine's first state: every block free)
        _replay_case(c, state, store, st, record, prompts, tokenizer_id, toks, out)
    out["exact_frac"] = out["exact"] / max(1, out["published"])
    return out


def _replay_case(c: dict[str, Any], state: dict[str, Any], store: Any, st: Any, record: Any,
                 prompts: dict[str, list[int]], tokenizer_id: str, toks: list[int], out: dict[str, Any]) -> None:
    """One case replayed from the estimator's state ``st`` (the state published at its step)."""
    from bear.estimator.estimate import plan
    from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery
    from bear.protocol.token_ids import pack
    from bear.replay.recorded_cache import find_prompt

    t = float(state["time"])
    # the requests that reached the engine after this snapshot and before the query: what
    # the router's dispatches tell the estimator (with the prompts' token ids)
    for k, w in enumerate(c["snapshot"]["waiting"][len(state["waiting"]):]):
        wt = find_prompt(prompts, w["id"])
        st.on_dispatch(Dispatch(query_id=w["id"], request_id=w["id"], prompt_tokens=w["prompt_tokens"],
                                predicted_output_tokens=c["output_lengths"][w["id"]], max_tokens=w["max_tokens"],
                                prefix_hit_tokens=w.get("prefix_hit_tokens", 0), t=t + 1e-3 * (k + 1),
                                tokens=None if wt is None else pack(wt)))
    req = c["request"]
    p = plan(EstimateQuery(id=req["id"], prompt_tokens=len(toks), max_tokens=req["max_tokens"]),
             [EstimateCandidate(instance=record.id, tokenizer=tokenizer_id)], store, t,
             EstimatorConfig(), tokens={tokenizer_id: pack(toks)})
    (job,) = p.jobs
    out["keyed"] += bool(job.keys)
    qd = {"id": req["id"], "prompt_tokens": len(toks), "max_tokens": req["max_tokens"],
          "prefix_hit_tokens": job.hit, **({"block_keys": job.keys} if job.keys else {})}
    out["ahead"] += len(job.inputs.ahead)
    res = libbea.estimate(job.snap, qd, beta=[1e-3, 0.0, 0.0, 0.0], lengths=c["output_lengths"],
                          ahead=job.inputs.ahead, trace=True)
    out["exact"] += res["batches"] == c["expected_batches"]


def prefix_fidelity(step_log: Path, prompts: dict[str, list[int]], config: str, work: Path) -> dict[str, Any]:
    """Every figure of a prefix-caching run from its step log and prompts alone: the mirror's hits
    against the engine's, the replay with the mirror's hits (block by block where the pool was
    logged), as counts, without hits and with the engine's own hits; with the block-op log, the
    pool replica against the engine and the replay from the states a snapshotter that keeps up
    publishes (``published_states``), each query keyed as a live estimator keys it."""
    agreement: list[dict[str, Any]] = []
    record_run([step_log], trace=config, out_dir=work, prompts=prompts, agreement=agreement)
    cases = read_cases(work)
    ((meta, steps),) = generations(step_log)
    batches = batches_of(steps, config)
    (agree,) = agreement
    with_hits = replay_fidelity(cases, batches)
    res: dict[str, Any] = {
        "config": config, "cases": len(cases), "steps": steps[-1]["seq"] + 1, "steps_logged": len(steps),
        "vllm": meta["vllm_version"], "block_size": meta["config"]["block_size"],
        "num_gpu_blocks": meta["config"]["num_gpu_blocks"],
        "hit_agreement": {k: v for k, v in agree.items() if k != "mismatches"}, "hit_mismatches": agree["mismatches"][:10],
        "cases_with_mirror_hits": sum(c.get("prefix_source") == "mirror" for c in cases),
        "cases_with_hit": sum(c["request"]["prefix_hit_tokens"] > 0 for c in cases),
        "replay_with_mirror_hits": with_hits,
        "replay_with_mirror_hit_counts": replay_fidelity(counts_only(cases), batches),
        "replay_without_hits": replay_fidelity(without_hits(cases), batches),
        "replay_with_engine_hits": replay_fidelity(with_engine_hits(cases, steps), batches),
        "engine_preemptions": sum(len(st.get("preempted") or ()) for st in steps),
    }
    if steps[0].get("block_ops") is not None:
        bs = int(meta["config"]["block_size"])
        res["cases_with_tracked_blocks"] = sum("tracked_blocks" in c["snapshot"] for c in cases)
        keyed = [c for c in cases if "block_keys" in c["request"]]
        res["tracked_hits"] = len(keyed)
        res["tracked_hits_equal_mirror"] = sum(keyed_hit(c, bs) == c["request"]["prefix_hit_tokens"] for c in keyed)
        res["pool_replica"] = pool_replica_agreement(meta, steps, kv_batches(step_log))
        instance = f"vllm-{config}"
        published = dict(published_states(meta, steps, instance=instance, model="tiny"))
        record = msgspec.structs.replace(instance_record(instance, "tiny", "", config=meta.get("config")),
                                         prefix_cache=prefix_info(meta))
        res["live_pool"] = live_pool_fidelity(cases, published, record, prompts, TOKENIZER_ID)
        # a snapshotter with --pool-deltas: the table's changes in the deltas, the whole table in
        # the full snapshots only (every 64 states here, so that every case's state is rebuilt
        # from a full snapshot and up to 63 deltas)
        stream = list(published_stream(meta, steps, instance=instance, model="tiny", full_every=64))
        res["live_pool_deltas"] = live_pool_delta_fidelity(cases, stream, record, prompts, TOKENIZER_ID)
    return res


def read_prompts(path: Path) -> dict[str, list[int]]:
    with gzip.open(path, "rt") as f:
        return {k: [int(t) for t in v] for k, v in json.load(f).items()}
