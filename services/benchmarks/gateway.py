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
import contextlib
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


# ---------------------------------------------------------------------------------------- slowloris
ATTACKER = "127.0.0.2"  # the attack's source address (Linux routes all of 127/8 to lo): another peer
HALF_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: bear\r\nContent-Type: application/json\r\n"


async def _slowloris(host: str, port: int, n: int, stop: asyncio.Event, trickle_s: float,
                     stats: dict[str, Any], wave: asyncio.Event) -> None:
    """``n`` connections from ``ATTACKER``, each sending half a request's headers and then one more
    header line every ``trickle_s``, reopened when the gateway closes it (a second after a
    refusal), until ``stop``; ``wave`` is set once each has tried its first."""
    tried = [0]

    def first_try(done: bool) -> None:
        if not done:
            tried[0] += 1
            if tried[0] == n:
                wave.set()

    async def one(k: int) -> None:
        first = False
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0))
            except OSError as exc:
                first_try(first)
                first = True
                stats["connect_errors"] += 1
                stats["connect_error_kinds"][type(exc).__name__] += 1
                await asyncio.sleep(1.0)
                continue
            first_try(first)
            first = True
            stats["opened"] += 1
            stats["open"] += 1
            got = b""
            try:
                writer.write(HALF_REQUEST)
                while not stop.is_set():
                    try:
                        got = await asyncio.wait_for(reader.read(4096), trickle_s)
                    except TimeoutError:
                        writer.write(b"X-Slow: %d\r\n" % k)  # one more header line, never the end
                        continue
                    break  # an answer or EOF: the gateway closed it
            except OSError:
                pass
            finally:
                stats["open"] -= 1
                writer.close()
            if stop.is_set() and not got:
                return  # the attack ended it, not the gateway
            status = got[9:12].decode(errors="replace") if got.startswith(b"HTTP/1.1 ") else ("eof" if not got else "?")
            stats["closed_by_gateway"][status] += 1
            if status != "429" and status != "503":
                stats["held_s"].append(time.monotonic() - t0)
            if stop.is_set():
                return
            await asyncio.sleep(1.0 if status in ("429", "503") else 0.05)

    await asyncio.gather(*(one(k) for k in range(n)))


async def _real_requests(url: str, key: str, rate: float, duration: float, timeout_s: float) -> dict[str, Any]:
    """One new connection per request (a client the attack does not know), ``rate`` per second."""
    import collections

    import aiohttp

    outcomes: collections.Counter[str] = collections.Counter()
    lat: list[float] = []
    body = {"model": "bear", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8}

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
                    s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                outcomes[str(r.status)] += 1
                if r.status == 200:
                    lat.append(time.perf_counter() - t0)
        except TimeoutError:
            outcomes["timeout"] += 1
        except aiohttp.ClientError as exc:
            outcomes[type(exc).__name__] += 1

    tasks = []
    n = max(1, round(rate * duration))
    t_start = time.monotonic()
    for k in range(n):
        delay = k / rate - (time.monotonic() - t_start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return {"sent": n, "outcomes": dict(outcomes), "served": outcomes.get("200", 0), "latency": latency_ms(lat)}


def _gateway_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("bear_gateway_connections_refused_total{", "bear_gateway_header_timeouts_total ",
                            "bear_gateway_connections ")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _attack_run(port: int, key: str, connections: int, duration: float, rate: float, trickle_s: float,
                      timeout_s: float) -> dict[str, Any]:
    import collections

    import aiohttp

    stats: dict[str, Any] = {"opened": 0, "open": 0, "connect_errors": 0, "connect_error_kinds": collections.Counter(),
                             "closed_by_gateway": collections.Counter(), "held_s": []}
    stop, wave = asyncio.Event(), asyncio.Event()
    attack = asyncio.create_task(_slowloris("127.0.0.1", port, connections, stop, trickle_s, stats, wave))
    t0 = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wave.wait(), 10.0)  # the attack's first wave is out (or 10 s)
    ramp_s = time.monotonic() - t0
    open_at_start = stats["open"]
    real = await _real_requests(f"http://127.0.0.1:{port}/v1/chat/completions", key, rate, duration, timeout_s)
    open_at_end = stats["open"]
    stop.set()
    await attack
    held = stats.pop("held_s")
    metrics: dict[str, float] = {}
    for _ in range(50):  # the gateway answers /metrics once the attack is gone
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                metrics = _gateway_metrics(await r.text())
            break
        except aiohttp.ClientError:
            await asyncio.sleep(0.2)
    return {"attack": {**stats, "connect_error_kinds": dict(stats["connect_error_kinds"]),
                       "closed_by_gateway": dict(stats["closed_by_gateway"]), "ramp_s": ramp_s,
                       "open_when_real_requests_began": open_at_start, "open_when_they_ended": open_at_end,
                       "held_s": {"n": len(held), "p50": float(np.median(held)) if held else None,
                                  "max": max(held) if held else None}},
            "real": real, "metrics": metrics}


