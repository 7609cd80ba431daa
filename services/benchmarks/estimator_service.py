"""``bear bench estimator-service``: throughput and service time of ONE estimator worker process over
NATS, with realistic snapshots (built by libbea.Engine from a sim profile: residents decoding at
several context lengths) refreshed every 200 ms, and load from separate client processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bear.protocol.codec import pack
from bear.protocol.subjects import Subjects
from bear.runtime import aio
from bear.runtime.measure import cpu_seconds

PROFILE = "qwen3-8b-h100"


def make_snapshot(instance: str, residents: int, seed: int) -> dict[str, Any]:
    """A busy instance: ``residents`` requests admitted and decoding, built by the sim scheduler."""
    from bear import libbea
    from bear.sim.profile import load_profile

    rng = np.random.default_rng(seed)
    eng = libbea.Engine(load_profile(PROFILE).engine_config())
    for k in range(residents):
        eng.add(f"{instance}-r{k}", int(rng.integers(100, 1500)), 4096, int(rng.integers(200, 2000)), 0.0)
    for _ in range(64):
        eng.step()
        eng.finish_step()
        if eng.n_waiting == 0 and eng.n_running == residents:
            break
    return eng.snapshot(instance, "Qwen/Qwen3-8B", time.time())


async def _connect(url: str, creds: str | None) -> Any:
    """A NATS connection (a cluster's comma-separated URLs too) as the identity ``creds`` names
    (None: $BEAR_NATS_CREDS, as every command; "": none, the bench's own local server)."""
    from bear.runtime.service import connect

    return await connect(url, "bear-bench-estimator-service", creds=creds)


async def _client(url: str, seconds: float, concurrency: int, instances: list[str], seed: int,
                  creds: str | None = None) -> dict[str, Any]:
    from bear.estimator.client import EstimatorClient

    nc = await _connect(url, creds)
    cli = EstimatorClient(nc, try_timeout_s=1.0)
    rng = np.random.default_rng(seed)
    rtts: list[float] = []
    service: list[float] = []
    methods: dict[str, int] = {}
    errors = 0
    end = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            q = {"id": f"q{rng.integers(1 << 30)}", "prompt_tokens": int(rng.integers(50, 2000)), "max_tokens": 512}
            t0 = time.perf_counter()
            try:
                rep = await cli.estimate(q, instances, budget_s=2.0)
            except Exception:
                errors += 1
                continue
            rtts.append(time.perf_counter() - t0)
            service.append(float(rep.service_s or 0.0))
            for e in rep.estimates:
                methods[e.method] = methods.get(e.method, 0) + 1

    t_start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t_start
    await nc.close()
    return {"n": len(rtts), "elapsed": elapsed, "rtts": rtts, "service": service, "methods": methods, "errors": errors}


def _client_proc(url: str, seconds: float, concurrency: int, instances: list[str], seed: int, out: Any,
                 creds: str | None = None) -> None:
    out.put(aio.run(_client(url, seconds, concurrency, instances, seed, creds)))


async def _publisher(url: str, snaps: list[dict[str, Any]], stop: asyncio.Event, creds: str | None = None) -> None:
    nc = await _connect(url, creds)
    subjects = Subjects()
    while not stop.is_set():
        for s in snaps:
            s["time"] = time.time()
            s["seq"] += 1
            await nc.publish(subjects.snapshot(s["instance"]), pack(s))
        await nc.flush()
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass
    await nc.close()




def run_bench(nats_url: str | None, *, seconds: float = 5.0, concurrency: int = 32, n_instances: int = 3,
              residents: int = 64, clients: int = 2, latency_seconds: float = 2.0,
              length_draws: int | None = None) -> dict[str, Any]:
    """``length_draws``: the started worker's ``--length-draws`` (None: its default); not
    applied to the workers of a given ``nats_url``."""
    from bear.runtime.nats_server import LocalNatsServer

    server = None
    worker = None
    creds: str | None = None  # a given NATS: the identity of $BEAR_NATS_CREDS (--nats-creds)
    if nats_url is None:
        creds = ""  # its own server has no identities
        server = LocalNatsServer().start()
        nats_url = server.url
        draws = [] if length_draws is None else ["--length-draws", str(length_draws)]
        worker = subprocess.Popen([sys.executable, "-m", "bear", "estimator", "--nats", nats_url, "--log-level",
                                   "warning", *draws])
    try:
        pid = worker.pid if worker is not None else None
        return aio.run(_run(nats_url, seconds, concurrency, n_instances, residents, clients, latency_seconds, pid,
                            creds))
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=10)
        if server is not None:
            server.close()


async def _run(url: str, seconds: float, concurrency: int, n_instances: int, residents: int,
               clients: int, latency_seconds: float, worker_pid: int | None, creds: str | None = None) -> dict[str, Any]:
    from bear.estimator.client import EstimatorClient

    snaps = [make_snapshot(f"bench-{i}", residents, i) for i in range(n_instances)]
    instances = [s["instance"] for s in snaps]
    stop = asyncio.Event()
    pub = asyncio.create_task(_publisher(url, snaps, stop, creds))
    nc = await _connect(url, creds)
    cli = EstimatorClient(nc, try_timeout_s=0.5)
    t_end = time.time() + 20
    while True:  # warm up until the worker(s) answer with BEA for every instance
        try:
            rep = await cli.estimate({"prompt_tokens": 100, "max_tokens": 10}, instances)
            if all(e.method == "bea" for e in rep.estimates):
                break
        except Exception:
            if time.time() > t_end:
                raise
        if time.time() > t_end:
            raise RuntimeError("workers never answered with BEA estimates")
        await asyncio.sleep(0.1)
    await nc.close()
    # Phase 1: unloaded latency (one request in flight).
    lat = await _client(url, latency_seconds, 1, instances, 99, creds) if latency_seconds > 0 else None
    # Phase 2: throughput under load from separate client processes.
    cpu0 = cpu_seconds(worker_pid, children=False) if worker_pid else None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(url, seconds, max(1, concurrency // clients), instances, k, out,
                                                         creds))
             for k in range(clients)]
    for p in procs:
        p.start()
    results = [await asyncio.to_thread(out.get) for _ in procs]
    for p in procs:
        p.join()
    cpu = cpu_seconds(worker_pid, children=False) - cpu0 if worker_pid and cpu0 is not None else None
    stop.set()
    await pub
    n = sum(r["n"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    rtts = np.array([x for r in results for x in r["rtts"]])
    svc = np.array([x for r in results for x in r["service"]])
    methods: dict[str, int] = {}
    for r in results:
        for k, v in r["methods"].items():
            methods[k] = methods.get(k, 0) + v
    def pct(xs: list[float] | np.ndarray, q: float) -> float | None:
        return float(np.percentile(xs, q) * 1e6) if len(xs) else None

    return {
        "unloaded_rtt_p50_us": pct(lat["rtts"], 50) if lat else None,
        "unloaded_rtt_p99_us": pct(lat["rtts"], 99) if lat else None,
        "unloaded_service_p50_us": pct(lat["service"], 50) if lat else None,
        "unloaded_service_p99_us": pct(lat["service"], 99) if lat else None,
        "requests": n,
        "worker_cpu_s": cpu,
        "worker_capacity_req_per_cpu_s": n / cpu if cpu else None,
        "errors": sum(r["errors"] for r in results),
        "req_per_s": n / elapsed if elapsed > 0 else 0.0,
        "loaded_rtt_p50_us": pct(rtts, 50),
        "loaded_rtt_p99_us": pct(rtts, 99),
        "loaded_service_p50_us": pct(svc, 50),
        "loaded_service_p99_us": pct(svc, 99),
        "instances": n_instances,
        "residents_per_instance": residents,
        "methods": methods,
    }
