"""``bear bench faults``: a Poisson load through a local stack (authentication on, the children
supervised as ``bear up`` does) while one fault is injected, per fault: queries sent, done, coded
errors (the router's own, by code), lost (no answer from any router: the client's own timeout),
and the recovery time (from the fault to the submission of the last query that did not end in
``done``; 0: no query failed). Faults: worker kill and hang (an estimator worker SIGKILLed, or
SIGSTOPped for ``hang_s``), predictor kill, engine kill (a sim engine), NATS restart, cluster node
kill (a 3-node NATS cluster, KV replicated, the node of one router killed) and overload (a burst
far above what the pool serves: ``overloaded`` shed, TTFT of what was served, ghost executions =
queries run although their client had already given up); stream-restarts (``bear.benchmarks.answers``:
NATS restarts, SIGTERM and SIGKILL, while long answers stream — answers whole, resumed, ended in a
coded error, done with a gap); leaked-service (``bear.benchmarks.leaked``: a leaked predictor or
estimator replica credential among 2 — prompts seen, forged replies refused, queries steered)."""

from __future__ import annotations

import asyncio
import contextlib
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

FAULTS = ("worker-kill", "worker-hang", "predictor-kill", "engine-kill", "nats-restart", "node-kill", "overload",
          "disk-full", "flood", "stream-restarts", "leaked-service")
OWN_STACK = ("node-kill", "disk-full", "flood", "stream-restarts", "leaked-service")  # each on a stack of its own
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
    qs, _ = make_queries(n, seed, None, MODELS)
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
               workdir: Path | None = None, log: Any = print, client_reconnect_s: float = 0.1,
               flood_router_args: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    from bear.stack.stack import Stack, StackConfig

    work = workdir or Path(tempfile.mkdtemp(prefix="bear-faults-"))
    results = []
    single = [f for f in faults if f not in OWN_STACK]
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
    if "disk-full" in faults:
        log("fault disk-full…")
        results.append(disk_full(work / "disk", rate=rate, seed=seed + 200))
        log(json.dumps(results[-1]))
    if "flood" in faults:
        log("fault flood…")
        results.append(flood(work / "flood", seed=seed + 300, router_args=flood_router_args))
        log(json.dumps(results[-1]))
    if "stream-restarts" in faults:  # NATS restarts during long answers (bear.benchmarks.answers, issue 40)
        from bear.benchmarks.answers import stream_restarts

        log("fault stream-restarts…")
        results.append(stream_restarts(work / "streams", log=log))
        log(json.dumps(results[-1]))
    if "leaked-service" in faults:  # a leaked predictor/estimator replica credential (bear.benchmarks.leaked, issue 40)
        from bear.benchmarks.leaked import leaked_service

        log("fault leaked-service…")
        results += leaked_service(work / "leaked", seed=seed + 400, log=log)
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


