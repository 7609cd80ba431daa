"""Estimator workers as separate processes: a queue group spreads requests over them, and a
worker killed mid-load costs callers at most one timeout and a retry, never a lost request."""

from __future__ import annotations

import asyncio
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
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.subjects import Subjects

from waiting import wait_until

S = Subjects()
TRY_S = 5.0  # one try's timeout


def start_worker(url: str) -> subprocess.Popen[bytes]:
    # --max-age: the snapshots published while the workers start stay BEA-usable throughout
    return subprocess.Popen([sys.executable, "-m", "bear", "estimator", "--nats", url, "--max-age", "3600",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def publish_snapshots(nc, snaps: list[dict]) -> None:
    """The instances' states, again (a worker that subscribed since gets them)."""
    for s in snaps:
        s["time"] = time.time()
        s["seq"] += 1
        await nc.publish(S.snapshot(s["instance"]), pack(s))
    await nc.flush()


@pytest.mark.slow
async def test_two_workers_share_load_and_survive_a_kill(nats_server) -> None:
    procs = [start_worker(nats_server.url) for _ in range(2)]
    nc = await nats.connect(nats_server.url)
    try:
        # a try that times out is a worker gone, never a slow one: the timeout bounds a hang
        client = EstimatorClient(nc, try_timeout_s=TRY_S, retries=1)
        instances = [f"mp-{k}" for k in range(3)]
        snaps = [busy_snapshot(i, seed=k) for k, i in enumerate(instances)]
        seen: dict[str, int] = {}

        async def both_answer() -> bool:  # both workers up, holding the states, answering with BEA
            await publish_snapshots(nc, snaps)
            try:
                rep = await client.estimate({"prompt_tokens": 500}, instances, budget_s=3 * TRY_S)
            except BearError as exc:  # no responders until a worker has subscribed
                if exc.code != ErrorCode.UNAVAILABLE:
                    raise
                return False
            if all(e.method == "bea" for e in rep.estimates):
                seen[rep.worker] = seen.get(rep.worker, 0) + 1
            return len(seen) == 2 and min(seen.values()) >= 5

        await wait_until(both_answer, what="both workers answering with BEA")

        # Load with 8 callers; one worker is SIGKILLed in the middle.
        answered: list[str] = []
        failures: list[Exception] = []
        done = asyncio.Event()

        async def caller(i: int) -> None:
            n = 0
            while not done.is_set():
                try:
                    rep = await client.estimate({"id": f"c{i}-{n}", "prompt_tokens": 700}, instances,
                                                budget_s=3 * TRY_S)
                    answered.append(rep.worker)
                except Exception as exc:
                    failures.append(exc)
                n += 1

        async def killer() -> None:
            await wait_until(lambda: len(set(answered)) == 2 and len(answered) >= 50, what="load on both workers")
            os.kill(procs[0].pid, signal.SIGKILL)
            at_kill = len(answered)
            await wait_until(lambda: len(answered) >= at_kill + 60 or failures, what="answers after the kill")
            done.set()

        timeouts_before = client.timeouts
        await asyncio.gather(killer(), *(caller(i) for i in range(8)))
        print(f"multiproc: {len(answered)} answered, {client.timeouts - timeouts_before} timeouts at the kill")
        assert failures == []
        assert client.timeouts - timeouts_before <= 8  # at most the requests in flight at the kill
        assert len(set(answered[-20:])) == 1  # only the survivor answers afterwards
    finally:
        await nc.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait(timeout=60)
