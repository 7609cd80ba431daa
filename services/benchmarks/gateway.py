"""``bear bench gateway``: what the gateway hop costs. One local stack (nats-server, three sim
engines, predictor, estimator, router, gateway — each its own process) and one load client that
sends every other request of one Poisson stream through the gateway (HTTP, OpenAI chat streaming,
aiohttp keep-alive) and the others through the router's own NATS client (``submit()``), so both
paths see the same load, in the same run, at the same moments.

Per request: time to first byte (TTFB) = send → first generated token at the client, and the
router's own ``ttft_s`` (submission received → first token, from its ``done``). Overhead of the
gateway = p50 (p99) of TTFB through the gateway − p50 (p99) through NATS. Because the router's and
the engine's time varies much more than the hop costs, it also reports the same difference of the
*residual* TTFB − ``ttft_s`` (client → router plus router → client, per request): the routing and
the engine cancel out, which is the sharper measure of the hop.

The floor under any HTTP hop on the host is measured in the same run: the same client against a
bare aiohttp process that answers each POST with one SSE event, at the gateway path's rate (two
process wake-ups per request, as the gateway adds). The gateway's own processing time (its
``bear_gateway_overhead_seconds``, mean) is read from its /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bear.runtime import aio
from bear.runtime.measure import cpu_seconds, latency_ms

PROMPTS = ("Explain KV caching briefly.", "What is the capital of France?", "Write a haiku about routers.",
           "Summarize the plot of Hamlet in two sentences.", "List three prime numbers.")
WARMUP = 40
ECHO = """
import sys
from aiohttp import web
from bear.runtime import aio

