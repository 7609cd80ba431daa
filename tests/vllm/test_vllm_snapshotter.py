"""Real vLLM (CPU build) + BEAR plugin + snapshotter + nats-server: every step arrives on NATS in
order; libbea replays vLLM's batches from the snapshot seen at each arrival; the state mirrored
from the plugin's per-step deltas equals the full state at every step (BEAR_SNAPSHOT_VERIFY=1);
the estimator's mirror, built in libbea from the published bear.delta/1 messages, equals the
published full snapshot at every step; the plugin's overhead at 256 residents; faults."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from harness import Load, VllmServer, retries, run_load

from bear import libbea
from bear.calibrator.fit import fit_beta
from bear.protocol.codec import unpack_map
from bear.runtime.nats_server import LocalNatsServer
from bear.snapshotter.cases import generations, record_run
from bear.snapshotter.records import StepDecoder, batches_of
from bear.snapshotter.service import Snapshotter, SnapshotterConfig
from bear.snapshotter.shm import ShmReader

from delta_check import check_mirror

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIGS: dict[str, dict[str, Any]] = {
    "light": {
        "args": ["--max-model-len", "4096", "--max-num-batched-tokens", "512", "--max-num-seqs", "16"],
        "load": Load(n=300, rate=10.0, prompt=(20, 600), output=(2, 24), seed=1),
    },
    "lpt-queueing": {
        "args": ["--max-model-len", "4096", "--max-num-batched-tokens", "384", "--max-num-seqs", "12",
                 "--long-prefill-token-threshold", "200"],
        "load": Load(n=200, rate=25.0, prompt=(50, 1200), output=(2, 32), seed=2),
    },
    "kv-pressure": {
        # 17 blocks of 128 tokens (vLLM's null block and one max-model-len request) and prompts
        # of 300-1,300 tokens: two residents of ~1k tokens overflow the pool, so it preempts
        # however fast the host serves the load (quiet runs, arrivals with a preemption: 1 to 36
        # with 100-900-token prompts at 17-20 blocks, 6 to 28 with these; none at 40 blocks;
        # docs/results/ci-kv-pressure-2026-12-02.md)
        "args": ["--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "16",
                 "--num-gpu-blocks-override", "17", "--no-enable-prefix-caching"],
        "load": Load(n=150, rate=12.0, prompt=(300, 1300), output=(32, 200), seed=3),
    },
}  # fmt: skip
# The fidelity configurations run with BEAR_SNAPSHOT_VERIFY=1: every record carries the delta and
# the full state, and the snapshotter's decoder compares its mirror with the full state each step.
# The snapshotter here shares this test's event loop with the load's HTTP clients and decodes a
# full record per step: 1024 ring slots (~8 s of these steps, 128 MiB of /dev/shm) instead of the
# default 256, so that a loop stalled on a loaded host does not let the ring overwrite steps (one
# run at load ≈ 3 lost a record with 256).
VERIFY_ENV = {"BEAR_SNAPSHOT_VERIFY": "1", "BEAR_SNAPSHOT_SLOTS": "1024"}
# Deltas only (not replayed): KV pressure with prefix caching on and shared prompt prefixes
# (preemptions, prefix hits on resume and admission), chunked prefill with a long-prefill
# threshold, clients that give up (aborts).
MIRROR_CONFIG: dict[str, Any] = {
    "args": ["--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "16",
             "--num-gpu-blocks-override", "48", "--long-prefill-token-threshold", "256"],
    "load": Load(n=200, rate=14.0, prompt=(50, 700), output=(16, 160), seed=4, prefix=300, prefix_frac=0.6,
                 abort_frac=0.15),
}  # fmt: skip

RESULTS = Path(os.environ.get("BEAR_VLLM_RESULTS", "/tmp/bear-vllm-results"))


def replay_fidelity(cases: list[dict[str, Any]], batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact-batch-sequence rate, and the TTFT MAPE with β fitted online: each case uses β fitted
    on the batch records that finished before its snapshot (refitted every 100 records)."""
    cases = sorted(cases, key=lambda c: c["snapshot"]["seq"])
    usable = [b for b in batches if b["duration_s"] is not None]
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


def save_result(name: str, result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


async def _collect(nc: Any, subject: str, sink: list[dict[str, Any]], raw: list[bytes] | None = None) -> Any:
    async def on_msg(msg: Any) -> None:
        sink.append(unpack_map(msg.data))
        if raw is not None:
            raw.append(msg.data)

    return await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)


