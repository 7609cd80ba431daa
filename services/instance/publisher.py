"""Publish one instance's state on NATS: ``bear.snapshot.<id>`` and ``bear.batches.<id>``.

The one publication path shared by the real-vLLM snapshotter and the simulated instance
(design.md §2, §3, §6), so that estimators cannot tell them apart.

Rules it implements:

* ``snapshot(d)`` and ``batch(r)`` are synchronous, cheap and never wait on the network: they are
  called from an engine loop that must not be slowed. A background task (``run()``) does the I/O.
* Snapshots coalesce: only the newest unsent snapshot is kept (the estimators only want the newest
  one too). ``min_interval_s`` > 0 additionally rate-limits publication.
* Idle heartbeat: an engine with no running and no waiting request does not step, so its state
  cannot change; its last snapshot is re-published every ``heartbeat_s`` with ``time`` refreshed,
  so that consumers can tell "idle" from "stale". A busy engine that stops stepping gets no
  heartbeat: its snapshot ages and consumers fall back (estimator docs).
* Batch records are grouped (a msgpack list of ``bear.batch/1``) and flushed every ``flush_s`` or
  when ``group_max`` records are buffered; the buffer is bounded (``max_buffered``), oldest dropped
  and counted.

Usage::

    pub = InstancePublisher(nc, "inst-a")
    task = asyncio.create_task(pub.run())
    ...  # in the engine loop, after every step:
    pub.batch({"seq": s, "duration_s": d, "items": [...]})
    pub.snapshot(snapshot_dict)       # a bear.snapshot/1 map (instance/v filled in if missing)
    ...
    await pub.close()                 # flushes what is buffered
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from bear.protocol.codec import pack
from bear.protocol.subjects import BATCH_SCHEMA, SNAPSHOT_SCHEMA, Subjects


@dataclass
class PublisherStats:
    snapshots_published: int = 0
    snapshots_coalesced: int = 0  # replaced by a newer one before being sent
    heartbeats: int = 0
    batch_records_published: int = 0
    batch_records_dropped: int = 0
    publish_errors: int = 0


class InstancePublisher:
    """Background publisher of one instance's snapshots and batch records (see module doc)."""

    def __init__(
        self,
        nc: Any,
        instance: str,
        subjects: Subjects | None = None,
        *,
        min_interval_s: float = 0.0,
        heartbeat_s: float = 0.5,
        flush_s: float = 0.1,
        group_max: int = 64,
        max_buffered: int = 4096,
    ) -> None:
        self.nc = nc
        self.instance = instance
        self.subjects = subjects or Subjects()
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.flush_s = flush_s
        self.group_max = group_max
        self.stats = PublisherStats()
        self._snap_subject = self.subjects.snapshot(instance)
        self._batch_subject = self.subjects.batches(instance)
        self._pending_snapshot: dict[str, Any] | None = None
        self._last_snapshot: dict[str, Any] | None = None
        self._last_sent = 0.0
        self._records: deque[dict[str, Any]] = deque(maxlen=max_buffered)
        self._wake = asyncio.Event()
        self._closed = False

    # ------------------------------------------------------------------ engine side (sync, cheap)
    def snapshot(self, snap: dict[str, Any]) -> None:
        """Offer the newest ``bear.snapshot/1`` map; replaces an unsent older one."""
        snap.setdefault("v", SNAPSHOT_SCHEMA)
        snap.setdefault("instance", self.instance)
        if self._pending_snapshot is not None:
            self.stats.snapshots_coalesced += 1
        self._pending_snapshot = snap
        self._wake.set()

    def batch(self, record: dict[str, Any]) -> None:
        """Queue one ``bear.batch/1`` record (``{seq, duration_s, items}``)."""
        record.setdefault("v", BATCH_SCHEMA)
        record.setdefault("instance", self.instance)
        if len(self._records) == self._records.maxlen:
            self.stats.batch_records_dropped += 1  # deque drops the oldest
        self._records.append(record)
        if len(self._records) >= self.group_max:
            self._wake.set()

    # ------------------------------------------------------------------ I/O side
    async def run(self) -> None:
        """Publish until ``close()``; never raises on NATS errors (counted instead)."""
        last_flush = time.monotonic()
        while not self._closed:
            timeout = self.flush_s
            if self._pending_snapshot is not None and self.min_interval_s > 0:
                timeout = min(timeout, max(0.0, self._last_sent + self.min_interval_s - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(timeout, 1e-3))
            self._wake.clear()
            await self._send_snapshot_if_due()
            now = time.monotonic()
            if len(self._records) >= self.group_max or (self._records and now - last_flush >= self.flush_s):
                await self._flush_records()
                last_flush = now
            await self._heartbeat_if_idle()

    async def close(self) -> None:
        """Stop ``run()`` after sending what is pending."""
        self._closed = True
        self._wake.set()
        self.min_interval_s = 0.0
        await self._send_snapshot_if_due()
        await self._flush_records()

    async def _publish(self, subject: str, payload: bytes) -> bool:
        try:
            await self.nc.publish(subject, payload)
            return True
        except Exception:  # a publisher must survive NATS reconnects and closed connections
            self.stats.publish_errors += 1
            return False

    async def _send_snapshot_if_due(self) -> None:
        snap = self._pending_snapshot
        if snap is None:
            return
        if self.min_interval_s > 0 and time.monotonic() - self._last_sent < self.min_interval_s:
            return
        self._pending_snapshot = None
        if await self._publish(self._snap_subject, pack(snap)):
            self.stats.snapshots_published += 1
        self._last_snapshot = snap
        self._last_sent = time.monotonic()

    async def _flush_records(self) -> None:
        while self._records:
            group = [self._records.popleft() for _ in range(min(self.group_max, len(self._records)))]
            if await self._publish(self._batch_subject, pack(group)):
                self.stats.batch_records_published += len(group)

    async def _heartbeat_if_idle(self) -> None:
        last = self._last_snapshot
        if last is None or self._pending_snapshot is not None or self.heartbeat_s <= 0:
            return
        if time.monotonic() - self._last_sent < self.heartbeat_s:
            return
        if last.get("running") or last.get("waiting"):
            return  # busy but not stepping: let the snapshot age (consumers fall back)
        beat = dict(last)
        beat["time"] = time.time()
        if await self._publish(self._snap_subject, pack(beat)):
            self.stats.heartbeats += 1
        self._last_snapshot = beat
        self._last_sent = time.monotonic()
