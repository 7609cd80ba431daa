"""The snapshotter process: reads the plugin's ring, publishes ``bear.snapshot.<id>`` and
``bear.batches.<id>``, and keeps the instance's entry in the ``bear_instances`` KV bucket.

It never talks back to vLLM: whatever happens here (NATS down, slow consumers, a crash) the engine
only keeps overwriting its ring. While NATS is unreachable snapshots are dropped (a stale snapshot
is worse than none) and batch records wait in a bounded drop-oldest buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError

from bear.protocol.codec import pack
from bear.protocol.subjects import SNAPSHOT_SCHEMA, Subjects
from bear.runtime.shutdown import cancel_all
from bear.snapshotter.metrics import SnapshotterMetrics
from bear.snapshotter.records import BatchBuilder, RecordError, StepDecoder, to_snapshot
from bear.snapshotter.shm import ShmReader, pid_namespace

INSTANCE_SCHEMA = "bear.instance/1"
log = structlog.get_logger("bear.snapshotter")


@dataclass
class SnapshotterConfig:
    instance: str
    shm: str
    nats_url: str = "nats://127.0.0.1:4222"
    model: str = ""
    base_url: str = ""
    gpu: str = ""
    price_input_per_mtok: float = 0.0
    price_output_per_mtok: float = 0.0
    prefix: str = "bear"
    min_interval_s: float = 0.0
    batch_flush_s: float = 0.2
    batch_buffer: int = 4096
    snapshot_buffer: int = 256
    poll_interval_s: float = 0.002
    heartbeat_s: float = 0.5
    idle_snapshot_s: float = 0.5  # an idle engine's last snapshot is re-sent this often (0 = never)
    stale_after_s: float = 1.0
    on_down: str = "mark"  # "mark" | "delete"
    record_to: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Snapshotter:
    """One instance's publisher. ``run()`` until ``stop()``; every loop is independent so that a
    NATS outage never delays reading the ring."""

    def __init__(self, cfg: SnapshotterConfig, metrics: SnapshotterMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or SnapshotterMetrics()
        self.subjects = Subjects(cfg.prefix)
        self.nc: NATS | None = None
        self._kv: Any = None
        self._reader: ShmReader | None = None
        self._meta: dict[str, Any] = {}
        self._builder = BatchBuilder(cfg.instance)
        self._decoder = StepDecoder()
        self._resync_asked = 0.0  # monotonic time of the last full-record request (0: none pending)
        self._mismatch_logged = 0
        self._skip_logged = 0.0  # monotonic time of the last steps_skipped warning
        self._meta_logged = False
        self._batches: deque[dict[str, Any]] = deque(maxlen=cfg.batch_buffer)
        self._pending: deque[dict[str, Any]] = deque(maxlen=cfg.snapshot_buffer)
        self._last_publish = 0.0
        self._last_snap: dict[str, Any] | None = None  # the newest snapshot sent (idle re-sends)
        self._last_seq = -1
        self._status = "starting"
        self._status_dirty = True
        self._stop = asyncio.Event()
        self._record: IO[str] | None = None
        self._bad_logged = False
        self.log = log.bind(instance=cfg.instance)

    # ---- lifecycle -------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        if self.cfg.record_to:
            opener = gzip.open if self.cfg.record_to.endswith(".gz") else open
            self._record = opener(self.cfg.record_to, "at")  # type: ignore[assignment]
        tasks = [
            asyncio.create_task(self._connect_loop(), name="nats"),
            asyncio.create_task(self._read_loop(), name="read"),
            asyncio.create_task(self._batch_loop(), name="batches"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        try:
            await self._stop.wait()
        finally:
            await cancel_all(tasks)
            await self._final_status()
            if self._record is not None:
                self._record.close()
            if self.nc is not None and not self.nc.is_closed:
                # close() writes what is buffered; no drain(): nothing is subscribed here, and
                # nats-py's drain() swallows its cancellation and then flushes for up to 10 s
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.nc.close(), 2.0)
            if self._reader is not None:
                self._reader.close()

    # ---- NATS --------------------------------------------------------------------------------------
    async def _connect_loop(self) -> None:
        delay = 0.1
        while self.nc is None:
            try:
                self.nc = await nats.connect(
                    self.cfg.nats_url,
                    name=f"bear-snapshotter-{self.cfg.instance}",
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    connect_timeout=1.0,
                    ping_interval=2,
                    max_outstanding_pings=2,
                    pending_size=8 * 1024 * 1024,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error,
                )
                self.log.info("nats_connected", url=self.cfg.nats_url)
                self._status_dirty = True
            except Exception as exc:
                self.log.warning("nats_connect_failed", error=str(exc), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _on_disconnected(self) -> None:
        self.log.warning("nats_disconnected")

    async def _on_reconnected(self) -> None:
        self.log.info("nats_reconnected")
        self._kv = None
        self._status_dirty = True

    async def _on_error(self, exc: Exception) -> None:
        self.log.debug("nats_error", error=str(exc))

    def _connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def _kv_bucket(self) -> Any:
        if self._kv is None and self.nc is not None:
            js = self.nc.jetstream(timeout=1.0)
            bucket = self.subjects.instances_bucket
            try:
                self._kv = await js.key_value(bucket)
            except BucketNotFoundError:
                self._kv = await js.create_key_value(bucket=bucket, history=1)
        return self._kv

    # ---- registry ---------------------------------------------------------------------------------
    def registry_entry(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "v": INSTANCE_SCHEMA,
            "id": cfg.instance,
            "model": cfg.model,
            "base_url": cfg.base_url,
            "gpu": cfg.gpu,
            "prices": {
                "input_per_mtok": cfg.price_input_per_mtok,
                "output_per_mtok": cfg.price_output_per_mtok,
            },
            "status": self._status,
            "heartbeat": time.time(),
            "seq": self._last_seq,
            "generation": self._reader.generation if self._reader is not None else None,
            "vllm_version": self._meta.get("vllm_version"),
            "config": self._meta.get("config"),
            **cfg.extra,
        }

    async def _put_status(self) -> None:
        if not self._connected():
            return
        kv = await self._kv_bucket()
        if self._status == "down" and self.cfg.on_down == "delete":
            await kv.delete(self.cfg.instance)
        else:
            await kv.put(self.cfg.instance, pack(self.registry_entry()))
        self._status_dirty = False

    async def _heartbeat_loop(self) -> None:
        last = 0.0
        while True:
            now = time.monotonic()
            if self._status_dirty or now - last >= self.cfg.heartbeat_s:
                try:
                    await asyncio.wait_for(self._put_status(), 1.0)
                    last = now
                except Exception as exc:
                    self._kv = None
                    self.log.warning("registry_put_failed", error=repr(exc))
            await asyncio.sleep(0.05)

    async def _final_status(self) -> None:
        if self._status == "up":
            self._status = "down"
            try:
                await asyncio.wait_for(self._put_status(), 1.0)
            except Exception as exc:
                self.log.warning("registry_final_put_failed", error=repr(exc))

    def _set_status(self, status: str, **why: Any) -> None:
        if status != self._status:
            self.log.info("instance_status", status=status, **why)
            self._status = status
            self._status_dirty = True
            self.metrics.engine_up.set(1 if status == "up" else 0)

    # ---- ring --------------------------------------------------------------------------------------
    def _attach(self) -> bool:
        try:
            reader = ShmReader(self.cfg.shm)
        except (FileNotFoundError, ValueError):
            return False
        if self._reader is not None:
            self._reader.close()
        self._reader = reader
        self._meta = reader.meta()
        self._builder.reset()
        self._decoder = StepDecoder()
        self._resync_asked = 0.0
        self._meta_logged = False
        self._last_seq = -1
        self._last_snap = None
        self._bad_logged = False
        self.metrics.engine_restarts.inc()
        self.log.info("engine_attached", pid=reader.pid, generation=reader.generation,
                      vllm_version=self._meta.get("vllm_version"))  # fmt: skip
        return True

    def _writer_dead(self, r: ShmReader) -> str | None:
        if r.closed:
            return "closed"
        same_ns = self._meta.get("pid_namespace", pid_namespace()) == pid_namespace()
        if same_ns and r.writer_alive() is False:  # a pid from another namespace means nothing here
            return "pid_gone"
        if time.time() - r.heartbeat_s > self.cfg.stale_after_s:
            return "heartbeat_stale"
        return None

    async def _read_loop(self) -> None:
        while True:
            r = self._reader
            if r is None or r.replaced():
                if r is not None:
                    await self._drain_and_publish(r)  # what the old engine completed before the new region appeared
                if not self._attach() and r is None:
                    await asyncio.sleep(0.05)  # no engine yet
                    continue
                r = self._reader  # the new region, or the old one (removed) to report it dead
                assert r is not None
            dead = self._writer_dead(r)
            if dead is not None:
                await self._drain_and_publish(r)
                self._set_status("down", reason=dead)
                await asyncio.sleep(0.05)
                continue
            self._set_status("up")
            await self._drain_and_publish(r)
            await self._idle_snapshot(r)
            await asyncio.sleep(self.cfg.poll_interval_s)

    def _ask_full(self, r: ShmReader, why: str) -> None:
        """Ask the plugin for a full record (the mirror cannot go on without one); again at most
        every 0.5 s while none arrives."""
        now = time.monotonic()
        if self._resync_asked and now - self._resync_asked < 0.5:
            return
        self._resync_asked = now
        ok = r.request_full()
        self.metrics.resync_requests.inc()
        self.log.info("resync_requested", reason=why, writable=ok)

    async def _drain_and_publish(self, r: ShmReader) -> None:
        """Read the ring and publish until it is empty, taking only as many records per read as
        the bounded publish buffer has room for: a reader that fell behind leaves the rest in the
        ring (itself bounded; what it overwrites is counted as skipped) instead of dropping
        snapshots from the middle of the stream."""
        while True:
            room = 4096 if self.cfg.min_interval_s > 0 else self.cfg.snapshot_buffer - len(self._pending)
            more = room > 0 and self._drain(r, limit=room) == room  # a full read: the ring may hold more
            await self._publish_snapshot()
            if not more or self._pending:  # unpublished (not connected, coalescing): the ring keeps the rest
                return
            await asyncio.sleep(0)  # catching up must not starve the heartbeat and batch loops

    def _drain(self, r: ShmReader, *, limit: int) -> int:
        """Decode up to ``limit`` records into the publish and batch buffers; how many were read."""
        res = r.poll(limit=limit)
        m = self.metrics
        if res.skipped:
            m.steps_skipped.inc(res.skipped)
            self._decoder.reset()  # the deltas in between are gone: wait for a full record
            now = time.monotonic()
            if now - self._skip_logged >= 1.0:  # a reader that stays behind would log every poll
                self._skip_logged = now
                self.log.warning("steps_skipped", count=res.skipped,
                                 why="the ring overwrote records before this reader got them")  # fmt: skip
        if res.torn_retries:
            m.torn_retries.inc(res.torn_retries)
        for raw in res.records:
            try:
                step = self._decoder.decode(raw)
            except RecordError as exc:
                if not self._bad_logged:  # once per engine generation: a version mismatch repeats
                    self.log.error("bad_record", error=str(exc), plugin_meta=self._meta)
                    self._bad_logged = True
                m.steps_skipped.inc()
                continue
            problem = self._decoder.last_problem
            if problem is not None:
                m.delta_mismatches.inc()
                self._mismatch_logged += 1
                if self._mismatch_logged <= 20 or self._mismatch_logged % 1000 == 0:
                    self.log.error("delta_mismatch", seq=raw[1], problem=problem, count=self._mismatch_logged,
                                   resync="from this full record" if step is not None else "requested")  # fmt: skip
            if step is None:  # a delta without the state before it: never publish a guess
                m.steps_undecodable.inc()
                self._ask_full(r, problem or "no state to apply the delta to (first records, or records lost)")
                continue
            if step["record"] != "delta":
                self._resync_asked = 0.0
            m.records.labels(step["record"]).inc()
            m.steps_read.inc()
            if step["overhead_ns"]:
                m.plugin_overhead.observe(step["overhead_ns"] / 1e9)
                m.plugin_overhead_cpu.observe(step["overhead_cpu_ns"] / 1e9)
            if self._record is not None:  # the metadata goes with the generation's first step logged
                first = not self._meta_logged
                self._meta_logged = True
                self._record.write(json.dumps({"meta": self._meta, "step": step} if first else step) + "\n")
            self._last_seq = step["seq"]
            snap = to_snapshot(
                step, self._meta.get("config", {}), instance=self.cfg.instance, model=self.cfg.model
            )
            snap["v"] = snap["schema"]
            if self.cfg.min_interval_s > 0:
                if self._pending:
                    m.snapshots_dropped.labels("coalesced").inc()
                self._pending.clear()
            self._pending.append(snap)  # never full here: _drain_and_publish reads only what fits
            for b in self._builder.feed(step):
                if len(self._batches) == self._batches.maxlen:
                    m.batches_dropped.inc()
                self._batches.append(b)
        return len(res.records)

    async def _publish_snapshot(self) -> None:
        """Publish pending snapshots oldest first (every step), or only the newest one per
        ``min_interval_s`` when coalescing."""
        if not self._pending:
            return
        now = time.monotonic()
        if self.cfg.min_interval_s and now - self._last_publish < self.cfg.min_interval_s:
            return  # keep the newest pending: it goes out when the interval has passed
        if self.nc is None:
            return  # not connected yet: hold (bounded) — they are fresh, not stale
        if not self._connected():
            self.metrics.snapshots_dropped.labels("disconnected").inc(len(self._pending))
            self._pending.clear()
            return
        assert self.nc is not None
        subject = self.subjects.snapshot(self.cfg.instance)
        while self._pending:
            snap = self._pending.popleft()
            try:
                await self.nc.publish(subject, pack(snap))
            except Exception as exc:
                self.metrics.snapshots_dropped.labels("publish_error").inc()
                self.log.warning("snapshot_publish_failed", error=repr(exc))
                continue
            self._last_publish = now
            self._last_snap = snap
            self.metrics.snapshots_published.inc()

    async def _idle_snapshot(self, r: ShmReader) -> None:
        """An idle engine (nothing running or waiting) does not step, so the plugin writes nothing
        and its state cannot change: re-send the last snapshot every ``idle_snapshot_s`` with
        ``time`` refreshed and ``idle: true`` (same ``seq``: not a new step), so that estimators tell idle from stale (the rule of
        ``bear.instance.publisher.InstancePublisher``). Called only while the plugin's own heartbeat
        is fresh (the engine is alive). An engine that has not stepped at all since it started gets
        an empty snapshot (every block free but vLLM's null block). A busy engine that stops
        stepping gets nothing: its snapshot ages and the estimator falls back."""
        if self.cfg.idle_snapshot_s <= 0 or self._pending or not self._connected():
            return
        now = time.monotonic()
        if now - self._last_publish < self.cfg.idle_snapshot_s:
            return
        last = self._last_snap
        if last is None:
            n_blocks = int(self._meta.get("config", {}).get("num_gpu_blocks") or 0)
            if r.count > 0 or n_blocks <= 0:
                return  # steps exist but none was published yet, or no engine config to build from
            last = {"schema": SNAPSHOT_SCHEMA, "v": SNAPSHOT_SCHEMA, "instance": self.cfg.instance,
                    "model": self.cfg.model, "seq": 0, "config": self._meta.get("config", {}),
                    "free_blocks": n_blocks - 1, "running": [], "waiting": [], "inflight": None}  # fmt: skip
        elif last.get("running") or last.get("waiting"):
            return
        beat = {**last, "time": time.time(), "idle": True}
        assert self.nc is not None
        try:
            await self.nc.publish(self.subjects.snapshot(self.cfg.instance), pack(beat))
        except Exception as exc:
            self.log.warning("snapshot_publish_failed", error=repr(exc))
            return
        self._last_publish = now
        self._last_snap = beat
        self.metrics.snapshots_published.inc()

    async def _batch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.batch_flush_s)
            if not self._batches:
                continue
            if not self._connected():
                continue  # the bounded buffer drops the oldest while we wait
            assert self.nc is not None
            items = list(self._batches)
            self._batches.clear()
            try:
                await self.nc.publish(self.subjects.batches(self.cfg.instance), pack(items))
                self.metrics.batches_published.inc(len(items))
            except Exception as exc:
                self.metrics.batches_dropped.inc(len(items))
                self.log.warning("batch_publish_failed", error=repr(exc))
