"""Per-step deltas end to end over a real NATS server, in separate processes: a ``bear sim-engine``
publishes a ``bear.delta/1`` every step and a full snapshot only when a delta cannot say it
(``--full-every 0``); a ``bear estimator`` started while the instance is busy holds no state, asks
``bear.resync.<id>``, then keeps the state by the deltas alone and answers BEA; every delta on the
bus chains onto the one before; after the load the worker's mirror equals the instance's idle
full snapshots (checked by the worker itself) and the state a resync returns."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from typing import Any

import httpx
import nats
import numpy as np
import pytest

from bear import libbea
from bear.estimator.client import EstimatorClient
from bear.protocol.codec import unpack_map
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import ResyncRequest, encode
from bear.protocol.subjects import Subjects
from bear.runtime.nats_server import free_port

from delta_check import check_mirror
from waiting import wait_until

S = Subjects()
INSTANCE = "e2e-deltas"


def _metric(text: str, name: str, label: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*"{label}"[^}}]*\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _bear(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bear", *args, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _answers(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(url)).status_code == 200
    except httpx.TransportError:
        return False


MIN_APPLIED = 100  # deltas the worker applies while the instance is busy before the load stops


@pytest.mark.slow
async def test_sim_instance_to_late_worker_by_deltas_and_resync(nats_server: Any) -> None:
    port, mport = free_port(), free_port()
    nc = await nats.connect(nats_server.url)
    fulls: list[bytes] = []
    deltas: list[bytes] = []

    new_state = asyncio.Event()

    async def on_state(msg: Any) -> None:  # one subscription: both streams seen in publication order
        if msg.subject == S.delta(INSTANCE):
            deltas.append(msg.data)
            new_state.set()
        elif msg.subject == S.snapshot(INSTANCE):
            fulls.append(msg.data)
            new_state.set()

    await nc.subscribe(f"{S.prefix}.*.{INSTANCE}", cb=on_state, pending_msgs_limit=1 << 20,
                       pending_bytes_limit=1 << 30)
    await nc.flush()
    sim = _bear("sim-engine", "--profile", "qwen3-8b-h100", "--port", str(port), "--instance", INSTANCE,
                "--nats", nats_server.url, "--seed", "3", "--output-lengths", "max", "--full-every", "0")
    worker: subprocess.Popen[bytes] | None = None
    answers: list[str] = []  # the estimator's statuses for the instance, in order
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            await wait_until(lambda: _answers(http, f"http://127.0.0.1:{port}/health"), what="the sim engine")
            rng = np.random.default_rng(11)
            stop = asyncio.Event()

            async def one(p: int, o: int) -> None:
                body = {"prompt": [1] * p, "max_tokens": o, "stream": True}
                async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def user() -> None:  # closed loop: a new query as soon as the last one ended
                while not stop.is_set():
                    await one(int(rng.integers(200, 3000)), int(rng.integers(30, 400)))

            async def metric(name: str, label: str) -> float:
                return _metric((await http.get(f"http://127.0.0.1:{mport}/metrics")).text, name, label)

            async def ask() -> None:  # the router's side: an estimate after each new state (the worker
                # parses a full snapshot, and checks its mirror against it, when an estimate needs it)
                client = EstimatorClient(nc, try_timeout_s=10.0, retries=1)
                while True:
                    await new_state.wait()
                    new_state.clear()
                    try:
                        rep = await client.estimate({"prompt_tokens": 800, "max_tokens": 50}, [INSTANCE],
                                                    budget_s=30.0)
                        answers.append(rep.estimates[0].status)
                    except BearError as exc:
                        answers.append(f"error {exc.code}: {exc.message}")

            loading = asyncio.gather(*(user() for _ in range(8)))
            # the instance is busy: the worker joins mid-stream
            await wait_until(lambda: len(deltas) >= 20, what="deltas while busy")
            # --max-age far beyond any stall: an answer is BEA whenever the state is held
            worker = _bear("estimator", "--nats", nats_server.url, "--metrics-port", str(mport), "--max-age", "60")
            await wait_until(lambda: _answers(http, f"http://127.0.0.1:{mport}/metrics"), what="the estimator")
            await wait_until(lambda: _estimates(nc), what="the estimator to answer")
            asker = asyncio.create_task(ask())
            await wait_until(lambda: answers.count("ok") >= 20, what="20 BEA answers while busy")
            await wait_until(lambda: _at_least(metric("bear_estimator_state_events_total", "delta_applied"),
                                               MIN_APPLIED), what=f"{MIN_APPLIED} deltas applied by the worker")
            stop.set()
            await loading
            # idle now: the sim re-sends its last state in full (every 0.5 s); the worker checks its
            # mirror against it; every delta went out before that re-send
            idle = await wait_until(lambda: _idle_after(fulls, deltas), what="an idle full snapshot after the load")
            await wait_until(lambda: _at_least(metric("bear_estimator_state_events_total", "mirror_verified"), 1),
                             what="the worker to verify its mirror")
            asker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asker
            text = (await http.get(f"http://127.0.0.1:{mport}/metrics")).text
            resync = ResyncRequest(instance=INSTANCE, consumer="test")
            final = (await nc.request(S.resync(INSTANCE), encode(resync), timeout=30.0)).data
    finally:
        for p in (sim, worker):
            if p is not None:
                p.terminate()
                p.wait(timeout=60)
        await nc.close()

    # the bus: one delta per step, each chaining onto the state before it (full snapshots: the
    # first state and the idle re-sends only); the mirror of them all equals the resync answer
    chained = check_mirror(fulls, deltas[:idle], final=final)
    assert chained["unchained"] == 0 and chained["differences"] == [], chained
    assert chained["applied"] == idle == len(deltas) >= MIN_APPLIED, chained
    busy_fulls = [f for f in fulls if libbea.Snapshot.from_msgpack(f).n_running > 0]
    assert len(busy_fulls) <= 2, len(busy_fulls)  # a delta said every busy step

    # the worker: resynced once on joining, then applied deltas; its mirror checked against the idle
    # full snapshots; BEA answers from the state it kept
    applied = _metric(text, "bear_estimator_state_events_total", "delta_applied")
    first_ok = answers.index("ok")
    print(f"e2e deltas: bus {chained['applied']} deltas ({chained['delta_bytes']} B), {len(fulls)} full snapshots; "
          f"worker applied {applied:.0f}, resyncs installed "
          f"{_metric(text, 'bear_estimator_resyncs_total', 'installed'):.0f}; answers {len(answers)}, "
          f"{first_ok} before the first ok: {sorted(set(answers[:first_ok]))}")
    assert MIN_APPLIED <= applied <= len(deltas), text
    assert _metric(text, "bear_estimator_resyncs_total", "installed") >= 1, text
    assert _metric(text, "bear_estimator_state_events_total", "mirror_verified") >= 1, text
    assert _metric(text, "bear_estimator_state_events_total", "mirror_mismatch") == 0, text
    assert _metric(text, "bear_estimator_state_events_total", "delta_malformed") == 0, text
    # once the state was installed it was kept: every answer after the first ok is BEA from it, none
    # an error
    assert set(answers[first_ok:]) == {"ok"}, sorted(set(answers[first_ok:]))
    assert not [a for a in answers if a.startswith("error")], answers


async def _estimates(nc: Any) -> bool:
    try:
        await EstimatorClient(nc, try_timeout_s=10.0, retries=0).estimate({"prompt_tokens": 8}, [INSTANCE],
                                                                          budget_s=30.0)
        return True
    except BearError as exc:  # no responders until the worker has subscribed
        if exc.code != ErrorCode.UNAVAILABLE:
            raise
        return False


async def _at_least(value: Any, bound: float) -> bool:
    return (await value) >= bound


def _idle_after(fulls: list[bytes], deltas: list[bytes]) -> int:
    """The number of deltas published before the newest idle full snapshot if it is the state of the
    last delta (0: not yet)."""
    if not fulls or not deltas:
        return 0
    last = unpack_map(fulls[-1])
    if not last.get("idle") or last.get("running") or last.get("waiting"):
        return 0
    d = libbea.Delta.from_msgpack(deltas[-1])
    return len(deltas) if (d.generation, d.seq) == (int(last.get("generation", 0)), int(last["seq"])) else 0
