"""Per-step deltas end to end over a real NATS server, in separate processes: a ``bear sim-engine``
publishes a ``bear.delta/1`` every step and a full snapshot only when a delta cannot say it
(``--full-every 0``); a ``bear estimator`` started while the instance is busy holds no state, asks
``bear.resync.<id>``, then keeps the state by the deltas alone and answers BEA; every delta on the
bus chains onto the one before; after the load the worker's mirror equals the instance's idle
full snapshots (checked by the worker itself) and the state a resync returns."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from typing import Any

import httpx
import nats
import numpy as np
import pytest

from bear import libbea
from bear.estimator.client import EstimatorClient
from bear.protocol.messages import ResyncRequest, encode
from bear.protocol.subjects import Subjects
from bear.runtime.nats_server import free_port

from delta_check import check_mirror

S = Subjects()
INSTANCE = "e2e-deltas"


def _metric(text: str, name: str, label: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*"{label}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _bear(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bear", *args, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _wait_http(http: httpx.AsyncClient, url: str) -> None:
    for _ in range(200):
        try:
            if (await http.get(url)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never answered")


@pytest.mark.slow
async def test_sim_instance_to_late_worker_by_deltas_and_resync(nats_server: Any) -> None:
    port, mport = free_port(), free_port()
    nc = await nats.connect(nats_server.url)
    fulls: list[bytes] = []
    deltas: list[bytes] = []

    async def on_full(msg: Any) -> None:
        fulls.append(msg.data)

    async def on_delta(msg: Any) -> None:
        deltas.append(msg.data)

    await nc.subscribe(S.snapshot(INSTANCE), cb=on_full, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
    await nc.subscribe(S.delta(INSTANCE), cb=on_delta, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
    await nc.flush()
    sim = _bear("sim-engine", "--profile", "qwen3-8b-h100", "--port", str(port), "--instance", INSTANCE,
                "--nats", nats_server.url, "--seed", "3", "--output-lengths", "max", "--full-every", "0")
    worker: subprocess.Popen[bytes] | None = None
    statuses: dict[str, int] = {}
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            await _wait_http(http, f"http://127.0.0.1:{port}/health")
            rng = np.random.default_rng(11)

            async def one(p: int, o: int) -> None:
                body = {"prompt": [1] * p, "max_tokens": o, "stream": True}
                async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def load(seconds: float) -> None:
                tasks = []
                t0 = t = time.time()
                while t - t0 < seconds:
                    t += rng.exponential(0.08)
                    await asyncio.sleep(max(0.0, t - time.time()))
                    tasks.append(asyncio.create_task(one(int(rng.integers(200, 3000)), int(rng.integers(30, 400)))))
                await asyncio.gather(*tasks)

            async def ask() -> None:  # the router's side: estimates while the instance is busy
                client = EstimatorClient(nc, try_timeout_s=0.5, retries=1)
                while True:
                    try:
                        rep = await client.estimate({"prompt_tokens": 800, "max_tokens": 50}, [INSTANCE],
                                                    budget_s=1.0)
                        st = rep.estimates[0].status
                        statuses[st] = statuses.get(st, 0) + 1
                    except Exception:  # no responders until the worker has started
                        if statuses:
                            statuses["error"] = statuses.get("error", 0) + 1
                    await asyncio.sleep(0.05)

            loading = asyncio.create_task(load(8.0))
            await asyncio.sleep(2.0)  # the instance is busy: the worker joins mid-stream
            assert deltas, "no delta published while busy"
            worker = _bear("estimator", "--nats", nats_server.url, "--metrics-port", str(mport))
            await _wait_http(http, f"http://127.0.0.1:{mport}/metrics")
            asker = asyncio.create_task(ask())
            await loading
            await asyncio.sleep(2.0)  # idle now: the sim re-sends its last state in full every 0.5 s
            asker.cancel()
            text = (await http.get(f"http://127.0.0.1:{mport}/metrics")).text
            resync = ResyncRequest(instance=INSTANCE, consumer="test")
            final = (await nc.request(S.resync(INSTANCE), encode(resync), timeout=2.0)).data
    finally:
        for p in (sim, worker):
            if p is not None:
                p.terminate()
                p.wait(timeout=10)
        await nc.close()

    # the bus: one delta per step, each chaining onto the state before it (full snapshots: the
    # first state and the idle re-sends only); the mirror of them all equals the resync answer
    chained = check_mirror(fulls, deltas, final=final)
    assert chained["unchained"] == 0 and chained["differences"] == [] and chained["applied"] == len(deltas) > 200
    busy_fulls = [f for f in fulls if libbea.Snapshot.from_msgpack(f).n_running > 0]
    assert len(busy_fulls) <= 2, len(busy_fulls)  # a delta said every busy step

    # the worker: resynced once on joining, then applied deltas; its mirror checked against the idle
    # full snapshots; BEA answers from the state it kept
    applied = _metric(text, "bear_estimator_state_events_total", "delta_applied")
    print(f"e2e deltas: bus {chained['applied']} deltas ({chained['delta_bytes']} B), {len(fulls)} full snapshots; "
          f"worker applied {applied:.0f}, resyncs installed "
          f"{_metric(text, 'bear_estimator_resyncs_total', 'installed'):.0f}; replies {statuses}")
    assert applied > 100, text
    assert _metric(text, "bear_estimator_resyncs_total", "installed") >= 1, text
    assert _metric(text, "bear_estimator_state_events_total", "mirror_verified") >= 1, text
    assert _metric(text, "bear_estimator_state_events_total", "mirror_mismatch") == 0, text
    assert _metric(text, "bear_estimator_state_events_total", "delta_malformed") == 0, text
    assert statuses.get("ok", 0) > 20 and statuses.get("ok", 0) >= 0.8 * sum(statuses.values()), statuses
