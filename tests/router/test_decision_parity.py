"""What is evaluated is what runs: one recorded state — snapshots of four busy instances (two of
them serving the same model, one with a short context), dispatches the snapshots do not show yet,
calibrations, registry records, observed outcomes and the predictor's answers — fed to the live
path (real NATS, a real estimator worker, a real router per query, a streaming instance) and to
the offline path ``bear eval`` takes (``estimator.estimate.estimate`` when the policy reads it +
``router.candidates.build_candidates`` + ``router.decide.decide`` with the router's profile), at
the same clocks. Every candidate field, every estimate and every decision must be equal, for every
policy, and so must what the request filters drop: a query naming a model, one too long for an
instance's context and one whose deadline some instances are predicted to miss; staleness
compensation, dispatches ahead and arrival fill are on in both."""

from __future__ import annotations

import itertools
import json
import math
import time
from typing import Any

import msgspec
import nats
import numpy as np
import pytest
from aiohttp import web

from bear import libbea
from bear.client.submit import submit
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.estimator.state import StateStore
from bear.estimator.worker import EstimatorWorker
from bear.instance.record import instance_record
from bear.protocol.codec import pack, unpack_map
from bear.protocol.messages import (
    Calibration,
    Dispatch,
    EstimateCandidate,
    EstimateQuery,
    Outcome,
    decode,
    encode,
)
from bear.protocol.subjects import Subjects
from bear.router.candidates import ModelPrediction, build_candidates
from bear.router.decide import Refused, decide, profile_for
from bear.router.policies import REGISTRY, QueryContext, make_policy
from bear.router.registry import InstanceInfo, predictor_name
from bear.router.service import RouterConfig, RouterService
from bear.runtime.kv import ensure_kv
from bear.runtime.nats_server import free_port
from bear.sim.profile import load_profile

from waiting import wait_until

S = Subjects()
MODELS = {"p-small": "org/Small-1B", "p-mid": "org/Mid-8B", "p-big": "org/Big-32B", "p-mid2": "org/Mid-8B"}
PRICES = {"p-small": (0.044, 0.173), "p-mid": (0.072, 0.287), "p-big": (0.287, 0.640), "p-mid2": (0.072, 0.287)}
BETAS = {"p-small": (3e-3, 2e-6, 4e-8, 5e-10), "p-mid": (8e-3, 1.6e-5, 6e-8, 2e-9), "p-big": (1.6e-2, 4e-5, 5e-8, 4e-9),
         "p-mid2": (9e-3, 1.8e-5, 7e-8, 2.5e-9)}
CONTEXT = {"p-small": 1024}  # registered max_model_len (the others register none)
MAX_TOKENS = 256
PREDICTIONS = {  # the predictor's answer per model: accuracy, length mean/p90, prompt tokens, cost (USD)
    "Small-1B": (0.41, 180.0, 400.0, 37, 3.3e-5), "Mid-8B": (0.80, 150.0, 300.0, 36, 4.6e-5),
    "Big-32B": (0.88, 160.0, 320.0, 36, 1.1e-4)}
PROMPT = "Summarise the report below in three sentences. " * 3
POLICY_PARAMS = {"bear-lagrange": {"delta": 0.5}}
CFG = EstimatorConfig(max_age_s=60.0)  # the snapshots are never refreshed here: keep them BEA-eligible


def busy_snapshot(instance: str, seed: int, at: float) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    cfg = {**load_profile("qwen3-8b-h100").engine_config(), "num_gpu_blocks": 4000, "max_num_seqs": 48}
    e = libbea.Engine(cfg)
    for k in range(40):
        e.add(f"{instance}-r{k}", int(rng.integers(50, 3000)), 2048, int(rng.integers(20, 900)))
    for _ in range(int(rng.integers(5, 25))):
        if e.step():
            e.finish_step()
    return e.snapshot(instance, MODELS[instance], at)


