"""The router (``bear router``): subscribes to ``bear.submit`` in queue group ``bear-router``
and serves each query as a pipeline of small parts:

* session and admission — ``router.admission`` sheds before the parse, ``router.query`` decodes
  the submit once, ``router.cancels`` keeps the cancels heard;
* the decision — ``router.decide.screen`` drops the instances the registry rules out (model,
  health, context); the predictor and, when the decision reads its rows, the estimator are asked
  concurrently (``router.predict``: deadlines, fallbacks; the query is tokenised once per
  tokenizer its candidates use, off the event loop, so the estimator gets exact prompt lengths and
  the ids it finds prefix-cache hits with); ``router.candidates`` builds the candidates and
  ``router.decide.decide`` runs the request filters, then the policy (``bear eval`` calls the same);
* streaming — ``bear.dispatch.<instance>`` is published, the instance's answer relayed to the
  client's inbox (``router.client_stream``: exactly one terminal message, sent again after a
  reconnect), the outcome logged; an instance that does not answer is retried once elsewhere.

Routers share nothing but NATS. Protocol and decisions: docs/router.md."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import structlog
from msgspec import UNSET

from bear.estimator.client import EstimatorClient
from bear.protocol.engine_fields import priority as engine_priority
from bear.protocol.engine_fields import (
    renders_own_prompt,
    sequences,
)
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import (
    Calibration,
    Dispatch,
    EstimateCandidate,
    EstimatePart,
    EstimateQuery,
    EstimateReply,
    EstimateRow,
    Outcome,
    encode,
)
from bear.protocol.replies import Chunk, Done, Routed
from bear.protocol.subjects import Subjects
from bear.protocol.token_ids import count
from bear.router.admission import Admission
from bear.router.cancels import Cancels
from bear.router.candidates import (
    LocalLoad,
    ModelPrediction,
    bare_candidate,
    build_candidates,
    dispatch_for,
    dispatch_tokens,
    prediction_at,
)
from bear.router.client_stream import AnswerKeeper, ClientStream, TerminalResender
from bear.router.config import RouterConfig
from bear.router.decide import Refused, decide, profile_for, screen
from bear.router.dedup import Deduplicator
from bear.router.dispatch import (
    InstanceRefused,
    InstanceUnavailable,
    StreamBroken,
    engine_session,
    request_body,
    stream_completion,
)
from bear.router.fairshare import Shares, identity_of
from bear.router.outcomes import OutcomeLog
from bear.router.policies import Candidate, Decision, Policy, QueryContext, make_policy
from bear.router.predict import ask_estimator, ask_predictor
from bear.router.query import Query, parse_submit, peek_deadline, peek_ids
from bear.router.registry import InstanceInfo, Registry
from bear.router.reply_bounds import ReplyGuard
from bear.router.selection import Cheap, SelectionConfig, select
from bear.router.sequencer import Pending, Reservations, Sequencer
from bear.router.takeover import Liveness
from bear.runtime import tracing
from bear.runtime.service import connect, stop_event
from bear.runtime.shutdown import cancel_all, close_nats
from bear.tokenizer.cache import TokenizerCache

log = structlog.get_logger("bear.router")

DISPATCH_MARGIN_S = 0.05  # a query is not dispatched this close to its client's deadline
MAX_PRIMED_CHARS = 1 << 20  # a longer answer is not encoded ahead of the next turn
WRITE_YIELDS = 4  # loop turns given to nats-py's flusher before tokenising (one suffices: it is next in line)


class RouterService:
    def __init__(self, nc: Any, config: RouterConfig | None = None, subjects: Subjects | None = None) -> None:
        self.nc = nc
        self.cfg = config or RouterConfig()
        self.subjects = subjects or Subjects()
        self.name = self.cfg.name or f"{os.uname().nodename}:{os.getpid()}:{id(self) & 0xFFFF:x}"
        self.policy: Policy = make_policy(self.cfg.policy, **self.cfg.policy_params)
        self.profile = profile_for(self.policy)  # the request filters, then the policy (bear.router.decide)
        self.registry = Registry(nc, self.subjects, down_after_s=self.cfg.down_after_s, aliases=self.cfg.aliases,
                                 allowed_base_urls=self.cfg.allowed_base_urls, provisioning=self.cfg.provisioning)
        self.admission = Admission(max_inflight=self.cfg.max_inflight, max_deciding=self.cfg.max_deciding,
                                   shed_lag_s=self.cfg.shed_lag_s, shares=Shares(
                                       self.cfg.identity_weights, self.cfg.identity_limits,
                                       default_weight=self.cfg.identity_weight,
                                       default_limit=self.cfg.identity_limit))
        shards = max(1, self.cfg.estimator_shards)
        # replies no real predictor or estimator sends are refused and counted (a leaked credential: issue 40)
        self.guard = ReplyGuard(calibration_of=self._calibration_of)
        self.estimators = [EstimatorClient(nc, self.subjects, try_timeout_s=self.cfg.estimate_try_s,
                                           subject=self.subjects.estimate_shard(k, shards),
                                           check=self.guard.estimate_check) for k in range(shards)]
        self.dedup = Deduplicator(nc, self.subjects.queries_bucket, ttl_s=self.cfg.dedup_ttl_s,
                                  timeout_s=self.cfg.dedup_timeout_s)
        self.registry.store_failing = lambda: self.dedup.failing  # heartbeats stale for JetStream's sake (issue 40)
        self.tokenizers = TokenizerCache(nc, self.subjects.tokenizers_bucket, sources=lambda bid: [
            i.id for i in self.registry.instances.values() if i.tokenizer == bid])
        if self.cfg.tokenize:
            self.registry.on_tokenizer = lambda tid: self.tokenizers.want([tid])
        self.outcomes = OutcomeLog(self.cfg.outcome_log)
        self.m = self.outcomes.m
        self.local = LocalLoad(defaultdict(int), defaultdict(int))  # in flight here: the eq. 8 fallback
        # the cheap first stage over large pools (bear.router.selection), and each instance's last
        # estimate row (monotonic time, row): its queued prefill is the stage's load signal
        self.selection = (SelectionConfig(k_max=self.cfg.selection_k_max,
                                          k_min=min(self.cfg.selection_k_min, self.cfg.selection_k_max))
                          if self.cfg.selection_k_max > 0 else None)
        self._last_rows: dict[str, tuple[float, EstimateRow]] = {}
        # this router's recent dispatches, sent with every estimate; decisions in order (the sequencer)
        self.reservations = Reservations(keep_s=self.cfg.reserve_s)
        self.sequencer = (Sequencer(self.reservations, monotone=self.policy.monotone, chain=self.cfg.sequence_chain,
                                    ask_parts=self._ask_parts)
                          if self.cfg.sequence and self.profile.needs_estimate else None)
        self._tasks: set[asyncio.Task[None]] = set()
        self._by_query: dict[str, asyncio.Task[None]] = {}  # query_id → the task serving it here
        self._inboxes: dict[str, str] = {}  # query_id → its answer's inbox, while served here
        self.cancels = Cancels()
        self._sub: Any = None
        self._client_sub: Any = None
        self._cancel_sub: Any = None
        self.refused_replies = 0  # submits whose reply subject is not the submitter's own inbox
        self._refused_logged = -1e9  # monotonic time of the last warning about them
        self._session: Any = None
        self._lag_task: asyncio.Task[None] | None = None
        self._resend_task: asyncio.Task[None] | None = None
        self.resender = TerminalResender(nc, self.subjects.terminals_bucket)  # terminals again after a reconnect
        self.keeper = AnswerKeeper(nc)  # the chunks relayed, for a client that missed some (bear.resend/1)
        self.liveness = Liveness(nc, self.subjects, self.name)  # alive probes: takeovers (bear.router.takeover)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._session = engine_session()
        await self.registry.start()
        await self._registry_loaded()
        self._lag_task = asyncio.create_task(self.admission.watch_loop())
        self._resend_task = asyncio.create_task(self.resender.run())
        self._sub = await self.nc.subscribe(self.subjects.submit, queue="bear-router", cb=self._on_submit,
                                            pending_msgs_limit=65536)
        # bear.submit.<client>: only that identity may publish there, and it is answered only into
        # its own inbox (Subjects.reply_owner)
        self._client_sub = await self.nc.subscribe(self.subjects.submit_all, queue="bear-router",
                                                   cb=self._on_submit, pending_msgs_limit=65536)
        # every router hears every cancel (no queue group): only the one serving the query acts
        self._cancel_sub = await self.nc.subscribe(self.subjects.cancel, cb=self._on_cancel, pending_msgs_limit=65536)
        await self.liveness.start()
        await self.nc.flush()
        log.info("router started", router=self.name, policy=self.policy.name, subject=self.subjects.submit)

    async def _registry_loaded(self) -> None:
        """Until the registry's initial entries (and bindings, with provisioning) are in, or
        ``registry_wait_s``: before that every query would be refused for want of instances."""
        events = [self.registry.loaded, *([self.registry.provisioned_loaded] if self.registry.provisioning else [])]
        try:
            async with asyncio.timeout(self.cfg.registry_wait_s):
                for e in events:
                    await e.wait()
        except TimeoutError:
            log.warning("registry not loaded; taking queries anyway", router=self.name, waited_s=self.cfg.registry_wait_s)

    async def stop(self, drain_s: float = 5.0) -> None:
        """Stop taking queries, let those in flight finish (up to ``drain_s``), close."""
        for sub in (self._sub, self._client_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        if self._cancel_sub is not None:
            with contextlib.suppress(Exception):
                await self._cancel_sub.unsubscribe()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=drain_s)
            await cancel_all(pending)
        await self.registry.stop()
        if self.sequencer is not None:
            await self.sequencer.stop()
        await cancel_all([t for t in (self._lag_task, self._resend_task) if t is not None])
        await self.liveness.stop()
        await self.tokenizers.close()
        if self._session is not None:
            await self._session.close()
        self.outcomes.close()

    # ------------------------------------------------------------------ submit
    async def _on_submit(self, msg: Any) -> None:
        t0 = time.perf_counter()
        if not msg.reply:
            return  # nowhere to answer: a malformed publish
        client = self.subjects.reply_owner(msg.subject, msg.reply)
        if client is None:  # not the submitter's own inbox: answered nowhere (issue 26)
            self._refuse_reply(msg.subject, msg.reply)
            return
        ident = identity_of(client, msg.headers, self.cfg.fair_relays)  # whose share it counts in
        refusal = self.admission.refuse(len(self._tasks), peek_deadline(msg.data), time.time(), ident)
        if refusal is not None:
            self.m.loop_lag.set(self.admission.lag)
            qid, nonce = peek_ids(msg.data)
            await ClientStream(self.nc, msg.reply, qid, nonce=nonce,
                               terminals=self.subjects.terminals_bucket).error(refusal.code, refusal.message)
            self.m.shed.labels(reason=refusal.reason).inc()
            # in the outcome log too (counted there in bear_router_queries_total): what a client was
            # refused is read beside what was served, not only in the metrics
            self.outcomes.record({"query_id": qid, "t": time.time(), "status": str(refusal.code),
                                  "reason": refusal.message, "admission": refusal.reason, "client": ident})
            return
        self.admission.deciding += 1
        self.admission.fair.add(ident)
        task = asyncio.create_task(self._serve(msg.data, msg.reply, t0, msg.headers, client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _t: self.admission.fair.remove(ident))

    def _refuse_reply(self, subject: str, reply: str) -> None:
        """A submit whose reply subject is not below its submitter's inbox prefix (a service's
        subject, a bucket, another client's inbox): counted, one warning line per 10 s."""
        self.refused_replies += 1
        self.m.queries.labels(status="reply_refused").inc()
        now = time.monotonic()
        if now - self._refused_logged >= 10.0:
            self._refused_logged = now
            log.warning("submit refused: its reply subject is not the submitter's own inbox", subject=subject[:128],
                        reply=reply[:128], refused_so_far=self.refused_replies)

    async def _on_cancel(self, msg: Any) -> None:
        """``bear.cancel/1``: remembered (``router.cancels``); the query aborted if served here.
        ``bear.resend/1`` (the same subject): the chunks asked for sent again, if kept here."""
        qid = self.cancels.hear(msg.data)
        if qid is None:
            await self.keeper.hear(msg.data)
            return
        task = self._by_query.get(qid) if qid is not None else None
        if task is not None and self.cancels.cancelled(qid, self._inboxes.get(qid, "")):
            task.cancel()

    def _record_cancelled(self, q: Query, **extra: Any) -> None:
        self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": "cancelled", "policy": self.policy.name,
                              "router": self.name, "target_s": q.ttft_target_s, **extra})

    async def _serve(self, data: bytes, inbox: str, t0: float, headers: dict[str, str] | None = None,
                     client: str = "") -> None:
        out = ClientStream(self.nc, inbox, "", self.resender.recent, terminals=self.subjects.terminals_bucket,
                           keeper=self.keeper)
        self.m.inflight.inc()
        q: Query | None = None
        try:
            try:
                q = parse_submit(data, self.cfg)
            except BearError as exc:
                out.query_id, out.nonce = peek_ids(data)  # a bad_request answer still carries them
                await out.error(exc.code, exc.message)
                self.m.queries.labels(status="bad_request").inc()
                return
            out.query_id, out.nonce = q.query_id, q.nonce
            q.inbox, q.client = inbox, client
            if self.cancels.cancelled(q.query_id, inbox):  # the client gave up before it got here
                out.finished = True
                self._record_cancelled(q)
                return
            if self._by_query.setdefault(q.query_id, asyncio.current_task()) is asyncio.current_task():  # type: ignore[arg-type]
                self._inboxes[q.query_id] = inbox
            with tracing.child("router.query", headers, kind="server", query_id=q.query_id) as span:
                q.trace = span.headers
                await self._route(q, out, t0)
        except asyncio.CancelledError:
            if q is not None and self.cancels.cancelled(q.query_id, inbox):  # the client cancelled: nobody to answer
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                out.finished = True
                self._record_cancelled(q, instance=q.served_by)
                return
            await out.error(ErrorCode.UNAVAILABLE, "router shutting down")
            raise
        except Exception as exc:
            log.exception("routing failed", query_id=out.query_id)
            await out.error(ErrorCode.INTERNAL, repr(exc))
            self.m.queries.labels(status="internal").inc()
        finally:
            self.m.inflight.dec()
            if q is None or q.deciding:
                self.admission.deciding = max(0, self.admission.deciding - 1)
            if q is not None and self._by_query.get(q.query_id) is asyncio.current_task():
                del self._by_query[q.query_id]
                self._inboxes.pop(q.query_id, None)
            if not out.finished:  # defensive: every accepted query ends in done or error
                await out.error(ErrorCode.INTERNAL, "no terminal message")

    async def _tokenize(self, q: Query, insts: list[InstanceInfo]) -> dict[str, bytes]:
        """The query's token ids per tokenizer of its candidates, packed (those loaded; {} when none,
        or when engine fields such as tools change the prompt the engine renders)."""
        if q.prompt_ids is not None:  # the client's ids: the engine's, whatever its tokenizer
            return {i.tokenizer: q.prompt_ids for i in insts if i.tokenizer}
        if not self.cfg.tokenize or renders_own_prompt(q.engine):
            return {}
        ids = [i.tokenizer for i in insts if i.tokenizer]
        if not ids:
            return {}
        self.tokenizers.want(ids)
        await self._requests_written()
        try:
            return await self.tokenizers.encode(ids, q.prompt, q.messages)
        except Exception as exc:  # a tokenizer that fails on this input: lengths are estimated
            log.warning("tokenize failed", query_id=q.query_id, error=repr(exc))
            return {}

    def _calibration_of(self, instance: str) -> Calibration | None:
        """This router's calibration of ``instance`` (None: not registered): the estimate floor's."""
        info = self.registry.instances.get(instance)
        return info.calibration if info is not None else None

    async def _requests_written(self) -> None:
        """Let the claim and predictor requests just published reach the socket before the loop
        is busy tokenising (nats-py writes them from its flusher task, which runs only when the
        loop is free): so the predictor works while the router tokenises, not after."""
        for _ in range(WRITE_YIELDS):
            if not getattr(self.nc, "pending_data_size", 0):
                return
            await asyncio.sleep(0)

    async def _ask(self, q: Query, insts: list[InstanceInfo], ptoks: int, estimate: bool = True,
                   claimed: bool = False) -> Asked:
        """The dedup claim, the predictor and the estimator, concurrently (three tasks, no nesting),
        each clocked where it finished; the estimator after the tokenisation (its input), and only
        with ``estimate`` (the decision reads its rows); ``claimed``: the claim is this router's already
        (a takeover)."""
        models = sorted({i.predictor_model for i in insts})
        t = time.perf_counter()
        pred = _traced("router.predict", q.trace, lambda h: ask_predictor(
            self.nc, self.subjects.predict, q.text, models, self.cfg.predict_budget_s,
            try_timeout_s=self.cfg.predict_try_s, prompt_tokens=q.prompt_tokens, query_id=q.query_id, headers=h,
            guard=self.guard))
        tokens: dict[str, bytes] = {}
        tokenize_s = 0.0
        est_cands: list[EstimateCandidate] = []
        est_query: EstimateQuery | None = None
        versions: dict[str, int] = {}
        sent = t

        async def tokenize_then_estimate() -> Any:
            nonlocal tokens, tokenize_s
            t_tok = time.perf_counter()
            tokens = await self._tokenize(q, insts)
            tokenize_s = time.perf_counter() - t_tok
            if not estimate:
                return None
            nonlocal est_cands, est_query, versions, sent
            est_cands = [EstimateCandidate(instance=i.id, tokenizer=i.tokenizer, prompt_tokens=count(tokens[i.tokenizer]))
                         if i.tokenizer in tokens else EstimateCandidate(instance=i.id) for i in insts]
            est_query = EstimateQuery(id=q.query_id, prompt_tokens=ptoks, max_tokens=q.max_tokens,
                                      priority=engine_priority(q.engine), sequences=sequences(q.engine),
                                      skip_reading_prefix_cache=q.skips_prefix_cache)
            ids = [i.id for i in insts]
            versions, sent = self.reservations.versions(ids), time.perf_counter()
            ahead = self.reservations.at(ids, time.time())
            return await _traced("router.estimate", q.trace, lambda h: ask_estimator(
                self.estimators, est_query, est_cands, self.cfg.estimate_budget_s, headers=h, tokens=tokens,
                ahead=ahead))

        (claimed, tc), (preds, tp), (reply, te) = await asyncio.gather(
            _clocked(_already() if claimed else self.dedup.claim(q.query_id, self.name, q.client)), _clocked(pred),
            _clocked(tokenize_then_estimate()))
        rows = {row.instance: row for row in reply.estimates} if reply is not None else None
        exact = {i.id: count(tokens[i.tokenizer]) for i in insts if i.tokenizer in tokens}
        return Asked(claimed, preds, rows, claim_s=tc - t, predict_s=tp - t, estimate_s=te - t,
                     estimated_at=reply.at if reply is not None else None, exact_tokens=exact, tokenize_s=tokenize_s,
                     tokens=tokens,
                     estimator_service_s=reply.service_s if reply is not None else None,
                     reply=reply, est_query=est_query, est_cands=est_cands, versions=versions, estimate_sent=sent)

    def _context(self, q: Query, ptoks: int) -> QueryContext:
        """What the decision knows of ``q``: the tokens it needs in a context are the client's
        prompt length (0 when it gave none: the estimate from the text is not refused on) and its
        ``max_tokens`` (one token of a ``max_tokens_rest`` query)."""
        need = (q.prompt_tokens or 0) + (1 if q.rest_of_context else q.max_tokens)
        return QueryContext(q.query_id, q.ttft_target_s, q.lam, ptoks, session=q.session, model=q.model,
                            context_tokens=need, deadline=q.deadline)

    async def _refuse(self, q: Query, out: ClientStream, r: Refused, **extra: Any) -> None:
        """The coded error of a query no candidate is left for, and its record."""
        await out.error(r.code, r.message)
        if r.filter == "deadline":
            self.m.shed.labels(reason="pool_deadline").inc()
        self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": str(r.code), "reason": r.message,
                              "filter": r.filter, "dropped": r.dropped, "policy": self.policy.name,
                              "target_s": q.ttft_target_s, "deadline": q.deadline, **extra})

    async def _take_over(self, q: Query, out: ClientStream) -> bool:
        """A takeover resubmission (``bear.router.takeover``): True when the query is now this
        router's to run; else its reply sent (``duplicate`` while its router lives, ``incomplete``
        when that router is gone after some of the answer reached the client)."""
        verdict, held_by = await self.dedup.take_over(q.query_id, self.name, q.client, self.liveness.gone)
        if verdict == "taken" and not q.takeover:
            q.taken_over_from = held_by
            self.m.takeovers.labels(outcome="run").inc()
            return True
        if verdict == "taken":
            self.m.takeovers.labels(outcome="incomplete").inc()
            await out.error(ErrorCode.INCOMPLETE, f"the router relaying this answer ({held_by}) is gone after "
                                                  f"{q.takeover} chunks reached the client; its engine request ended "
                                                  "with it: submit the query again")
            return False
        await self._duplicate(out)
        return False

    async def _duplicate(self, out: ClientStream) -> None:
        self.m.duplicates.inc()
        await out.error(ErrorCode.DUPLICATE, "query_id already submitted; not executed again")

    async def _route(self, q: Query, out: ClientStream, t0: float) -> None:
        if q.takeover is not None and not await self._take_over(q, out):
            return
        healthy = {i.id for i in self.registry.healthy()}
        ptoks = q.token_estimate()  # once per query: it encodes the whole text
        ctx = self._context(q, ptoks)
        # the filters that read only the registry, before anything is asked about the instances
        dropped: dict[str, str] = {}
        kept = screen(self.profile.registry_filters, ctx, [
            bare_candidate(i, i.id in healthy) for i in sorted(self.registry.instances.values(), key=lambda i: i.id)],
            time.time(), dropped)
        if isinstance(kept, Refused):
            await self._refuse(q, out, kept)
            return
        insts = [self.registry.get(c.instance) for c in kept]
        estimate = self.profile.needs_estimate
        selection = None
        if self.selection is not None and estimate:  # only the instances worth a replay are asked about
            selection = select([self._cheap(i, ptoks) for i in insts], self.selection)
            if selection.replayed < len(insts):
                chosen = set(selection.replay)
                insts = [i for i in insts if i.id in chosen]
        if q.rest_of_context and all(i.max_model_len for i in insts):
            q.max_tokens = max(q.max_tokens_at(i.max_model_len, ptoks) or 1 for i in insts)
        # The dedup claim (a JetStream round trip) runs concurrently with the two questions.
        asked = await self._ask(q, insts, ptoks, estimate, claimed=q.taken_over_from is not None)
        asked.selection = selection.record() if selection is not None else None
        if selection is not None and asked.rows:  # the rows' queues: the next selection's load signal
            seen = time.monotonic()
            for row in asked.rows.values():
                self._last_rows[row.instance] = (seen, row)
        claimed, preds, rows, waited = asked.claimed, asked.preds, asked.rows, asked.wait_s
        if not claimed:
            await self._duplicate(out)
            return
        fallbacks = []
        if preds is None:
            fallbacks.append("predictor")
            self.m.fallbacks.labels(kind="predictor").inc()
        if rows is None and estimate:
            fallbacks.append("estimator")
            self.m.fallbacks.labels(kind="estimator").inc()
        asked.decided_at = time.time()
        elapsed = (asked.estimate_sent if rows is not None else time.perf_counter()) - t0  # in the router before it
        cands, used = build_candidates(ptoks, insts, preds, rows, asked.decided_at,
                                       default_output_tokens=self.cfg.default_output_tokens, local=self.local,
                                       exact_tokens=asked.exact_tokens, sequences=sequences(q.engine),
                                       elapsed_s=elapsed)
        excluded: set[str] = set()
        attempts: list[dict[str, Any]] = []
        for attempt in range(1, self.cfg.max_attempts + 1):
            live = [c for c in cands if c.instance not in excluded]
            if not live:
                break
            request_id = f"bear-{uuid.uuid4().hex}"
            d: Decision | Refused | None = None
            if not self._deadline_passed(q):
                if attempt == 1 and self.sequencer is not None and asked.reply is not None:
                    # in order behind the decisions before it; the dispatch is published in turn
                    d, cands, used = await self._decide_in_order(q, ctx, insts, ptoks, asked, dropped, request_id, t0)
                else:
                    d = decide(self.profile, ctx, live, asked.decided_at if attempt == 1 else time.time(), dropped)
                    if not isinstance(d, Refused):
                        await self._publish(q, d, used, asked, request_id)
            if d is None:
                # the client has given up (or will before the answer starts): do not execute
                await out.error(ErrorCode.DEADLINE_EXCEEDED, "the client's deadline passed before dispatch; "
                                                             "not executed")
                self.m.shed.labels(reason="expired").inc()
                self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": "deadline_exceeded",
                                      "policy": self.policy.name, "attempt": attempt, "target_s": q.ttft_target_s})
                return
            if isinstance(d, Refused):  # every instance is predicted to start it after its client has given up
                await self._refuse(q, out, d, attempt=attempt, prompt_tokens=ptoks, decided_at=asked.decided_at,
                                   estimated_at=asked.estimated_at,
                                   ttft_elapsed={c.instance: c.ttft_elapsed for c in cands})
                return
            inst = self.registry.get(d.candidate.instance)
            p = used[inst.id]
            decision_s = time.perf_counter() - t0
            if q.deciding:
                q.deciding = False
                self.admission.decided(decision_s)
            if attempt == 1:
                self.m.decision.observe(decision_s)
                self.m.overhead.observe(max(0.0, decision_s - waited))
            self.m.routed.labels(instance=inst.id).inc()
            await out.send(Routed(instance=inst.id, model=inst.model, predictor_model=inst.predictor_model,
                                  predicted_ttft_s=_finite(self.policy.latency_estimate(d.candidate)),
                                  ttft_method=d.candidate.ttft_method, feasible=d.feasible, policy=self.policy.name,
                                  decision_s=decision_s, attempt=attempt, backend=inst.backend,
                                  prompt_tokens=d.candidate.prompt_tokens or p.prompt_tokens,
                                  prompt_tokens_exact=d.candidate.tokens_exact))
            try:
                await self._stream(q, out, inst, d, p, request_id, max(1, p.prompt_tokens - d.candidate.prefix_hit_tokens),
                                   t0, decision_s, asked, fallbacks, cands, attempt)
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

    def _cheap(self, inst: InstanceInfo, ptoks: int) -> Cheap:
        """The selection's cheap signals of one instance: the queued prefill of its last estimate
        row (while younger than ``selection_row_s``) plus what this router has in flight there."""
        seen = self._last_rows.get(inst.id)
        queued = seen[1].pending_prefill_tokens if seen and time.monotonic() - seen[0] <= self.cfg.selection_row_s else 0
        return Cheap(inst.id, inst.predictor_model, queued + self.local.pending_prefill_tokens.get(inst.id, 0), ptoks,
                     prefill_tps=inst.calibration.prefill_tps())

    async def _ask_parts(self, instance: str, parts: list[EstimatePart]) -> EstimateReply | None:
        """A sequencer's chain at one instance: every part in one request to its shard."""
        client = self.estimators[Subjects.shard_of(instance, len(self.estimators))]
        first = parts[0]
        try:
            return await client.estimate(first.query, list(first.instances), budget_s=self.cfg.estimate_budget_s,
                                         tokens=first.tokens, ahead=first.ahead, also=parts[1:],
                                         then=first.then)
        except Exception:  # BearError, NATS away: the sequencer decides on what it has
            return None

    @staticmethod
    def _deadline_passed(q: Query) -> bool:
        return q.deadline is not None and time.time() > q.deadline - DISPATCH_MARGIN_S

    async def _publish(self, q: Query, d: Decision, used: dict[str, ModelPrediction], asked: Asked,
                       request_id: str) -> Dispatch:
        """``bear.dispatch.<instance>`` of the decision, reserved for the estimates after it."""
        inst = self.registry.get(d.candidate.instance)
        p = used[inst.id]
        dispatch = dispatch_for(
            q.query_id, request_id, p, q.max_tokens_at(inst.max_model_len, p.prompt_tokens), time.time(),
            d.candidate.prefix_hit_tokens,
            dispatch_tokens(asked.tokens, inst.tokenizer, asked.rows.get(inst.id) if asked.rows else None),
            sequences=sequences(q.engine), skip_reading_prefix_cache=q.skips_prefix_cache)
        await self.nc.publish(self.subjects.dispatch(inst.id), encode(dispatch))
        self.reservations.add(inst.id, dispatch)
        q.served_by, q.predicted_output = inst.id, dispatch.predicted_output_tokens
        return dispatch

    async def _decide_in_order(self, q: Query, ctx: QueryContext, insts: list[InstanceInfo], ptoks: int,
                               asked: Asked, dropped: dict[str, str], request_id: str, t0: float,
                               ) -> tuple[Decision | Refused | None, list[Candidate], dict[str, ModelPrediction]]:
        """The decision through the sequencer (``bear.router.sequencer``): on the estimates asked
        so far, asked again where they miss a decision made before it; published in turn. None:
        the client's deadline passed while it waited."""
        assert self.sequencer is not None and asked.est_query is not None
        by_id = {i.id: i for i in insts}
        cand_of = {c.instance: c for c in asked.est_cands}
        query = asked.est_query

        def decide_on(rows: dict[str, EstimateRow], elapsed: dict[str, float]) -> tuple[Any, str | None]:
            now = time.time()
            if self._deadline_passed(q):
                return (None, [], {}), None
            asked.decided_at = now
            cands, used = build_candidates(ptoks, insts, asked.preds, rows, now,
                                           default_output_tokens=self.cfg.default_output_tokens, local=self.local,
                                           exact_tokens=asked.exact_tokens, sequences=sequences(q.engine),
                                           elapsed_s=elapsed)
            d = decide(self.profile, ctx, cands, now, dropped)
            return (d, cands, used), None if isinstance(d, Refused) else d.candidate.instance

        def hypothetical(i: str) -> Dispatch:
            inst = by_id[i]
            p = prediction_at(inst, ptoks, asked.preds, self.cfg.default_output_tokens, asked.exact_tokens)
            es = pending.estimates.get(i)
            return dispatch_for(q.query_id, request_id, p, q.max_tokens_at(inst.max_model_len, p.prompt_tokens),
                                time.time(), es[-1].row.prefix_hit_tokens if es else 0, sequences=sequences(q.engine),
                                skip_reading_prefix_cache=q.skips_prefix_cache)

        async def ask(instances: list[str], ahead: dict[str, list[Dispatch]]) -> EstimateReply | None:
            return await ask_estimator(self.estimators, query, [cand_of[i] for i in instances if i in cand_of],
                                       self.cfg.estimate_budget_s, tokens=asked.tokens, ahead=ahead)

        async def commit(result: Any) -> None:
            d, _, used = result
            await self._publish(q, d, used, asked, request_id)

        def part(instances: list[str], ahead: dict[str, list[Dispatch]]) -> EstimatePart:
            cs = [cand_of[i] for i in instances if i in cand_of]
            toks = {c.tokenizer: asked.tokens[c.tokenizer] for c in cs if c.tokenizer in asked.tokens}
            return EstimatePart(query=query, instances=list(cs), tokens=toks, ahead=ahead)  # type: ignore[arg-type]

        pending = Pending(q.query_id, list(by_id), decide_on, hypothetical, ask, commit, t0, part=part)
        pending.add_reply(asked.reply, asked.versions, asked.estimate_sent - t0)
        result = await self.sequencer.decide(pending)
        asked.asks = pending.asks
        return result  # type: ignore[no-any-return]

    async def _stream(self, q: Query, out: ClientStream, inst: InstanceInfo, d: Decision, p: ModelPrediction,
                      request_id: str, uncached: int, t0: float, decision_s: float, asked: Asked,
                      fallbacks: list[str], cands: list[Candidate], attempt: int) -> None:
        # the rest of the context: no max_tokens in the body, so the engine applies its own rest
        cap = q.body_max_tokens(inst.max_model_len, p.prompt_tokens, inst.id in asked.exact_tokens)
        path, body = request_body(inst.model, q.engine_prompt, q.messages, cap, {**q.sampling, **q.engine},
                                  stream=not q.unstreamed)
        raw = bool(q.engine)  # engine fields may shape the answer (choices, tool calls): relay it verbatim
        first: float | None = None
        usage: dict[str, int] = {}
        finish = None
        seq = 0
        answer: list[str] = []  # kept for priming the next turn, up to MAX_PRIMED_CHARS
        answer_chars = 0
        local = self.local
        local.pending_prefill_tokens[inst.id] += uncached
        local.running[inst.id] += 1
        pending_open = True
        predicted = self.policy.latency_estimate(d.candidate)
        with tracing.child("router.engine", q.trace, kind="client", instance=inst.id, model=inst.model,
                           request_id=request_id, attempt=attempt, ttft_method=d.candidate.ttft_method,
                           predicted_ttft_s=_finite(predicted)) as span:
            headers = dict(span.headers or {})
            key = self.cfg.engine_keys.get(inst.id) or self.cfg.engine_keys.get("*")
            if key and self.registry.engine_key_allowed(inst):  # only to the provisioned address
                headers["Authorization"] = f"Bearer {key}"
            # until the first token; an unstreamed answer comes whole (its idle timeout bounds it)
            limit = asyncio.timeout(None if q.unstreamed else self.cfg.first_token_timeout_s)
            try:
                async with limit:  # until the first token only (rescheduled to never then)
                    async for piece in stream_completion(self._session, inst.base_url, request_id, path, body,
                                                         connect_timeout_s=self.cfg.connect_timeout_s,
                                                         idle_timeout_s=self.cfg.idle_timeout_s, headers=headers,
                                                         raw=raw, coalesce=self.cfg.coalesce):
                        relay = piece.choices is not None
                        if relay or piece.text:
                            if first is None and (piece.produced or not relay):
                                first = time.perf_counter()
                                limit.reschedule(None)
                                local.pending_prefill_tokens[inst.id] -= uncached
                                pending_open = False
                                span.event("first_token")
                            await out.send(Chunk(seq=seq, choices=UNSET if piece.choices is None else piece.choices)
                                           if relay else Chunk(seq=seq, text=piece.text))
                            seq += 1
                            if relay:
                                answer_chars = MAX_PRIMED_CHARS + 1  # choices and tool calls: not one text to prime
                            elif answer_chars <= MAX_PRIMED_CHARS:
                                answer.append(piece.text)
                                answer_chars += len(piece.text)
                        if piece.usage:
                            usage = piece.usage
                        if piece.finish_reason:
                            finish = piece.finish_reason
            except TimeoutError:
                if not limit.expired():
                    raise
                span.error("no first token")
                await out.error(ErrorCode.DEADLINE_EXCEEDED,
                                f"no first token from {inst.id} within {self.cfg.first_token_timeout_s:g} s of "
                                "dispatch; its request was aborted", instance=inst.id)
                self.m.shed.labels(reason="first_token_timeout").inc()
                self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": "first_token_timeout",
                                      "instance": inst.id, "policy": self.policy.name, "target_s": q.ttft_target_s,
                                      "predicted_ttft_s": _finite(predicted)})
                return
            except StreamBroken as exc:
                span.error(str(exc))
                await out.error(ErrorCode.UNAVAILABLE, f"instance stream failed mid-answer: {exc}", instance=inst.id)
                self.outcomes.record({"query_id": q.query_id, "t": time.time(), "status": "broken",
                                      "instance": inst.id, "policy": self.policy.name, "target_s": q.ttft_target_s})
                return
            finally:
                if pending_open:
                    local.pending_prefill_tokens[inst.id] -= uncached
                local.running[inst.id] -= 1
        end = time.perf_counter()
        if (self.cfg.tokenize and self.cfg.prime_answers and answer_chars <= MAX_PRIMED_CHARS
                and q.prompt_ids is None):
            primed = self.tokenizers.prime(inst.tokenizer, q.prompt, q.messages, "".join(answer))
            if primed is not None:
                self.m.primed.labels(outcome=primed).inc()
        if first is None:  # an empty answer: the first (and only) token is the end of the stream
            first = end
        ttft = first - t0
        n_out = int(usage.get("completion_tokens", seq))
        n_in = int(usage.get("prompt_tokens", p.prompt_tokens))
        cost_musd = n_in * inst.price_in + n_out * inst.price_out
        utility = p.acc - q.lam * cost_musd
        on_time = ttft <= q.ttft_target_s
        per_seq = n_out / sequences(q.engine)  # n answers decode side by side: a token each per step
        tpot = (end - first) / (per_seq - 1) if per_seq > 1 else None
        if not q.unstreamed:  # an unstreamed answer's "first token" is the whole answer: no TTFT to calibrate
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.outcome(inst.id), encode(Outcome(
                    instance=inst.id, ttft_s=ttft, tpot_s=tpot, predicted_ttft_s=_finite(d.candidate.ttft),
                    method=d.candidate.ttft_method, completed=True, t=time.time(),
                    output_tokens=min(round(per_seq), 2**31 - 1), predicted_output_tokens=q.predicted_output,
                    elapsed_s=d.candidate.ttft_elapsed, path_s=d.candidate.ttft_path, prompt_tokens=p.prompt_tokens,
                    engine_ttft_s=_finite(d.candidate.ttft - d.candidate.ttft_elapsed - d.candidate.ttft_path))))
        await out.finish(Done(instance=inst.id, model=inst.model, predictor_model=inst.predictor_model, ttft_s=ttft,
                              target_s=q.ttft_target_s, on_time=on_time, utility=utility,
                              predicted_utility=d.candidate.utility(q.lam), predicted_ttft_s=_finite(predicted),
                              usage=usage, finish_reason=finish, decision_s=decision_s))
        self.m.prompt_tokens.labels(how="exact" if d.candidate.tokens_exact else "estimated").inc()
        self.outcomes.record({
            "query_id": q.query_id, "t": time.time(), "status": "done", "policy": self.policy.name,
            "router": self.name, "instance": inst.id, "model": inst.model, "predictor_model": inst.predictor_model,
            "target_s": q.ttft_target_s, "lam": q.lam, "prompt_tokens": q.token_estimate(),  # what the estimate was asked
            "instance_prompt_tokens": p.prompt_tokens, "tokens": "exact" if d.candidate.tokens_exact else "estimated",
            "prefix_hit_tokens": d.candidate.prefix_hit_tokens,
            "max_tokens": q.max_tokens_at(inst.max_model_len, p.prompt_tokens),
            "max_tokens_rest": q.rest_of_context,
            "predicted_ttft_s": predicted, "ttft_method": d.candidate.ttft_method, "feasible": d.feasible,
            "ttft_calibration": d.candidate.ttft_calibration,
            "observed_ttft_s": ttft, "on_time": on_time, "utility": utility,
            "predicted_utility": d.candidate.utility(q.lam), "decision_s": decision_s, "wait_s": asked.wait_s,
            "decided_at": asked.decided_at, "estimated_at": asked.estimated_at, "deadline": q.deadline,
            "predict_s": asked.predict_s, "estimate_s": asked.estimate_s, "claim_s": asked.claim_s,
            "tokenize_s": asked.tokenize_s, "estimator_service_s": asked.estimator_service_s,
            "fallbacks": fallbacks, "dropped": d.dropped, "selection": asked.selection, "attempt": attempt, "asked_again": asked.asks, "usage": usage, "request_id": request_id,
            "chunks": seq, "engine_streamed": not q.unstreamed, "taken_over_from": q.taken_over_from,
            "candidates": {c.instance: {
                "model": c.model, "acc": c.acc, "cost": c.cost, "out_len": c.out_len, "out_p90": c.out_p90,
                "ttft": c.ttft, "ttft_elapsed": c.ttft_elapsed, "ttft_path": c.ttft_path, "method": c.ttft_method, "calibration": c.ttft_calibration,
                "ttft_prefill": c.ttft_prefill, "n_running": c.n_running,
                "n_waiting": c.n_waiting, "pending_prefill_tokens": c.pending_prefill_tokens,
                "pending_decode_tokens": c.pending_decode_tokens, "prefill_tps": c.prefill_tps, "tpot": c.tpot,
                "throughput_rps": c.throughput_rps, "observed_ttft_p50": c.observed_ttft_p50,
                "observed_ttft_p90": c.observed_ttft_p90, "observed_ttft_p95": c.observed_ttft_p95,
                "observed_tpot_p90": c.observed_tpot_p90, "prompt_tokens": c.prompt_tokens,
                "prefix_hit_tokens": c.prefix_hit_tokens, "kv_usage": c.kv_usage, "score": d.scores.get(c.instance)}
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
    exact_tokens: dict[str, int] = field(default_factory=dict)  # instance → its tokenizer's prompt length
    tokenize_s: float = 0.0  # of estimate_s: tokenising the query (before the estimator was asked)
    estimator_service_s: float | None = None  # of estimate_s: the worker's own time on the request
    tokens: dict[str, bytes] = field(default_factory=dict)  # tokenizer id → the prompt's packed ids
    reply: EstimateReply | None = None
    est_query: EstimateQuery | None = None  # what the estimator was asked (a sequenced decision asks again)
    est_cands: list[EstimateCandidate] = field(default_factory=list)
    versions: dict[str, int] = field(default_factory=dict)  # the instances' commits here when it was asked
    estimate_sent: float = 0.0  # perf_counter when the estimate was asked
    asks: int = 0  # estimates asked again by the sequencer (decisions before it changed the picture)
    # the cheap first stage (Selection.record: stage, considered, replayed, k per model); None: off
    selection: dict[str, object] | None = None

    @property
    def wait_s(self) -> float:
        """The wait for the predictor and the estimator (the claim excluded)."""
        return max(self.predict_s, self.estimate_s)


async def _already() -> bool:
    return True


async def _clocked(aw: Any) -> tuple[Any, float]:
    return await aw, time.perf_counter()


def _traced(name: str, parent: dict[str, str] | None, call: Any) -> Any:
    """``call(headers)`` — the awaitable of a request to another service — inside a client span
    ``name`` when tracing is on; otherwise the call itself, handed the query's trace context."""
    if not tracing.enabled():
        return call(parent)

    async def run() -> Any:
        with tracing.child(name, parent, kind="client") as span:
            return await call(span.headers)

    return run()


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
    tracing.shutdown()
    log.info("router stopped", router=router.name)
