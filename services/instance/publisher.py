"""Publish one instance's state on NATS: ``bear.delta.<id>``, ``bear.snapshot.<id>`` and
``bear.batches.<id>``; answer ``bear.resync.<id>``.

The one publication path of the real-vLLM snapshotter and the simulated instance (design.md §2,
§3, §6), so that estimators cannot tell them apart. The policy (docs/contract.md, "Publication"):

* **Every step.** ``snapshot(d)`` queues the state after a step; ``publish_snapshots()`` (called
  by ``run()``, or by a caller that reads faster than it publishes) sends them oldest first. The
  queue is bounded: a caller reads only ``room()`` new steps at a time, so steps are never dropped
  from the middle of the stream. With ``min_interval_s`` > 0 only the newest pending snapshot is
  kept and at most one per interval goes out (coalescing; counted).
* **Deltas and full snapshots** (``bear.instance.delta.StateStream``). Each state goes out as a
  ``bear.delta/1`` against the state sent before it (``deltas``: the step's change as the caller
  gave it, else computed from the two states), and as a full snapshot every
  ``full_every`` states (1: every state, as before deltas), whenever no delta can express the
  change (the first state, a new engine generation), and as the answer to a resync request
  (unicast, at most ``resync_per_s`` per second).
* **No stale state.** While NATS is down pending snapshots are dropped (an estimator must not get
  a burst of old states when it comes back); batch records wait in a bounded drop-oldest buffer.
* **Idle re-send.** An engine with nothing running or waiting does not step, so its state cannot
  change: while ``engine_alive()`` holds, its last snapshot is re-sent every ``idle_snapshot_s``
  with ``time`` refreshed and ``idle: true`` (same ``seq``). An engine that has not stepped at all
  yet sends ``initial()`` (its empty state). A busy engine that stops stepping gets nothing: its
  snapshot ages and estimators fall back.
* **Batch records** go out as msgpack lists of ``bear.batch/1`` every ``batch_flush_s``.
* **Prefix cache** (``kv_events=True``): what each step did to the cache goes out on
  ``bear.kv.<id>`` as soon as it is given, and the whole cache on a resync request
  (``bear.instance.kv_stream``).

``snapshot`` and ``batch`` are synchronous and cheap: they are called from engine loops that must
not wait on the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from bear.instance.delta import StateStream
from bear.instance.kv_stream import KvStream
from bear.instance.metrics import PublisherMetrics
from bear.protocol.batch import BatchRecord, encode_batches
from bear.protocol.codec import pack
from bear.protocol.errors import BearError, ErrorCode, error_reply
from bear.protocol.messages import KvOp, ResyncRequest, decode, encode
from bear.protocol.subjects import BATCH_SCHEMA, SNAPSHOT_SCHEMA, Subjects

log = structlog.get_logger("bear.instance")


class InstancePublisher:
    def __init__(self, nc: Any, instance: str, subjects: Subjects | None = None, *, min_interval_s: float = 0.0,
                 idle_snapshot_s: float = 0.5, snapshot_buffer: int = 256, batch_flush_s: float = 0.2,
                 batch_buffer: int = 4096, metrics: PublisherMetrics | None = None,
                 engine_alive: Callable[[], bool] = lambda: True,
                 initial: Callable[[], dict[str, Any] | None] = lambda: None, deltas: bool = True,
                 full_every: int = 256, resync_per_s: float = 20.0, generation: int = 0,
                 kv_events: bool = False) -> None:
        self.nc = nc  # None until connected (the snapshotter connects in the background)
        self.instance = instance
        self.subjects = subjects or Subjects()
        self.min_interval_s = min_interval_s
        self.idle_snapshot_s = idle_snapshot_s
        self.snapshot_buffer = snapshot_buffer
        self.batch_flush_s = batch_flush_s
        self.metrics = metrics or PublisherMetrics()
        self.engine_alive = engine_alive
        self.initial = initial
        self._snap_subject = self.subjects.snapshot(instance)
        self._delta_subject = self.subjects.delta(instance)
        self.stream = StateStream(deltas=deltas, full_every=full_every)
        self.generation = generation  # stamped on every state queued (the snapshotter's: per engine start)
        self.resync_per_s = resync_per_s
        self._resync_tokens = max(1.0, resync_per_s)
        self._resync_refill = time.monotonic()
        self._resync_sub: Any = None
        self._batch_subject = self.subjects.batches(instance)
        self._pending: deque[tuple[dict[str, Any], dict[str, Any] | None]] = deque()  # (state, change)
        self._batches: deque[BatchRecord | dict[str, Any]] = deque(maxlen=batch_buffer)
        self._last: dict[str, Any] | None = None  # the newest snapshot sent (idle re-sends)
        self._last_sent = 0.0  # monotonic
        self._wake = asyncio.Event()
        # One sender of states at a time: the snapshotter's reader and ``run()`` both call
        # ``publish_snapshots``, and ``nc.publish`` can yield (its buffer full, a loaded host), so
        # without it one caller's full snapshot went out after the other caller's newer states.
        self._sending = asyncio.Lock()
        self._closed = False
        self.kv = KvStream(instance, self.subjects) if kv_events else None
        self.log = log.bind(instance=instance)

    # ------------------------------------------------------------------ engine side (sync, cheap)
    def room(self) -> int:
        """How many more snapshots ``snapshot`` takes before the caller must let them go out."""
        return 1 << 30 if self.min_interval_s > 0 else max(0, self.snapshot_buffer - len(self._pending))

    def snapshot(self, snap: dict[str, Any], change: dict[str, Any] | None = None,
                 table: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Queue the state after one step (a ``bear.snapshot/1`` map; ``v``/``instance`` filled in)
        and, when the caller knows it, the step's change as a ``bear.delta/1`` body: forwarded as
        the delta when the state sent before is the step before (``delta.forward_delta``).
        ``table``: writes the block table in full on a state (``PoolTable.full``), called now
        when this state will go out in full (``StateStream.with_table``)."""
        snap.setdefault("v", SNAPSHOT_SCHEMA)
        snap.setdefault("instance", self.instance)
        snap.setdefault("generation", self.generation)
        self.stream.with_table(snap, change, table, ahead=len(self._pending), force=self.min_interval_s > 0)
        if self.min_interval_s > 0 and self._pending:
            self.metrics.snapshots_dropped.labels("coalesced").inc(len(self._pending))
            self._pending.clear()
        self._pending.append((snap, change))
        self._wake.set()

    def batch(self, record: BatchRecord | dict[str, Any]) -> None:
        """Queue one ``bear.batch/1`` record, ``instance`` filled in: a ``BatchRecord`` (the sim
        engine), or the snapshotter's map with the same keys (built stdlib-only beside vLLM)."""
        if isinstance(record, BatchRecord):
            if not record.instance:
                record.instance = self.instance
        else:
            record.setdefault("v", BATCH_SCHEMA)
            record.setdefault("instance", self.instance)
        if len(self._batches) == self._batches.maxlen:
            self.metrics.batches_dropped.inc()  # the deque drops the oldest
        self._batches.append(record)

    def kv_events(self, ops: list[KvOp], t: float | None = None) -> None:
        """What one step did to the prefix cache (needs ``kv_events=True``)."""
        if self.kv is not None and ops:
            self.kv.events(ops, t)
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ I/O side
    def _connected(self) -> bool:
        return self.nc is not None and bool(getattr(self.nc, "is_connected", True))

    async def publish_snapshots(self) -> None:
        """Send the pending snapshots (module doc: every step, or the newest per interval)."""
        if not self._pending:
            return
        if self.min_interval_s and time.monotonic() - self._last_sent < self.min_interval_s:
            return  # the newest pending one goes out when the interval has passed
        if self.nc is None:
            return  # not connected yet: hold them (bounded) — they are fresh, not stale
        if not self._connected():
            self.metrics.snapshots_dropped.labels("disconnected").inc(len(self._pending))
            self._pending.clear()
            return
        async with self._sending:
            await self._send_pending()

    async def _send_pending(self) -> None:
        m = self.metrics
        while self._pending:  # a caller that waited for the lock finds what the other one left
            snap, change = self._pending.popleft()
            full, delta = self.stream.encode(snap, change)
            ok = True
            if delta is not None:
                ok = await self._send(self._delta_subject, delta)
                if ok:
                    m.deltas_published.inc()
                    m.state_bytes.labels("delta").inc(len(delta))
            if full is not None and ok:
                ok = await self._send(self._snap_subject, full)
                if ok:
                    m.state_bytes.labels("full").inc(len(full))
            if ok:
                self._last_sent = time.monotonic()
                self._last = snap
                m.snapshots_published.inc()
            else:
                m.snapshots_dropped.labels("publish_error").inc()

    async def publish_batches(self) -> None:
        if not self._batches or not self._connected():
            return  # the bounded buffer drops the oldest while NATS is away
        items = list(self._batches)
        self._batches.clear()
        if await self._send(self._batch_subject, encode_batches(items)):
            self.metrics.batches_published.inc(len(items))
        else:
            self.metrics.batches_dropped.inc(len(items))

    async def publish_kv(self) -> None:
        """The prefix-cache stream: queued events, then a state when one is wanted."""
        kv = self.kv
        if kv is None or self.nc is None:
            return
        if not self._connected():
            if kv.pending:
                kv.disconnected()
            return
        try:
            await kv.subscribe(self.nc)
            await kv.publish(self.nc)
        except Exception as exc:  # a publisher must survive reconnects and closed connections
            kv.disconnected()
            self.log.warning("kv_publish_failed", error=repr(exc))

    async def resend_idle(self) -> None:
        """The idle re-send of the module doc (nothing while snapshots are pending)."""
        if self.idle_snapshot_s <= 0 or self._pending or not self._connected() or not self.engine_alive():
            return
        if time.monotonic() - self._last_sent < self.idle_snapshot_s:
            return
        last = self._last if self._last is not None else self.initial()
        if last is None or last.get("running") or last.get("waiting"):
            return
        if self._sending.locked():
            return  # states are going out: the engine is not idle
        beat = {**last, "v": SNAPSHOT_SCHEMA, "instance": self.instance, "time": time.time(), "idle": True}
        beat.setdefault("generation", self.generation)
        async with self._sending:
            sent = await self._send(self._snap_subject, pack(beat))
        if sent:
            self._last_sent = time.monotonic()
            self._last = beat
            self.stream.sent_full(beat)
            self.metrics.snapshots_published.inc()
            self.metrics.idle_resends.inc()

    # ------------------------------------------------------------------ resync (request-reply)
    async def serve_resync(self) -> None:
        """Answer ``bear.resync.<id>`` (once connected; ``run()`` calls it every loop turn)."""
        if self._resync_sub is not None or not self._connected():
            return
        try:
            self._resync_sub = await self.nc.subscribe(self.subjects.resync(self.instance), cb=self._on_resync)
        except Exception as exc:  # NATS away: the next loop turn tries again
            self.log.warning("resync_subscribe_failed", error=repr(exc))

    def resync_reply(self, data: bytes) -> bytes:
        """The answer to one resync request: the newest state sent, as a full snapshot (the state
        the next delta applies to), or a coded error (bad request, rate limit, nothing sent yet)."""
        m = self.metrics
        try:
            decode(ResyncRequest, data)
        except BearError as exc:
            m.resyncs.labels("bad_request").inc()
            return encode(exc.reply())
        now = time.monotonic()
        rate = max(self.resync_per_s, 1e-9)
        self._resync_tokens = min(max(1.0, rate), self._resync_tokens + (now - self._resync_refill) * rate)
        self._resync_refill = now
        if self._resync_tokens < 1.0:
            m.resyncs.labels("rate_limited").inc()
            return encode(error_reply(ErrorCode.OVERLOADED, f"at most {self.resync_per_s:g} resyncs/s; retry"))
        last = self.stream.last
        if last is None:
            last = self.initial()
            if last is not None:
                last = {**last, "v": SNAPSHOT_SCHEMA, "instance": self.instance}
                last.setdefault("generation", self.generation)
        if last is None:
            m.resyncs.labels("no_state").inc()
            return encode(error_reply(ErrorCode.NOT_FOUND, f"{self.instance} has published no state yet"))
        self._resync_tokens -= 1.0
        m.resyncs.labels("answered").inc()
        if "pool_table" not in last:
            self.stream.want_table()  # a block table kept step by step: the next state carries it in full
        full = pack(last)
        m.state_bytes.labels("resync").inc(len(full))
        return full

    async def _on_resync(self, msg: Any) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(self.resync_reply(msg.data))
        except Exception as exc:  # the asker went away, NATS reconnecting
            self.log.debug("resync_reply_failed", error=repr(exc))

    async def _send(self, subject: str, payload: bytes) -> bool:
        try:
            await self.nc.publish(subject, payload)
            return True
        except Exception as exc:  # a publisher must survive reconnects and closed connections
            self.log.warning("publish_failed", subject=subject, error=repr(exc))
            return False

    async def run(self) -> None:
        """Publish until ``close()``: snapshots as they come, batches every ``batch_flush_s``, idle
        re-sends; never raises on NATS errors (counted instead)."""
        last_flush = time.monotonic()
        tick = min(x for x in (self.batch_flush_s, self.idle_snapshot_s or 1.0, 0.1) if x > 0)
        while not self._closed:
            timeout = tick
            if self._pending and self.min_interval_s > 0:
                timeout = min(timeout, max(1e-3, self._last_sent + self.min_interval_s - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            self._wake.clear()
            await self.serve_resync()
            await self.publish_snapshots()
            await self.publish_kv()
            if time.monotonic() - last_flush >= self.batch_flush_s:
                await self.publish_batches()
                last_flush = time.monotonic()
            await self.resend_idle()

    async def close(self) -> None:
        """Stop ``run()`` after sending what is pending."""
        self._closed = True
        self._wake.set()
        self.min_interval_s = 0.0
        await self.publish_snapshots()
        await self.publish_kv()
        await self.publish_batches()
        if self._resync_sub is not None:
            with contextlib.suppress(Exception):
                await self._resync_sub.unsubscribe()
            self._resync_sub = None
