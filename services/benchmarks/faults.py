"""``bear bench faults``: a Poisson load through a local stack (authentication on, the children
supervised as ``bear up`` does) while one fault is injected, per fault: queries sent, done, coded
errors (the router's own, by code), lost (no answer from any router: the client's own timeout),
and the recovery time (from the fault to the submission of the last query that did not end in
``done``; 0: no query failed). Faults: worker kill and hang (an estimator worker SIGKILLed, or
SIGSTOPped for ``hang_s``), predictor kill, engine kill (a sim engine), NATS restart, cluster node
kill (a 3-node NATS cluster, KV replicated, the node of one router killed) and overload (a burst
far above what the pool serves: ``overloaded`` shed, TTFT of what was served, ghost executions =
queries run although their client had already given up)."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bear.runtime import aio

FAULTS = ("worker-kill", "worker-hang", "predictor-kill", "engine-kill", "nats-restart", "node-kill", "overload")
MODELS = ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B")


@dataclass
class Sent:
    query_id: str
    t: float  # seconds after the load started
    status: str = ""  # done | an error code
    client_made: bool = False  # the client's own error: no router answered (lost)
    routed: bool = False
    ttft_s: float | None = None
    message: str = ""  # the error's message
    first_s: float | None = None  # the client's wait for its first token (or its done), from the submission


WINDOW_S = 10.0  # the first-token figures after a fault: the queries submitted in this window
RECOVERY_WINDOW_S, RECOVERY_STEP_S = 2.0, 0.5  # the p99 recovery: sliding windows of submissions


def _pcts(xs: list[float]) -> dict[str, float] | None:
    """p50/p99 in ms (a query that never got a first token counts as infinitely slow)."""
    if not xs:
        return None
    a = np.array(xs)
    return {"p50": round(float(np.percentile(a, 50, method="higher")) * 1e3, 1),
            "p99": round(float(np.percentile(a, 99, method="higher")) * 1e3, 1),
            "n": len(xs)}


def first_token_figures(queries: list[Sent], t_fault: float | None, window_s: float = WINDOW_S,
                        factor: float = 2.0) -> dict[str, Any]:
    """The client's first-token wait of the queries served before the fault (first token before
    it), and of the others submitted before ``t_fault + window_s`` (a query without a first token
    counts as infinite; one waiting across the fault counts after it), and the seconds from the
    fault until the p99 is back within ``factor``× of before: the start of the first sliding
    window (``RECOVERY_WINDOW_S`` wide, every ``RECOVERY_STEP_S``) from which on every window's p99
    is (None: not within the run)."""
    if t_fault is None:
        return {}
    def wait(q: Sent) -> float:
        return q.first_s if q.first_s is not None else math.inf

    served_before = {id(q) for q in queries if q.t + wait(q) < t_fault}
    before = [wait(q) for q in queries if id(q) in served_before]
    after = [wait(q) for q in queries if q.t < t_fault + window_s and id(q) not in served_before]
    out: dict[str, Any] = {"first_token_before_ms": _pcts(before), "first_token_after_ms": _pcts(after)}
    if not before:
        return out
    bound = factor * float(np.percentile(np.array(before), 99, method="higher"))
    late = [q for q in queries if id(q) not in served_before]
    if not late:
        return out
    end = max(q.t for q in late)
    starts = np.arange(t_fault, end + 1e-9, RECOVERY_STEP_S)
    ok = []
    for i, s0 in enumerate(starts):  # the first window also holds those submitted before the fault
        w = [wait(q) for q in late if (i == 0 or s0 <= q.t) and q.t < s0 + RECOVERY_WINDOW_S]
        ok.append(not w or float(np.percentile(np.array(w), 99, method="higher")) <= bound)
    recovered = None
    for i in range(len(ok)):
        if all(ok[i:]):
            recovered = round(float(starts[i] - t_fault), 2)
            break
    out["first_token_p99_recovery_s"] = recovered
    return out


@dataclass
class FaultRun:
    fault: str
    t_fault: float | None = None
    queries: list[Sent] = field(default_factory=list)
    note: str = ""

    def figures(self) -> dict[str, Any]:
        done = [q for q in self.queries if q.status == "done"]
        coded = Counter(q.status for q in self.queries if q.status != "done" and not q.client_made)
        lost = [q for q in self.queries if q.client_made]
        after = [q for q in self.queries if self.t_fault is not None and q.t >= self.t_fault and q.status != "done"]
        last_failure = max((q.t for q in after), default=self.t_fault)
        out: dict[str, Any] = {
            "fault": self.fault, "sent": len(self.queries), "done": len(done), "coded_errors": dict(coded),
            "lost": len(lost), "lost_after_routed": sum(q.routed for q in lost),
            "recovery_s": round(max(q.t for q in after) - self.t_fault, 2) if after and self.t_fault is not None
            else 0.0,
            # the queries sent after the fault's last failure, all done: routing went on
            "done_after_recovery": 0 if last_failure is None else sum(q.t > last_failure for q in done),
        }
        if any(q.ttft_s is not None for q in done):
            ttft = np.array([q.ttft_s for q in done if q.ttft_s is not None])
            out["ttft_ms"] = {"p50": round(float(np.percentile(ttft, 50)) * 1e3, 1),
                              "p99": round(float(np.percentile(ttft, 99)) * 1e3, 1)}
        out.update(first_token_figures(self.queries, self.t_fault))
        failed = [q for q in self.queries if q.status != "done"]
        if failed:  # why, in the router's words (the first few)
            out["errors"] = [f"+{q.t - (self.t_fault or 0.0):.1f} s {q.status}: {q.message}" for q in failed[:5]]
        if self.note:
            out["note"] = self.note
        return out


async def drive(url: str, nats_options: dict[str, Any], rate: float, duration: float, seed: int,
                inject: Any = None, at: float = 3.0, max_tokens: int = 32, run: FaultRun | None = None,
                accept_timeout_s: float = 2.0, reconnect_wait_s: float = 0.1) -> FaultRun:
    """Poisson arrivals at ``rate`` for ``duration`` s; ``inject()`` (blocking, run in a thread)
    at ``at`` s; ``reconnect_wait_s``: the client's wait between reconnect attempts (nats-py's
    default is 2 s: a client then comes back after the routers)."""
    from bear.client.submit import submit
    from bear.load.arrivals import arrivals
    from bear.load.generator import make_queries
    from bear.protocol.replies import Chunk, Done, Error, Routed
    from bear.runtime.service import connect

    run = run or FaultRun("none")
    n = max(1, round(rate * duration))
    qs = make_queries(n, seed, None, MODELS)
    times = arrivals("poisson", rate, n, seed=seed)
    nc = await connect(url, "bear-bench-faults", creds="", reconnect_time_wait=reconnect_wait_s, **nats_options)
    t0 = time.monotonic()

    async def one(q: Any, t: float) -> None:
        rec = Sent(q.query_id, t)
        run.queries.append(rec)
        sent = time.monotonic()
        async for m in submit(nc, q.prompt, ttft_target_s=q.target_s, max_tokens=max_tokens, query_id=q.query_id,
                              accept_timeout_s=accept_timeout_s, idle_timeout_s=15.0):
            if rec.first_s is None and isinstance(m, Chunk | Done):
                rec.first_s = time.monotonic() - sent
            if isinstance(m, Routed):
                rec.routed = True
            elif isinstance(m, Done):
                rec.status, rec.ttft_s = "done", m.ttft_s
            elif isinstance(m, Error):
                rec.status = m.code
                rec.message = m.message[:120]
                rec.client_made = m.client is True

    async def fault() -> None:
        await asyncio.sleep(at)
        run.t_fault = time.monotonic() - t0
        await asyncio.to_thread(inject)

    tasks = [asyncio.create_task(fault())] if inject is not None else []
    try:
        for q, t in zip(qs, times, strict=True):
            delay = float(t) - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(q, time.monotonic() - t0)))
        await asyncio.gather(*tasks)
    finally:
        await nc.close()
    return run


class Supervisor:
    """``Stack.supervise()`` every 0.2 s in a thread, as ``bear up`` runs it."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.events: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.events += self.stack.supervise()

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _injector(stack: Any, fault: str, hang_s: float) -> Any:
    def kill(name: str) -> Any:
        return lambda: stack.children[name].signal(signal.SIGKILL)

    if fault == "worker-kill":
        return kill("estimator-0")
    if fault == "predictor-kill":
        return kill("predictor")
    if fault == "engine-kill":
        return kill(next(n for n in stack.children if n.startswith("sim-qwen8b")))
    if fault == "worker-hang":
        def hang() -> None:
            stack.children["estimator-0"].signal(signal.SIGSTOP)
            time.sleep(hang_s)
            stack.children["estimator-0"].signal(signal.SIGCONT)
        return hang
    if fault == "nats-restart":
        return lambda: stack.nats.restart()
    raise ValueError(fault)