class Fakes:
    """A predictor that answers PREDICTIONS and one streaming instance behind all three ids."""

    def __init__(self) -> None:
        self.port = free_port()
        self.runner: web.AppRunner | None = None
        self.service: Any = None

    async def start(self, nc: Any) -> None:
        from nats.micro import add_service

        async def predict(req: Any) -> None:
            body = unpack_map(req.data)
            models = {m: {"acc": a, "len": {"mean": mean, "p50": mean, "p90": p90}, "prompt_tokens": pt, "cost": c}
                      for m, (a, mean, p90, pt, c) in PREDICTIONS.items() if m in body["models"]}
            await req.respond(pack({"v": "bear.prediction/1", "models": models}))

        self.service = await add_service(nc, name="bear-predictor", version="0.0.1", queue_group="bear-predictor")
        await self.service.add_endpoint(name="predict", subject=S.predict, handler=predict)

        async def complete(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for k in range(3):
                await resp.write(f"data: {json.dumps({'choices': [{'text': f'w{k} ', 'finish_reason': None}]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.service.stop()
        assert self.runner is not None
        await self.runner.cleanup()


def offline_info(inst: str, cal: Calibration, outcomes: list[Outcome], port: int) -> InstanceInfo:
    info = InstanceInfo(inst, model=MODELS[inst], base_url=f"http://127.0.0.1:{port}/v1",
                        price_in=PRICES[inst][0], price_out=PRICES[inst][1],
                        predictor_model=predictor_name(MODELS[inst], {}), calibration=cal,
                        max_model_len=CONTEXT.get(inst))
    for o in outcomes:
        if o.instance == inst:
            info.obs.add_outcome(o.t, o.ttft_s, o.tpot_s, o.completed)
    return info


CANDIDATE_FIELDS = ("model", "acc", "cost", "out_len", "out_p90", "ttft", "method", "ttft_prefill", "n_running",
                    "n_waiting", "pending_prefill_tokens", "pending_decode_tokens", "prefill_tps", "tpot",
                    "throughput_rps", "observed_ttft_p50", "observed_ttft_p90", "observed_ttft_p95",
                    "observed_tpot_p90")


def as_logged(c: Any) -> dict[str, Any]:
    """An offline Candidate as the router's outcome log writes it (JSON: inf → null)."""
    d = {f: getattr(c, f.replace("method", "ttft_method")) for f in CANDIDATE_FIELDS}
    return json.loads(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                  for k, v in d.items()}))