async def main(port):
    async def handle(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\\n\\ndata: [DONE]\\n\\n')
        return resp
    app = web.Application()
    app.router.add_post("/echo", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    import asyncio
    await asyncio.Event().wait()

aio.run(main(int(sys.argv[1])))
"""


async def http_echo_floor(rate: float, n: int, seed: int) -> dict[str, float]:
    """Time to the first SSE event from a bare aiohttp process, requests at Poisson times of ``rate``."""
    import subprocess
    import sys

    import aiohttp

    from bear.runtime.nats_server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", ECHO, str(port)])  # noqa: ASYNC220 — starts in ms, before timing
    rng = np.random.default_rng(seed)
    url = f"http://127.0.0.1:{port}/echo"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for _ in range(200):  # until it listens
                try:
                    async with s.post(url, json={}) as r:
                        await r.read()
                    break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            out: list[float] = []

            async def one() -> None:
                t = time.perf_counter()
                async with s.post(url, json={"model": "bear", "messages": [{"role": "user", "content": "x"}]}) as r:
                    await r.content.readline()
                    out.append(time.perf_counter() - t)
                    await r.read()

            tasks = []
            for _ in range(n):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)
        return latency_ms(out)
    finally:
        proc.kill()
        proc.wait()


async def gateway_own_overhead(gateway_url: str) -> tuple[float, int]:
    """(sum, count) of the gateway's bear_gateway_overhead_seconds."""
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(gateway_url.removesuffix("/v1") + "/metrics") as r:
        text = await r.text()
    vals = {}
    for line in text.splitlines():
        for k in ("bear_gateway_overhead_seconds_sum", "bear_gateway_overhead_seconds_count"):
            if line.startswith(k + " "):
                vals[k] = float(line.split()[1])
    return vals.get("bear_gateway_overhead_seconds_sum", 0.0), int(vals.get("bear_gateway_overhead_seconds_count", 0))




async def _via_nats(nc: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, bool]:
    from bear.client.submit import submit
    from bear.protocol.replies import Chunk, Done, Error, Routed

    t0 = time.perf_counter()
    first = None
    done: Done | None = None
    routed = False
    async for m in submit(nc, None, messages=messages, ttft_target_s=1.0, max_tokens=max_tokens):
        if isinstance(m, Routed):
            routed = True
        elif isinstance(m, Chunk) and first is None:
            first = time.perf_counter() - t0
        elif isinstance(m, Done):
            done = m
        elif isinstance(m, Error):
            raise RuntimeError(f"router error: {m.code}: {m.message}")
    if first is None or done is None or done.ttft_s is None:
        raise RuntimeError("no token through NATS")
    return first, float(done.ttft_s), routed


async def _via_gateway(session: Any, url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, bool]:
    t0 = time.perf_counter()
    first = None
    router_ttft = None
    body = {"model": "bear", "messages": messages, "max_tokens": max_tokens, "stream": True}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"gateway HTTP {resp.status}: {(await resp.text())[:200]}")
        routed = "x-bear-instance" in resp.headers
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            d = json.loads(line[6:])
            if first is None and d.get("choices") and d["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - t0
            if "bear" in d:
                router_ttft = d["bear"].get("ttft_s")
    if first is None or router_ttft is None:
        raise RuntimeError("no token through the gateway")
    return first, float(router_ttft), routed


async def measure(nats_url: str, gateway_url: str, key: str, rate: float, duration: float, max_tokens: int,
                  seed: int, nats_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rate: Poisson arrivals, alternate requests on the two paths."""
    import aiohttp
    import nats

    from bear.load.arrivals import arrivals

    rng = np.random.default_rng(seed)
    n = max(2, round(rate * duration))
    times = arrivals("poisson", rate, n, seed=seed)
    nc = await nats.connect(nats_url, **(nats_options or {}))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    headers={"Authorization": f"Bearer {key}"})
    url = gateway_url + "/chat/completions"
    out: dict[str, dict[str, list[float]]] = {p: {"ttfb": [], "residual": []} for p in ("gateway", "nats")}
    errors: dict[str, list[str]] = {"gateway": [], "nats": []}
    unrouted = {"gateway": 0, "nats": 0}

    async def one(path: str, k: int, keep: bool) -> None:
        messages = [{"role": "user", "content": PROMPTS[k % len(PROMPTS)] + f" ({k})"}]
        try:
            if path == "gateway":
                ttfb, ttft, routed = await _via_gateway(session, url, messages, max_tokens)
            else:
                ttfb, ttft, routed = await _via_nats(nc, messages, max_tokens)
        except Exception as exc:
            errors[path].append(str(exc)[:200])
            return
        if not keep:
            return
        unrouted[path] += not routed
        out[path]["ttfb"].append(ttfb)
        out[path]["residual"].append(ttfb - ttft)

    try:
        await asyncio.gather(*(one(p, k, False) for k in range(WARMUP) for p in ("gateway", "nats")))
        order = rng.permutation(n) % 2  # half each, interleaved at random
        tasks = []
        t_start = time.monotonic()
        for k, t in enumerate(times):
            delay = float(t) - (time.monotonic() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one("gateway" if order[k] else "nats", k, True)))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t_start
    finally:
        await session.close()
        await nc.close()
    g, s = out["gateway"], out["nats"]
    res = {"rate_rps": rate, "sent": n, "achieved_rps": n / max(elapsed, 1e-9),
           "errors": {p: len(e) for p, e in errors.items()}, "error_examples": {p: e[:3] for p, e in errors.items()},
           "unrouted": unrouted,
           "ttfb": {"gateway": latency_ms(g["ttfb"]), "nats": latency_ms(s["ttfb"])},
           "residual": {"gateway": latency_ms(g["residual"]), "nats": latency_ms(s["residual"])}}
    for kind in ("ttfb", "residual"):
        res[f"overhead_{kind}"] = {q: res[kind]["gateway"][q] - res[kind]["nats"][q] for q in ("p50_ms", "p99_ms")}
    return res


def run_bench(rates: list[float], duration: float, *, max_tokens: int = 1, seed: int = 0) -> dict[str, Any]:
    from bear.gateway.auth import write_new_key
    from bear.runtime.nats_server import free_port
    from bear.stack.stack import Stack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="bear-gateway-bench-"))
    key_file = work / "key"
    key = write_new_key(key_file)
    stack = Stack(StackConfig(workdir=work, calibrator=False, log_level="warning", gateway_port=free_port(),
                              gateway_key_file=key_file))
    runs = []
    with stack:
        gw = stack.children["gateway"].proc
        for k, rate in enumerate(rates):
            floor = aio.run(http_echo_floor(rate / 2, min(1000, max(50, round(rate * duration / 2))), seed + k))
            cpu0 = cpu_seconds(gw.pid) if gw else float("nan")
            s0, n0 = aio.run(gateway_own_overhead(stack.gateway_url))
            r = aio.run(measure(stack.url, stack.gateway_url, key, rate, duration, max_tokens, seed + k,
                                nats_options=stack.nats_options("client")))
            s1, n1 = aio.run(gateway_own_overhead(stack.gateway_url))
            r["gateway_cpu_ms_per_request"] = (cpu_seconds(gw.pid) - cpu0) * 1e3 / max(r["sent"] / 2 + WARMUP, 1) if gw else None
            r["gateway_own_overhead_mean_ms"] = (s1 - s0) * 1e3 / max(n1 - n0, 1)
            r["http_echo_floor"] = floor
            runs.append(r)
    return {"duration_s": duration, "max_tokens": max_tokens, "cpus": os.cpu_count(), "host_load": os.getloadavg(),
            "event_loop": aio.loop_name(), "runs": runs}


def print_table(res: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="gateway hop: TTFB through the gateway vs through the router's NATS client (ms)")
    for col in ("rate", "path", "n", "err", "TTFB p50", "TTFB p99", "resid. p50", "resid. p99"):
        t.add_column(col, justify="right")
    for r in res["runs"]:
        for path in ("nats", "gateway"):
            a, b = r["ttfb"][path], r["residual"][path]
            t.add_row(f"{r['rate_rps']:g}", path, str(a["n"]), str(r["errors"][path]), f"{a['p50_ms']:.3f}",
                      f"{a['p99_ms']:.3f}", f"{b['p50_ms']:.3f}", f"{b['p99_ms']:.3f}")
        o, q = r["overhead_ttfb"], r["overhead_residual"]
        t.add_row(f"{r['rate_rps']:g}", "[bold]overhead[/bold]", "", "", f"{o['p50_ms']:+.3f}", f"{o['p99_ms']:+.3f}",
                  f"[bold]{q['p50_ms']:+.3f}[/bold]", f"{q['p99_ms']:+.3f}")
        f = r["http_echo_floor"]
        t.add_row(f"{r['rate_rps']:g}", "HTTP echo floor", str(f["n"]), "", f"{f['p50_ms']:.3f}", f"{f['p99_ms']:.3f}",
                  "", "", end_section=True)
    console.print(t)
    per = "; ".join(f"{r['rate_rps']:g} req/s: own time {r['gateway_own_overhead_mean_ms']:.3f} ms mean, CPU "
                    f"{r['gateway_cpu_ms_per_request']:.3f} ms" for r in res["runs"])
    console.print(f"gateway per request — {per}. Host load {res['host_load'][0]:.2f}, {res['cpus']} CPUs, "
                  f"loop {res['event_loop']}")