def _ready(stack: Any) -> None:
    from bear.stack.stack import wait_ready

    aio.run(wait_ready(stack.url, list(stack.instances), stack.cfg.prefix, 90.0, stack, creds=stack.creds("admin")))


def _ghosts(stack: Any, run: FaultRun) -> int:
    """Queries the routers executed (done in an outcome log) whose client had given up."""
    gave_up = {q.query_id for q in run.queries if q.client_made}
    done = set()
    for i in range(stack.cfg.routers):
        path = stack.outcome_log(i)
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("status") == "done":
                    done.add(rec["query_id"])
    return len(gave_up & done)


def _executions(stack: Any) -> Counter[str]:
    """How often each query id was executed (dispatched) across the routers' outcome logs."""
    n: Counter[str] = Counter()
    for i in range(stack.cfg.routers):
        path = stack.outcome_log(i)
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("status") in ("done", "broken", "cancelled") and rec.get("instance"):
                    n[rec["query_id"]] += 1
    return n


def run_faults(faults: tuple[str, ...] = FAULTS, *, rate: float = 8.0, duration: float = 12.0, at: float = 3.0,
               hang_s: float = 5.0, overload_rate: float = 300.0, overload_s: float = 5.0, seed: int = 0,
               workdir: Path | None = None, log: Any = print, client_reconnect_s: float = 0.1) -> list[dict[str, Any]]:
    from bear.stack.stack import Stack, StackConfig

    work = workdir or Path(tempfile.mkdtemp(prefix="bear-faults-"))
    results = []
    single = [f for f in faults if f != "node-kill"]
    if single:
        cfg = StackConfig(workdir=work / "single", estimator_workers=2, routers=2, log_level="warning",
                          restart_backoff_s=(0.5, 5.0))
        with Stack(cfg) as stack, Supervisor(stack) as sup:
            opts = stack.nats_options("client")
            for k, fault in enumerate(single):
                log(f"fault {fault}…")
                if fault == "overload":
                    run = aio.run(drive(stack.url, opts, overload_rate, overload_s, seed + k, run=FaultRun(fault),
                                        max_tokens=16))
                    figs = run.figures()
                    figs["offered_qps"] = overload_rate
                    figs["ghost_executions"] = _ghosts(stack, run)
                else:
                    run = aio.run(drive(stack.url, opts, rate, duration, seed + k, _injector(stack, fault, hang_s),
                                        at, run=FaultRun(fault), reconnect_wait_s=client_reconnect_s))
                    figs = run.figures()
                figs["executed_twice"] = sum(v > 1 for v in _executions(stack).values())
                figs["restarts"] = [e for e in sup.events if "restarted" in e]
                sup.events.clear()
                results.append(figs)
                log(json.dumps(figs))
                _ready(stack)
    if "node-kill" in faults:
        log("fault node-kill…")
        results.append(node_kill(work / "cluster", rate=rate, duration=duration, at=at, seed=seed + 100))
        log(json.dumps(results[-1]))
    return results


