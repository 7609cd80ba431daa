"""Estimator workers as separate processes: a queue group spreads requests over them, and a
worker killed mid-load costs callers at most one timeout and a retry, never a lost request."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import nats
import pytest
from test_estimator_service import busy_snapshot

from bear.estimator.client import EstimatorClient
from bear.protocol.codec import pack
from bear.protocol.subjects import Subjects

S = Subjects()


def start_worker(url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bear", "estimator", "--nats", url, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def keep_publishing(nc, stop: asyncio.Event) -> None:
    snaps = [busy_snapshot(f"mp-{k}", seed=k) for k in range(3)]
    while not stop.is_set():
        for s in snaps:
            s["time"] = time.time()
            s["seq"] += 1
            await nc.publish(S.snapshot(s["instance"]), pack(s))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


@pytest.mark.slow
async def test_two_workers_share_load_and_survive_a_kill(nats_server) -> None:
    procs = [start_worker(nats_server.url) for _ in range(2)]
    nc = await nats.connect(nats_server.url)
    stop = asyncio.Event()
    pub = asyncio.create_task(keep_publishing(nc, stop))
    try:
        client = EstimatorClient(nc, try_timeout_s=0.3, retries=1)
        instances = [f"mp-{k}" for k in range(3)]
        seen: dict[str, int] = {}
        end = time.monotonic() + 30
        while len(seen) < 2 or min(seen.values()) < 5:  # both workers up and answering with BEA
            assert time.monotonic() < end, f"workers seen: {seen}"
            try:
                rep = await client.estimate({"prompt_tokens": 500}, instances, budget_s=1.0)
            except Exception:
                await asyncio.sleep(0.1)
                continue
            if all(e.method == "bea" for e in rep.estimates):
                seen[rep.worker] = seen.get(rep.worker, 0) + 1
        assert len(seen) == 2

        # Load with 8 callers; one worker is SIGKILLed in the middle.
        answered: list[str] = []
        failures: list[Exception] = []
        t_stop = time.monotonic() + 3.0

        async def caller(i: int) -> None:
            n = 0
            while time.monotonic() < t_stop:
                try:
                    rep = await client.estimate({"id": f"c{i}-{n}", "prompt_tokens": 700}, instances, budget_s=1.0)
                    answered.append(rep.worker)
                except Exception as exc:
                    failures.append(exc)
                n += 1

        async def killer() -> None:
            await asyncio.sleep(1.0)
            os.kill(procs[0].pid, signal.SIGKILL)

        timeouts_before = client.timeouts
        await asyncio.gather(killer(), *(caller(i) for i in range(8)))
        assert failures == []
        assert len(answered) > 100
        assert client.timeouts - timeouts_before <= 8  # at most the requests in flight at the kill
        assert len(set(answered[-20:])) == 1  # only the survivor answers afterwards
    finally:
        stop.set()
        await pub
        await nc.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait(timeout=10)
