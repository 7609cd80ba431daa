"""``bear bench estimator`` (ingest): what a worker pays per engine step to keep an instance's state,
with full snapshots (parse + install) and with per-step deltas (applied in libbea), at 64, 256 and
1,024 residents; the estimate with and without the step's ingest; and what that leaves of one core
(a worker's capacity) when every instance steps 30 times a second.

The steps are real scheduler steps (libbea's engine): residents decoding, about one in 150 finishing
per step and replaced by a new arrival (prefill), API-server-like request ids, every id announced
by a dispatch just before the step that shows it (as a router's would be; dispatched all at once,
every later arrival would queue "ahead" of the query and inflate the estimate). Each step's two
payloads are what the shared publisher sends: ``pack(state)`` and ``pack(encode_delta(previous, state))``. Ingest runs the worker's own code
(``InstanceState.offer_snapshot`` + ``ensure_parsed`` + ``apply_lengths``; ``offer_delta``); the
estimate is ``bear.estimator.estimate.estimate`` for one candidate. Every number is timed in this
process, one call at a time, in the same run: medians and p99 over every step of several passes.
NATS receive costs are not included (the bytes per step say what each mode sends).
"""

from __future__ import annotations

import gc
import itertools
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from bear import libbea
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.estimator.state import StateStore
from bear.instance.delta import encode_delta
from bear.protocol.codec import pack
from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery
from bear.sim.profile import load_profile

RESIDENTS = (64, 256, 1024)
STEPS_PER_S = 30.0  # an instance's step rate for the capacity figures (GPU steps: 10-40 ms)
QUERY = EstimateQuery(id="q", prompt_tokens=1024, max_tokens=256)
CFG = EstimatorConfig()
AGE_S = 0.015  # each step's message is ingested and the query estimated this long after its capture


def step_states(residents: int, steps: int, seed: int = 0) -> tuple[list[dict[str, Any]], list[Dispatch]]:
    """``steps`` consecutive published states of an instance with ``residents`` requests, and the
    dispatches of every request in them (each stamped when its request was added)."""
    rng = random.Random(seed)
    cfg = {**load_profile("qwen3-8b-h100").engine_config(), "max_num_seqs": residents,
           "max_num_batched_tokens": 8192, "num_gpu_blocks": 400_000}
    eng = libbea.Engine(cfg)
    dispatches: list[Dispatch] = []
    t = time.time() - 3600.0

    def add() -> None:
        rid = f"cmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}-0"
        out = rng.randint(100, 300)
        dispatches.append(Dispatch(request_id=rid, prompt_tokens=100, predicted_output_tokens=out, t=t))
        eng.add(rid, rng.randint(100, 1500), 4096, out, t)

    for _ in range(residents):
        add()
    states = []
    for k in range(steps + 200):
        if eng.step():
            eng.finish_step()
        t += 0.03
        for _ in range(residents - eng.live):
            add()
        if k >= 200:  # past the initial prefill: every step a decode step with some churn
            states.append(dict(eng.snapshot("bench", "m", t), generation=1))
    return states, dispatches


