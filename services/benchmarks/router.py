"""``bear bench router``: decision overhead of the router — submit received → dispatch sent — at a
fixed Poisson rate, on a local stack (nats-server, three sim engines, predictor, one estimator
worker, one router, each its own process). Queries are short synthetic prompts answered with one
token so the instances stay light; the numbers come from the router's own outcome log:
``decision_s`` (everything: parsing, the concurrent predictor + estimator round trips and the
dedup claim, candidate building, policy, dispatch publish) and ``overhead`` = decision − the wait
for the predictor and estimator replies (the router's own work). It also reports each process's
CPU time per query, and — as the floor measured on the same host in the same run — the round trip
of a bare NATS echo between two idle processes at the same Poisson rate (the predictor and the
estimator are each at least one such round trip away from the router)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bear.runtime import aio
from bear.runtime.identity import CREDS_ENV
from bear.runtime.measure import cpu_seconds, latency_ms


def _processes(stack: Any) -> dict[str, int]:
    procs = {name: c.proc.pid for name, c in stack.children.items() if c.proc is not None}
    if stack.nats is not None and stack.nats.proc is not None:
        procs["nats-server"] = stack.nats.proc.pid
    procs["load-client"] = os.getpid()
    return procs


ECHO = """
import asyncio, sys
import nats
from bear.runtime import aio
from bear.runtime.measure import cpu_seconds, latency_ms
from bear.runtime.service import auth_options

async def main(url):
    nc = await nats.connect(url, **auth_options())

    async def echo(msg):
        await msg.respond(msg.data)

    await nc.subscribe("bench.echo", cb=echo)
    await asyncio.Event().wait()

aio.run(main(sys.argv[1]))
"""


async def echo_rtt(url: str, rate: float, n: int, seed: int = 0, **nats_options: Any) -> dict[str, float]:
    """Round trips to a bare echo process (``ECHO``), requests sent at Poisson times of ``rate``:
    the NATS-and-scheduler floor under any request-reply on this host, without BEAR's work."""
    import asyncio

    import nats

    rng = np.random.default_rng(seed)
    nc = await nats.connect(url, **nats_options)
    try:
        for _ in range(100):  # until the echo process is subscribed
            try:
                await nc.request("bench.echo", b"x", timeout=0.5)
                break
            except Exception:
                await asyncio.sleep(0.05)
        rtts = []
        for _ in range(n):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
            t = time.perf_counter()
            await nc.request("bench.echo", b"x" * 256, timeout=2.0)
            rtts.append(time.perf_counter() - t)
        return latency_ms(rtts)
    finally:
        await nc.close()


def run_bench(rate: float, duration: float, seed: int = 0, routers: int = 1, answer_tokens: int = 1,
              router_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """``answer_tokens``: every answer streams this many tokens (the sim engines never stop early),
    so that the router's CPU per query includes relaying them; ``router_args``: more ``bear
    router`` arguments (e.g. ``--no-coalesce``)."""

    from bear.load.arrivals import arrivals
    from bear.load.generator import make_queries
    from bear.stack.stack import Stack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="bear-router-bench-"))
    n = max(1, round(rate * duration))
    queries, _ = make_queries(n, seed, ("alpaca",), ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B"))
    times = arrivals("poisson", rate, n, seed=seed)
    stack = Stack(StackConfig(workdir=work, calibrator=False, log_level="warning", routers=routers,
                              router_args=list(router_args)))
    with stack:
        import subprocess
        import sys

        admin = stack.creds("admin")
        env = {**os.environ, CREDS_ENV: str(admin)} if admin is not None else None
        echo = subprocess.Popen([sys.executable, "-c", ECHO, stack.url], env=env)
        try:
            floor = aio.run(echo_rtt(stack.url, rate, min(n, 1000), seed, **stack.nats_options("admin")))
        finally:
            echo.kill()
            echo.wait()
        procs = _processes(stack)
        cpu0 = {k: cpu_seconds(pid) for k, pid in procs.items()}
        t0 = time.time()
        res = stack.run_load(queries, times, max_tokens=answer_tokens)
        elapsed = time.time() - t0
        cpu1 = {k: cpu_seconds(pid) for k, pid in procs.items()}
    recs = [json.loads(line) for i in range(routers) for line in stack.outcome_log(i).read_text().splitlines()]
    recs = [r for r in recs if r.get("status") == "done" and not str(r["query_id"]).startswith("probe-")]
    dec = [r["decision_s"] for r in recs]
    own = [max(0.0, r["decision_s"] - r["wait_s"]) for r in recs]
    wait = [r["wait_s"] for r in recs]
    router_cpu_ms = sum((cpu1[k] - cpu0[k]) * 1e3 for k in procs if k.startswith("router"))
    streamed = sum(int((r.get("usage") or {}).get("completion_tokens", 0)) for r in recs)
    chunks = sum(int(r.get("chunks", 0)) for r in recs)
    return {
        "rate_qps": rate, "duration_s": duration, "routers": routers, "answer_tokens": answer_tokens,
        "router_args": list(router_args),
        # the routers' CPU, relaying included: per query sent and per answer token streamed
        "router_cpu_ms_per_query": router_cpu_ms / max(res.sent, 1),
        "router_cpu_us_per_token": router_cpu_ms * 1e3 / streamed if streamed else None,
        "tokens_streamed": streamed, "relay_messages": chunks, "sent": res.sent, "done": len(res.outcomes),
        "errors": dict(res.errors), "achieved_qps": res.sent / max(float(times[-1]), 1e-9), "wall_s": elapsed,
        "decision": latency_ms(dec), "router_own_overhead": latency_ms(own), "predictor_estimator_wait": latency_ms(wait),
        "nats_echo_rtt_floor": floor,
        "predictor_reply": latency_ms([r["predict_s"] for r in recs]),
        "estimator_reply": latency_ms([r["estimate_s"] for r in recs]),
        "dedup_claim": latency_ms([r["claim_s"] for r in recs]),
        "fallbacks": sum(bool(r["fallbacks"]) for r in recs), "host_load": os.getloadavg(),
        "cpus": os.cpu_count(), "event_loop": aio.loop_name(),
        # where the two cores go: CPU milliseconds per query of each process during the load
        "cpu_ms_per_query": {k: (cpu1[k] - cpu0[k]) * 1e3 / max(res.sent, 1) for k in procs},
        "cpu_busy_share": sum(cpu1[k] - cpu0[k] for k in procs) / max(elapsed * (os.cpu_count() or 1), 1e-9),
    }
