"""One estimator worker: a nats.micro service on ``bear.estimate`` (queue group, so more
processes scale out) that answers "TTFT of this query at each candidate instance, now".

Inputs, all from NATS and nothing else: ``bear.delta.*`` (per-step deltas, applied in libbea to
the held state; a broken chain asks ``bear.resync.<id>`` for a full snapshot),
``bear.snapshot.*`` (full snapshots: newest per instance kept, parsed lazily),
``bear.dispatch.*`` (the router's dispatches: predicted lengths, the requests a snapshot does not
show yet, the prompt-token rate), ``bear.kv.*`` (each instance's prefix-cache events, mirrored;
on a gap the worker asks the instance for its whole state on ``bear.kv.resync.<id>``), KV
``bear_calibration`` (β, θ) and KV ``bear_instances`` (heartbeats, to tell a stale instance from
a dead one; engine config; prefix-cache hashing). The estimate itself is
``bear.estimator.estimate`` — the same code ``bear eval`` runs. Contract: docs/estimator.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import structlog

from bear.estimator.delta_ingest import release, resynced
from bear.estimator.estimate import EstimatorConfig, finish, plan, run_jobs
from bear.estimator.metrics import metrics
from bear.estimator.state import InstanceState, StateStore
from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import (
    Calibration,
    Dispatch,
    EstimateCandidate,
    EstimateQuery,
    EstimateReply,
    EstimateRequest,
    EstimateRow,
    InstanceRecord,
    KvEvents,
    KvMessage,
    KvResync,
    KvState,
    ResyncRequest,
    decode,
    encode,
)
from bear.protocol.subjects import ESTIMATOR_QUEUE, Subjects
from bear.runtime.identity import own_name
from bear.runtime.kv import watch_kv
from bear.runtime.request import error_in, request
from bear.runtime.shutdown import cancel_all

log = structlog.get_logger("bear.estimator")

MAX_CANDIDATES = 64
RESYNC_EVERY_S = 1.0  # at most one resync request per instance this often


class EstimatorWorker:
    def __init__(self, nc: Any, config: EstimatorConfig | None = None, subjects: Subjects | None = None) -> None:
        self.nc = nc
        self.cfg = config or EstimatorConfig()
        self.subjects = subjects or Subjects()
        self.m = metrics()
        self.store = StateStore(on_event=lambda event: self.m.state_events.labels(event=event).inc())
        # the name in every reply (``EstimateReply.worker``): with an identity of its own (a replica's,
        # ``estimator-1``) it leads, so a refused reply names the identity to revoke (issue 40)
        ident = own_name()
        self.name = self.cfg.worker_name or (f"{ident}@" if ident else "") + \
            f"{os.uname().nodename}:{os.getpid()}:{id(self) & 0xFFFF:x}"
        self._resyncs: dict[str, asyncio.Task[None]] = {}  # at most one resync request per instance
        self.handled = 0
        self._service: Any = None
        self._subs: list[Any] = []
        self._owned: dict[str, list[Any]] = {}  # sharded: the subscriptions of each instance owned
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def sharded(self) -> bool:
        return self.cfg.shards > 1

    def owns(self, instance: str) -> bool:
        return Subjects.shard_of(instance, self.cfg.shards) == self.cfg.shard

    async def _follow(self, instance: str) -> list[Any]:
        """Subscribe to the deltas, snapshots, dispatches and prefix-cache events of one instance
        (or of all: ``*``). The prefix-cache stream is never dropped from: a lost message costs a
        resync."""
        s = self.subjects
        one = instance != "*"
        subs = [
            await self.nc.subscribe(s.delta(instance) if one else s.delta_all, cb=self._on_delta,
                                    pending_msgs_limit=self.cfg.delta_pending_msgs),
            await self.nc.subscribe(s.snapshot(instance) if one else s.snapshot_all, cb=self._on_snapshot,
                                    pending_msgs_limit=self.cfg.snapshot_pending_msgs,
                                    pending_bytes_limit=64 * 1024 * 1024),
            await self.nc.subscribe(s.dispatch(instance) if one else s.dispatch_all, cb=self._on_dispatch),
        ]
        if self.cfg.use_prefix_hits:
            subs.append(await self.nc.subscribe(s.kv(instance) if one else s.kv_all, cb=self._on_kv, pending_msgs_limit=65536,
                                                pending_bytes_limit=256 * 1024 * 1024))
        return subs

    async def start(self) -> None:
        from nats.micro import add_service

        if not 0 <= self.cfg.shard < max(1, self.cfg.shards):
            raise ValueError(f"shard {self.cfg.shard} is not in 0..{self.cfg.shards - 1}")
        if not self.sharded:
            self._subs += await self._follow("*")
        js = self.nc.jetstream()
        for bucket, handler in (
            (self.subjects.calibration_bucket, self._on_calibration),
            (self.subjects.instances_bucket, self._on_registry),
        ):
            self._tasks.append(asyncio.create_task(watch_kv(js, bucket, handler, retry_s=1.0, log=log, nc=self.nc)))
        subject = self.subjects.estimate_shard(self.cfg.shard, self.cfg.shards)
        self._service = await add_service(
            self.nc,
            name="bear-estimator",
            version="0.1.0",
            description="BEA TTFT estimates per candidate instance",
            # one group name for every shard (a message on a shard's subject reaches only that shard's
            # workers): the only group an estimator identity may take its requests in (bear.runtime.nats_auth)
            queue_group=ESTIMATOR_QUEUE,
        )
        await self._service.add_endpoint(name="estimate", subject=subject, handler=self._handle)
        await self.nc.flush()
        log.info("estimator worker started", worker=self.name, subject=subject,
                 shard=f"{self.cfg.shard}/{self.cfg.shards}")

    async def stop(self) -> None:
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        for s in [*self._subs, *(x for subs in self._owned.values() for x in subs)]:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        await cancel_all([*self._tasks, *self._resyncs.values()])

    # ------------------------------------------------------------------ feeds
    async def _on_delta(self, msg: Any) -> None:
        instance = Subjects.instance_of(msg.subject)
        st = self.store.get(instance)
        st.offer_delta(msg.data, time.time())
        if st.gapped and instance not in self._resyncs and st.feed.wants_resync(st, time.monotonic()):
            task = asyncio.create_task(self._resync(instance, st))
            self._resyncs[instance] = task
            task.add_done_callback(self._resync_done(instance))

    def _resync_done(self, instance: str) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._resyncs.pop(instance, None)

        return done

    async def _resync(self, instance: str, st: InstanceState) -> None:
        """Ask the instance's publisher for its newest full snapshot (its delta chain broke here)."""
        snap = st.snap
        ask = ResyncRequest(instance=instance, consumer=self.name,
                            generation=None if snap is None else int(snap.generation),
                            seq=None if snap is None else int(snap.seq),
                            reason="no_state" if snap is None else "gap",
                            deadline=time.time() + self.cfg.resync_timeout_s)
        try:
            data = await request(self.nc, self.subjects.resync(instance), encode(ask),
                                 deadline=Deadline.after(self.cfg.resync_timeout_s),
                                 try_timeout_s=self.cfg.resync_timeout_s, retries=0)
        except BearError as exc:
            self.m.resyncs.labels(outcome=str(exc.code)).inc()
            log.info("resync failed", instance=instance, error=exc.message)
            return
        err = error_in(data)
        if err is not None:
            self.m.resyncs.labels(outcome=str(err.code)).inc()
            return
        if self.store.peek(instance) is not st:
            return  # forgotten meanwhile (deregistered)
        self.store.offer(instance, data, time.time())  # within the store's byte budget
        parsed = st.ensure_parsed()
        if parsed is not None:
            self._count_parse(parsed)
        if parsed:
            resynced(st, time.time())
        self.m.resyncs.labels(outcome="installed" if parsed else "refused").inc()

    async def _on_snapshot(self, msg: Any) -> None:
        if self.store.offer(Subjects.instance_of(msg.subject), msg.data, time.time()):
            self.m.snapshots_dropped.inc()

    async def _on_dispatch(self, msg: Any) -> None:
        try:
            d = decode(Dispatch, msg.data)
        except BearError:
            self.m.dispatch_malformed.inc()
            return
        if not self.store.get(Subjects.instance_of(msg.subject)).on_dispatch(d, time.time()):
            self.m.dispatch_malformed.inc()

    async def _on_kv(self, msg: Any) -> None:
        instance = Subjects.instance_of(msg.subject)
        try:
            m: KvEvents | KvState = decode(KvMessage, msg.data)  # type: ignore[arg-type]  # msgspec decodes a union
        except BearError:
            self.m.kv_malformed.inc()
            return
        if m.instance != instance:
            self.m.kv_malformed.inc()
            return
        st = self.store.get(instance)
        was = st.prefix.synced
        st.prefix.offer(m)
        if was and not st.prefix.synced:
            self.m.kv_resyncs.labels(reason="gap").inc()
        if not was and st.prefix.synced:
            st.resync_asked = 0.0  # answered: the next loss may ask at once
        if st.prefix.needs_resync:
            await self._ask_resync(instance, st.prefix.resync_reason or "")

    async def _ask_resync(self, instance: str, reason: str) -> None:
        """Ask the instance for its whole prefix cache (rate-limited per instance)."""
        st = self.store.get(instance)
        now = time.monotonic()
        if now - st.resync_asked < RESYNC_EVERY_S:
            return
        st.resync_asked = now
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.kv_resync(instance), encode(KvResync(instance=instance, reason=reason)))
            self.m.kv_resync_requests.inc()

    def _on_calibration(self, key: str, value: bytes | None) -> None:
        st = self.store.get(key)
        if value is None:
            st.set_calibration(None)
            return
        try:
            st.set_calibration(decode(Calibration, value))
            self.m.calibration_updates.inc()
        except BearError as exc:
            log.warning("malformed calibration entry dropped", instance=key, error=exc.message)

    def _on_registry(self, key: str, value: bytes | None) -> None:
        if value is None:  # deregistered: forget it (and stop following it, when sharded)
            self.store.forget(key)
            for sub in self._owned.pop(key, None) or ():
                self._tasks.append(asyncio.create_task(sub.unsubscribe()))
            return
        try:
            rec = decode(InstanceRecord, value)
        except BearError:
            return
        st = self.store.get(key)
        st.on_registry(rec)
        if st.prefix_events and st.prefix.needs_resync and self.cfg.use_prefix_hits and (
                not self.sharded or self.owns(key)):
            # a worker that starts after the instance: ask for the state instead of waiting for a gap
            self._tasks.append(asyncio.create_task(self._ask_resync(key, st.prefix.resync_reason or "")))
        if self.sharded and self.owns(key) and key not in self._owned:
            self._owned[key] = []  # claimed now; the subscriptions follow on the loop
            self._tasks.append(asyncio.create_task(self._own(key)))

    async def _own(self, instance: str) -> None:
        """Follow one more instance of this shard (learnt from the registry)."""
        try:
            self._owned[instance] = await self._follow(instance)
        except Exception as exc:  # NATS away: the next registry update tries again
            self._owned.pop(instance, None)
            log.warning("cannot follow instance", instance=instance, error=repr(exc))

    # ------------------------------------------------------------------ requests
    async def _handle(self, req: Any) -> None:
        t0 = time.perf_counter()
        self.m.requests.inc()
        self.handled += 1
        try:
            body = decode(EstimateRequest, req.data)
            deadline = Deadline(body.deadline) if body.deadline is not None else Deadline.after(
                self.cfg.default_deadline_s)
            if deadline.expired():
                self.m.deadline_dropped.inc()
                return  # nobody waits for it any more
            reply = await self.estimate(body)
            reply.service_s = time.perf_counter() - t0
            data = encode(reply)
        except BearError as exc:
            self.m.errors.labels(code=str(exc.code)).inc()
            data = encode(exc.reply())
        except Exception as exc:  # a bug: answer coded, keep serving
            log.exception("estimate failed")
            self.m.errors.labels(code=str(ErrorCode.INTERNAL)).inc()
            data = encode(BearError(ErrorCode.INTERNAL, repr(exc)).reply())
        await req.respond(data)
        self.m.latency.observe(time.perf_counter() - t0)

    async def estimate(self, body: EstimateRequest) -> EstimateReply:
        """The reply to one decoded ``bear.estimate/1`` request (raises BearError): its query's
        rows, and those of each query in ``also``, in order, on the same clock."""
        try:
            aheads = body.aheads()
        except ValueError as exc:
            raise BearError(ErrorCode.TOO_LARGE, str(exc)) from None
        parts = [(body.query, body.candidates(), body.tokens, aheads[0]),
                 *((a.query, a.candidates(), a.tokens, ahead) for a, ahead in zip(body.also, aheads[1:], strict=True))]
        if any(len(c) > MAX_CANDIDATES for _, c, _, _ in parts):
            raise BearError(ErrorCode.TOO_LARGE, f"at most {MAX_CANDIDATES} candidate instances")
        now = time.time()
        rows = [await self._rows(q, c, now, tokens, ahead) for q, c, tokens, ahead in parts]
        return EstimateReply(query_id=body.query.id, worker=self.name, estimates=rows[0], at=now, also=rows[1:])

    async def _rows(self, query: EstimateQuery, candidates: list[EstimateCandidate], now: float,
                    tokens: Any, ahead: Any) -> list[EstimateRow]:
        p = plan(query, candidates, self.store, now, self.cfg, on_parse=self._count_parse, tokens=tokens,
                 ahead=ahead)
        if p.off_loop(self.cfg):
            for j in p.jobs:
                j.state.in_use += 1
            try:
                results = await asyncio.get_running_loop().run_in_executor(None, run_jobs, p, self.cfg)
            finally:
                for j in p.jobs:
                    j.state.in_use -= 1
                    release(j.state, time.time())  # the deltas that arrived meanwhile
        else:
            results = run_jobs(p, self.cfg)
        rows = finish(p, results, self.cfg)
        if p.unkeyed_ahead:
            self.m.unkeyed_dispatches.inc(p.unkeyed_ahead)
        for r in rows:
            self.m.methods.labels(method=r.method).inc()
            self.m.prefix.labels(how=r.prefix).inc()
        return rows

    def _count_parse(self, kept: bool) -> None:
        (self.m.snapshots_kept if kept else self.m.snapshots_malformed).inc()
