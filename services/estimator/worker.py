"""One estimator worker: a nats.micro service on ``bear.estimate`` (queue group, so more
processes scale out) that answers "TTFT of this query at each candidate instance, now".

Inputs, all from NATS and nothing else: ``bear.snapshot.*`` (newest per instance kept),
``bear.dispatch.*`` (predicted lengths of dispatched requests), KV ``bear_calibration`` (β) and
KV ``bear_instances`` (heartbeats, to tell a stale instance from a dead one).
Contract: docs/estimator.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import structlog

from bear import libbea
from bear.estimator.analytic import analytic_ttft
from bear.estimator.metrics import metrics
from bear.estimator.state import CalibrationEntry, InstanceState, StateStore
from bear.protocol.codec import pack, unpack, unpack_map
from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.subjects import Subjects
from bear.runtime.kv import watch_kv
from bear.runtime.shutdown import cancel_all

log = structlog.get_logger("bear.estimator")

REQUEST_SCHEMA = "bear.estimate/1"
REPLY_SCHEMA = "bear.estimate.reply/1"
CALIBRATION_SCHEMA = "bear.calibration/1"
MAX_CANDIDATES = 64
EXECUTOR_RESIDENTS = 512  # replays over more residents than this run off the event loop


@dataclass
class EstimatorConfig:
    max_age_s: float = 1.0  # older snapshots → analytic fallback
    down_after_s: float = 10.0  # no snapshot and no registry heartbeat for this long → down
    default_output_tokens: int = 256  # residents the router never announced
    overrun_fraction: float = 0.5  # residents already past their prediction get this much more
    default_deadline_s: float = 1.0
    snapshot_pending_msgs: int = 256  # NATS client-side pending limit of the snapshot subscription
    compensate_staleness: bool = True  # run residents through the snapshot's age before inserting the query
    worker_name: str = ""


class EstimatorWorker:
    def __init__(self, nc: Any, config: EstimatorConfig | None = None, subjects: Subjects | None = None) -> None:
        self.nc = nc
        self.cfg = config or EstimatorConfig()
        self.subjects = subjects or Subjects()
        self.store = StateStore()
        self.name = self.cfg.worker_name or f"{os.uname().nodename}:{os.getpid()}:{id(self) & 0xFFFF:x}"
        self.m = metrics()
        self.handled = 0
        self._service: Any = None
        self._subs: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        from nats.micro import add_service

        self._subs.append(
            await self.nc.subscribe(
                self.subjects.snapshot_all,
                cb=self._on_snapshot,
                pending_msgs_limit=self.cfg.snapshot_pending_msgs,
                pending_bytes_limit=64 * 1024 * 1024,
            )
        )
        self._subs.append(await self.nc.subscribe(self.subjects.dispatch_all, cb=self._on_dispatch))
        js = self.nc.jetstream()
        for bucket, handler in (
            (self.subjects.calibration_bucket, self._on_calibration),
            (self.subjects.instances_bucket, self._on_registry),
        ):
            self._tasks.append(asyncio.create_task(watch_kv(js, bucket, handler, retry_s=1.0, log=log)))
        self._service = await add_service(
            self.nc,
            name="bear-estimator",
            version="0.1.0",
            description="BEA TTFT estimates per candidate instance",
            queue_group="bear-estimator",
        )
        await self._service.add_endpoint(name="estimate", subject=self.subjects.estimate, handler=self._handle)
        await self.nc.flush()
        log.info("estimator worker started", worker=self.name, subject=self.subjects.estimate)

    async def stop(self) -> None:
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        await cancel_all(self._tasks)

    # ------------------------------------------------------------------ feeds
    async def _on_snapshot(self, msg: Any) -> None:
        st = self.store.get(Subjects.instance_of(msg.subject))
        if st.offer_snapshot(msg.data, time.time()):
            self.m.snapshots_dropped.inc()

    async def _on_dispatch(self, msg: Any) -> None:
        try:
            d = unpack_map(msg.data)
            rid = d["request_id"]
            p = int(d.get("prompt_tokens", 0))
            o = int(d["predicted_output_tokens"])
            t = float(d.get("t", time.time()))
            if not isinstance(rid, str) or not rid or o < 0 or p < 0 or not math.isfinite(t):
                raise ValueError("bad dispatch fields")
        except (BearError, KeyError, TypeError, ValueError):
            self.m.dispatch_malformed.inc()
            return
        self.store.get(Subjects.instance_of(msg.subject)).on_dispatch(rid, p, o, t)

    def _on_calibration(self, key: str, value: bytes | None) -> None:
        st = self.store.get(key)
        if value is None:
            st.calibration = CalibrationEntry()
            return
        try:
            d = decode_calibration(value)
            beta = tuple(float(x) for x in d["beta"])
            if len(beta) != 4 or not all(math.isfinite(b) and b >= 0 for b in beta):
                raise ValueError("beta")
            theta = d.get("theta")
            st.calibration = CalibrationEntry(
                beta=(beta[0], beta[1], beta[2], beta[3]),
                theta=float(theta) if isinstance(theta, int | float) and theta > 0 else None,
                mape=float(d.get("mape", math.nan)),
                n=int(d.get("n", 0)),
                calibrated=True,
            )
            self.m.calibration_updates.inc()
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("malformed calibration entry dropped", instance=key, error=str(exc))

    def _on_registry(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.store.get(key).registry_heartbeat = 0.0
            return
        try:
            d = unpack_map(value)
            self.store.get(key).registry_heartbeat = float(d.get("heartbeat", 0.0))
        except (BearError, TypeError, ValueError):
            pass

    # ------------------------------------------------------------------ requests
    async def _handle(self, req: Any) -> None:
        t0 = time.perf_counter()
        self.m.requests.inc()
        self.handled += 1
        try:
            body = unpack_map(req.data)
            deadline = Deadline.from_request(body, self.cfg.default_deadline_s)
            if deadline.expired():
                self.m.deadline_dropped.inc()
                return  # nobody waits for it any more
            reply = await self.estimate(body)
            reply["service_s"] = time.perf_counter() - t0
        except BearError as exc:
            self.m.errors.labels(code=str(exc.code)).inc()
            reply = exc.reply()
        except Exception as exc:  # a bug: answer coded, keep serving
            log.exception("estimate failed")
            self.m.errors.labels(code=str(ErrorCode.INTERNAL)).inc()
            reply = BearError(ErrorCode.INTERNAL, repr(exc)).reply()
        await req.respond(pack(reply))
        self.m.latency.observe(time.perf_counter() - t0)

    async def estimate(self, body: dict[str, Any]) -> dict[str, Any]:
        """The reply map for one decoded ``bear.estimate/1`` request (raises BearError)."""
        query = body.get("query")
        if not isinstance(query, dict):
            raise BearError(ErrorCode.BAD_REQUEST, "query must be a map")
        try:
            q = libbea.Query.from_dict({k: query[k] for k in ("id", "prompt_tokens", "max_tokens", "priority") if k in query})
        except (ValueError, TypeError) as exc:
            raise BearError(ErrorCode.BAD_REQUEST, str(exc)) from exc
        candidates = parse_candidates(body.get("instances"))
        now = time.time()
        rows: list[dict[str, Any]] = []
        bea_rows: list[tuple[int, InstanceState, int, float]] = []
        for name, hit in candidates:
            st = self.store.peek(name)
            row: dict[str, Any] = {"instance": name, "ttft_s": None, "method": "none", "age_s": None,
                                   "stale": False, "status": "down", "n_batches": 0}
            rows.append(row)
            if st is None:
                continue
            parsed = st.ensure_parsed()
            if parsed is False:
                self.m.snapshots_malformed.inc()
            elif parsed:
                self.m.snapshots_kept.inc()
            age = st.age(now)
            row["age_s"] = age
            if age is not None and age <= self.cfg.max_age_s:
                st.apply_lengths()
                bea_rows.append((len(rows) - 1, st, hit, age))
                continue
            alive = (age is not None and age <= self.cfg.down_after_s) or (
                now - st.registry_heartbeat <= self.cfg.down_after_s
            )
            if not alive:
                continue
            row["stale"] = True
            row["method"] = "analytic"
            row["status"] = "no_snapshot" if age is None else "stale"
            ttft = analytic_ttft(st, q.prompt_tokens, now)
            row["ttft_s"] = ttft if math.isfinite(ttft) else None
            if not math.isfinite(ttft):
                row["status"] = "overloaded"
            if st.snap is not None:
                st.apply_lengths()
                self._load_counters(row, st)  # the last known load, aged (``age_s`` says how much)
        if bea_rows:
            await self._run_bea(query, q, bea_rows, rows)
        for r in rows:
            self.m.methods.labels(method=r["method"]).inc()
        return {"v": REPLY_SCHEMA, "query_id": query.get("id", q.id), "worker": self.name, "estimates": rows}

    def _age_for(self, st: InstanceState, age: float) -> float:
        """The age the replay compensates for: the snapshot's age (libbea runs the residents
        through every step that starts before it, then inserts the query), or 0 when compensation
        is off or the snapshot is async-mode (it already carries its in-flight batch)."""
        if not self.cfg.compensate_staleness or st.snap.async_scheduling:
            return 0.0
        return max(0.0, age)

    async def _run_bea(self, query: dict[str, Any], q: Any, bea_rows: list[tuple[int, InstanceState, int, float]],
                       rows: list[dict[str, Any]]) -> None:
        groups: dict[int, list[tuple[int, InstanceState, int, float]]] = {}
        for item in bea_rows:
            groups.setdefault(item[2], []).append(item)
        residents = sum(st.snap.n_running + st.snap.n_waiting for _, st, _, _ in bea_rows)
        for hit, items in groups.items():
            qd = {"id": q.id, "prompt_tokens": q.prompt_tokens, "max_tokens": q.max_tokens,
                  "prefix_hit_tokens": hit, "priority": int(query.get("priority", 0) or 0)}
            snaps = [st.snap for _, st, _, _ in items]
            betas = [list(st.calibration.beta) for _, st, _, _ in items]
            ages = [self._age_for(st, age) for _, st, _, age in items]
            try:
                if residents > EXECUTOR_RESIDENTS:
                    res = await asyncio.get_running_loop().run_in_executor(None, self._many, snaps, qd, betas, ages)
                else:
                    res = self._many(snaps, qd, betas, ages)
            except ValueError:
                res = [self._one(s, qd, b, a) for s, b, a in zip(snaps, betas, ages, strict=True)]
            for (k, st, _, _), (ttft, n_batches, status) in zip(items, res, strict=True):
                row = rows[k]
                row["method"] = "bea" if status != "error" else "none"
                row["status"] = status
                row["n_batches"] = n_batches
                row["ttft_s"] = ttft if isinstance(ttft, float) and math.isfinite(ttft) else None
                self._load_counters(row, st)

    def _load_counters(self, row: dict[str, Any], st: InstanceState) -> None:
        """Per-instance load counters from the snapshot held (for load-based baselines)."""
        snap = st.snap
        row["n_running"] = int(snap.n_running)
        row["n_waiting"] = int(snap.n_waiting)
        row["pending_prefill_tokens"] = int(snap.pending_prefill_tokens())
        row["pending_decode_tokens"] = int(snap.pending_decode_tokens(self.cfg.default_output_tokens))
        theta = st.calibration.theta
        row["theta"] = theta if theta is not None else None

    def _many(self, snaps: list[Any], qd: dict[str, Any], betas: list[list[float]],
              ages: list[float]) -> list[tuple[float, int, str]]:
        return libbea.estimate_many(snaps, qd, betas, default_output_tokens=self.cfg.default_output_tokens,
                                    overrun_fraction=self.cfg.overrun_fraction, ages=ages)

    def _one(self, snap: Any, qd: dict[str, Any], beta: list[float], age: float) -> tuple[float, int, str]:
        try:
            r = libbea.estimate(snap, qd, beta=beta, default_output_tokens=self.cfg.default_output_tokens,
                                overrun_fraction=self.cfg.overrun_fraction, age_s=age)
            return float(r["ttft_s"]), int(r["n_batches"]), str(r["status"])
        except ValueError:
            return math.inf, 0, "error"


def parse_candidates(raw: Any) -> list[tuple[str, int]]:
    """``instances``: a list of ids or of ``{instance, prefix_hit_tokens}`` maps."""
    if not isinstance(raw, list) or not raw:
        raise BearError(ErrorCode.BAD_REQUEST, "instances must be a non-empty list")
    if len(raw) > MAX_CANDIDATES:
        raise BearError(ErrorCode.TOO_LARGE, f"at most {MAX_CANDIDATES} candidate instances")
    out: list[tuple[str, int]] = []
    for c in raw:
        if isinstance(c, str) and c:
            out.append((c, 0))
        elif isinstance(c, dict) and isinstance(c.get("instance"), str) and c["instance"]:
            hit = c.get("prefix_hit_tokens", 0)
            if not isinstance(hit, int) or isinstance(hit, bool) or hit < 0:
                raise BearError(ErrorCode.BAD_REQUEST, "prefix_hit_tokens must be a non-negative integer")
            out.append((c["instance"], hit))
        else:
            raise BearError(ErrorCode.BAD_REQUEST, "each instance must be an id or {instance, prefix_hit_tokens}")
    return out


def decode_calibration(value: bytes) -> dict[str, Any]:
    """A ``bear_calibration`` value: msgpack ``bear.calibration/1`` (JSON accepted too)."""
    try:
        d = unpack(value)
    except BearError:
        d = json.loads(value)
    if not isinstance(d, dict):
        raise ValueError("calibration entry is not a map")
    return d
