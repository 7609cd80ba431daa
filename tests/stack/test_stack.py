"""The whole stack as separate processes (nats-server, three sim engines with the paper's
profiles, predictor, estimator workers, calibrator, router): every query ends in exactly one
done or error, the chosen instance is the policy's choice given the logged predictions, killing
an estimator worker or the predictor mid-load loses no query, and a NATS restart mid-load ends
every query explicitly and routing resumes: every query sent once it has is done."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from pathlib import Path

import nats
import pytest

from bear.client.submit import submit
from bear.load.arrivals import arrivals
from bear.load.generator import make_queries, run_load
from bear.router.policies import Candidate, QueryContext, make_policy
from bear.stack.stack import Stack, StackConfig

from waiting import HANG_S, wait_until

pytestmark = pytest.mark.slow
MODELS = ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    st = Stack(StackConfig(workdir=tmp_path_factory.mktemp("stack"), estimator_workers=2, log_level="warning"))
    with st:
        yield st


def records(st: Stack) -> list[dict]:
    path: Path = st.outcome_log(0)
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


async def wait_records(st: Stack, ids: set[str]) -> dict[str, dict]:
    """Outcome records of ``ids``, once all are there (the router writes them after the answer ends)."""

    def all_there() -> dict[str, dict] | None:
        got = {r["query_id"]: r for r in records(st) if r["query_id"] in ids}
        return got if len(got) == len(ids) else None

    return await wait_until(all_there, what=f"the outcome records of {len(ids)} queries")


class Progress:
    """How far a load has got: when each query was sent, and when its connection came back
    after a NATS restart (monotonic times)."""

    def __init__(self, qs: list) -> None:
        self.qs = qs
        self.sent_at: dict[str, float] = {}
        self.reconnected_at: list[float] = []

    @property
    def sent(self) -> int:
        return len(self.sent_at)

    def on_event(self, kind: str, res) -> None:
        if kind == "sent":
            self.sent_at[self.qs[res.sent - 1].query_id] = time.monotonic()


async def load(st: Stack, rate: float, seconds: float, seed: int, during=None):
    """Run a Poisson load; ``during(progress)`` runs beside it (the faults, at points of the load)."""
    n = round(rate * seconds)
    qs, _ = make_queries(n, seed, None, MODELS)
    times = arrivals("poisson", rate, n, seed=seed)
    prog = Progress(qs)

    async def reconnected() -> None:
        prog.reconnected_at.append(time.monotonic())

    nc = await nats.connect(st.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, reconnected_cb=reconnected,
                            **st.nats_options("client"))
    try:
        task = asyncio.create_task(run_load(nc, qs, times, max_tokens=512, idle_timeout_s=15.0,
                                            on_event=prog.on_event))
        if during is not None:
            await during(prog)
        return qs, await task, prog
    finally:
        await nc.close()


def candidate_of(name: str, d: dict) -> Candidate:
    inf = math.inf
    return Candidate(instance=name, model=d["model"], acc=d["acc"], cost=d["cost"], out_len=d["out_len"],
                     out_p90=d["out_p90"], ttft=inf if d["ttft"] is None else d["ttft"], ttft_method=d["method"],
                     ttft_prefill=inf if d["ttft_prefill"] is None else d["ttft_prefill"], n_running=d["n_running"],
                     n_waiting=d["n_waiting"], pending_prefill_tokens=d["pending_prefill_tokens"],
                     pending_decode_tokens=d["pending_decode_tokens"], prefill_tps=d["prefill_tps"], tpot=d["tpot"],
                     throughput_rps=d["throughput_rps"], observed_ttft_p50=d["observed_ttft_p50"],
                     observed_ttft_p90=d["observed_ttft_p90"], observed_ttft_p95=d["observed_ttft_p95"],
                     observed_tpot_p90=d["observed_tpot_p90"])


async def test_every_query_one_terminal_and_policy_obeyed(stack: Stack) -> None:
    qs, res, _ = await load(stack, rate=6.0, seconds=4.0, seed=1)
    assert res.sent == len(qs) and res.terminal == len(qs) and res.duplicates_terminal == 0
    assert dict(res.errors) == {} and len(res.outcomes) == len(qs)
    recs = await wait_records(stack, {q.query_id for q in qs})
    assert len(recs) == len(qs)
    policy = make_policy("bear")
    methods = set()
    for q in qs:
        r = recs[q.query_id]
        assert r["status"] == "done" and r["attempt"] == 1
        cands = [candidate_of(k, v) for k, v in r["candidates"].items()]
        d = policy.decide(QueryContext(q.query_id, r["target_s"], r["lam"], r["prompt_tokens"]), cands)
        assert d.candidate.instance == r["instance"], r
        methods |= {c.ttft_method for c in cands}
        assert all(c.acc > 0 for c in cands) and r["fallbacks"] == []
    assert "bea" in methods
    # routing uses more than one instance and reports predicted vs observed TTFT
    assert len({o.instance for o in res.outcomes}) >= 2
    assert all(math.isfinite(o.ttft_s) for o in res.outcomes)


async def test_kill_estimator_and_predictor_mid_load_loses_nothing(stack: Stack) -> None:
    async def during(prog: Progress) -> None:  # a quarter of the load in, then half of it
        await wait_until(lambda: prog.sent >= len(prog.qs) // 4, what="a quarter of the load sent")
        stack.kill("estimator-0", signal.SIGKILL)
        await wait_until(lambda: prog.sent >= len(prog.qs) // 2, what="half of the load sent")
        stack.kill("predictor", signal.SIGKILL)
        stack.kill("estimator-1", signal.SIGKILL)

    qs, res, _ = await load(stack, rate=6.0, seconds=4.0, seed=2, during=during)
    try:
        assert res.terminal == len(qs) and res.duplicates_terminal == 0
        assert dict(res.errors) == {} and len(res.outcomes) == len(qs)
        recs = await wait_records(stack, {q.query_id for q in qs})
        fb = [r["fallbacks"] for r in recs.values()]
        assert any("predictor" in f for f in fb) and any("estimator" in f for f in fb)
        decision = [r["decision_s"] for r in recs.values()]
        assert all(math.isfinite(d) and d >= 0 for d in decision)  # every query decided (none stalled: all done)
        print(f"decision time with the estimators and the predictor killed: max {max(decision):.3f} s")  # with -s
    finally:
        for name in ("estimator-0", "estimator-1", "predictor"):
            stack.restart_child(name)
        from bear.stack.stack import wait_ready

        await wait_ready(stack.url, list(stack.instances), "bear", 60.0, creds=stack.creds("admin"))


async def test_nats_restart_mid_load(stack: Stack) -> None:
    routed_again: dict[str, float] = {}

    async def during(prog: Progress) -> None:
        await wait_until(lambda: prog.sent >= len(prog.qs) * 3 // 8, what="three eighths of the load sent")
        await asyncio.to_thread(stack.nats.restart)
        t_restart = time.monotonic()
        nc = await nats.connect(stack.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                                **stack.nats_options("client"))
        try:
            while time.monotonic() - t_restart < HANG_S:  # bounds a hang only
                msgs = [m async for m in submit(nc, "after restart", ttft_target_s=1.0, max_tokens=2,
                                                accept_timeout_s=0.3, resubmits=0)]
                if msgs[-1]["v"] == "bear.done/1":
                    routed_again["s"] = time.monotonic() - t_restart
                    routed_again["at"] = time.monotonic()
                    return
        finally:
            await nc.close()

    qs, res, prog = await load(stack, rate=5.0, seconds=4.0, seed=3, during=during)
    # In flight across the restart: each query ends once, in done or an explicit error.
    assert res.terminal == len(qs) and res.duplicates_terminal == 0
    assert len(res.outcomes) + sum(res.errors.values()) == len(qs)
    # New queries route again after the restart ...
    assert "s" in routed_again, "no query was routed after the NATS restart"
    # ... and every query the load sent once routing was back and its own connection too is done
    assert prog.reconnected_at, "the load's connection never reconnected"
    back = max(routed_again["at"], prog.reconnected_at[0])
    after = {qid for qid, t in prog.sent_at.items() if t > back}
    done = {o.query_id for o in res.outcomes}
    assert after <= done, sorted(after - done)
    print(f"NATS restart mid-load: routed again {routed_again['s']:.2f} s after it; {len(res.outcomes)} of "
          f"{len(qs)} done, errors {dict(res.errors)}; {len(after)} sent after recovery, all done")  # with -s


def test_up_hands_policy_params_to_its_routers(tmp_path, monkeypatch) -> None:
    """``bear up --param`` reaches every router's command line (``--param=NAME=VALUE``), checked
    against the policy first; without it the routers get none (the policy's defaults)."""
    from typer.testing import CliRunner

    import bear.commands.stack as up
    from bear.cli import app

    seen: list = []
    monkeypatch.setattr(up, "run_up", lambda cfg, *a: seen.append(cfg) or 0)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["up", "--param", "overflow=0", "--gateway-port", "0"])
    assert res.exit_code == 0, res.output
    assert seen[-1].router_args == ["--param=overflow=0"]
    res = CliRunner().invoke(app, ["up", "--gateway-port", "0"])
    assert res.exit_code == 0 and seen[-1].router_args == []
    res = CliRunner().invoke(app, ["up", "--policy", "score", "--param", "overflow=1"])
    assert res.exit_code == 2 and len(seen) == 2  # refused before anything was built
