"""Benchmark of ``bear.predict`` over NATS: latency (sequential requests) and throughput (many in
flight) against a predictor process, with prompts from the synthetic task mix."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bear.predictor.service import REQUEST_SCHEMA
from bear.protocol.codec import pack, unpack
from bear.protocol.errors import is_error


@dataclass
class BenchResult:
    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    throughput_rps: float
    concurrency: int
    errors: int
    per_task_p50_ms: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def _request(prompt: str, models: list[str], deadline_s: float) -> bytes:
    return pack({"v": REQUEST_SCHEMA, "prompt": prompt, "models": models, "deadline": time.time() + deadline_s})


async def run_bench(nats_url: str, prompts: list[tuple[str, str]], models: list[str], n_latency: int,
                    n_throughput: int, concurrency: int, subject: str = "bear.predict") -> tuple[BenchResult, BenchResult]:
    """(latency run: one request at a time, throughput run: ``concurrency`` in flight)."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        for prompt, _ in prompts[:50]:  # warm-up
            await nc.request(subject, _request(prompt, models, 2.0), timeout=5.0)

        lat: list[float] = []
        tasks: list[str] = []
        errors = 0
        for i in range(n_latency):
            prompt, task = prompts[i % len(prompts)]
            data = _request(prompt, models, 2.0)
            t0 = time.perf_counter()
            msg = await nc.request(subject, data, timeout=5.0)
            lat.append(time.perf_counter() - t0)
            tasks.append(task)
            errors += is_error(unpack(msg.data))
        t_seq = float(np.sum(lat))
        seq = _summarise(lat, tasks, errors, t_seq, 1)

        lat2: list[float] = [0.0] * n_throughput
        tasks2: list[str] = [""] * n_throughput
        errs = [0]
        next_i = iter(range(n_throughput))

        async def worker() -> None:
            # ``concurrency`` workers, each with one request in flight. (One task per request behind a
            # semaphore made the loop start all of them before reading any reply: the first 32
            # requests waited tens of ms, which was the whole p99 of this phase.)
            for i in next_i:
                prompt, task = prompts[i % len(prompts)]
                t0 = time.perf_counter()
                msg = await nc.request(subject, _request(prompt, models, 5.0), timeout=10.0)
                lat2[i] = time.perf_counter() - t0
                tasks2[i] = task
                errs[0] += is_error(unpack(msg.data))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        par = _summarise(lat2, tasks2, errs[0], time.perf_counter() - t0, concurrency)
        return seq, par
    finally:
        await nc.close()


def _summarise(lat: list[float], tasks: list[str], errors: int, wall: float, conc: int) -> BenchResult:
    a = np.asarray(lat) * 1e3
    t = np.asarray(tasks)
    return BenchResult(
        n=len(a),
        p50_ms=float(np.percentile(a, 50)),
        p99_ms=float(np.percentile(a, 99)),
        mean_ms=float(a.mean()),
        throughput_rps=len(a) / wall,
        concurrency=conc,
        errors=errors,
        per_task_p50_ms={k: float(np.percentile(a[t == k], 50)) for k in sorted(set(tasks))},
    )
