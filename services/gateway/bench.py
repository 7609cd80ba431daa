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
the engine cancel out, which is the sharper measure of the hop."""

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

PROMPTS = ("Explain KV caching briefly.", "What is the capital of France?", "Write a haiku about routers.",
           "Summarize the plot of Hamlet in two sentences.", "List three prime numbers.")
WARMUP = 40


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=float) * 1e3
    if a.size == 0:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan"), "n": 0}
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()), "n": int(a.size)}


async def _via_nats(nc: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, bool]:
    from bear.client.submit import submit

    t0 = time.perf_counter()
    first = None
    done: dict[str, Any] = {}
    routed = False
    async for m in submit(nc, None, messages=messages, ttft_target_s=1.0, max_tokens=max_tokens):
        v = m.get("v")
        if v == "bear.routed/1":
            routed = True
        elif v == "bear.chunk/1" and first is None:
            first = time.perf_counter() - t0
        elif v == "bear.done/1":
            done = m
        elif v == "bear.error/1":
            raise RuntimeError(f"router error: {m.get('error')}")
    if first is None or "ttft_s" not in done:
        raise RuntimeError("no token through NATS")
    return first, float(done["ttft_s"]), routed


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
                  seed: int) -> dict[str, Any]:
    """One rate: Poisson arrivals, alternate requests on the two paths."""
    import aiohttp
    import nats

    from bear.load.arrivals import arrivals

    rng = np.random.default_rng(seed)
    n = max(2, round(rate * duration))
    times = arrivals("poisson", rate, n, seed=seed)
    nc = await nats.connect(nats_url)
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
           "ttfb": {"gateway": _pct(g["ttfb"]), "nats": _pct(s["ttfb"])},
           "residual": {"gateway": _pct(g["residual"]), "nats": _pct(s["residual"])}}
    for kind in ("ttfb", "residual"):
        res[f"overhead_{kind}"] = {q: res[kind]["gateway"][q] - res[kind]["nats"][q] for q in ("p50_ms", "p99_ms")}
    return res


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")


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
            cpu0 = _cpu_s(gw.pid) if gw else float("nan")
            r = aio.run(measure(stack.url, stack.gateway_url, key, rate, duration, max_tokens, seed + k))
            r["gateway_cpu_ms_per_request"] = (_cpu_s(gw.pid) - cpu0) * 1e3 / max(r["sent"] / 2 + WARMUP, 1) if gw else None
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
                  f"[bold]{q['p50_ms']:+.3f}[/bold]", f"{q['p99_ms']:+.3f}", end_section=True)
    console.print(t)
    cpu = ", ".join(f"{r['gateway_cpu_ms_per_request']:.3f} ms" for r in res["runs"])
    console.print(f"gateway CPU per request: {cpu}; host load {res['host_load'][0]:.2f}, {res['cpus']} CPUs, "
                  f"loop {res['event_loop']}")
