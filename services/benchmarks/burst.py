"""``bear bench burst``: N chat requests at one instant through the gateway of a local stack, then
the same N spread out, under each routing configuration asked for — BEAR with its decisions in
order (the shipped router), BEAR with each decision blind to those beside it (``--no-sequence``,
the router before), round robin — with one router or several.

Per run: the share of requests whose first token came within the target (the router's TTFT,
submit → first token, and the client's, send → first byte), the router's predicted TTFT against
the observed one (MAPE, median signed error), where the requests went, the decision times the
router reported, and how long the routers' dispatches took to reach a subscriber on
``bear.dispatch.*`` (what an estimator worker hears: the window in which two routers' decisions
cannot see each other). Each configuration runs on a fresh stack of the same shape (three sim
engines, predictor, estimator, calibrator, gateway) in one work directory, so the predictor is
trained once."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bear.runtime import aio
from bear.runtime.measure import latency_ms

PROMPTS = ("Explain KV caching briefly.", "What is the capital of France?", "Write a haiku about routers.",
           "Summarize the plot of Hamlet in two sentences.", "List three prime numbers.",
           "Why is the sky blue?", "Translate 'good morning' into Spanish.", "Name a sorting algorithm.")


@dataclass(frozen=True)
class Config:
    name: str  # what the table calls it
    policy: str
    router_args: tuple[str, ...] = ()


CONFIGS = {
    "bear": Config("bear (in order)", "bear"),
    "bear-blind": Config("bear (blind, --no-sequence)", "bear", ("--no-sequence",)),
    "bear-chain-63": Config("bear (in order, --sequence-chain 63)", "bear", ("--sequence-chain", "63")),
    "round-robin": Config("round-robin", "round-robin"),
}


@dataclass
class Answer:
    instance: str = ""
    predicted_s: float | None = None
    router_ttft_s: float | None = None
    client_ttft_s: float | None = None
    decision_s: float | None = None
    feasible: bool | None = None
    error: str = ""


async def _one(session: Any, url: str, k: int, max_tokens: int, target_ms: float) -> Answer:
    a = Answer()
    t0 = time.perf_counter()
    body = {"model": "bear", "messages": [{"role": "user", "content": f"{PROMPTS[k % len(PROMPTS)]} ({k})"}],
            "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(url, json=body, headers={"x-slo-ttft-ms": f"{target_ms:g}"}) as resp:
            if resp.status != 200:
                a.error = f"HTTP {resp.status}: {(await resp.text())[:120]}"
                return a
            h = resp.headers
            a.instance = h.get("x-bear-instance", "")
            if "x-bear-predicted-ttft-ms" in h:
                a.predicted_s = float(h["x-bear-predicted-ttft-ms"]) / 1e3
            if "x-bear-decision-ms" in h:
                a.decision_s = float(h["x-bear-decision-ms"]) / 1e3
            a.feasible = h.get("x-bear-feasible") == "true" if "x-bear-feasible" in h else None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                d = json.loads(line[6:])
                if a.client_ttft_s is None and d.get("choices") and d["choices"][0].get("delta", {}).get("content"):
                    a.client_ttft_s = time.perf_counter() - t0
                if "bear" in d and d["bear"].get("ttft_s") is not None:
                    a.router_ttft_s = float(d["bear"]["ttft_s"])
    except Exception as exc:  # counted, the run goes on
        a.error = f"{type(exc).__name__}: {exc}"[:160]
    return a


async def _dispatch_lags(nats_url: str, options: dict[str, Any] | None, prefix: str, stop: asyncio.Event,
                         into: list[float]) -> None:
    """Seconds from each dispatch's stamp (the router's clock at publish) to its arrival here."""
    import nats

    from bear.protocol.messages import Dispatch, decode

    try:
        nc = await nats.connect(nats_url, **(options or {}))
    except Exception:
        return

    async def on(msg: Any) -> None:
        try:
            into.append(time.time() - decode(Dispatch, msg.data).t)
        except Exception:
            return

    try:
        await nc.subscribe(f"{prefix}.dispatch.*", cb=on)
        await nc.flush()
        await stop.wait()
    except Exception:
        return
    finally:
        await nc.close()


async def measure(stack: Any, key: str, n: int, spacing_s: float, max_tokens: int, target_ms: float,
                  estimator_options: dict[str, Any] | None) -> dict[str, Any]:
    """One pattern on a running stack: ``n`` requests ``spacing_s`` apart (0: at one instant)."""
    import aiohttp

    url = stack.gateway_url + "/chat/completions"
    lags: list[float] = []
    stop = asyncio.Event()
    listener = asyncio.create_task(_dispatch_lags(stack.url, estimator_options, stack.cfg.prefix, stop, lags))
    await asyncio.sleep(0.2)  # subscribed
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers={"Authorization": f"Bearer {key}"}) as session:
        for k in range(8):  # warm: connections, the routers' tokenizers
            await _one(session, url, 10_000 + k, max_tokens, target_ms)
        await asyncio.sleep(1.0)
        lags.clear()
        t_start = time.perf_counter()
        tasks = []
        for k in range(n):
            if spacing_s > 0:
                delay = k * spacing_s - (time.perf_counter() - t_start)
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, k, max_tokens, target_ms)))
        answers = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
    await asyncio.sleep(0.2)
    stop.set()
    await listener
    return summarize(answers, target_ms / 1e3, wall, lags)


def summarize(answers: list[Answer], target_s: float, wall_s: float, lags: list[float]) -> dict[str, Any]:
    """The figures of one run (pure: tests feed it answers)."""
    ok = [a for a in answers if not a.error and a.router_ttft_s is not None]
    shares: dict[str, int] = {}
    for a in ok:
        shares[a.instance] = shares.get(a.instance, 0) + 1
    pairs = [(a.predicted_s, a.router_ttft_s) for a in ok if a.predicted_s is not None and a.router_ttft_s]
    rel = np.array([(p - o) / o for p, o in pairs if o and o > 0], dtype=float)
    feas = [a for a in ok if a.feasible]
    return {
        "n": len(answers), "answered": len(ok), "errors": len(answers) - len(ok),
        "error_examples": sorted({a.error for a in answers if a.error})[:3],
        "on_time": sum(1 for a in ok if a.router_ttft_s is not None and a.router_ttft_s <= target_s) / max(len(answers), 1),
        "on_time_client": sum(1 for a in ok if a.client_ttft_s is not None and a.client_ttft_s <= target_s)
        / max(len(answers), 1),
        "feasible": len(feas),
        "on_time_among_feasible": (sum(1 for a in feas if a.router_ttft_s is not None and a.router_ttft_s <= target_s)
                                   / len(feas)) if feas else None,
        "mape": float(np.mean(np.abs(rel))) if len(rel) else None,
        "median_signed_error": float(np.median(rel)) if len(rel) else None,
        "shares": dict(sorted(shares.items())),
        "ttft_ms": latency_ms([a.router_ttft_s for a in ok if a.router_ttft_s is not None]),
        "decision_ms": latency_ms([a.decision_s for a in ok if a.decision_s is not None]),
        "dispatch_lag_ms": latency_ms(lags) if lags else None,
        "wall_s": wall_s,
    }


def run_bench(configs: list[str], routers: list[int], n: int, spacing_ms: float, max_tokens: int,
              target_ms: float, repeat: int = 1, progress: Any = None) -> dict[str, Any]:
    from bear.gateway.auth import write_new_key
    from bear.runtime.nats_server import free_port
    from bear.stack.stack import Stack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="bear-burst-bench-"))
    key_file = work / "key"
    key = write_new_key(key_file)
    runs = []
    for name in configs:
        c = CONFIGS[name]
        for r in routers:
            stack = Stack(StackConfig(workdir=work, log_level="warning", gateway_port=free_port(),
                                      gateway_key_file=key_file, routers=r, policy=c.policy,
                                      router_args=list(c.router_args)))
            with stack:
                try:
                    est_opts = stack.nats_options("estimator")
                except Exception:
                    est_opts = None
                for rep in range(repeat):
                    for pattern, spacing in (("burst", 0.0), ("spread", spacing_ms / 1e3)):
                        res = aio.run(measure(stack, key, n, spacing, max_tokens, target_ms, est_opts))
                        res.update(config=c.name, routers=r, pattern=pattern, repeat=rep)
                        runs.append(res)
                        if progress is not None:
                            progress(res)
                        time.sleep(2.0)  # the engines drain between patterns
    return {"n": n, "spacing_ms": spacing_ms, "max_tokens": max_tokens, "target_ms": target_ms,
            "cpus": os.cpu_count(), "host_load": os.getloadavg(), "runs": runs}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def print_table(res: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"{res['n']} chat requests ({res['max_tokens']}-token answers, {res['target_ms']:g} ms target) "
                    f"at once vs {res['spacing_ms']:g} ms apart, through the gateway")
    for col in ("config", "routers", "pattern", "err", "on time", "client on time", "on time | feasible", "MAPE",
                "median err", "TTFT p50/p99 ms", "decision p50/p99 ms", "dispatch lag p50/p99 ms", "instances"):
        t.add_column(col, justify="right")
    for r in res["runs"]:
        lag = r["dispatch_lag_ms"]
        t.add_row(r["config"], str(r["routers"]), r["pattern"], str(r["errors"]), _pct(r["on_time"]),
                  _pct(r["on_time_client"]), _pct(r["on_time_among_feasible"]), _pct(r["mape"]),
                  _pct(r["median_signed_error"]),
                  f"{r['ttft_ms']['p50_ms']:.0f} / {r['ttft_ms']['p99_ms']:.0f}",
                  f"{r['decision_ms']['p50_ms']:.1f} / {r['decision_ms']['p99_ms']:.1f}",
                  "—" if lag is None else f"{lag['p50_ms']:.2f} / {lag['p99_ms']:.2f}",
                  " ".join(f"{k.split('-')[-1] if '-' in k else k}:{v}" for k, v in r["shares"].items()))
    console.print(t)
    console.print(f"host load {res['host_load'][0]:.2f}, {res['cpus']} CPUs. 'on time': the router's TTFT (submit → "
                  "first token) within the target; 'client': send → first byte at this client; MAPE and the median "
                  "signed error: the router's predicted TTFT against its observed one")
