"""Publish one instance's state on NATS: ``bear.snapshot.<id>`` and ``bear.batches.<id>``.

The one publication path of the real-vLLM snapshotter and the simulated instance (design.md §2,
§3, §6), so that estimators cannot tell them apart. The policy (docs/contract.md, "Publication"):

* **Every step.** ``snapshot(d)`` queues the state after a step; ``publish_snapshots()`` (called
  by ``run()``, or by a caller that reads faster than it publishes) sends them oldest first. The
  queue is bounded: a caller reads only ``room()`` new steps at a time, so steps are never dropped
  from the middle of the stream. With ``min_interval_s`` > 0 only the newest pending snapshot is
  kept and at most one per interval goes out (coalescing; counted).
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

from bear.instance.kv_stream import KvStream
from bear.instance.metrics import PublisherMetrics
from bear.protocol.codec import pack
from bear.protocol.messages import KvOp
from bear.protocol.subjects import BATCH_SCHEMA, SNAPSHOT_SCHEMA, Subjects

log = structlog.get_logger("bear.instance")


class InstancePublisher:
    def __init__(self, nc: Any, instance: str, subjects: Subjects | None = None, *, min_interval_s: float = 0.0,
                 idle_snapshot_s: float = 0.5, snapshot_buffer: int = 256, batch_flush_s: float = 0.2,
                 batch_buffer: int = 4096, metrics: PublisherMetrics | None = None,
                 engine_alive: Callable[[], bool] = lambda: True,
                 initial: Callable[[], dict[str, Any] | None] = lambda: None, kv_events: bool = False) -> None:
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
        self._batch_subject = self.subjects.batches(instance)
        self._pending: deque[dict[str, Any]] = deque()
        self._batches: deque[dict[str, Any]] = deque(maxlen=batch_buffer)
        self._last: dict[str, Any] | None = None  # the newest snapshot sent (idle re-sends)
        self._last_sent = 0.0  # monotonic
        self._wake = asyncio.Event()
        self._closed = False
        self.kv = KvStream(instance, self.subjects) if kv_events else None
        self.log = log.bind(instance=instance)

    # ------------------------------------------------------------------ engine side (sync, cheap)
    def room(self) -> int:
        """How many more snapshots ``snapshot`` takes before the caller must let them go out."""
        return 1 << 30 if self.min_interval_s > 0 else max(0, self.snapshot_buffer - len(self._pending))

    def snapshot(self, snap: dict[str, Any]) -> None:
        """Queue the state after one step (a ``bear.snapshot/1`` map; ``v``/``instance`` filled in)."""
        snap.setdefault("v", SNAPSHOT_SCHEMA)
        snap.setdefault("instance", self.instance)
        if self.min_interval_s > 0 and self._pending:
            self.metrics.snapshots_dropped.labels("coalesced").inc(len(self._pending))
            self._pending.clear()
        self._pending.append(snap)
        self._wake.set()

    def batch(self, record: dict[str, Any]) -> None:
        """Queue one ``bear.batch/1`` record (``{seq, duration_s, items}``)."""
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
        while self._pending:
            snap = self._pending.popleft()
            if await self._send(self._snap_subject, pack(snap)):
                self._last_sent = time.monotonic()
                self._last = snap
                self.metrics.snapshots_published.inc()
            else:
                self.metrics.snapshots_dropped.labels("publish_error").inc()

    async def publish_batches(self) -> None:
        if not self._batches or not self._connected():
            return  # the bounded buffer drops the oldest while NATS is away
        items = list(self._batches)
        self._batches.clear()
        if await self._send(self._batch_subject, pack(items)):
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
        beat = {**last, "v": SNAPSHOT_SCHEMA, "instance": self.instance, "time": time.time(), "idle": True}
        if await self._send(self._snap_subject, pack(beat)):
            self._last_sent = time.monotonic()
            self._last = beat
            self.metrics.snapshots_published.inc()
            self.metrics.idle_resends.inc()

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