def node_kill(work: Path, *, rate: float = 8.0, duration: float = 12.0, at: float = 3.0, seed: int = 0) -> dict[str, Any]:
    """A 3-node cluster (KV replicated), services spread round robin over the nodes, two routers on
    different nodes; the node of router-0 is SIGKILLed under load. The client is on another node."""
    from bear.stack.stack import Stack, StackConfig

    cfg = StackConfig(workdir=work, estimator_workers=2, routers=2, log_level="warning", nats_cluster=3)
    with Stack(cfg) as stack:
        assert stack.cluster is not None
        victim = stack.node_of("router-0")
        assert victim is not None and victim != stack.node_of("router-1")
        client_url = stack.cluster.nodes[(victim + 1) % 3].url
        if stack.node_of("router-1") == (victim + 1) % 3:
            client_url = stack.cluster.nodes[(victim + 2) % 3].url
        run = aio.run(drive(client_url, stack.nats_options("client"), rate, duration, seed,
                            lambda: stack.cluster.kill(victim), at, run=FaultRun("node-kill")))
        figs = run.figures()
        execs = _executions(stack)
        figs["executed_twice"] = sum(v > 1 for v in execs.values())
        figs["note"] = (f"node {victim} of 3 killed (router-0 and "
                        f"{sum(stack.node_of(n) == victim for n in stack.children) - 1} other services on it)")
        return figs


def faults_table(results: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table."""
    rows = ["| fault | sent | done | coded errors | lost | recovery | TTFT p50 / p99 | first token p50 / p99 before "
            "| in the 10 s after | p99 within 2× after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r["coded_errors"].items())) or "—"
        t = r.get("ttft_ms") or {}
        ttft = f"{t.get('p50', math.nan):.0f} / {t.get('p99', math.nan):.0f} ms" if t else "—"
        def pp(x: dict[str, Any] | None) -> str:
            return f"{x['p50']:.0f} / {x['p99']:.0f} ms" if x else "—"

        rec = r.get("first_token_p99_recovery_s", "—")
        rec = "not in the run" if rec is None else (f"{rec} s" if rec != "—" else rec)
        rows.append(f"| {r['fault']} | {r['sent']} | {r['done']} | {errs} | {r['lost']} | {r['recovery_s']} s | {ttft} "
                    f"| {pp(r.get('first_token_before_ms'))} | {pp(r.get('first_token_after_ms'))} | {rec} |")
    return "\n".join(rows)