def run_slowloris(connections: int = 1100, nofile: int = 1024, duration: float = 40.0, rate: float = 2.0,
                  trickle_s: float = 5.0, timeout_s: float = 10.0, unprotected: bool = True) -> dict[str, Any]:
    """``connections`` slowloris connections against a gateway process whose open-file limit is
    ``nofile`` (soft and hard: ``bear``'s own raise to the hard limit changes nothing), while real
    chat requests come at ``rate`` per second for ``duration`` s from another address; with
    ``unprotected``, the same once more with the header timeout and the connection caps off (the
    gateway before issue 40). The gateway's log lines of refusals and timeouts are counted."""
    import resource
    import subprocess
    import sys

    import aiohttp

    from bear.gateway.auth import write_new_key
    from bear.runtime.nats_server import free_port
    from bear.stack.stack import Stack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="bear-slowloris-bench-"))
    key_file = work / "key"
    key = write_new_key(key_file)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    async def healthy(port: int) -> None:
        for _ in range(300):
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("the gateway did not come up")

    configs = [("protected (defaults)", [])]
    if unprotected:
        configs.append(("unprotected (header timeout and caps off)",
                        ["--header-timeout", "0", "--max-connections-per-peer", "0", "--max-connections", "0"]))
    runs = []
    stack = Stack(StackConfig(workdir=work, calibrator=False, log_level="warning"))
    with stack:
        creds = stack.creds("gateway")
        for name, extra in configs:
            port = free_port()
            log_path = work / f"gateway-{len(runs)}.log"
            argv = [sys.executable, "-m", "bear", "gateway", "--nats", stack.url, "--port", str(port),
                    "--api-key-file", str(key_file), "--log-format", "json", *extra]
            if creds is not None:
                argv += ["--nats-creds", str(creds)]
            with log_path.open("w") as logf:
                gw = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=limit)
            try:
                aio.run(healthy(port))
                soft_hard = Path(f"/proc/{gw.pid}/limits").read_text() if sys.platform.startswith("linux") else ""
                r = aio.run(_attack_run(port, key, connections, duration, rate, trickle_s, timeout_s))
            finally:
                gw.terminate()
                try:
                    gw.wait(15)
                except subprocess.TimeoutExpired:
                    gw.kill()
                    gw.wait()
            lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
            events = [e.get("event", "") for e in lines]
            r["config"] = name
            r["gateway_log"] = {
                "refusal_lines": sum(e == "connections refused" for e in events),
                "timeout_lines": sum(e == "connections closed: request headers too slow" for e in events),
                "lines": len(lines),
                "refused_logged": sum(x.get("connections", 0) for x in lines if x.get("event") == "connections refused"),
                "timed_out_logged": sum(x.get("connections", 0) for x in lines
                                        if x.get("event") == "connections closed: request headers too slow"),
                "example": next((x for x in lines if x.get("event") == "connections refused"), None)}
            r["open_files"] = next((ln.split()[3:5] for ln in soft_hard.splitlines() if ln.startswith("Max open files")),
                                   None)
            runs.append(r)
    return {"connections": connections, "nofile": nofile, "duration_s": duration, "rate_rps": rate,
            "trickle_s": trickle_s, "cpus": os.cpu_count(), "host_load": os.getloadavg(),
            "event_loop": aio.loop_name(), "runs": runs}


def print_slowloris(res: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"{res['connections']} slowloris connections at a {res['nofile']} open-file limit, real requests "
                    f"at {res['rate_rps']:g}/s for {res['duration_s']:g} s from another address")
    for col in ("gateway", "real served", "real failed", "real p50/p99 ms", "attack opened", "refused (429/503)",
                "closed 408", "held p50/max s", "refusal log lines"):
        t.add_column(col, justify="right")
    for r in res["runs"]:
        real, att, lg = r["real"], r["attack"], r["gateway_log"]
        failed = {k: v for k, v in real["outcomes"].items() if k != "200"}
        closed = att["closed_by_gateway"]
        held = att["held_s"]
        t.add_row(r["config"], f"{real['served']}/{real['sent']}", ", ".join(f"{k}: {v}" for k, v in failed.items()) or "0",
                  f"{real['latency']['p50_ms']:.0f}/{real['latency']['p99_ms']:.0f}" if real["served"] else "-",
                  str(att["opened"]), str(closed.get("429", 0) + closed.get("503", 0)), str(closed.get("408", 0)),
                  f"{held['p50']:.1f}/{held['max']:.1f}" if held["n"] else "-",
                  f"{lg['refusal_lines']} + {lg['timeout_lines']}")
    console.print(t)
    for r in res["runs"]:
        console.print(f"{r['config']}: open-file limit {r['open_files']}, attack connect errors "
                      f"{r['attack']['connect_errors']} {r['attack']['connect_error_kinds']}, gateway metrics "
                      f"{r['metrics']}, refusals logged {r['gateway_log']['refused_logged']} in "
                      f"{r['gateway_log']['refusal_lines']} lines, header timeouts logged "
                      f"{r['gateway_log']['timed_out_logged']} in {r['gateway_log']['timeout_lines']} lines",
                      soft_wrap=True)