def _us(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"median_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)), "mean_us": float(a.mean())}


def arrivals(states: list[dict[str, Any]], dispatches: list[Dispatch]) -> list[list[Dispatch]]:
    """Per state, the dispatches of the requests it shows first (all of them for the first state):
    what a router sends just before those requests reach the instance."""
    by_id = {d.request_id: d for d in dispatches}
    out: list[list[Dispatch]] = []
    known: set[str] = set()
    for s in states:
        ids = [r["id"] for r in itertools.chain(s["running"], s["waiting"]) if r["id"] not in known]
        known.update(ids)
        out.append([by_id[i] for i in ids])
    return out


def _fresh(states: list[dict[str, Any]], first: list[Dispatch], full0: bytes) -> Any:
    """A worker's store holding the first state, its residents' dispatches known."""
    store = StateStore()
    st = store.get("bench")
    for d in first:
        st.on_dispatch(d)
    st.offer_snapshot(full0, states[0]["time"] + AGE_S)
    st.ensure_parsed()
    st.apply_lengths()
    return store, st


def _steps(st: Any, states: list[dict[str, Any]], payloads: list[bytes],
           sent: list[list[Dispatch]]) -> Iterator[tuple[float, bytes]]:
    """Per step after the first: (the worker's clock when the step's message arrives, the message),
    after the router's dispatches of that step's arrivals reached ``st`` (not timed: per query)."""
    for state, raw, new in zip(states[1:], payloads, sent[1:], strict=True):
        for d in new:
            st.on_dispatch(d)
        yield state["time"] + AGE_S, raw  # the instance's clock: ages as in a live worker


def measure(residents: int, steps: int, passes: int) -> dict[str, Any]:
    """Per-step ingest and estimate timings for one population (see the module doc)."""
    states, dispatches = step_states(residents, steps + 1)
    sent = arrivals(states, dispatches)
    fulls = [pack(s) for s in states]
    deltas = []
    for a, b in itertools.pairwise(states):
        d = encode_delta(a, b)
        if d is None:
            raise RuntimeError("a bench step was not expressible as a delta")
        deltas.append(pack(d))
    cand = [EstimateCandidate(instance="bench")]
    gc.collect()
    gc.freeze()  # the recorded steps are this process's, not a worker's: keep the collector off them
    parse, ing_full, ing_delta, est, est_full, est_delta, encode_s = [], [], [], [], [], [], []
    pc = time.perf_counter
    for _ in range(passes):
        for a, b in itertools.pairwise(states):  # the publisher's side, once per step
            t0 = pc()
            pack(encode_delta(a, b))
            encode_s.append(pc() - t0)
        # full snapshots: every step parsed and installed, then one estimate
        store, st = _fresh(states, sent[0], fulls[0])
        for now, raw in _steps(st, states, fulls[1:], sent):
            t0 = pc()
            libbea.Snapshot.from_msgpack(raw)
            t1 = pc()
            st.offer_snapshot(raw, now)
            st.ensure_parsed()
            st.apply_lengths()
            t2 = pc()
            estimate(QUERY, cand, store, now, CFG)
            t3 = pc()
            parse.append(t1 - t0)
            ing_full.append(t2 - t1)
            est_full.append(t3 - t1)
        # deltas: every step applied, then one estimate; then the same estimate again (nothing new)
        store, st = _fresh(states, sent[0], fulls[0])
        for now, raw in _steps(st, states, deltas, sent):
            t0 = pc()
            st.offer_delta(raw, now)
            st.apply_lengths()
            t1 = pc()
            estimate(QUERY, cand, store, now, CFG)
            t2 = pc()
            estimate(QUERY, cand, store, now, CFG)
            t3 = pc()
            ing_delta.append(t1 - t0)
            est_delta.append(t2 - t0)
            est.append(t3 - t2)
        if st.gapped or libbea.snapshot_difference(st.snap, libbea.Snapshot.from_msgpack(fulls[-1])) is not None:
            raise RuntimeError("the delta mirror left the published state")
    gc.unfreeze()
    n_res = np.mean([len(s["running"]) + len(s["waiting"]) for s in states])
    return {
        "residents": residents, "mean_residents": float(n_res), "steps": steps, "passes": passes,
        "full_bytes_per_step": float(np.median([len(b) for b in fulls])),
        "delta_bytes_per_step": float(np.median([len(b) for b in deltas])),
        "delta_bytes_p99": float(np.percentile([len(b) for b in deltas], 99)),
        "parse": _us(parse), "ingest_full": _us(ing_full), "ingest_delta": _us(ing_delta),
        "estimate": _us(est), "ingest_estimate_full": _us(est_full), "ingest_estimate_delta": _us(est_delta),
        "encode_delta": _us(encode_s),
    }


def capacity(row: dict[str, Any], instances: int = 100) -> dict[str, Any]:
    """One worker core: the instances whose ingest alone fills it at ``STEPS_PER_S`` each, and the
    estimates/s left with ``instances`` instances. Per step and instance the worker pays: with full
    snapshots, receiving one (NATS) and, as soon as a query comes, parsing and installing it; with
    deltas, receiving and applying one (the NATS figure includes the apply: it happens in the
    subscription callback). Medians: the work is the same every step; a shared host's outliers
    are not the code's. Without the NATS figures, the in-process ingest alone."""
    est_s = row["estimate"]["median_us"] / 1e6
    nats_rx = row.get("nats")
    out: dict[str, Any] = {}
    for mode in ("full", "delta"):
        ing = row[f"ingest_{mode}"]["median_us"]
        if nats_rx is not None:
            rx = nats_rx[mode]["cpu_us_per_message"]
            ing = rx + ing if mode == "full" else rx
        ing_s = ing / 1e6
        busy = instances * STEPS_PER_S * ing_s
        out[mode] = {
            "per_step_us": ing,
            # None: the ingest took less than the CPU clock resolves over a brief run (a worker's
            # CPU is read in 10-ms ticks; over half a second of deltas it can read 0)
            "instances_at_30_steps_s": 1.0 / (STEPS_PER_S * ing_s) if ing_s > 0 else None,
            f"ingest_core_share_at_{instances}": busy,
            f"estimates_per_s_at_{instances}": max(0.0, (1.0 - busy) / est_s),
            f"mb_per_s_at_{instances}": instances * STEPS_PER_S * row[f"{mode}_bytes_per_step"] / 1e6,
        }
    return out


def run_ingest(steps: int, passes: int, nats_seconds: float = 0.0, nats_instances: int = 10) -> list[dict[str, Any]]:
    rows = []
    for r in RESIDENTS:
        row = measure(r, steps, passes)
        if nats_seconds > 0:
            row["nats"] = run_nats_receive(r, nats_instances, nats_seconds)
        row["capacity"] = capacity(row)
        rows.append(row)
    return rows


def print_ingest(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(x: dict[str, float]) -> str:
        return f"{x['median_us']:.1f} / {x['p99_us']:.1f}"

    t = Table(title="Ingest per engine step: full snapshots vs deltas (µs median / p99; bytes: median)",
              caption="parse: libbea.Snapshot.from_msgpack alone; ingest: the worker's code for one step's "
                      "message; estimate: one candidate, the step already ingested; ÷ estimate: ingest+est. "
                      "delta over estimate (medians); encode: the publisher's delta, once per step")
    for col in ("residents", "bytes full", "bytes delta", "parse", "ingest full", "ingest delta",
                "estimate", "ingest+est. full", "ingest+est. delta", "÷ estimate", "encode (pub.)"):
        t.add_column(col, justify="right")
    for r in rows:
        ratio = r["ingest_estimate_delta"]["median_us"] / r["estimate"]["median_us"]
        t.add_row(str(r["residents"]), f"{r['full_bytes_per_step']:,.0f}", f"{r['delta_bytes_per_step']:,.0f}",
                  cell(r["parse"]), cell(r["ingest_full"]), cell(r["ingest_delta"]), cell(r["estimate"]),
                  cell(r["ingest_estimate_full"]), cell(r["ingest_estimate_delta"]), f"{ratio:.2f}×",
                  cell(r["encode_delta"]))
    Console().print(t)
    c = Table(title=f"One worker core, instances stepping {STEPS_PER_S:g}×/s",
              caption="per step: NATS receive (a worker process, measured) + parse/install (full) or "
                      "receive+apply (delta); estimates/s: what is left of the core at 100 instances")
    for col in ("residents", "mode", "NATS rx µs/msg", "per step µs", "instances (ingest only)",
                "ingest at 100", "estimates/s at 100", "MB/s in at 100"):
        c.add_column(col, justify="right")
    for r in rows:
        for mode in ("full", "delta"):
            x = r["capacity"][mode]
            rx = r["nats"][mode]["cpu_us_per_message"] if "nats" in r else float("nan")
            c.add_row(str(r["residents"]), mode, f"{rx:.0f}", f"{x['per_step_us']:.0f}",
                      "below resolution" if x["instances_at_30_steps_s"] is None
                      else f"{x['instances_at_30_steps_s']:,.0f}",
                      f"{100 * x['ingest_core_share_at_100']:.0f} %", f"{x['estimates_per_s_at_100']:,.0f}",
                      f"{x['mb_per_s_at_100']:.2f}")
    Console().print(c)


def run_nats_receive(residents: int = 256, instances: int = 20, seconds: float = 4.0) -> dict[str, Any]:
    """What a worker process pays to *receive* each instance's stream over a local NATS (no
    queries): its CPU seconds per message, full snapshots every step vs deltas every step, from
    ``instances`` instances at 30 steps/s. (In full mode nothing is parsed without queries: the
    parse happens per query and is counted in ``ingest_full``.)"""
    import subprocess
    import sys

    from bear.protocol.subjects import Subjects
    from bear.runtime import aio
    from bear.runtime.nats_server import LocalNatsServer

    steps = int(seconds * STEPS_PER_S) + 2
    states, _ = step_states(residents, steps)
    fulls = [pack(s) for s in states]
    deltas = [pack(encode_delta(a, b)) for a, b in itertools.pairwise(states)]
    out: dict[str, Any] = {"residents": residents, "instances": instances, "steps_per_s": STEPS_PER_S}
    server = LocalNatsServer().start()
    worker = subprocess.Popen([sys.executable, "-m", "bear", "estimator", "--nats", server.url, "--log-level",
                               "warning"])
    try:
        for mode in ("full", "delta"):
            out[mode] = aio.run(_stream(server.url, Subjects(), mode, fulls, deltas, instances, worker.pid))
    finally:
        worker.terminate()
        worker.wait(timeout=10)
        server.close()
    return out


async def _stream(url: str, subjects: Any, mode: str, fulls: list[bytes], deltas: list[bytes], instances: int,
                  pid: int) -> dict[str, Any]:
    import asyncio

    import nats

    from bear.runtime.measure import cpu_seconds

    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    names = [f"{mode}-{k}" for k in range(instances)]
    for n in names:  # every instance's first state in full (the base of its deltas)
        await nc.publish(subjects.snapshot(n), fulls[0])
    await nc.flush()
    await asyncio.sleep(1.0)  # the worker has subscribed long before: let it settle
    payloads = fulls[1:] if mode == "full" else deltas
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    sent = nbytes = 0
    for k, raw in enumerate(payloads):
        target = t0 + k / STEPS_PER_S
        await asyncio.sleep(max(0.0, target - time.perf_counter()))
        for n in names:
            await nc.publish(subjects.snapshot(n) if mode == "full" else subjects.delta(n), raw)
            sent += 1
            nbytes += len(raw)
        await nc.flush()
    await asyncio.sleep(0.5)  # let the worker drain
    elapsed = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    await nc.close()
    return {"messages": sent, "bytes": nbytes, "elapsed_s": elapsed, "worker_cpu_s": cpu,
            "cpu_us_per_message": 1e6 * cpu / max(sent, 1), "worker_cpu_share": cpu / elapsed}
