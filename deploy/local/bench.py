"""Faults and scale of the podman deployment (deploy/local/up.sh), measured from the host through
the gateway; prints the figures and, with --out, writes them as JSON. Run it with the repository's
environment (it needs aiohttp): ``.venv/bin/python deploy/local/bench.py load|faults|scale``.

- ``load``: N chat requests at a fixed rate; answered, failed, and the TTFT BEAR reports.
- ``faults``: a steady load while, in turn, one router pod, one estimator pod, one NATS pod and the
  predictor pod are killed (SIGKILL to the container; podman restarts it): per kill the queries
  lost (no 200 answer), duplicated (dispatched twice: two ``done`` records of one query id in the
  routers' outcome logs), failed, the time until the pod ran again and until answers were whole again.
- ``scale``: the estimator pods 1 → 2 → 3 (the others stopped) at one fixed rate: the estimate
  requests the estimators served per second and the estimate answer time a router saw (p50, p99),
  from the routers' outcome logs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
RUN = Path(os.environ.get("BEAR_DEPLOY_RUN", HERE / "run"))
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(HERE / "containers.conf"))}


@dataclass
class Answer:
    start: float  # seconds since the load began
    status: int  # HTTP status; 0: no answer (connection failed or timed out)
    query_id: str = ""
    instance: str = ""
    ttft_ms: float = 0.0
    error: str = ""  # the OpenAI error code (or the exception's name when no answer came)
    message: str = ""  # the error's message


@dataclass
class Load:
    answers: list[Answer] = field(default_factory=list)

    def failed(self, since: float = 0.0) -> list[Answer]:
        return [a for a in self.answers if a.start >= since and a.status != 200]


def podman(*args: str, check: bool = True) -> str:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, env=PODMAN_ENV, timeout=120)
    if check and r.returncode != 0:
        raise SystemExit(f"error: podman {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def gateway() -> tuple[str, str]:
    if not (RUN / "gateway").exists():
        raise SystemExit(f"error: no deployment in {RUN}: run deploy/local/up.sh first")
    key = (RUN / "secrets" / "files" / "bear-gateway-keys" / "keys").read_text().split()[0]
    return (RUN / "gateway").read_text().strip(), key


async def _one(session: aiohttp.ClientSession, url: str, t0: float, timeout_s: float) -> Answer:
    start = time.monotonic() - t0
    body = {"model": "bear", "messages": [{"role": "user", "content": f"tell me about {uuid.uuid4().hex[:8]}"}],
            "max_tokens": 16}
    try:
        async with session.post(url, json=body, headers={"x-slo-ttft-ms": "1000"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = await r.text()
            if r.status != 200:
                try:
                    e = json.loads(text).get("error", {})
                    err, message = e.get("code", "") or text[:80], str(e.get("message", ""))[:160]
                except ValueError:
                    err, message = text[:80], ""
                return Answer(start, r.status, error=str(err), message=message)
            return Answer(start, 200, r.headers.get("x-bear-query-id", ""), r.headers.get("x-bear-instance", ""),
                          float(r.headers.get("x-bear-ttft-ms") or 0.0))
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return Answer(start, 0, error=type(exc).__name__)


async def run_load(rate: float, duration_s: float, events: list[tuple[float, Any]] = (), timeout_s: float = 30.0) -> Load:
    """Requests every 1/rate s for duration_s; each (t, fn) of ``events`` runs fn() at t (in a thread)."""
    base, key = gateway()
    url = base.rstrip("/") + "/chat/completions"
    load = Load()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"},
                                     connector=aiohttp.TCPConnector(limit=512)) as session:
        t0 = time.monotonic()
        tasks: list[asyncio.Task[Answer]] = []
        side = [asyncio.create_task(_at(t0 + t, fn)) for t, fn in events]
        n = int(rate * duration_s)
        for k in range(n):
            await asyncio.sleep(max(0.0, t0 + k / rate - time.monotonic()))
            tasks.append(asyncio.create_task(_one(session, url, t0, timeout_s)))
        load.answers = list(await asyncio.gather(*tasks))
        await asyncio.gather(*side)
    return load


async def _at(when: float, fn: Any) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    await asyncio.to_thread(fn)


def outcome_records() -> list[dict[str, Any]]:
    """Every record of every router pod's outcome log (they survive a container restart)."""
    out: list[dict[str, Any]] = []
    for pod in (RUN / "pods").read_text().split():
        if pod.startswith("router"):
            text = podman("exec", f"{pod}-router", "cat", "/var/log/bear/outcomes.jsonl", check=False)
            out += [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(load: Load) -> dict[str, Any]:
    ok = [a for a in load.answers if a.status == 200]
    errors: dict[str, int] = {}
    for a in load.failed():
        errors[f"{a.status}:{a.error}"] = errors.get(f"{a.status}:{a.error}", 0) + 1
    inst: dict[str, int] = {}
    for a in ok:
        inst[a.instance] = inst.get(a.instance, 0) + 1
    ttft = [a.ttft_ms for a in ok]
    messages = sorted({a.message for a in load.failed() if a.message})[:5]
    return {"sent": len(load.answers), "answered": len(ok), "failed": len(load.answers) - len(ok), "errors": errors,
            "unanswered": sum(1 for a in load.answers if a.status == 0), "messages": messages,
            "instances": inst, "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99)}


def started_at(container: str) -> float:
    """When the container last started (as a Unix time; 0 while it is not running)."""
    out = podman("inspect", container, "--format", "{{.State.Running}} {{.State.StartedAt.UnixNano}}",
                 check=False).split()
    return int(out[1]) / 1e9 if len(out) == 2 and out[0] == "true" and out[1].isdigit() else 0.0


def cmd_load(a: argparse.Namespace) -> dict[str, Any]:
    load = asyncio.run(run_load(a.rate, a.n / a.rate))
    s = summary(load)
    print(f"load: {s['answered']} of {s['sent']} answered, {s['failed']} failed {s['errors']}; "
          f"TTFT p50 {s['ttft_ms_p50']:.1f} ms, p99 {s['ttft_ms_p99']:.1f} ms; instances {s['instances']}")
    return s


KILLS = {"router": "router-0-router", "estimator": "estimator-0-estimator", "nats": "nats-1-nats",
         "predictor": "predictor-predictor"}


def cmd_faults(a: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for what in a.kill:
        container = KILLS[what]
        before = {r["query_id"] for r in outcome_records()}
        killed: dict[str, float] = {}

        def kill(c: str = container, k: dict[str, float] = killed) -> None:
            # the container's process, killed from outside as a crash or the OOM killer would: podman
            # restarts it (restartPolicy Always); `podman kill` would count as a stop and leave it down
            pid = int(podman("inspect", c, "--format", "{{.State.Pid}}").strip())
            k["wall"], k["mono"] = time.time(), time.monotonic()
            os.kill(pid, signal.SIGKILL)

        load = asyncio.run(run_load(a.rate, a.duration, [(a.duration / 3, kill)]))
        # back: the container runs again (podman's restart), answers whole again: the last failure's start
        deadline = time.time() + 60
        while started_at(container) < killed["wall"] - 1 and time.time() < deadline:
            time.sleep(0.2)
        restart_s = max(0.0, started_at(container) - killed["wall"])
        kill_at = a.duration / 3
        failed = load.failed(kill_at - 1.0)
        recs = [r for r in outcome_records() if r["query_id"] not in before]
        done: dict[str, int] = {}
        for r in recs:
            if r.get("status") == "done":
                done[r["query_id"]] = done.get(r["query_id"], 0) + 1
        s = summary(load)
        results[what] = {**s, "container": container, "lost": s["failed"],
                         "duplicated": sum(1 for n in done.values() if n > 1),
                         "restart_s": restart_s,
                         "recovery_s": max((x.start for x in failed), default=kill_at) - kill_at}
        r = results[what]
        print(f"kill -9 {what:9s} ({container}): {r['answered']}/{r['sent']} answered, lost {r['lost']} "
              f"{r['errors']} ({r['unanswered']} without an answer), duplicated {r['duplicated']}, pod back in "
              f"{r['restart_s']:.1f} s, answers whole {r['recovery_s']:.1f} s after the kill"
              + (f"; {r['messages']}" if r["messages"] else ""))
        time.sleep(a.settle)
    return results


def estimator_served() -> float:
    """Estimate requests served so far, summed over the running estimator pods (their /metrics)."""
    total = 0.0
    for pod in (RUN / "pods").read_text().split():
        if not pod.startswith("estimator"):
            continue
        text = podman("exec", f"{pod}-estimator", "python3", "-c",
                      "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9400/metrics').read().decode())",
                      check=False)
        for ln in text.splitlines():
            if ln.startswith("bear_estimator_requests_total"):
                total += float(ln.rsplit(" ", 1)[1])
    return total


def cmd_scale(a: argparse.Namespace) -> dict[str, Any]:
    pods = [p for p in (RUN / "pods").read_text().split() if p.startswith("estimator")]
    if len(pods) < max(a.pods):
        raise SystemExit(f"error: {len(pods)} estimator pods up; deploy with BEAR_REPLICAS=estimator={max(a.pods)}")
    results: dict[str, Any] = {}
    for n in a.pods:
        for k, pod in enumerate(pods):
            podman("pod", "start" if k < n else "stop", pod, check=False)
        time.sleep(a.settle)
        before = {r["query_id"] for r in outcome_records()}
        served0, t0 = estimator_served(), time.monotonic()
        load = asyncio.run(run_load(a.rate, a.duration))
        served = (estimator_served() - served0) / (time.monotonic() - t0)
        recs = [r for r in outcome_records() if r["query_id"] not in before and r.get("status") == "done"]
        est = [1000 * r["estimate_s"] for r in recs if isinstance(r.get("estimate_s"), (int, float))]
        bea = sum(1 for r in recs if r.get("ttft_method") == "bea")
        s = summary(load)
        results[str(n)] = {**s, "estimates_per_s": served, "estimate_ms_p50": pct(est, 0.5),
                           "estimate_ms_p99": pct(est, 0.99), "bea_share": bea / max(1, len(recs))}
        r = results[str(n)]
        print(f"{n} estimator pod(s) at {a.rate:g} q/s: {r['estimates_per_s']:.0f} estimates/s served, estimate "
              f"answer p50 {r['estimate_ms_p50']:.1f} ms p99 {r['estimate_ms_p99']:.1f} ms, BEA {100 * r['bea_share']:.0f} %, "
              f"{r['answered']}/{r['sent']} answered")
    for pod in pods:
        podman("pod", "start", pod, check=False)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("load", help="N requests at a fixed rate")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--rate", type=float, default=8.0)
    p = sub.add_parser("faults", help="kill -9 pods in turn under a steady load")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per kill (the kill at a third)")
    p.add_argument("--kill", nargs="+", default=list(KILLS), choices=list(KILLS))
    p.add_argument("--settle", type=float, default=5.0)
    p = sub.add_parser("scale", help="estimator pods 1 → 3 at one rate")
    p.add_argument("--rate", type=float, default=30.0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--pods", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--settle", type=float, default=5.0)
    for q in sub.choices.values():
        q.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = ap.parse_args()
    res = {"load": cmd_load, "faults": cmd_faults, "scale": cmd_scale}[a.cmd](a)
    if a.out:
        a.out.write_text(json.dumps(res, indent=2, default=lambda o: asdict(o)) + "\n")
    return 0 if a.cmd != "load" or res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