async def _load_under_snapshotter(
    srv: VllmServer, nats_url: str, instance: str, step_log: Path, load: Load
) -> tuple[Snapshotter, list[dict[str, Any]]]:
    """Run a snapshotter (every step logged to ``step_log``; every state published in full and as a
    delta) beside the started vLLM while ``load`` runs, then stop it: (the snapshotter, the load's
    per-request results)."""
    svc = Snapshotter(SnapshotterConfig(instance=instance, shm=srv.shm, nats_url=nats_url, model="tiny",
                                        base_url=srv.base_url, record_to=str(step_log), full_every=1))  # fmt: skip
    task = asyncio.create_task(svc.run())
    await asyncio.sleep(1.0)
    results = await run_load(srv.base_url, load)
    await asyncio.sleep(1.5)
    svc.stop()
    await asyncio.wait_for(task, 15)
    return svc, results


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_every_step_published_and_replayed(
    config: str, vllm_py: str, tiny_model: Path, tmp_path: Path
) -> None:
    spec = CONFIGS[config]
    srv = VllmServer(vllm_py, tiny_model, spec["args"], log_path=tmp_path / "vllm.log", env=VERIFY_ENV)
    step_log = tmp_path / "steps.jsonl.gz"
    with LocalNatsServer() as nats_srv:
        await asyncio.to_thread(srv.start)
        try:
            nc = await nats.connect(nats_srv.url)
            snaps: list[dict[str, Any]] = []
            raw_snaps: list[bytes] = []
            deltas: list[dict[str, Any]] = []
            raw_deltas: list[bytes] = []
            await _collect(nc, f"bear.snapshot.vllm-{config}", snaps, raw_snaps)
            await _collect(nc, f"bear.delta.vllm-{config}", deltas, raw_deltas)
            await nc.flush()
            svc, results = await _load_under_snapshotter(srv, nats_srv.url, f"vllm-{config}", step_log, spec["load"])
            await nc.flush()
            await nc.close()
        finally:
            srv.stop()
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    # connections that broke before an answer were retried once (harness.post): a few at most
    assert len(retries(results)) <= max(1, len(results) // 50), retries(results)
    ((meta, steps),) = generations(step_log)
    mirror = _mirror_stats(svc, steps)
    assert meta["verify"] and mirror["mismatches"] == 0, mirror
    last = steps[-1]["seq"]
    assert len(steps) == last + 1, f"{last + 1 - len(steps)} steps lost before the snapshotter read them"
    assert mirror["verified"] >= len(steps) - 1 - mirror["records"].get("check", 0), mirror
    dropped = {why: svc.metrics.publisher.snapshots_dropped.labels(why)._value.get()  # type: ignore[attr-defined]
               for why in ("coalesced", "disconnected", "publish_error")}  # fmt: skip
    assert not any(dropped.values()), dropped
    seqs = [s["seq"] for s in snaps if not s.get("idle")]  # idle re-sends repeat the last step
    assert seqs == list(range(last + 1)), "snapshots missing or out of order on NATS"
    assert all(not (s["running"] or s["waiting"]) for s in snaps if s.get("idle"))
    for s in snaps[:: max(1, len(snaps) // 50)]:
        libbea.Snapshot.from_dict(s)
    # the estimator's side: the published deltas, applied in libbea, equal every published state
    delta_mirror = check_mirror(raw_snaps, raw_deltas)
    assert delta_mirror["differences"] == [] and delta_mirror["unchained"] == 0, delta_mirror
    assert delta_mirror["compared"] == len(seqs) - 1 == delta_mirror["deltas"], delta_mirror
    overhead = [st["overhead_ns"] / 1e3 for st in steps[1:] if st["overhead_ns"]]
    max_res = max(len(st["running"]) + len(st["waiting"]) for st in steps)
    out = tmp_path / "record"
    record_run([step_log], trace=config, out_dir=out)
    with gzip.open(out / "cases.jsonl.gz", "rt") as f:
        cases = [json.loads(line) for line in f]
    fid = replay_fidelity(cases, batches_of(steps, config))
    fid.update(config=config, steps=last, requests=len(results), max_resident=max_res,
               overhead_us_median=sorted(overhead)[len(overhead) // 2], vllm=meta["vllm_version"],
               skipped_steps=last + 1 - len(steps), delta_mirror=mirror,
               published_deltas={k: v for k, v in delta_mirror.items() if k != "differences"},
               published_full_bytes=sum(map(len, raw_snaps)))  # fmt: skip
    fid["connection_retries"] = retries(results)
    fid["engine_preemptions"] = sum(len(st.get("preempted") or ()) for st in steps)
    save_result(config, fid)
    assert fid["arrivals"] >= 0.9 * len(results)
    assert fid["exact_frac_known"] >= 0.99, fid
    assert fid["later_arrival_cases"] <= 0.1 * fid["arrivals"], fid  # counted apart, never many
    if config == "kv-pressure":
        # the engine preempted (its step log); how many arrivals' replays span a preemption
        # depends on timing (preemption_cases: 0 in a clean-clone CI run with 4 preemptions, 28
        # in another run), so it is reported, and every arrival's replay is checked above
        assert fid["engine_preemptions"] > 0, "the KV-pressure configuration never preempted"


def _mirror_stats(svc: Snapshotter, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What the snapshotter's decoder saw: records by kind, deltas checked against the full state."""
    kinds: dict[str, int] = {}
    for st in steps:
        kinds[st["record"]] = kinds.get(st["record"], 0) + 1
    return {**svc._decoder.stats, "records": kinds}


async def test_delta_mirror_equals_full_capture(vllm_py: str, tiny_model: Path, tmp_path: Path) -> None:
    """BEAR_SNAPSHOT_VERIFY=1 under KV pressure with prefix caching and shared prefixes, chunked
    prefill with a long-prefill threshold, and clients that give up: at every step the state the
    snapshotter rebuilt from the deltas equals the full state vLLM had."""
    srv = VllmServer(vllm_py, tiny_model, MIRROR_CONFIG["args"], log_path=tmp_path / "vllm.log", env=VERIFY_ENV)
    step_log = tmp_path / "steps.jsonl.gz"
    snaps: list[dict[str, Any]] = []
    raw_snaps: list[bytes] = []
    deltas: list[dict[str, Any]] = []
    raw_deltas: list[bytes] = []
    with LocalNatsServer() as nats_srv:
        await asyncio.to_thread(srv.start)
        try:
            nc = await nats.connect(nats_srv.url)
            await _collect(nc, "bear.snapshot.vm", snaps, raw_snaps)
            await _collect(nc, "bear.delta.vm", deltas, raw_deltas)
            await nc.flush()
            svc, results = await _load_under_snapshotter(srv, nats_srv.url, "vm", step_log, MIRROR_CONFIG["load"])
            await nc.flush()
            await nc.close()
        finally:
            srv.stop()
    ((meta, steps),) = generations(step_log)
    mirror = _mirror_stats(svc, steps)
    published = check_mirror(raw_snaps, raw_deltas)
    res = {
        **mirror,
        "published_deltas": {k: v for k, v in published.items() if k != "differences"},
        "published_full_bytes": sum(map(len, raw_snaps)),
        "steps": steps[-1]["seq"],
        "requests": len(results),
        "aborted": sum(1 for r in results if r.get("aborted")),
        "preemptions": sum(len(st["preempted"]) for st in steps),
        "prefix_hit_admissions": sum(1 for st in steps for c in st["new_reqs"].values() if c > 0),
        "max_resident": max(len(st["running"]) + len(st["waiting"]) for st in steps),
    }
    save_result("delta-mirror", res)
    assert meta["verify"] and res["mismatches"] == 0 and res["undecodable"] == 0, res
    assert res["verified"] >= len(steps) - 1 - mirror["records"].get("check", 0), res
    assert res["steps"] + 1 == len(steps), "steps missing from the log"
    # Prefix hits and aborts are in every run; preemptions depend on how fast the engine runs (a CI
    # run on a quiet host had none, every other run had some). Deltas across preemptions are checked
    # on every run by tests/vllm/test_vllm_delta.py (kv-pressure) and the kv-pressure every-step test.
    assert res["prefix_hit_admissions"] > 0 and res["aborted"] > 0, res
    busy = [s["seq"] for s in snaps if not s.get("idle")]
    assert published["differences"] == [] and published["unchained"] == 0, published
    assert published["compared"] == len(busy) - 1 == published["deltas"], published


def _drain_steps(reader: ShmReader, dec: StepDecoder, sink: list[dict[str, Any]]) -> None:
    """What the snapshotter service does: steps lost to a wrapped ring (this reader shares the
    GIL with 256 HTTP clients) leave the next deltas undecodable until a full record, which it
    asks for."""
    res = reader.poll()
    if res.skipped:
        dec.reset()
    asked = False
    for raw in res.records:
        step = dec.decode(raw)
        if step is None:
            asked = asked or reader.request_full()
            continue
        sink.append(step)


STEPS_AT_256 = 300  # steps measured at ≥ 250 residents before the load is cancelled


async def test_plugin_overhead_at_256_residents(vllm_py: str, tiny_model: Path, tmp_path: Path) -> None:
    """The time the plugin adds to an engine step with 256 requests resident (all decoding)."""
    args = ["--max-model-len", "4096", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]
    srv = VllmServer(vllm_py, tiny_model, args, log_path=tmp_path / "vllm.log")
    await asyncio.to_thread(srv.start)
    steps: list[dict[str, Any]] = []
    try:
        reader = ShmReader(srv.shm)
        delta_mode = bool(reader.meta().get("delta"))  # BEAR_SNAPSHOT_DELTA=0 in the environment: full
        dec = StepDecoder()
        # Drain the ring from its own thread: the 256 streaming clients share this event loop, and a
        # reader starved behind them would let the ring wrap and lose the very steps measured here.
        stop = threading.Event()
        enough = threading.Event()  # STEPS_AT_256 steps measured with ≥ 250 requests resident

        def drain() -> None:
            at_256 = 0
            while not stop.is_set():
                seen = len(steps)
                _drain_steps(reader, dec, steps)
                at_256 += sum(1 for s in steps[seen:] if len(s["running"]) >= 250)
                if at_256 >= STEPS_AT_256:
                    enough.set()
                time.sleep(0.002)
            _drain_steps(reader, dec, steps)

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        # On a loaded 2-core host the API server can take tens of seconds to admit 256 streams (with
        # 900-token answers the first ones finished before the last came in: peaks of 195–256 seen),
        # so the answers are long enough to overlap on any host, and the load is cancelled (vLLM
        # aborts the requests) once enough steps at 256 are measured, or after a time limit.
        load = asyncio.create_task(run_load(srv.base_url, Load(n=256, rate=1e6, prompt=(16, 16),
                                                               output=(3500, 3500))))  # fmt: skip
        try:
            await asyncio.to_thread(enough.wait, 240.0)
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            stop.set()
            await asyncio.to_thread(drainer.join)
            reader.close()
    finally:
        srv.stop()
    # Steps with (nearly) all 256 requests resident and every one of them scheduled.
    peak = max((len(s["running"]) for s in steps), default=0)
    assert peak >= 250, f"only {peak} requests were ever resident together"
    full = [s for s in steps if len(s["running"]) >= 0.95 * peak and len(s["sched"]) == len(s["running"])]
    assert len(full) > 50, f"only {len(full)} steps near the peak of {peak} residents"
    over = sorted(s["overhead_ns"] / 1e3 for s in full)
    cpu = sorted(s["overhead_cpu_ns"] / 1e3 for s in full)
    period = sorted(
        b["duration_s"] for b in batches_of(steps, "x") if b["duration_s"] and len(b["items"]) >= 0.95 * peak
    )
    kinds: dict[str, int] = {}
    for s in full:
        kinds[s["record"]] = kinds.get(s["record"], 0) + 1
    res = {
        "mode": "delta" if delta_mode else "full",
        "steps_at_256": len(full),
        "records": kinds,
        "peak_residents": peak,
        "overhead_us_median": over[len(over) // 2],
        "overhead_us_p90": over[int(len(over) * 0.9)],
        "overhead_us_mean": sum(over) / len(over),
        "overhead_cpu_us_median": cpu[len(cpu) // 2],
        "overhead_cpu_us_p90": cpu[int(len(cpu) * 0.9)],
        "overhead_cpu_us_mean": sum(cpu) / len(cpu),
        "step_ms_median": 1e3 * period[len(period) // 2],
        "loadavg_1m": os.getloadavg()[0],
        "decoder": dec.stats,
    }
    res["overhead_frac_of_step"] = res["overhead_us_median"] / 1e3 / res["step_ms_median"]
    res["overhead_cpu_frac_of_step"] = res["overhead_cpu_us_median"] / 1e3 / res["step_ms_median"]
    save_result(f"overhead-256{'' if delta_mode else '-full'}", res)
    assert dec.stats["mismatches"] == 0, res
    if not delta_mode:  # the full capture (before per-step deltas): ≈ 1 ms CPU ≈ 1.5 % of a step
        assert res["overhead_cpu_frac_of_step"] < 0.03, res
        return
    # Per-step deltas (docs/snapshotter.md): nearly every step at 256 residents is a delta record
    # (a full one every BEAR_SNAPSHOT_FULL_EVERY steps). Measured here 46 µs CPU median at load ≈ 1
    # and ~74 µs at load 4–5 (the full capture: 485 µs); the guard leaves room for a loaded host
    # and fails on a fall-back to full records (≥ 3× this).
    assert kinds.get("delta", 0) >= 0.9 * len(full), res
    assert res["overhead_cpu_us_median"] < 150, res


async def test_faults_nats_restart_and_vllm_kill(vllm_py: str, tiny_model: Path, tmp_path: Path) -> None:
    """Mid-load: restart NATS → snapshots flow again within 2 s and the engine never stalled;
    SIGKILL vLLM → the instance is marked down within 2 s."""
    srv = VllmServer(vllm_py, tiny_model, CONFIGS["light"]["args"], log_path=tmp_path / "vllm.log")
    step_log = tmp_path / "steps.jsonl"
    with LocalNatsServer() as nats_srv:
        await asyncio.to_thread(srv.start)
        try:
            svc = Snapshotter(SnapshotterConfig(instance="vf", shm=srv.shm, nats_url=nats_srv.url, model="tiny",
                                                base_url=srv.base_url, record_to=str(step_log)))  # fmt: skip
            task = asyncio.create_task(svc.run())
            load = asyncio.create_task(
                run_load(srv.base_url, Load(n=400, rate=20.0, prompt=(20, 400), output=(8, 64), seed=7))
            )
            await asyncio.sleep(4.0)
            nc = await nats.connect(nats_srv.url)
            kv = await nc.jetstream().key_value("bear_instances")
            assert unpack_map((await kv.get("vf")).value)["status"] == "up"
            await nc.close()

            t_stop = time.monotonic()
            await asyncio.to_thread(nats_srv.stop)
            await asyncio.sleep(1.5)
            t_start = time.monotonic()
            await asyncio.to_thread(nats_srv.start)
            got = asyncio.Event()
            seen: list[int] = []
            nc = await nats.connect(nats_srv.url)

            async def on_snap(msg: Any) -> None:
                seen.append(unpack_map(msg.data)["seq"])
                got.set()

            await nc.subscribe("bear.snapshot.vf", cb=on_snap)
            await nc.subscribe("bear.delta.vf", cb=on_snap)  # every step: a delta (full ones every 256)
            await asyncio.wait_for(got.wait(), 5)
            resumed_s = time.monotonic() - t_start
            await asyncio.sleep(2.0)

            kv = await nc.jetstream().key_value("bear_instances")
            t_kill = time.monotonic()
            await asyncio.to_thread(srv.kill)
            down_s = None
            while time.monotonic() - t_kill < 5:
                if unpack_map((await kv.get("vf")).value)["status"] == "down":
                    down_s = time.monotonic() - t_kill
                    break
                await asyncio.sleep(0.02)
            await nc.close()
            load.cancel()
            svc.stop()
            await asyncio.wait_for(task, 15)
        finally:
            srv.stop()
    steps = [s for _, s in _read_plain(step_log)]
    # time.monotonic() is one system-wide clock: engine step times compare with ours directly
    outage = [s for s in steps if t_stop <= s["t_sched0"] <= t_start + resumed_s]
    gaps = [b["t_sched0"] - a["t_upd1"] for a, b in itertools.pairwise(outage) if a["busy_after"]]
    res = {"nats_resume_s": resumed_s, "down_after_kill_s": down_s, "steps_during_outage": len(outage),
           "max_busy_gap_during_outage_ms": 1e3 * max(gaps, default=0.0), "steps": len(steps)}  # fmt: skip
    save_result("faults", res)
    assert resumed_s < 2.0, res
    assert down_s is not None and down_s < 2.0, res
    assert len(outage) > 50 and res["max_busy_gap_during_outage_ms"] < 100, res


def _read_plain(path: Path) -> list[tuple[Any, dict[str, Any]]]:
    from bear.snapshotter.cases import read_steps

    return list(read_steps(path))
