"""The snapshotter process: reads the plugin's ring, publishes ``bear.delta.<id>``,
``bear.snapshot.<id>`` and ``bear.batches.<id>`` (answering ``bear.resync.<id>``), and keeps the
instance's entry in the ``bear_instances`` KV bucket. When
the engine publishes KV cache events (vLLM ``--kv-events-config``, ZMQ) it also mirrors them on
``bear.kv.<id>`` (``kv_events``), registers how the engine hashes its blocks, and puts the
engine's tokenizer bundle in the ``bear_tokenizers`` object store (its id in the registry entry).

It never talks back to vLLM: whatever happens here (NATS down, slow consumers, a crash) the engine
only keeps overwriting its ring. While NATS is unreachable snapshots are dropped (a stale snapshot
is worse than none) and batch records wait in a bounded drop-oldest buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import nats
import structlog
from nats.aio.client import Client as NATS

from bear.instance.publisher import InstancePublisher
from bear.instance.record import Registration, instance_record
from bear.prefix.tracked_pool import PoolTable, TrackedPool
from bear.protocol import schemas
from bear.protocol.jsonl import open_text
from bear.protocol.messages import KvOp, PrefixCacheInfo
from bear.protocol.subjects import SNAPSHOT_SCHEMA, Subjects
from bear.runtime.service import auth_options
from bear.runtime.shutdown import cancel_all
from bear.snapshotter.kv_events import KvEventsReader
from bear.snapshotter.metrics import SnapshotterMetrics
from bear.snapshotter.records import BatchBuilder, RecordError, to_snapshot
from bear.snapshotter.shm import ShmReader, pid_namespace
from bear.snapshotter.step_decoder import StepDecoder

INSTANCE_SCHEMA = schemas.INSTANCE
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
    deltas: bool = True  # publish bear.delta/1 every step (bear.delta.<id>)
    full_every: int = 256  # a full bear.snapshot/1 every this many steps (1: every step; 0: only when needed)
    batch_flush_s: float = 0.2
    batch_buffer: int = 4096
    snapshot_buffer: int = 256
    poll_interval_s: float = 0.002
    heartbeat_s: float = 0.5
    idle_snapshot_s: float = 0.5  # an idle engine's last snapshot is re-sent this often (0 = never)
    stale_after_s: float = 1.0
    on_down: str = "mark"  # "mark" | "delete"
    record_to: str | None = None
    tokenizer_dir: str | None = None  # where the engine's tokenizer is (default: the path vLLM loaded)
    register_tokenizer: bool = True  # put the tokenizer bundle in the object store, its id in the registry
    kv_events: bool = True  # mirror the engine's KV events when it publishes them
    # BEAR_SNAPSHOT_BLOCK_OPS=1: a step already superseded by a newer one read in the same poll is
    # published without the pool's description while describing takes longer than this, in
    # processor time (a large pool: the snapshotter must not fall behind the engine); below it,
    # every step is described
    describe_superseded_below_s: float = 0.001
    # BEAR_SNAPSHOT_BLOCK_OPS=1: keep the block table step by step (PoolTable) and send its change
    # in each step's delta, the whole table only in full snapshots (issue 28); off: every step
    # described in full (TrackedPool.describe: O(pool) a step) and sent as a full snapshot
    pool_deltas: bool = True


DESCRIBE_SAMPLES = 5  # descriptions timed before a pool can be judged slow to describe


def prefix_info(meta: dict[str, Any], *, kv_events: bool = True) -> PrefixCacheInfo | None:
    """The registry's prefix-cache entry from the plugin's metadata (None: no cache, or a seed the
    plugin could not read — a mirror would hash wrong); also what a recorded run is replayed with."""
    pc = meta.get("prefix_cache")
    if not isinstance(pc, dict):
        return None
    seed = pc.get("hash_seed")
    if seed is None:
        return None
    return PrefixCacheInfo(enabled=bool(pc.get("enabled")), block_size=int(pc.get("block_size") or 16),
                           hash_algo=str(pc.get("hash_algo", "sha256")), hash_seed=str(seed),
                           events=bool(pc.get("events")) and kv_events)


class Snapshotter:
    """One instance's publisher. ``run()`` until ``stop()``; every loop is independent so that a
    NATS outage never delays reading the ring."""

    def __init__(self, cfg: SnapshotterConfig, metrics: SnapshotterMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or SnapshotterMetrics()
        self.subjects = Subjects(cfg.prefix)
        self.nc: NATS | None = None
        self._reader: ShmReader | None = None
        self._meta: dict[str, Any] = {}
        self._builder = BatchBuilder(cfg.instance)
        self._decoder = StepDecoder()
        self._pool: TrackedPool | None = None  # the engine's block pool, when the plugin logs it (BEAR_SNAPSHOT_BLOCK_OPS=1)
        self._table: PoolTable | None = None  # its table kept step by step (pool_deltas)
        # the processor time of the last descriptions of the pool: their median is its cost (one
        # garbage collection or preemption inside a description must not count as a large pool)
        self._describe_s: deque[float] = deque(maxlen=16)
        self._resync_asked = 0.0  # monotonic time of the last full-record request (0: none pending)
        self._mismatch_logged = 0
        self._skip_logged = 0.0  # monotonic time of the last steps_skipped warning
        self._meta_logged = False
        self.publisher = InstancePublisher(
            None, cfg.instance, self.subjects, min_interval_s=cfg.min_interval_s,
            idle_snapshot_s=cfg.idle_snapshot_s, snapshot_buffer=cfg.snapshot_buffer,
            batch_flush_s=cfg.batch_flush_s, batch_buffer=cfg.batch_buffer, metrics=self.metrics.publisher,
            engine_alive=self._engine_alive, initial=self._empty_snapshot, deltas=cfg.deltas,
            full_every=cfg.full_every, kv_events=cfg.kv_events)
        self._kv_reader: KvEventsReader | None = None
        self._kv_task: asyncio.Task[None] | None = None
        self._tokenizer_task: asyncio.Task[None] | None = None
        self.registration = Registration(
            None, instance_record(cfg.instance, cfg.model, cfg.base_url, gpu=cfg.gpu,
                                  price_input_per_mtok=cfg.price_input_per_mtok,
                                  price_output_per_mtok=cfg.price_output_per_mtok),
            self.subjects, heartbeat_s=cfg.heartbeat_s, on_down=cfg.on_down)
        self.registration.update(status="starting")
        self._stop = asyncio.Event()
        self._record: IO[str] | None = None
        self._bad_logged = False
        self.log = log.bind(instance=cfg.instance)

    # ---- lifecycle -------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        if self.cfg.record_to:
            self._record = open_text(self.cfg.record_to, "at")
        tasks = [
            asyncio.create_task(self._connect_loop(), name="nats"),
            asyncio.create_task(self._read_loop(), name="read"),
            asyncio.create_task(self.publisher.run(), name="publish"),
            asyncio.create_task(self.registration.run(), name="registry"),
        ]
        stop = asyncio.create_task(self._stop.wait(), name="stop")
        try:
            pending: set[asyncio.Task[Any]] = {stop, *tasks}
            while stop in pending:  # a loop that fails is a bug: fail loudly, not go on publishing nothing
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    exc = None if t is stop or t.cancelled() else t.exception()
                    if exc is not None:
                        self.log.error("snapshotter_loop_failed", loop=t.get_name(), error=repr(exc))
                        raise RuntimeError(f"the snapshotter's {t.get_name()} loop failed: {exc!r}") from exc
        finally:
            await cancel_all([stop, *tasks, *(t for t in (self._kv_task, self._tokenizer_task) if t is not None)])
            await self.publisher.close()
            await self.registration.close()
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
                    **auth_options(),  # the instance's own identity ($BEAR_NATS_CREDS)
                )
                self.log.info("nats_connected", url=self.cfg.nats_url)
                self.publisher.nc = self.registration.nc = self.nc
            except Exception as exc:
                self.log.warning("nats_connect_failed", error=str(exc), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _on_disconnected(self) -> None:
        if self._stop.is_set():  # nats-py calls this on our own close() too: not a fault
            self.log.info("nats_closed")
            return
        self.log.warning("nats_disconnected")

    async def _on_reconnected(self) -> None:
        self.log.info("nats_reconnected")
        self.registration.reconnected()

    async def _on_error(self, exc: Exception) -> None:
        self.log.debug("nats_error", error=str(exc))

    def _connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def _engine_alive(self) -> bool:
        r = self._reader
        return r is not None and self._writer_dead(r) is None

    def _empty_snapshot(self) -> dict[str, Any] | None:
        """The state of an engine that has not stepped yet: every block free but vLLM's null block."""
        n_blocks = int(self._meta.get("config", {}).get("num_gpu_blocks") or 0)
        if self._reader is None or self._reader.count > 0 or n_blocks <= 0:
            return None  # steps exist but none was published yet, or no engine config to build from
        return {"schema": SNAPSHOT_SCHEMA, "v": SNAPSHOT_SCHEMA, "instance": self.cfg.instance,
                "model": self.cfg.model, "seq": 0, "config": self._meta.get("config", {}),
                "free_blocks": n_blocks - 1, "running": [], "waiting": [], "inflight": None}

    def _set_status(self, status: str, **why: Any) -> None:
        if status != self.registration.record.status:
            self.log.info("instance_status", status=status, **why)
            self.registration.update(status=status)
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
        self.publisher.generation = reader.generation  # seq restarts with the engine: deltas never cross it
        self._meta = reader.meta()
        self._builder.reset()
        self._decoder = StepDecoder()
        self._pool = None
        self._resync_asked = 0.0
        self._meta_logged = False
        self._bad_logged = False
        self.registration.update(seq=-1, generation=reader.generation, vllm_version=self._meta.get("vllm_version"),
                                 config=self._meta.get("config"), prefix_cache=self._prefix_info())
        self._follow_kv_events()
        self._register_tokenizer()
        self.metrics.engine_restarts.inc()
        self.log.info("engine_attached", pid=reader.pid, generation=reader.generation,
                      vllm_version=self._meta.get("vllm_version"))  # fmt: skip
        return True

    # ---- prefix cache and tokenizer ---------------------------------------------------------------------
    def _prefix_info(self) -> PrefixCacheInfo | None:
        return prefix_info(self._meta, kv_events=self.cfg.kv_events)

    def _follow_kv_events(self) -> None:
        """Subscribe to the (new) engine's KV events, or restart the stream on the same socket."""
        pc = self._meta.get("prefix_cache") or {}
        kv = self.publisher.kv
        if kv is None or not pc.get("events"):
            return
        kv.restart()  # a new engine generation starts with an empty cache
        if self._kv_reader is not None and self._kv_reader.endpoint.endswith(str(pc["endpoint"]).split("://")[-1]):
            self._kv_reader.restart()
            return
        if self._kv_task is not None:
            self._kv_task.cancel()
        self._kv_reader = KvEventsReader(str(pc["endpoint"]), pc.get("replay_endpoint"), str(pc.get("topic", "")),
                                         self._on_kv_batch, kv.lost)
        self._kv_task = asyncio.create_task(self._kv_reader.run(), name="kv-events")

    def _on_kv_batch(self, seq: int, ts: float, ops: list[KvOp]) -> None:
        self.publisher.kv_events(ops, ts)
        if self._record is not None:
            self._record.write(json.dumps({"kv": {"seq": seq, "ts": ts, "ops": [[o.kind, o.hashes] for o in ops]}})
                               + "\n")

    def _register_tokenizer(self) -> None:
        if not self.cfg.register_tokenizer or (self._tokenizer_task is not None and not self._tokenizer_task.done()):
            return
        where = self.cfg.tokenizer_dir or str(self._meta.get("tokenizer") or "")
        if where:
            self._tokenizer_task = asyncio.create_task(self._put_tokenizer(where), name="tokenizer")

    async def _put_tokenizer(self, where: str) -> None:
        """Put the engine's tokenizer bundle in the object store (once NATS is there), then name it
        in the registry entry; a model directory without a tokenizer.json leaves it unnamed."""
        from bear.tokenizer.bundle import BundleError, find_model_dir, from_model_dir
        from bear.tokenizer.store import put_bundle

        d = find_model_dir(where)
        try:
            if d is None:
                raise BundleError(f"no tokenizer.json at {where} (nor in the Hugging Face cache)")
            bundle = await asyncio.to_thread(from_model_dir, d)
        except BundleError as exc:
            self.log.warning("tokenizer_not_registered", reason=str(exc))
            return
        while True:
            if self._connected():
                try:
                    bid = await put_bundle(self.nc.jetstream(timeout=2.0), self.subjects.tokenizers_bucket, bundle,
                                           self.cfg.instance)
                    self.registration.update(tokenizer=bid)
                    self.log.info("tokenizer_registered", tokenizer=bid, source=str(d))
                    return
                except Exception as exc:
                    self.log.warning("tokenizer_put_failed", error=repr(exc))
            await asyncio.sleep(1.0)

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
            await asyncio.sleep(self.cfg.poll_interval_s)

    def _describe_pool(self, r: ShmReader, step: dict[str, Any], snap: dict[str, Any], *, superseded: bool) -> None:
        """The pool block by block on this step's snapshot (``bear.prefix.tracked_pool``), for an
        exact replay under KV pressure; while it is not known (the snapshotter attached after the
        engine's first record, or records were lost) the snapshot goes out with counts only and
        a full record — which carries the pool's dump — is asked for. ``superseded``: a newer
        step was read with this one; estimators replace its snapshot at once, so it is not
        described while describing is slow (a pool of tens of thousands of blocks: the
        snapshotter would fall behind the engine, and its ring would overwrite records)."""
        pool = self._pool
        if pool is None:
            pool = self._pool = TrackedPool(int(self._meta.get("config", {}).get("num_gpu_blocks", 0)) or 1)
        was = pool.synced
        pool.step(step)
        if superseded and pool.synced and self._describe_slow():
            self.metrics.pool_superseded.inc()
            return
        # the processor time this thread spent describing, not the wall time: on a loaded host a
        # preemption in the middle would read as a slow pool and drop descriptions for nothing
        t = time.thread_time()
        if pool.describe(snap):
            took = time.thread_time() - t
            self._describe_s.append(took)
            self.metrics.pool_describe.observe(took)
            self.metrics.pool_described.inc()
            return
        if was:
            self.log.warning("block_pool_lost", problem=pool.problem, seq=step["seq"])
        self._ask_full(r, f"block pool: {pool.problem}")

    def _keep_table(self, r: ShmReader, step: dict[str, Any], snap: dict[str, Any], change: dict[str, Any] | None,
                    ) -> tuple[dict[str, Any] | None, Callable[[dict[str, Any]], None] | None]:  # fmt: skip
        """The pool's table kept step by step (``PoolTable``, ``pool_deltas``): the step's change
        with the table's change in it (``pool``) and the writer of the whole table for a state
        that goes out in full (``InstancePublisher.snapshot``); while the pool is not known, the
        change alone (a delta without ``pool``: consumers replay by counts) and a full record is
        asked for."""
        if not self._meta.get("config", {}).get("enable_prefix_caching"):
            return change, None  # no cache: no table (libbea takes one only with prefix caching on)
        pool = self._pool
        if pool is None:
            pool = self._pool = TrackedPool(int(self._meta.get("config", {}).get("num_gpu_blocks", 0)) or 1)
        if self._table is None or self._table.pool is not pool:
            self._table = PoolTable(pool)
        was = pool.synced
        t = time.thread_time()
        pool.step(step)
        pc = self._table.update(snap)
        if not pool.synced:
            if was:
                self.log.warning("block_pool_lost", problem=pool.problem, seq=step["seq"])
            self._ask_full(r, f"block pool: {pool.problem}")
            return change, None
        took = time.thread_time() - t
        self._describe_s.append(took)
        self.metrics.pool_describe.observe(took)
        self.metrics.pool_described.inc()
        if pc is not None:  # (a full record: the lists' change comes from the two states)
            change = {**change, "pool": pc} if change is not None else {"pool": pc}
        return change, self._table.full

    def _describe_slow(self) -> bool:
        """Whether describing the pool costs more than ``describe_superseded_below_s``: the median
        processor time of the last descriptions, once there are ``DESCRIBE_SAMPLES`` of them (one
        slow first description is not a verdict)."""
        d = self._describe_s
        return len(d) >= DESCRIBE_SAMPLES and statistics.median(d) > self.cfg.describe_superseded_below_s

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
        pub = self.publisher
        while True:
            room = min(pub.room(), 4096)
            more = room > 0 and self._drain(r, limit=room) == room  # a full read: the ring may hold more
            await pub.publish_snapshots()
            if not more or pub.pending:  # unpublished (not connected, coalescing): the ring keeps the rest
                return
            await asyncio.sleep(0)  # catching up must not starve the heartbeat and batch loops

    def _drain(self, r: ShmReader, *, limit: int) -> int:
        """Decode up to ``limit`` records into the publish and batch buffers; how many were read."""
        res = r.poll(limit=limit)
        m = self.metrics
        if res.skipped:
            m.steps_skipped.inc(res.skipped)
            self._decoder.reset()  # the deltas in between are gone: wait for a full record
            if self._pool is not None:
                self._pool.lose("records skipped")
            now = time.monotonic()
            if now - self._skip_logged >= 1.0:  # a reader that stays behind would log every poll
                self._skip_logged = now
                self.log.warning("steps_skipped", count=res.skipped,
                                 why="the ring overwrote records before this reader got them")  # fmt: skip
        if res.torn_retries:
            m.torn_retries.inc(res.torn_retries)
        newest = len(res.records) - 1
        for k, raw in enumerate(res.records):
            try:
                step = self._decoder.decode(raw)
            except RecordError as exc:
                if not self._bad_logged:  # once per engine generation: a version mismatch repeats
                    self.log.error("bad_record", error=str(exc), plugin_meta=self._meta)
                    self._bad_logged = True
                m.steps_skipped.inc()
                if self._pool is not None:
                    self._pool.lose("a record could not be read")
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
                if self._pool is not None:
                    self._pool.lose("a record could not be decoded")
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
            self.registration.note(seq=step["seq"])
            snap = to_snapshot(
                step, self._meta.get("config", {}), instance=self.cfg.instance, model=self.cfg.model
            )
            change, table = self._decoder.change, None
            if step.get("block_ops") is not None:
                if self.cfg.pool_deltas and self.cfg.deltas:
                    change, table = self._keep_table(r, step, snap, change)
                else:
                    self._describe_pool(r, step, snap, superseded=k < newest)
            # never full here: _drain_and_publish reads only what fits; the plugin's delta goes on
            # as the step's bear.delta/1 (no diff of the two states)
            self.publisher.snapshot(snap, change, table)
            for b in self._builder.feed(step):
                self.publisher.batch(b)
        return len(res.records)
