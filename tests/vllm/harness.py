"""Run a real vLLM (CPU build) with the BEAR plugin, the snapshotter and a Poisson load; shared by
the tests in this folder. The vLLM process itself (BEAR_VLLM_PYTHON, a separate venv made by
.ci/install-vllm.sh; command line; tiny model) is ``bear.vllm_instance.launch``, which
``bear up --backend vllm`` uses too."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bear.vllm_instance.launch import VllmServer, make_tiny_model, vllm_python

__all__ = ["Load", "VllmServer", "make_tiny_model", "run_load", "vllm_python"]


@dataclass
class Load:
    """A Poisson stream of completions with random token-id prompts (ignore_eos: exact lengths).
    ``prefix_frac`` of the prompts start with one of two shared ``prefix``-token prefixes (prefix
    cache hits); ``abort_frac`` of the clients give up after 0.05–0.6 s (vLLM aborts the request)."""

    n: int
    rate: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    seed: int = 0
    prefix: int = 0
    prefix_frac: float = 0.0
    abort_frac: float = 0.0


async def run_load(base_url: str, load: Load) -> list[dict[str, Any]]:
    rng = random.Random(load.seed)
    results: list[dict[str, Any]] = []

    prefixes = [[rng.randint(0, 255) for _ in range(load.prefix)] for _ in range(2)]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        n_prompt = rng.randint(*load.prompt)
        prompt = [rng.randint(0, 255) for _ in range(n_prompt)]
        if load.prefix and rng.random() < load.prefix_frac:
            prompt = rng.choice(prefixes) + prompt
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": rng.randint(*load.output),
            "ignore_eos": True,
            "temperature": 0.0,
        }
        timeout = rng.uniform(0.05, 0.6) if load.abort_frac and rng.random() < load.abort_frac else 600
        t0 = time.monotonic()
        try:
            r = await client.post(f"{base_url}/completions", json=body, timeout=timeout)
            results.append({"i": i, "status": r.status_code, "latency": time.monotonic() - t0})
        except httpx.HTTPError as exc:
            results.append({"i": i, "status": -1, "error": repr(exc), "aborted": timeout < 600})

    async with httpx.AsyncClient(
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    ) as client:
        tasks = []
        for i in range(load.n):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(rng.expovariate(load.rate))
        await asyncio.gather(*tasks)
    return results
