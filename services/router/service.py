"""The router (``bear router``): subscribes to ``bear.submit`` in queue group ``bear-router``;
per query it asks the predictor and the estimator concurrently (deadlines, fallbacks), builds one
``Candidate`` per healthy instance as the offline evaluation does, lets the policy pick, publishes
``bear.dispatch.<instance>``, streams the instance's answer to the client's inbox and logs the
outcome. Routers share nothing but NATS. Protocol and decisions: docs/router.md."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from bear import libbea
from bear.calibrator.fit import NOMINAL_BETA
from bear.estimator.client import EstimatorClient
from bear.protocol.codec import pack, unpack_map
from bear.protocol.errors import BearError, ErrorCode, error_reply
from bear.protocol.subjects import Subjects
from bear.router.dedup import Deduplicator
from bear.router.dispatch import (
    InstanceRefused,
    InstanceUnavailable,
    StreamBroken,
    request_body,
    stream_completion,
)
from bear.router.outcomes import OutcomeLog
from bear.router.policies import Candidate, Decision, Policy, QueryContext, make_policy
from bear.router.predict import (
    ModelPrediction,
    ask_estimator,
    ask_predictor,
    fallback_prediction,
    prefill_eq8,
)
from bear.router.registry import InstanceInfo, Registry
from bear.runtime.service import connect
from bear.runtime.shutdown import cancel_all, close_nats

log = structlog.get_logger("bear.router")

SUBMIT_SCHEMA = "bear.submit/1"
MUSD = 1e6  # Candidate.cost is in micro-USD, the scale λ = 5e-4 is meant for
# θ when no calibration exists: 1 / (β1 + β0 / E[P]) with the nominal β and E[P] = 512.
NOMINAL_THETA = 1.0 / (NOMINAL_BETA[1] + NOMINAL_BETA[0] / 512.0)
MAX_PROMPT_BYTES = 4 * 1024 * 1024


@dataclass
class RouterConfig:
    policy: str = "bear"
    policy_params: dict[str, float] = field(default_factory=dict)
    lam: float = 5e-4  # default λ of eq. 4 when the query gives none
    default_ttft_target_s: float = 1.0
    default_max_tokens: int = 256
    predict_budget_s: float = 0.2
    predict_try_s: float = 0.1
    estimate_budget_s: float = 0.2
    estimate_try_s: float = 0.1
    default_output_tokens: int = 256  # fallback prediction of the output length
    max_inflight: int = 4096
    down_after_s: float = 10.0
    fail_backoff_s: float = 5.0  # an instance that refused a connection is avoided this long
    max_attempts: int = 2  # instances tried per query before an `unavailable` error
    connect_timeout_s: float = 2.0
    idle_timeout_s: float = 60.0
    dedup_ttl_s: float = 600.0
    dedup_timeout_s: float = 0.1
    outcome_log: Path | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # served model → predictor model
    name: str = ""


@dataclass
class Query:
    query_id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    ttft_target_s: float
    max_tokens: int
    lam: float
    prompt_tokens: int | None
    sim_output_tokens: int | dict[str, int] | None

    @property
    def text(self) -> str:
        if self.messages is not None:
            return "\n".join(str(m.get("content", "")) for m in self.messages)
        return self.prompt or ""

    def token_estimate(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else max(1, math.ceil(len(self.text.encode()) / 4))


def parse_submit(data: bytes, cfg: RouterConfig) -> Query:
    d = unpack_map(data)
    if d.get("v", SUBMIT_SCHEMA) != SUBMIT_SCHEMA:
        raise BearError(ErrorCode.BAD_REQUEST, f"expected v={SUBMIT_SCHEMA}")
    qid = d.get("query_id")
    if not isinstance(qid, str) or not qid or len(qid) > 256:
        raise BearError(ErrorCode.BAD_REQUEST, "query_id must be a non-empty string (≤ 256 chars)")
    prompt, messages = d.get("prompt"), d.get("messages")
    if (prompt is None) == (messages is None):
        raise BearError(ErrorCode.BAD_REQUEST, "exactly one of prompt or messages is required")
    if prompt is not None and not isinstance(prompt, str):
        raise BearError(ErrorCode.BAD_REQUEST, "prompt must be a string")
    if messages is not None and (not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages)):
        raise BearError(ErrorCode.BAD_REQUEST, "messages must be a list of maps")

    def num(key: str, default: float, lo: float) -> float:
        v = d.get(key, default)
        if v is None:
            v = default
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < lo:
            raise BearError(ErrorCode.BAD_REQUEST, f"{key} must be a number ≥ {lo}")
        return float(v)

    pt = d.get("prompt_tokens")
    if pt is not None and (not isinstance(pt, int) or isinstance(pt, bool) or pt < 0):
        raise BearError(ErrorCode.BAD_REQUEST, "prompt_tokens must be a non-negative integer")
    sot = d.get("sim_output_tokens")
    if sot is not None and not (isinstance(sot, int) or isinstance(sot, dict)):
        raise BearError(ErrorCode.BAD_REQUEST, "sim_output_tokens must be an integer or a map model → integer")
    q = Query(query_id=qid, prompt=prompt, messages=messages,
              ttft_target_s=num("ttft_target_s", cfg.default_ttft_target_s, 0.0),
              max_tokens=int(num("max_tokens", cfg.default_max_tokens, 1)), lam=num("lam", cfg.lam, 0.0),
              prompt_tokens=pt, sim_output_tokens=sot)
    if len(q.text.encode()) > MAX_PROMPT_BYTES:
        raise BearError(ErrorCode.TOO_LARGE, f"prompt larger than {MAX_PROMPT_BYTES} bytes")
    return q


class ClientStream:
    """Messages to one client inbox; guarantees exactly one terminal message (done or error)."""

    def __init__(self, nc: Any, inbox: str, query_id: str) -> None:
        self.nc = nc
        self.inbox = inbox
        self.query_id = query_id
        self.finished = False

    async def send(self, msg: dict[str, Any]) -> None:
        if self.finished:
            return
        msg.setdefault("query_id", self.query_id)
        try:
            await self.nc.publish(self.inbox, pack(msg))
        except Exception as exc:  # NATS down: the client's own timeout makes the failure explicit
            log.warning("reply to client failed", query_id=self.query_id, error=str(exc))

    async def finish(self, msg: dict[str, Any]) -> None:
        await self.send(msg)
        self.finished = True

    async def error(self, code: ErrorCode, message: str, **extra: Any) -> None:
        m = error_reply(code, message)
        m.update(extra)
        await self.finish(m)


class RouterService:
    def __init__(self, nc: Any, config: RouterConfig | None = None, subjects: Subjects | None = None) -> None:
        self.nc = nc
        self.cfg = config or RouterConfig()
        self.subjects = subjects or Subjects()
        self.name = self.cfg.name or f"{os.uname().nodename}:{os.getpid()}:{id(self) & 0xFFFF:x}"
        self.policy: Policy = make_policy(self.cfg.policy, **self.cfg.policy_params)
        self.registry = Registry(nc, self.subjects, down_after_s=self.cfg.down_after_s, aliases=self.cfg.aliases)
        self.estimator = EstimatorClient(nc, self.subjects, try_timeout_s=self.cfg.estimate_try_s)
        self.dedup = Deduplicator(nc, f"{self.subjects.prefix}_queries", ttl_s=self.cfg.dedup_ttl_s,
                                  timeout_s=self.cfg.dedup_timeout_s)
        self.outcomes = OutcomeLog(self.cfg.outcome_log)
        self.m = self.outcomes.m
        self.local_pending: dict[str, int] = defaultdict(int)  # prompt tokens dispatched, no first token yet
        self.local_running: dict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Any = None
        self._session: Any = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        await self.registry.start()
        self._sub = await self.nc.subscribe(self.subjects.submit, queue="bear-router", cb=self._on_submit,
                                            pending_msgs_limit=65536)
        await self.nc.flush()
        log.info("router started", router=self.name, policy=self.policy.name, subject=self.subjects.submit)

    async def stop(self, drain_s: float = 5.0) -> None:
        """Stop taking queries, let those in flight finish (up to ``drain_s``), close."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=drain_s)
            await cancel_all(pending)
        await self.registry.stop()
        if self._session is not None:
            await self._session.close()
        self.outcomes.close()

    # ------------------------------------------------------------------ submit
    async def _on_submit(self, msg: Any) -> None:
        t0 = time.perf_counter()
        if not msg.reply:
            return  # nowhere to answer: a malformed publish
        if len(self._tasks) >= self.cfg.max_inflight:
            await ClientStream(self.nc, msg.reply, "").error(ErrorCode.OVERLOADED, "router at max_inflight")
            self.m.queries.labels(status="overloaded").inc()
            return
        task = asyncio.create_task(self._serve(msg.data, msg.reply, t0))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, data: bytes, inbox: str, t0: float) -> None:
        out = ClientStream(self.nc, inbox, "")
        self.m.inflight.inc()
        try:
            try:
                q = parse_submit(data, self.cfg)
            except BearError as exc:
                await out.error(exc.code, exc.message)
                self.m.queries.labels(status="bad_request").inc()
                return
            out.query_id = q.query_id
            await self._route(q, out, t0)
        except asyncio.CancelledError:
            await out.error(ErrorCode.UNAVAILABLE, "router shutting down")
            raise
        except Exception as exc:
            log.exception("routing failed", query_id=out.query_id)
            await out.error(ErrorCode.INTERNAL, repr(exc))
            self.m.queries.labels(status="internal").inc()
        finally:
            self.m.inflight.dec()
            if not out.finished:  # defensive: every accepted query ends in done or error
                await out.error(ErrorCode.INTERNAL, "no terminal message")

    async def _ask(self, q: Query, insts: list[InstanceInfo], ptoks: int) -> Asked:
        """The dedup claim, the predictor and the estimator, concurrently (three tasks, no nesting),
        each clocked where it finished."""
        models = sorted({i.predictor_model for i in insts})
        t = time.perf_counter()
        pred = ask_predictor(self.nc, self.subjects.predict, q.text, models, self.cfg.predict_budget_s,
                             try_timeout_s=self.cfg.predict_try_s, prompt_tokens=q.prompt_tokens,
                             query_id=q.query_id)
        est = ask_estimator(self.estimator, {"id": q.query_id, "prompt_tokens": ptoks, "max_tokens": q.max_tokens},
                            [i.id for i in insts], self.cfg.estimate_budget_s)
        (claimed, tc), (preds, tp), (rows, te) = await asyncio.gather(
            _clocked(self.dedup.claim(q.query_id, self.name)), _clocked(pred), _clocked(est))
        return Asked(claimed, preds, rows, claim_s=tc - t, predict_s=tp - t, estimate_s=te - t)

    def candidates(self, q: Query, insts: list[InstanceInfo], ptoks: int, preds: dict[str, ModelPrediction] | None,
                   rows: dict[str, Any] | None) -> tuple[list[Candidate], dict[str, ModelPrediction]]:
        """One Candidate per instance, built as ``evaluation.cluster.Cluster.candidates`` builds them."""
        now = time.time()
        cands, used = [], {}
        for inst in insts:
            p = preds.get(inst.predictor_model) if preds else None
            if p is None:
                p = fallback_prediction(ptoks, inst.price_in, inst.price_out, self.cfg.default_output_tokens)
            used[inst.id] = p
            theta = inst.theta or NOMINAL_THETA
            c = Candidate(instance=inst.id, model=inst.predictor_model, acc=p.acc, cost=p.cost_usd * MUSD,
                          out_len=p.out_len, out_p90=p.out_p90, prefill_tps=theta, tpot=inst.tpot,
                          throughput_rps=inst.throughput_rps(now))
            p50, p90 = inst.observed_percentiles()
            c.observed_ttft_p50, c.observed_ttft_p90 = p50, p90
            row = rows.get(inst.id) if rows else None
            if row is not None:
                c.n_running = int(row.get("n_running") or 0)
                c.n_waiting = int(row.get("n_waiting") or 0)
                c.pending_prefill_tokens = int(row.get("pending_prefill_tokens") or 0)
                c.pending_decode_tokens = float(row.get("pending_decode_tokens") or 0)
                ttft = row.get("ttft_s")
                c.ttft = float(ttft) if isinstance(ttft, int | float) else math.inf
                c.ttft_method = str(row.get("method", "none"))
                if isinstance(row.get("theta"), int | float) and row["theta"] > 0:
                    c.prefill_tps = float(row["theta"])
            else:  # estimator absent: eq. 8 over what this router has in flight there
                c.n_running = self.local_running[inst.id]
                c.pending_prefill_tokens = self.local_pending[inst.id]
                c.ttft = prefill_eq8(c.pending_prefill_tokens, ptoks, c.prefill_tps)
                c.ttft_method = "router-eq8"
            c.ttft_prefill = libbea.prefill_throughput_ttft(c.pending_prefill_tokens, ptoks, c.prefill_tps)
            cands.append(c)
        return cands, used

    async def _route(self, q: Query, out: ClientStream, t0: float) -> None:
        insts = self.registry.healthy()
        if not insts:
            await out.error(ErrorCode.UNAVAILABLE, "no healthy instance registered")
            self.m.queries.labels(status="unavailable").inc()
            return
        ptoks = q.token_estimate()
        # The dedup claim (a JetStream round trip) runs concurrently with the two questions.
        asked = await self._ask(q, insts, ptoks)
        claimed, preds, rows, waited = asked.claimed, asked.preds, asked.rows, asked.wait_s
        if not claimed:
            self.m.duplicates.inc()
            await out.error(ErrorCode.DUPLICATE, "query_id already submitted; not executed again")
            return
        fallbacks = []
        if preds is None:
            fallbacks.append("predictor")
            self.m.fallbacks.labels(kind="predictor").inc()
        if rows is None:
            fallbacks.append("estimator")
            self.m.fallbacks.labels(kind="estimator").inc()
        cands, used = self.candidates(q, insts, ptoks, preds, rows)
        ctx = QueryContext(q.query_id, q.ttft_target_s, q.lam, ptoks)
        excluded: set[str] = set()
        attempts: list[dict[str, Any]] = []
        for attempt in range(1, self.cfg.max_attempts + 1):
            live = [c for c in cands if c.instance not in excluded]
            if not live:
                break
            d = self.policy.decide(ctx, live)
            inst = self.registry.get(d.candidate.instance)
            p = used[inst.id]
            request_id = f"bear-{uuid.uuid4().hex}"
            prompt_tokens = p.prompt_tokens if p.source == "predictor" else ptoks
            predicted_out = int(max(1, round(min(p.out_len, q.max_tokens))))
            await self.nc.publish(self.subjects.dispatch(inst.id), pack({
                "query_id": q.query_id, "request_id": request_id, "prompt_tokens": prompt_tokens,
                "predicted_output_tokens": predicted_out, "t": time.time()}))
            decision_s = time.perf_counter() - t0
            if attempt == 1:
                self.m.decision.observe(decision_s)
                self.m.overhead.observe(max(0.0, decision_s - waited))
            self.m.routed.labels(instance=inst.id).inc()
            await out.send({"v": "bear.routed/1", "instance": inst.id, "model": inst.model,
                            "predictor_model": inst.predictor_model,
                            "predicted_ttft_s": _finite(self.policy.latency_estimate(d.candidate)),
                            "ttft_method": d.candidate.ttft_method, "feasible": d.feasible,
                            "policy": self.policy.name, "decision_s": decision_s, "attempt": attempt,
                            "backend": inst.backend})
            try:
                await self._stream(q, out, inst, d, p, request_id, ptoks, t0, decision_s, asked, fallbacks,
                                   cands, attempt)
                return
            except InstanceRefused as exc:
                # the request's own fault (too long, bad parameter): any instance would refuse it,
                # so neither another attempt nor a mark against this instance
                await out.error(exc.code, f"{inst.id} refused the query: {exc.reason}", instance=inst.id)
                self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": str(exc.code),
                                      "instance": inst.id, "policy": self.policy.name, "attempt": attempt,
                                      "http_status": exc.status, "reason": exc.reason,
                                      "target_s": q.ttft_target_s})
                return
            except InstanceUnavailable as exc:
                inst.failed_until = time.monotonic() + self.cfg.fail_backoff_s
                excluded.add(inst.id)
                attempts.append({"instance": inst.id, "error": str(exc)})
                log.warning("instance unavailable; trying another", instance=inst.id, query_id=q.query_id,
                            error=str(exc))
        await out.error(ErrorCode.UNAVAILABLE, f"no instance answered: {attempts}")
        self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": "unavailable",
                              "policy": self.policy.name, "attempts": attempts, "target_s": q.ttft_target_s})

    async def _stream(self, q: Query, out: ClientStream, inst: InstanceInfo, d: Decision, p: ModelPrediction,
                      request_id: str, ptoks: int, t0: float, decision_s: float, asked: Asked,
                      fallbacks: list[str], cands: list[Candidate], attempt: int) -> None:
        extra: dict[str, Any] = {}
        if inst.backend == "sim":
            if q.prompt_tokens is not None:
                extra["sim_prompt_tokens"] = max(1, q.prompt_tokens)
            sot = q.sim_output_tokens
            if isinstance(sot, dict):
                sot = sot.get(inst.predictor_model, sot.get(inst.model))
            if isinstance(sot, int) and sot > 0:
                extra["sim_output_tokens"] = sot
        path, body = request_body(inst.model, q.prompt, q.messages, q.max_tokens, extra)
        first: float | None = None
        usage: dict[str, int] = {}
        finish = None
        seq = 0
        self.local_pending[inst.id] += ptoks
        self.local_running[inst.id] += 1
        pending_open = True
        try:
            async for piece in stream_completion(self._session, inst.base_url, request_id, path, body,
                                                 connect_timeout_s=self.cfg.connect_timeout_s,
                                                 idle_timeout_s=self.cfg.idle_timeout_s):
                if piece.text:
                    if first is None:
                        first = time.perf_counter()
                        self.local_pending[inst.id] -= ptoks
                        pending_open = False
                    await out.send({"v": "bear.chunk/1", "seq": seq, "text": piece.text})
                    seq += 1
                if piece.usage:
                    usage = piece.usage
                if piece.finish_reason:
                    finish = piece.finish_reason
        except StreamBroken as exc:
            await out.error(ErrorCode.UNAVAILABLE, f"instance stream failed mid-answer: {exc}", instance=inst.id)
            self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": "broken",
                                  "instance": inst.id, "policy": self.policy.name, "target_s": q.ttft_target_s})
            return
        finally:
            if pending_open:
                self.local_pending[inst.id] -= ptoks
            self.local_running[inst.id] -= 1
        end = time.perf_counter()
        if first is None:  # an empty answer: the first (and only) token is the end of the stream
            first = end
        ttft = first - t0
        n_out = int(usage.get("completion_tokens", seq))
        n_in = int(usage.get("prompt_tokens", p.prompt_tokens))
        cost_musd = n_in * inst.price_in + n_out * inst.price_out
        utility = p.acc - q.lam * cost_musd
        on_time = ttft <= q.ttft_target_s
        tpot = (end - first) / (n_out - 1) if n_out > 1 else None
        with contextlib.suppress(Exception):
            await self.nc.publish(f"{self.subjects.prefix}.outcome.{inst.id}", pack({
                "v": "bear.outcome/1", "instance": inst.id, "ttft_s": ttft, "tpot_s": tpot, "completed": True,
                "t": time.time()}))
        predicted = self.policy.latency_estimate(d.candidate)
        await out.finish({"v": "bear.done/1", "instance": inst.id, "model": inst.model,
                          "predictor_model": inst.predictor_model, "ttft_s": ttft, "target_s": q.ttft_target_s,
                          "on_time": on_time, "utility": utility, "predicted_utility": d.candidate.utility(q.lam),
                          "predicted_ttft_s": _finite(predicted), "usage": usage, "finish_reason": finish,
                          "decision_s": decision_s})
        self.outcomes.record({
            "query_id": q.query_id, "t": time.time(), "status": "done", "policy": self.policy.name,
            "router": self.name, "instance": inst.id, "model": inst.model, "predictor_model": inst.predictor_model,
            "target_s": q.ttft_target_s, "lam": q.lam, "prompt_tokens": ptoks, "max_tokens": q.max_tokens,
            "predicted_ttft_s": predicted, "ttft_method": d.candidate.ttft_method, "feasible": d.feasible,
            "observed_ttft_s": ttft, "on_time": on_time, "utility": utility,
            "predicted_utility": d.candidate.utility(q.lam), "decision_s": decision_s, "wait_s": asked.wait_s,
            "predict_s": asked.predict_s, "estimate_s": asked.estimate_s, "claim_s": asked.claim_s,
            "fallbacks": fallbacks, "attempt": attempt, "usage": usage, "request_id": request_id,
            "candidates": {c.instance: {
                "model": c.model, "acc": c.acc, "cost": c.cost, "out_len": c.out_len, "out_p90": c.out_p90,
                "ttft": c.ttft, "method": c.ttft_method, "ttft_prefill": c.ttft_prefill, "n_running": c.n_running,
                "n_waiting": c.n_waiting, "pending_prefill_tokens": c.pending_prefill_tokens,
                "pending_decode_tokens": c.pending_decode_tokens, "prefill_tps": c.prefill_tps, "tpot": c.tpot,
                "throughput_rps": c.throughput_rps, "observed_ttft_p50": c.observed_ttft_p50,
                "observed_ttft_p90": c.observed_ttft_p90, "score": d.scores.get(c.instance)}
                for c in cands},
        })


@dataclass
class Asked:
    """What ``_ask`` got, and when each answer was in (seconds after the questions went out)."""

    claimed: bool
    preds: dict[str, ModelPrediction] | None
    rows: dict[str, Any] | None
    claim_s: float
    predict_s: float
    estimate_s: float

    @property
    def wait_s(self) -> float:
        """The wait for the predictor and the estimator (the claim excluded)."""
        return max(self.predict_s, self.estimate_s)


async def _clocked(aw: Any) -> tuple[Any, float]:
    return await aw, time.perf_counter()


def _finite(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


async def serve(nats_url: str, cfg: RouterConfig, prefix: str = "bear", ready: Any = None) -> None:
    """Process main of ``bear router``: runs until SIGINT/SIGTERM, then drains."""
    import signal

    nc = await connect(nats_url, f"bear-router-{os.getpid()}")
    router = RouterService(nc, cfg, Subjects(prefix))
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    await router.stop()
    await close_nats(nc)
    log.info("router stopped", router=router.name)
