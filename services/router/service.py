"""The router (``bear router``): subscribes to ``bear.submit`` in queue group ``bear-router``;
per query it asks the predictor and the estimator concurrently (deadlines, fallbacks), builds one
``Candidate`` per healthy instance (``router.candidates``, which ``bear eval`` calls too), lets the
policy pick, publishes ``bear.dispatch.<instance>``, streams the instance's answer to the client's inbox and logs the
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

from bear.estimator.client import EstimatorClient
from bear.protocol.codec import pack, unpack_map
from bear.protocol.errors import BearError, ErrorCode, error_reply
from bear.protocol.messages import EstimateQuery, EstimateRow, Outcome, encode
from bear.protocol.subjects import Subjects
from bear.router.candidates import LocalLoad, ModelPrediction, build_candidates, dispatch_for
from bear.router.dedup import Deduplicator
from bear.router.dispatch import InstanceUnavailable, StreamBroken, request_body, stream_completion
from bear.router.outcomes import OutcomeLog
from bear.router.policies import Candidate, Decision, Policy, QueryContext, make_policy
from bear.router.predict import ask_estimator, ask_predictor
from bear.router.registry import InstanceInfo, Registry
from bear.runtime.service import connect, stop_event
from bear.runtime.shutdown import cancel_all, close_nats

log = structlog.get_logger("bear.router")

SUBMIT_SCHEMA = "bear.submit/1"
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
    q = Query(query_id=qid, prompt=prompt, messages=messages,
              ttft_target_s=num("ttft_target_s", cfg.default_ttft_target_s, 0.0),
              max_tokens=int(num("max_tokens", cfg.default_max_tokens, 1)), lam=num("lam", cfg.lam, 0.0),
              prompt_tokens=pt)
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
        self.dedup = Deduplicator(nc, self.subjects.queries_bucket, ttl_s=self.cfg.dedup_ttl_s,
                                  timeout_s=self.cfg.dedup_timeout_s)
        self.outcomes = OutcomeLog(self.cfg.outcome_log)
        self.m = self.outcomes.m
        self.local = LocalLoad(defaultdict(int), defaultdict(int))  # in flight here: the eq. 8 fallback
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
        est = ask_estimator(self.estimator, EstimateQuery(id=q.query_id, prompt_tokens=ptoks, max_tokens=q.max_tokens),
                            [i.id for i in insts], self.cfg.estimate_budget_s)
        (claimed, tc), (preds, tp), (reply, te) = await asyncio.gather(
            _clocked(self.dedup.claim(q.query_id, self.name)), _clocked(pred), _clocked(est))
        rows = {row.instance: row for row in reply.estimates} if reply is not None else None
        return Asked(claimed, preds, rows, claim_s=tc - t, predict_s=tp - t, estimate_s=te - t,
                     estimated_at=reply.at if reply is not None else None)

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
        asked.decided_at = time.time()
        cands, used = build_candidates(ptoks, insts, preds, rows, asked.decided_at,
                                       default_output_tokens=self.cfg.default_output_tokens, local=self.local)
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
            await self.nc.publish(self.subjects.dispatch(inst.id),
                                  encode(dispatch_for(q.query_id, request_id, p, q.max_tokens, time.time())))
            decision_s = time.perf_counter() - t0
            if attempt == 1:
                self.m.decision.observe(decision_s)
                self.m.overhead.observe(max(0.0, decision_s - waited))
            self.m.routed.labels(instance=inst.id).inc()
            await out.send({"v": "bear.routed/1", "instance": inst.id, "model": inst.model,
                            "predictor_model": inst.predictor_model,
                            "predicted_ttft_s": _finite(self.policy.latency_estimate(d.candidate)),
                            "ttft_method": d.candidate.ttft_method, "feasible": d.feasible,
                            "policy": self.policy.name, "decision_s": decision_s, "attempt": attempt})
            try:
                await self._stream(q, out, inst, d, p, request_id, ptoks, t0, decision_s, asked, fallbacks,
                                   cands, attempt)
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
        path, body = request_body(inst.model, q.prompt, q.messages, q.max_tokens, {})
        first: float | None = None
        usage: dict[str, int] = {}
        finish = None
        seq = 0
        local = self.local
        local.pending_prefill_tokens[inst.id] += ptoks
        local.running[inst.id] += 1
        pending_open = True
        try:
            async for piece in stream_completion(self._session, inst.base_url, request_id, path, body,
                                                 connect_timeout_s=self.cfg.connect_timeout_s,
                                                 idle_timeout_s=self.cfg.idle_timeout_s):
                if piece.text:
                    if first is None:
                        first = time.perf_counter()
                        local.pending_prefill_tokens[inst.id] -= ptoks
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
                local.pending_prefill_tokens[inst.id] -= ptoks
            local.running[inst.id] -= 1
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
            await self.nc.publish(self.subjects.outcome(inst.id), encode(Outcome(
                instance=inst.id, ttft_s=ttft, tpot_s=tpot, completed=True, t=time.time())))
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
            "decided_at": asked.decided_at, "estimated_at": asked.estimated_at,
            "predict_s": asked.predict_s, "estimate_s": asked.estimate_s, "claim_s": asked.claim_s,
            "fallbacks": fallbacks, "attempt": attempt, "usage": usage, "request_id": request_id,
            "candidates": {c.instance: {
                "model": c.model, "acc": c.acc, "cost": c.cost, "out_len": c.out_len, "out_p90": c.out_p90,
                "ttft": c.ttft, "method": c.ttft_method, "ttft_prefill": c.ttft_prefill, "n_running": c.n_running,
                "n_waiting": c.n_waiting, "pending_prefill_tokens": c.pending_prefill_tokens,
                "pending_decode_tokens": c.pending_decode_tokens, "prefill_tps": c.prefill_tps, "tpot": c.tpot,
                "throughput_rps": c.throughput_rps, "observed_ttft_p50": c.observed_ttft_p50,
                "observed_ttft_p90": c.observed_ttft_p90, "observed_ttft_p95": c.observed_ttft_p95,
                "observed_tpot_p90": c.observed_tpot_p90, "score": d.scores.get(c.instance)}
                for c in cands},
        })


@dataclass
class Asked:
    """What ``_ask`` got, and when each answer was in (seconds after the questions went out)."""

    claimed: bool
    preds: dict[str, ModelPrediction] | None
    rows: dict[str, EstimateRow] | None
    claim_s: float
    predict_s: float
    estimate_s: float
    estimated_at: float | None = None  # the estimator's clock for its rows
    decided_at: float = 0.0  # this router's clock when it built the candidates

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
    nc = await connect(nats_url, f"bear-router-{os.getpid()}")
    router = RouterService(nc, cfg, Subjects(prefix))
    await router.start()
    stop = stop_event()
    if ready is not None:
        ready.set()
    await stop.wait()
    await router.stop()
    await close_nats(nc)
    log.info("router stopped", router=router.name)