def _mount_tmpfs(path: Path, size_mib: int) -> str:
    """A tmpfs of ``size_mib`` MiB mounted at ``path`` ("" when done, else why not: it needs root)."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], capture_output=True,
                       text=True, check=False)
    return "" if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def _fill(path: Path) -> int:
    """Fill the file system of ``path`` until a write fails (ENOSPC); the bytes written."""
    import os

    n = 0
    with path.open("wb", buffering=0) as f:
        free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(1, free - (1 << 20)))
            n = free - (1 << 20)
        f.seek(n)
        with contextlib.suppress(OSError):
            while True:  # the last pages, up to the byte
                n += f.write(b"\0" * 4096)
    return n


def _tracebacks(log_dir: Path) -> dict[str, int]:
    """Tracebacks per child log (``Traceback`` lines, and JSON records with an ``exception``)."""
    out = {}
    for path in sorted(log_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        n = text.count("Traceback (most recent call last)")
        if n:
            out[path.stem] = n
    return out


def disk_full(work: Path, *, rate: float = 8.0, fill_at: float = 5.0, hold_s: float = 15.0, after_s: float = 25.0,
              seed: int = 0, size_mib: int = 4096) -> dict[str, Any]:
    """The disk under the stack (its run directory: JetStream store, logs, outcome logs) filled
    while it serves, ``hold_s`` full, then freed: per phase the queries' statuses; the recovery
    (from the space coming back to the submission of the last query that did not end in
    ``done``); tracebacks in the children's logs; what the supervisor said (``bear up`` prints it)."""
    import os
    import subprocess

    from bear.stack.stack import Stack, StackConfig

    why = _mount_tmpfs(work, size_mib)
    if why:
        return {"fault": "disk-full", "sent": 0, "done": 0, "coded_errors": {}, "lost": 0, "recovery_s": 0.0,
                "skipped": f"no tmpfs at {work}: {why}"}
    fill = work / "fill"
    marks: dict[str, float] = {}
    try:
        cfg = StackConfig(workdir=work, estimator_workers=1, routers=2, log_level="warning", restart_backoff_s=(0.5, 5.0))
        with Stack(cfg) as stack, Supervisor(stack) as sup:
            t0 = [0.0]

            def inject() -> None:
                marks["filled"] = time.monotonic() - t0[0]
                marks["filled_bytes"] = _fill(fill)
                time.sleep(hold_s)
                fill.unlink()
                marks["freed"] = time.monotonic() - t0[0]

            async def go() -> FaultRun:
                t0[0] = time.monotonic()
                return await drive(stack.url, stack.nats_options("client"), rate, fill_at + hold_s + after_s, seed,
                                   inject, fill_at, run=FaultRun("disk-full"), reconnect_wait_s=0.1)

            run = aio.run(go())
            events = list(sup.events)
            figs = run.figures()
            freed = marks.get("freed", math.inf)
            filled = marks.get("filled", math.inf)
            phases = {"before": [q for q in run.queries if q.t < filled],
                      "full": [q for q in run.queries if filled <= q.t < freed],
                      "after": [q for q in run.queries if q.t >= freed]}
            figs["phases"] = {k: dict(Counter(q.status for q in v)) for k, v in phases.items()}
            late = [q for q in phases["after"] if q.status != "done"]
            figs["recovery_after_free_s"] = round(max(q.t for q in late) - freed, 2) if late else 0.0
            figs["unavailable_after_free_10s"] = sum(q.status != "done" and q.t >= freed + 10 for q in phases["after"])
            figs["tracebacks"] = _tracebacks(stack.log_dir)
            figs["supervisor"] = [e for e in events if "disk" in e or "nats" in e.lower() or "JetStream" in e][:12]
            figs["note"] = (f"tmpfs {size_mib} MiB; filled at +{filled:.1f} s ({marks.get('filled_bytes', 0) >> 20} MiB), "
                            f"freed at +{freed:.1f} s")
            figs["accepted_lost"] = figs["lost_after_routed"]
        return figs
    finally:
        with contextlib.suppress(OSError):
            fill.unlink()
        subprocess.run(["umount", "-l", str(work)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(work)


def _light_figures(run: FaultRun) -> dict[str, Any]:
    """The light identity's figures: sent, done, overloaded, the TTFT p50/p99 of its done queries
    (the router's, submit → first token) and the client's first-token wait p99."""
    done = [q for q in run.queries if q.status == "done"]
    ttft = [q.ttft_s for q in done if q.ttft_s is not None]
    first = [q.first_s if q.first_s is not None else math.inf for q in run.queries]
    out: dict[str, Any] = {"sent": len(run.queries), "done": len(done),
                           "overloaded": sum(q.status == "overloaded" for q in run.queries),
                           "other_errors": dict(Counter(q.status for q in run.queries
                                                        if q.status not in ("done", "overloaded")))}
    if ttft:
        out["ttft_ms"] = {"p50": round(float(np.percentile(ttft, 50)) * 1e3, 1),
                          "p99": round(float(np.percentile(ttft, 99, method="higher")) * 1e3, 1)}
    failed = [q for q in run.queries if q.status != "done"]
    if failed:
        out["errors"] = [f"+{q.t:.1f} s {q.status}: {q.message}" for q in failed[:4]]
    if first:
        out["first_token_p99_ms"] = round(float(np.percentile(first, 99, method="higher")) * 1e3, 1)
    return out


def flood(work: Path, *, seed: int = 0, light_rate: float = 2.0, flood_rate: float = 60.0, flood_s: float = 10.0,
          light_s: float = 20.0, flood_tokens: int = 512, light_tokens: int = 32,
          router_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Two client identities on one sim stack (one router): ``light`` alone at ``light_rate``
    for ``light_s``, then again while ``flood`` sends ``flood_rate`` q/s of ``flood_tokens``-token
    answers for ``flood_s`` (from 2 s in). The light identity's ``overloaded`` count and TTFT
    p99, with and without the flood, and what the flooder got; ``router_args``: the router's
    options (fair shares: ``--identity-limit``, ``--max-inflight``)."""
    from bear.stack.stack import Stack, StackConfig

    cfg = StackConfig(workdir=work, estimator_workers=1, routers=1, log_level="warning", clients=("light", "flood"),
                      router_args=list(router_args))
    with Stack(cfg) as stack:
        quiet = aio.run(drive(stack.url, stack.nats_options("light"), light_rate, light_s, seed,
                              run=FaultRun("light"), max_tokens=light_tokens))

        async def both() -> tuple[FaultRun, FaultRun]:
            async def flooding() -> FaultRun:
                await asyncio.sleep(2.0)
                return await drive(stack.url, stack.nats_options("flood"), flood_rate, flood_s, seed + 1,
                                   run=FaultRun("flood"), max_tokens=flood_tokens)

            light, heavy = await asyncio.gather(
                drive(stack.url, stack.nats_options("light"), light_rate, light_s, seed + 2, run=FaultRun("light"),
                      max_tokens=light_tokens), flooding())
            return light, heavy

        light, heavy = aio.run(both())
    base, during = _light_figures(quiet), _light_figures(light)
    figs: dict[str, Any] = {
        "fault": "flood", "sent": len(light.queries), "done": sum(q.status == "done" for q in light.queries),
        "coded_errors": dict(Counter(q.status for q in light.queries if q.status != "done" and not q.client_made)),
        "lost": sum(q.client_made for q in light.queries), "recovery_s": 0.0,
        "light_alone": base, "light_in_flood": during,
        "flooder": {"sent": len(heavy.queries), "done": sum(q.status == "done" for q in heavy.queries),
                    "refused": dict(Counter(q.status for q in heavy.queries if q.status != "done"))},
        "router_args": list(router_args),
    }
    b, d = base.get("ttft_ms"), during.get("ttft_ms")
    if b and d and b["p99"] > 0:
        figs["light_ttft_p99_ratio"] = round(d["p99"] / b["p99"], 2)
    figs["note"] = (f"light {light_rate:g} q/s × {light_s:g} s ({light_tokens} tokens), flood {flood_rate:g} q/s × "
                    f"{flood_s:g} s ({flood_tokens} tokens); router {' '.join(router_args) or 'defaults'}")
    return figs