@pytest.mark.slow
async def test_live_router_and_offline_evaluation_decide_alike(nats_server, tmp_path) -> None:
    nc = await nats.connect(nats_server.url)
    fakes = Fakes()
    await fakes.start(nc)
    worker = EstimatorWorker(nc, CFG)
    await worker.start()
    offline = StateStore()
    now = time.time()
    try:
        # ---- the recorded state, published once; the offline store gets the same objects.
        kv_inst = await ensure_kv(nc.jetstream(), S.instances_bucket)
        kv_cal = await ensure_kv(nc.jetstream(), S.calibration_bucket)
        cals: dict[str, Calibration] = {}
        for k, inst in enumerate(MODELS):
            rec = instance_record(inst, MODELS[inst], f"http://127.0.0.1:{fakes.port}/v1",
                                  price_input_per_mtok=PRICES[inst][0], price_output_per_mtok=PRICES[inst][1],
                                  config={"max_model_len": CONTEXT[inst]} if inst in CONTEXT else None)
            await kv_inst.put(inst, encode(msgspec.structs.replace(rec, heartbeat=now + 3600)))  # alive throughout
            cals[inst] = Calibration(instance=inst, beta=BETAS[inst], mape=0.05, n=500,
                                     theta=None if k == 0 else 20_000.0 / (k + 1))  # one θ derived from β
            await kv_cal.put(inst, encode(cals[inst]))
            raw = pack(busy_snapshot(inst, seed=k, at=now - 0.2))
            await nc.publish(S.snapshot(inst), raw)
            snap = libbea.Snapshot.from_msgpack(raw)
            st = offline.get(inst)
            st.install(snap, float(snap.time), now)
            st.calibration, st.calibrated = cals[inst], True
        dispatches = []  # residents' predicted lengths, plus requests sent after the snapshots
        for k, inst in enumerate(MODELS):
            for j in range(0, 40, 4):
                dispatches.append(Dispatch(request_id=f"{inst}-r{j}", prompt_tokens=500, predicted_output_tokens=120 + j,
                                           max_tokens=2048, t=now - 5.0 + j * 0.01))
            for j in range(3 + k):
                dispatches.append(Dispatch(request_id=f"{inst}-new{j}", prompt_tokens=800 + 100 * j,
                                           predicted_output_tokens=90, max_tokens=512, t=now - 0.1 + j * 0.01))
        for d in dispatches:
            inst = d.request_id.rsplit("-", 1)[0]
            await nc.publish(S.dispatch(inst), encode(d))
            offline.get(inst).on_dispatch(d)
        outcomes = [Outcome(instance=inst, ttft_s=0.05 + 0.01 * j + 0.02 * k, tpot_s=0.004 * (k + 1) + 1e-4 * j,
                            completed=True, t=now - 30 + j)
                    for k, inst in enumerate(MODELS) for j in range(12)]
        await nc.flush()
        await wait_until(lambda: all(worker.store.peek(i) is not None and worker.store.get(i).calibrated for i in MODELS))
        await wait_until(lambda: sum(len(worker.store.get(i).dispatches) for i in MODELS) == len(dispatches))

        seen: list[Dispatch] = []

        async def on_dispatch(m: Any) -> None:
            seen.append(decode(Dispatch, m.data))

        seen_sub = await nc.subscribe(S.dispatch_all, cb=on_dispatch)
        infos = [offline_info(i, cals[i], outcomes, fakes.port) for i in sorted(MODELS)]
        preds = {m: ModelPrediction(acc=a, out_len=mean, out_p90=p90, prompt_tokens=pt, cost_usd=c)
                 for m, (a, mean, p90, pt, c) in PREDICTIONS.items()}

        def offline_candidates(profile: Any, qid: str, prompt_tokens: int, estimated_at: float | None,
                               decided_at: float, elapsed: dict[str, float] | float = 0.0) -> list[Any]:
            """``elapsed``: the time the live query had spent in the router when each instance was
            estimated (its record's ``ttft_elapsed``: host timing, taken as the live router measured it)."""
            rows = None
            if profile.needs_estimate:
                assert estimated_at is not None
                q = EstimateQuery(id=qid, prompt_tokens=prompt_tokens, max_tokens=MAX_TOKENS)
                rows = {r.instance: r for r in estimate(q, [EstimateCandidate(instance=i) for i in sorted(MODELS)],
                                                        offline, estimated_at, CFG)}
            cands, _ = build_candidates(prompt_tokens, infos, preds, rows, decided_at,
                                        default_output_tokens=RouterConfig().default_output_tokens, elapsed_s=elapsed)
            return cands

        routed: list[str] = []  # the queries dispatched so far

        async def route_both(policy: str, qid: str, model: str | None = None, prompt_tokens: int | None = None,
                             **submit_kw: Any) -> tuple[dict[str, Any], Any]:
            """One query through a fresh live router and, at its clocks, through the offline path:
            (the live outcome record, the offline decision); the two decisions are asserted equal."""
            params = POLICY_PARAMS.get(policy, {})
            log_path = tmp_path / f"{qid}.jsonl"
            router = RouterService(nc, RouterConfig(policy=policy, policy_params=params, outcome_log=log_path,
                                                    predict_budget_s=2.0, estimate_budget_s=2.0, predict_try_s=1.0,
                                                    estimate_try_s=1.0))
            await router.start()
            await wait_until(lambda r=router: {i.id for i in r.registry.healthy()} == set(MODELS))
            await wait_until(lambda r=router: all(r.registry.get(i).calibration.n == 500 for i in MODELS))
            for o in outcomes:  # what this router has observed of the instances
                await nc.publish(S.outcome(o.instance), encode(o))
            await wait_until(lambda r=router: sum(len(r.registry.get(i).obs.observed) for i in MODELS) == len(outcomes))
            msgs = [m async for m in submit(nc, PROMPT, ttft_target_s=0.4, max_tokens=MAX_TOKENS, lam=5e-4,
                                            query_id=qid, model=model, prompt_tokens=prompt_tokens, **submit_kw)]
            await router.stop()
            rec = json.loads(log_path.read_text().splitlines()[-1])
            assert rec["policy"] == policy and rec["deadline"] is not None  # every client's submit carries one

            # ---- the offline path at the same clocks, on the same state, through the same profile.
            profile = profile_for(make_policy(policy, **params))
            ctx = QueryContext(qid, 0.4, 5e-4, rec["prompt_tokens"], model=model,
                               context_tokens=(prompt_tokens or 0) + MAX_TOKENS, deadline=rec["deadline"])
            elapsed = ({i: c["ttft_elapsed"] for i, c in rec["candidates"].items()} if "candidates" in rec
                       else rec.get("ttft_elapsed", {}))
            cands = offline_candidates(profile, qid, rec["prompt_tokens"], rec["estimated_at"], rec["decided_at"],
                                       elapsed)
            d = decide(profile, ctx, cands, rec["decided_at"])
            assert rec["dropped"] == d.dropped, (policy, qid)
            if isinstance(d, Refused):
                assert (rec["status"], rec["filter"], rec["reason"]) == (str(d.code), d.filter, d.message)
                assert (msgs[-1].code, msgs[-1].message) == (str(d.code), d.message)
                return rec, d
            assert msgs[-1]["v"] == "bear.done/1", msgs[-1]
            assert rec["fallbacks"] == []
            estimated = {i for i in MODELS if not d.dropped.get(i, "deadline").startswith(("model", "context"))}
            assert set(rec["candidates"]) == estimated, (policy, qid)  # the registry's filters ran first
            for c in cands:
                if c.instance in estimated:
                    live = {k: rec["candidates"][c.instance][k] for k in CANDIDATE_FIELDS}
                    assert live == as_logged(c), (policy, qid, c.instance)
                    assert c.ttft_method == ("bea" if profile.needs_estimate else "router-eq8")
            assert rec["instance"] == d.candidate.instance, (policy, qid)
            assert rec["feasible"] == d.feasible
            # The live dispatch goes to both estimators alike (the next query sees it ahead).
            routed.append(qid)
            await wait_until(lambda: len(seen) == len(routed))
            await wait_until(lambda: sum(len(worker.store.get(i).dispatches) for i in MODELS)
                             == len(dispatches) + len(routed))
            assert seen[-1].prompt_tokens == PREDICTIONS[predictor_name(MODELS[rec["instance"]], {})][3]
            offline.get(rec["instance"]).on_dispatch(seen[-1])
            return rec, d

        decisions: dict[str, str] = {}
        for n, policy in enumerate(sorted(REGISTRY)):
            rec, _ = await route_both(policy, f"parity-{n}")
            assert rec["dropped"] == {}
            decisions[policy] = rec["instance"]
        # The policies do not all agree: the comparison covered different decisions.
        assert len(set(decisions.values())) >= 2, decisions

        # ---- the request filters: what they drop, and the decision on the rest, are equal too.
        for policy in ("bear", "round-robin", "shortest-queue"):
            rec, d = await route_both(policy, f"model-{policy}", model="org/Mid-8B")
            assert set(d.dropped) == {"p-small", "p-big"} and rec["instance"] in ("p-mid", "p-mid2")
            rec, d = await route_both(policy, f"context-{policy}", prompt_tokens=900)  # + 256 > p-small's 1024
            assert set(d.dropped) == {"p-small"} and d.dropped["p-small"].startswith("context: ")
        # A deadline between the instances' estimates: those predicted to start after it are dropped.
        est = sorted(c.ttft for c in offline_candidates(profile_for(make_policy("bear")), "probe", rec["prompt_tokens"],
                                                        time.time(), time.time()))
        _, lo, hi = max((b - a, a, b) for a, b in itertools.pairwise(est))
        rec, d = await route_both("bear", "deadline-bear", accept_timeout_s=(lo + hi) / 2, resubmits=0)
        assert 0 < sum(v.startswith("deadline: ") for v in d.dropped.values()) < len(MODELS), (est, d.dropped)
        # round robin asks no estimate: no candidate has a calibrated one, the deadline drops none
        rec, d = await route_both("round-robin", "deadline-round-robin", accept_timeout_s=(lo + hi) / 2, resubmits=0)
        assert d.dropped == {} and rec["estimated_at"] is None
        await seen_sub.unsubscribe()
    finally:
        await worker.stop()
        await fakes.stop()
        await nc.close()
