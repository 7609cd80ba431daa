"""The snapshotter service against a fake engine process and a real nats-server: every step in
order, registry up/down, engine restarts, NATS restarts."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from bear import libbea
from bear.protocol.codec import unpack, unpack_map
from bear.runtime.nats_server import LocalNatsServer
from bear.snapshotter.service import Snapshotter, SnapshotterConfig
from bear.snapshotter.shm import ShmReader, ShmWriter, shm_path

from delta_check import check_mirror
from waiting import HANG_S, wait_until, wait_until_sync

FAKES = Path(__file__).with_name("snapshotter_fakes.py")


@pytest.fixture
def shm_name() -> Iterator[str]:
    n = f"bear-svc-{uuid.uuid4().hex[:10]}"
    yield n
    try:
        os.unlink(shm_path(n))
    except FileNotFoundError:
        pass


def start_engine(name: str, mode: str = "full") -> subprocess.Popen[bytes]:
    """A fake engine process, returned once its ring is there (its own: a new engine's pid)."""
    p = subprocess.Popen([sys.executable, str(FAKES), name, "0.005", mode])

    def ring_is_ours() -> bool:
        if p.poll() is not None:
            raise AssertionError(f"the fake engine exited with code {p.returncode} before writing its ring")
        try:
            r = ShmReader(name)
        except (FileNotFoundError, ValueError):
            return False
        try:
            return r.pid == p.pid
        finally:
            r.close()

    try:
        wait_until_sync(ring_is_ours, what="the fake engine's ring")
    except BaseException:
        p.kill()
        p.wait()
        raise
    return p


@contextlib.asynccontextmanager
async def beating(w: ShmWriter) -> AsyncIterator[None]:
    """The plugin's heartbeat thread while the test waits: the engine is alive."""

    async def beat() -> None:
        while True:
            w.heartbeat()
            await asyncio.sleep(0.05)  # sleep: the plugin's heartbeat period (time passing, not an event)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def stepped(snaps: list[dict]) -> list[int]:
    """The seqs of the snapshots of steps (an idle re-send repeats a step)."""
    return [s["seq"] for s in snaps if not s.get("idle")]


@pytest.fixture
async def service(nats_server: LocalNatsServer, shm_name: str) -> AsyncIterator[Snapshotter]:
    cfg = SnapshotterConfig(instance="i1", shm=shm_name, nats_url=nats_server.url, model="tiny",
                            base_url="http://127.0.0.1:1/v1", gpu="cpu", heartbeat_s=0.2, batch_flush_s=0.05,
                            full_every=1)  # every step full too (what these tests read), and the deltas  # fmt: skip
    svc = Snapshotter(cfg)
    task = asyncio.create_task(svc.run())
    yield svc
    svc.stop()
    await asyncio.wait_for(task, HANG_S)


async def _status(js_kv: object) -> dict:
    entry = await js_kv.get("i1")  # type: ignore[attr-defined]
    return unpack_map(entry.value)


async def _wait_status(kv: object, want: str) -> float:
    """Wait until the registry entry's status is ``want``; how long that took (reported, not judged)."""
    t0 = time.monotonic()

    async def is_want() -> bool:
        try:
            return (await _status(kv))["status"] == want
        except Exception:  # no entry yet
            return False

    await wait_until(is_want, what=f"registry status {want!r}")
    return time.monotonic() - t0


async def test_every_step_in_order_then_down_on_kill_and_up_on_restart(
    service: Snapshotter, nats_server: LocalNatsServer, shm_name: str
) -> None:
    nc = await nats.connect(nats_server.url)
    snaps: list[dict] = []
    raw_snaps: list[bytes] = []
    deltas: list[bytes] = []
    batches: list[dict] = []

    states: set[tuple[int, int, float]] = set()  # (generation, seq, time): the states received in full

    async def on_snap(msg: nats.aio.msg.Msg) -> None:
        m = unpack_map(msg.data)
        snaps.append(m)
        raw_snaps.append(msg.data)
        states.add((int(m.get("generation", 0)), int(m["seq"]), float(m["time"])))

    async def on_delta(msg: nats.aio.msg.Msg) -> None:
        deltas.append(msg.data)

    async def on_batches(msg: nats.aio.msg.Msg) -> None:
        batches.extend(unpack(msg.data))

    await nc.subscribe("bear.snapshot.i1", cb=on_snap)
    await nc.flush()
    await nc.subscribe("bear.delta.i1", cb=on_delta)
    await nc.subscribe("bear.batches.i1", cb=on_batches)
    # the subscriptions reach the server before the engine starts: else its first full snapshot
    # can go out unseen and the first delta has no base here (CI saw one 'unchained')
    await nc.flush()
    engine = start_engine(shm_name)
    try:
        js = nc.jetstream()

        async def bucket() -> object:
            try:
                return await js.key_value("bear_instances")
            except Exception:  # not created yet
                return None

        kv = await wait_until(bucket, what="the bear_instances bucket")
        await _wait_status(kv, "up")
        entry = await _status(kv)
        assert entry["model"] == "tiny" and entry["base_url"] and entry["config"]["block_size"] == 128
        await wait_until(lambda: len(stepped(snaps)) > 50 and batches, what="50 steps' snapshots and a batch record")
        seqs = stepped(snaps)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a step is missing or out of order"
        assert all(s["v"] == "bear.snapshot/1" and s["instance"] == "i1" for s in snaps)
        libbea.Snapshot.from_dict(snaps[-1])
        assert snaps[-1]["running"][0]["computed_tokens"] == 10 + snaps[-1]["seq"]
        assert batches and all(b["v"] == "bear.batch/1" for b in batches)
        assert service.metrics.plugin_overhead._sum.get() > 0  # type: ignore[attr-defined]

        engine.send_signal(signal.SIGKILL)
        engine.wait()
        print(f"registry status down {await _wait_status(kv, 'down'):.2f} s after the kill")  # with -s

        n_before = len(snaps)
        engine = start_engine(shm_name)  # a new engine: new region, seq restarts at 0
        await _wait_status(kv, "up")
        await wait_until(lambda: len(stepped(snaps[n_before:])) >= 10, what="10 steps of the new engine")
        new = stepped(snaps[n_before:])
        assert new[0] == 0 and new == list(range(len(new)))
        # the per-step deltas rebuild every published state, across the engine restart
        assert len({s["generation"] for s in snaps if not s.get("idle")}) == 2
        await nc.flush()
        # the deltas received so far; each state goes out as a delta, then in full, but the two
        # subscriptions' callbacks run as separate tasks: wait until every one of these deltas'
        # states has arrived in full before the deltas are checked against them
        n_deltas = len(deltas)
        wanted = {(d.generation, d.seq, d.time) for d in map(libbea.Delta.from_msgpack, deltas[:n_deltas])}
        await wait_until(lambda: wanted <= states, what="the full snapshots of the deltas' states")
        mirror = check_mirror(list(raw_snaps), deltas[:n_deltas])
        assert mirror["differences"] == [] and mirror["compared"] >= len(seqs) + len(new) - 3, mirror
        assert mirror["restarts"] == 1 and mirror["unchained"] == 0, (mirror.get("unchained_at"), mirror)
    finally:
        engine.kill()
        engine.wait()
        await nc.close()


async def test_nats_restart_resumes_publishing_and_never_stalls_the_engine(
    service: Snapshotter, nats_server: LocalNatsServer, shm_name: str
) -> None:
    engine = start_engine(shm_name)
    reader = ShmReader(shm_name)
    pub = service.metrics.publisher
    try:
        await wait_until(lambda: pub.snapshots_published._value.get() > 20,  # type: ignore[attr-defined]
                         what="20 snapshots published")
        dropped = pub.snapshots_dropped.labels("disconnected")
        dropped0 = dropped._value.get()  # type: ignore[attr-defined]
        nats_server.stop()
        count0 = reader.count
        # the outage as the snapshotter sees it: it drops what it reads (a stale snapshot is worse
        # than none), and the engine goes on stepping meanwhile
        await wait_until(lambda: dropped._value.get() > dropped0 and reader.count > count0,  # type: ignore[attr-defined]
                         what="snapshots dropped while NATS is down, the engine stepping")
        print(f"NATS down: the engine stepped {reader.count - count0} times until the outage was seen")  # with -s
        count_restart = reader.count  # no await since it: the snapshotter read nothing newer yet
        t_restart = time.monotonic()
        await asyncio.to_thread(nats_server.restart)  # the snapshotter keeps reading (and dropping) meanwhile
        seen: list[int] = []
        got = asyncio.Event()
        nc = await nats.connect(nats_server.url)

        async def on_snap(msg: nats.aio.msg.Msg) -> None:
            seen.append(unpack_map(msg.data)["seq"])
            got.set()

        await nc.subscribe("bear.snapshot.i1", cb=on_snap)
        await wait_until(got.is_set, what="a snapshot after the NATS restart")
        print(f"NATS restart: first snapshot {time.monotonic() - t_restart:.2f} s after it")  # with -s
        # nothing stale was flushed after the reconnect: the first snapshot received is of a step
        # the engine took after NATS came back up, none of those read during the outage
        assert seen[0] >= count_restart, (seen[0], count_restart)
        await nc.close()
    finally:
        reader.close()
        engine.kill()
        engine.wait()


async def test_idle_engine_snapshot_is_resent_busy_one_ages(
    service: Snapshotter, nats_server: LocalNatsServer, shm_name: str
) -> None:
    """Nothing stepped yet → an empty snapshot (all blocks free but the null block); an idle last
    step → re-sent with a fresh time every ~0.5 s; a busy last step that is not followed → no re-send."""
    from snapshotter_fakes import meta, raw_step

    nc = await nats.connect(nats_server.url)
    snaps: list[dict] = []

    async def on_snap(msg: nats.aio.msg.Msg) -> None:
        snaps.append(unpack_map(msg.data))

    await nc.subscribe("bear.snapshot.i1", cb=on_snap)
    await nc.flush()
    # when the publisher looked for an idle re-send (monotonic time of each look)
    pub = service.publisher
    looked: list[float] = []
    resend_idle = pub.resend_idle

    async def look() -> None:
        t = time.monotonic()
        await resend_idle()
        looked.append(t)

    pub.resend_idle = look  # type: ignore[method-assign]
    w = ShmWriter(shm_name, meta=meta())
    try:
        async with beating(w):
            await wait_until(lambda: len(snaps) >= 2, what="two snapshots of an engine that never stepped")
            assert all(s["idle"] and s["seq"] == 0 for s in snaps), snaps
            assert snaps[0]["free_blocks"] == 999 and snaps[0]["running"] == [] and snaps[0]["waiting"] == []
            libbea.Snapshot.from_dict(snaps[0])
            w.write(raw_step(0, busy=False, free=990))  # one idle step
            await wait_until(lambda: len([s for s in snaps if s["free_blocks"] == 990]) >= 3,
                             what="an idle step's snapshot and two re-sends")
            after = [s for s in snaps if s["free_blocks"] == 990]
            assert not after[0].get("idle") and all(s.get("idle") for s in after[1:])
            assert all(b["time"] > a["time"] for a, b in itertools.pairwise(after))
            req = {"id": "R", "prompt": 10, "computed": 11, "output": 1, "max_tokens": 100}
            w.write(raw_step(1, sched={"R": 1}, cached={"R": 10}, running=[req]))  # busy, then silence
            await wait_until(lambda: any(s["seq"] == 1 for s in snaps), what="the busy step's snapshot")
            t_busy = time.monotonic()  # it was sent before this
            # the publisher has looked for a re-send when one would have been due (idle_snapshot_s
            # after the busy snapshot went out), and sent none
            await wait_until(lambda: any(t >= t_busy + pub.idle_snapshot_s for t in looked),
                             what="a look for a re-send once one was due")
            busy = [s for s in snaps if s["seq"] == 1]
            assert len(busy) == 1 and not busy[0].get("idle"), busy
    finally:
        w.close()
        await nc.close()


async def test_deltas_without_a_full_record_ask_the_plugin_for_one(
    service: Snapshotter, nats_server: LocalNatsServer, shm_name: str
) -> None:
    """An engine whose first full record is gone (a reader that came late): the deltas cannot be
    decoded, so nothing is published until the snapshotter's resync request makes the plugin write
    a full record; from there every step is decoded from deltas, in order."""
    nc = await nats.connect(nats_server.url)
    snaps: list[dict] = []

    async def on_snap(msg: nats.aio.msg.Msg) -> None:
        snaps.append(unpack_map(msg.data))

    await nc.subscribe("bear.snapshot.i1", cb=on_snap)
    await nc.flush()
    engine = start_engine(shm_name, "deltas-no-initial-full")
    try:
        m = service.metrics
        await wait_until(lambda: len(stepped(snaps)) > 50 and m.records.labels("delta")._value.get() > 50  # type: ignore[attr-defined]
                         and m.records.labels("resync")._value.get() >= 1,  # type: ignore[attr-defined]
                         what="50 steps decoded from deltas after a resync")
        assert m.resync_requests._value.get() >= 1  # type: ignore[attr-defined]
        assert m.steps_undecodable._value.get() >= 1  # type: ignore[attr-defined]
        assert m.delta_mismatches._value.get() == 0  # type: ignore[attr-defined]
        seqs = stepped(snaps)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        last = snaps[-1]
        assert last["running"][0]["computed_tokens"] == 10 + last["seq"]
        assert last["running"][0]["blocks"] == -(-last["running"][0]["computed_tokens"] // 128)
        assert m.records.labels("delta")._value.get() > 50  # type: ignore[attr-defined]
        assert m.records.labels("resync")._value.get() >= 1  # type: ignore[attr-defined]
    finally:
        engine.kill()
        engine.wait()
        await nc.close()


async def test_a_reader_behind_publishes_every_step_through_a_small_buffer(
    nats_server: LocalNatsServer, shm_name: str
) -> None:
    """600 steps already in the ring when the snapshotter comes, a publish buffer of 16: it reads
    only what the buffer has room for and publishes in between, so every step goes out in order
    and nothing is dropped from the middle of the stream (a CI run lost 15 snapshots that way)."""
    from snapshotter_fakes import meta, raw_step

    w = ShmWriter(shm_name, meta=meta(), slot_count=1024)
    req = {"id": "R", "prompt": 10, "computed": 10, "output": 0, "max_tokens": 10**6}
    for seq in range(600):
        req = {**req, "computed": 10 + seq, "output": seq}
        w.write(raw_step(seq, sched={"R": 1}, running=[req]))
    nc = await nats.connect(nats_server.url)
    seqs: list[int] = []

    async def on_snap(msg: nats.aio.msg.Msg) -> None:
        seqs.append(unpack_map(msg.data)["seq"])

    await nc.subscribe("bear.snapshot.i1", cb=on_snap)
    await nc.flush()  # the server has the subscription before the first snapshot goes out
    cfg = SnapshotterConfig(instance="i1", shm=shm_name, nats_url=nats_server.url, model="tiny",
                            base_url="http://127.0.0.1:1/v1", snapshot_buffer=16, idle_snapshot_s=0,
                            full_every=1)  # fmt: skip
    svc = Snapshotter(cfg)
    task = asyncio.create_task(svc.run())
    dropped = svc.metrics.publisher.snapshots_dropped

    def n_dropped() -> int:
        return sum(dropped.labels(why)._value.get()  # type: ignore[attr-defined]
                   for why in ("coalesced", "disconnected", "publish_error"))  # fmt: skip

    try:
        async with beating(w):
            await wait_until(lambda: len(seqs) >= 600 or n_dropped(), what="600 snapshots")
        await nc.flush()
        assert seqs == list(range(600))
        assert n_dropped() == 0
    finally:
        svc.stop()
        await asyncio.wait_for(task, HANG_S)
        w.close()
        await nc.close()


@pytest.mark.parametrize("below_ms, described, pause", [(1000.0, 50, ""), (0.0, 6, ""), (1.0, 50, "preempted"),
                                                       (1.0, 50, "one_slow"), (1.0, 6, "all_slow")])
async def test_superseded_steps_skip_the_pool_description_while_it_is_slow(
    nats_server: LocalNatsServer, shm_name: str, below_ms: float, described: int, pause: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--no-pool-deltas``, BEAR_SNAPSHOT_BLOCK_OPS=1, 50 steps read in one poll: below the threshold every step's
    snapshot describes the pool; above it (0: always) only the first five (which measure the cost)
    and the newest do — the others go out with counts, superseded at once — and the pool stays in
    step. The cost is the median processor time of the last descriptions, so that a loaded host
    does not read as a large pool (a CI run lost 8 % of its described states at 48 blocks):
    ``preempted``,
    every description takes 2 ms of wall time but no processor time (the thread is off the
    processor) — every step is described; ``one_slow``, one description burns 30 ms of processor
    time (a garbage collection) — every step is described; ``all_slow``, every description burns
    2 ms — only the first five and the newest are."""
    import time

    from bear.prefix.pool_replica import OP_DUMP
    from bear.prefix.tracked_pool import TrackedPool

    if pause:
        describe = TrackedPool.describe
        calls: list[int] = []

        def burn(seconds: float) -> None:
            t = time.thread_time()
            while time.thread_time() - t < seconds:
                pass

        def paused(self: TrackedPool, snap: dict, extra: dict | None = None) -> bool:
            calls.append(1)
            if pause == "preempted":
                time.sleep(0.002)  # sleep: wall time passing off the processor (a preemption), not an event
            elif pause == "all_slow" or len(calls) == 1:
                burn(0.03 if pause == "one_slow" else 0.002)
            return describe(self, snap, extra)

        monkeypatch.setattr(TrackedPool, "describe", paused)

    from snapshotter_fakes import meta, raw_step

    w = ShmWriter(shm_name, meta=meta(), slot_count=1024)
    req = {"id": "R", "prompt": 10, "computed": 10, "output": 0, "max_tokens": 10**6}
    for seq in range(50):
        req = {**req, "computed": 10 + seq, "output": seq}
        ops: list = [(OP_DUMP, list(range(1, 1000)), [], [])] if seq == 0 else []
        w.write(raw_step(seq, sched={"R": 1}, running=[req], block_ops=ops))
    nc = await nats.connect(nats_server.url)
    last: dict = {}

    async def on_snap(msg: nats.aio.msg.Msg) -> None:
        last.update(unpack_map(msg.data))

    await nc.subscribe("bear.snapshot.i1", cb=on_snap)
    await nc.flush()
    cfg = SnapshotterConfig(instance="i1", shm=shm_name, nats_url=nats_server.url, model="tiny",
                            base_url="http://127.0.0.1:1/v1", idle_snapshot_s=0, full_every=1,
                            describe_superseded_below_s=below_ms / 1e3, pool_deltas=False)  # fmt: skip
    svc = Snapshotter(cfg)
    task = asyncio.create_task(svc.run())
    try:
        m = svc.metrics
        async with beating(w):
            await wait_until(lambda: m.steps_read._value.get() >= 50 and last.get("seq") == 49,  # type: ignore[attr-defined]
                             what="the 50 steps read and the newest published")
        await nc.flush()
        assert m.pool_described._value.get() == described  # type: ignore[attr-defined]
        assert m.pool_superseded._value.get() == 50 - described  # type: ignore[attr-defined]
        assert last["seq"] == 49 and "tracked_blocks" in last  # the newest state describes the pool
        assert svc._pool is not None and svc._pool.synced
    finally:
        svc.stop()
        await asyncio.wait_for(task, HANG_S)
        w.close()
        await nc.close()


async def test_pool_deltas_keep_a_consumers_table_by_deltas(nats_server: LocalNatsServer, shm_name: str) -> None:
    """``pool_deltas`` (issue 28), BEAR_SNAPSHOT_BLOCK_OPS=1: the first state and every
    ``full_every``-th go out in full with the whole table, the others as deltas with the table's
    change; a consumer that installs the full snapshots and applies the deltas (libbea) ends with
    the snapshotter's table."""
    import copy

    from bear.prefix.pool_replica import OP_CACHE, OP_DUMP, OP_POP

    from snapshotter_fakes import CONFIG, meta, raw_step

    w = ShmWriter(shm_name, meta={**meta(), "config": {**CONFIG, "enable_prefix_caching": True}}, slot_count=1024)
    for seq in range(40):
        ops: list = [(OP_DUMP, list(range(1, 1000)), [], []), (OP_POP, [1])] if seq == 0 else \
            [(OP_CACHE, [seq], [1000 + seq]), (OP_POP, [seq + 1])]
        req = {"id": "R", "prompt": 4000, "computed": 100 * seq, "output": 0, "max_tokens": 10**6,
               "blocks": seq + 1, "bids": tuple(range(1, seq + 2))}
        w.write(raw_step(seq, sched={"R": 128}, running=[req], block_ops=ops, free=998 - seq, with_ids=True))
    nc = await nats.connect(nats_server.url)
    held: list = [None]
    got = {"full": 0, "table": 0, "delta": 0, "pool": 0}

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        if msg.subject == "bear.snapshot.i1":
            got["full"] += 1
            held[0] = libbea.Snapshot.from_msgpack(msg.data)
            got["table"] += held[0].tracked_blocks > 0
        elif msg.subject == "bear.delta.i1":
            got["delta"] += 1
            got["pool"] += "pool" in unpack_map(msg.data)
            d = libbea.Delta.from_msgpack(msg.data)
            if held[0] is not None and d.base == held[0].seq:
                held[0].apply_delta(d)

    await nc.subscribe("bear.*.i1", cb=on_msg)
    await nc.flush()
    cfg = SnapshotterConfig(instance="i1", shm=shm_name, nats_url=nats_server.url, model="tiny",
                            base_url="http://127.0.0.1:1/v1", idle_snapshot_s=0, full_every=16,
                            pool_deltas=True)  # fmt: skip
    svc = Snapshotter(cfg)
    task = asyncio.create_task(svc.run())
    try:
        async with beating(w):
            await wait_until(lambda: held[0] is not None and held[0].seq == 39, what="the 40 steps published")
        await nc.flush()
        assert got["full"] >= 3 and got["table"] == got["full"], got  # the first, every 16th: with the table
        assert got["delta"] >= 30 and got["pool"] == got["delta"], got
        assert svc._table is not None
        ref = copy.deepcopy(svc.publisher.stream.last)
        svc._table.full(ref)
        assert held[0].tracked_blocks == len(svc._table.entries) > 990
        assert libbea.snapshot_difference(held[0], libbea.Snapshot.from_dict(ref)) is None
    finally:
        svc.stop()
        await asyncio.wait_for(task, HANG_S)
        w.close()
        await nc.close()


async def test_a_loop_that_fails_stops_the_snapshotter_loudly(tmp_path: Path) -> None:
    """A loop that raises (a bug) ends run() with that error instead of leaving a snapshotter
    that heartbeats 'up' and publishes nothing."""
    from bear.snapshotter.service import Snapshotter, SnapshotterConfig

    svc = Snapshotter(SnapshotterConfig(instance="i-fail", shm=str(tmp_path / "none"), nats_url="nats://127.0.0.1:1",
                                        model="m", base_url="http://127.0.0.1:1/v1"))

    async def broken() -> None:
        await asyncio.sleep(0)  # the other loops are running when it fails
        raise TypeError("Object of type bytes is not JSON serializable")

    svc._read_loop = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"read loop failed.*not JSON serializable"):
        await asyncio.wait_for(svc.run(), HANG_S)
