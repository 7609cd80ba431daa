"""The fuzz suite of issue 16: ≥ 2,000 hostile messages on every subject a BEAR service reads
(submit, predict, estimate, snapshot, delta, batches, dispatch) and into every KV bucket (instances,
calibration, queries), against a router, an estimator worker, a predictor and a calibrator on one
NATS server. Every request gets a coded reply within its deadline, no traceback reaches any log,
memory stays bounded, and afterwards the estimates, predictions and routing decisions for the two
real instances are what they were before the fuzzing (the control run).

Messages about the real instances are sent only when they are invalid (a valid message about them
would legitimately change their state); valid and invalid ones go to made-up instance ids. The
estimator runs without staleness compensation and arrival fill, which would make the two control
estimates differ by the milliseconds between them (or by the fuzz submits routed for real)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from bear import libbea
from bear.calibrator.service import OnlineCalibrator, valid_record
from bear.estimator.estimate import EstimatorConfig
from bear.estimator.state import MAX_CLOCK_SKEW_S
from bear.estimator.worker import EstimatorWorker
from bear.instance.delta import encode_delta
from bear.instance.record import instance_record
from bear.predictor.runtime import Predictor
from bear.predictor.service import PredictorService, ServiceLimits
from bear.predictor.synth import generate
from bear.predictor.train import TrainConfig, train
from bear.protocol.codec import pack, unpack
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import Calibration, Dispatch, EstimateRequest, InstanceRecord, decode, encode
from bear.protocol.subjects import Subjects
from bear.router.service import RouterConfig, RouterService
from bear.runtime.kv import ensure_kv
from bear.runtime.nats_server import LocalNatsServer
from bear.sim.profile import load_profile

from bus_fuzz import hostile, kv_key
from fake_engine import FakeEngine
from waiting import HANG_S, wait_until

S = Subjects()
N = 2000  # messages per subject and per bucket
REAL = {"good-a": "Qwen/Qwen3-8B", "good-b": "Qwen/Qwen3-0.6B"}
CODES = {str(c) for c in ErrorCode}
BETA = (3e-3, 2e-5, 5e-8, 4e-9)


def _engine(instance: str, steps: int) -> Any:
    cfg = {**load_profile("qwen3-8b-h100").engine_config(), "num_gpu_blocks": 3000, "max_num_seqs": 32}
    e = libbea.Engine(cfg)
    for k in range(12):
        e.add(f"{instance}-{k}", 300 + 40 * k, 512, 50 + 10 * k)
    for _ in range(steps):
        if e.step():
            e.finish_step()
    return e


def snapshot(instance: str, at: float) -> dict[str, Any]:
    return _engine(instance, 5).snapshot(instance, "m", at)


def a_delta(instance: str, at: float) -> dict[str, Any]:
    """A real ``bear.delta/1``: one step of the fuzz engine."""
    e = _engine(instance, 4)
    prev = e.snapshot(instance, "m", at - 0.01)
    if e.step():
        e.finish_step()
    d = encode_delta(prev, e.snapshot(instance, "m", at))
    assert d is not None
    return d


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> Predictor:
    out = tmp_path_factory.mktemp("fuzz-model")
    train(list(generate(300, seed=3)), out, cfg=TrainConfig(rounds=30, test_fraction=0.0))
    return Predictor(out)


class Pool:
    """The services under fuzz and the control inputs of the two real instances."""

    def __init__(self, srv: LocalNatsServer, predictor: Predictor, tmp: Path) -> None:
        self.srv, self.predictor, self.tmp = srv, predictor, tmp
        self.engines = {i: FakeEngine() for i in REAL}
        self.conns: list[Any] = []

    async def connect(self, name: str) -> Any:
        nc = await nats.connect(self.srv.url, name=name, pending_size=64 << 20)
        self.conns.append(nc)
        return nc

    async def start(self) -> None:
        for e in self.engines.values():
            await e.start()
        self.nc = await self.connect("fuzzer")
        self.js = self.nc.jetstream()
        for bucket in (S.instances_bucket, S.calibration_bucket):
            await ensure_kv(self.js, bucket)
        self.predictor_svc = PredictorService(self.predictor, limits=ServiceLimits(max_inflight=4096), metrics=False)
        await self.predictor_svc.start(await self.connect("predictor"))
        self.worker = EstimatorWorker(await self.connect("estimator"), EstimatorConfig(
            max_age_s=5.0, arrival_fill=False, compensate_staleness=False))  # no drift with the control snapshot's age
        await self.worker.start()
        self.calibrator = OnlineCalibrator(await self.connect("calibrator"), refit_s=0.5)
        await self.calibrator.start()
        # max_attempts: a fuzzed registry entry whose mutated heartbeat made it healthy is a
        # registered instance that refuses connections; the control query fails over past every
        # such one (how many there are depends on the fuzz stream) to a real instance
        self.router = RouterService(await self.connect("router"), RouterConfig(
            policy="bear", outcome_log=self.tmp / "outcomes.jsonl", max_deciding=4096, shed_lag_s=5.0,
            max_attempts=16))
        await self.router.start()
        await self.control_inputs()

    @staticmethod
    def calibration(inst: str) -> Calibration:
        return Calibration(instance=inst, beta=BETA, n=100, theta=20_000.0)

    @staticmethod
    def is_control(c: Calibration, inst: str) -> bool:  # its mape is NaN: a Calibration never equals itself
        return (c.instance, c.beta, c.n, c.theta) == (inst, BETA, 100, 20_000.0)

    def snapshot_taken(self, inst: str, at: float, data: bytes) -> bool:
        """Whether the estimator worker holds the snapshot ``data`` (captured ``at``) of ``inst``."""
        st = self.worker.store.peek(inst)
        return st is not None and (st.raw == data or (st.raw is None and st.snap_time == at))

    def inputs_taken(self, now: float, snaps: dict[str, bytes]) -> bool:
        """Whether the router and the estimator worker hold the control inputs stamped ``now``."""
        for inst in REAL:
            info = self.router.registry.instances.get(inst)
            st = self.worker.store.peek(inst)
            if info is None or info.heartbeat != now or not self.is_control(info.calibration, inst):
                return False
            if st is None or st.registry_heartbeat != now or not self.is_control(st.calibration, inst):
                return False
            if not self.snapshot_taken(inst, now, snaps[inst]):
                return False
        return True

    async def control_inputs(self) -> None:
        """The real instances' registry entries, calibrations and snapshots, stamped now; returns
        once the router and the estimator worker hold them."""
        reg = await self.js.key_value(S.instances_bucket)
        cal = await self.js.key_value(S.calibration_bucket)
        now = time.time()
        snaps: dict[str, bytes] = {}
        for inst, model in REAL.items():
            rec = instance_record(inst, model, f"http://127.0.0.1:{self.engines[inst].port}/v1",
                                  price_input_per_mtok=0.1, price_output_per_mtok=0.4, config={"max_model_len": 8192})
            await reg.put(inst, encode(msgspec.structs.replace(rec, heartbeat=now)))
            await cal.put(inst, encode(self.calibration(inst)))
            snaps[inst] = pack(snapshot(inst, now))
            await self.nc.publish(S.snapshot(inst), snaps[inst])
        await self.nc.flush()
        await wait_until(lambda: self.inputs_taken(now, snaps), what="the control inputs in the router and the worker")

    async def control(self) -> dict[str, Any]:
        """What the services say about a fixed query at the real instances."""
        await self.control_inputs()
        fresh = {inst: (t, pack(snapshot(inst, t))) for inst in ("good-a", "good-b") for t in [time.time()]}
        for inst, (_, data) in fresh.items():
            await self.nc.publish(S.snapshot(inst), data)
        await self.nc.flush()
        await wait_until(lambda: all(self.snapshot_taken(inst, t, data) for inst, (t, data) in fresh.items()),
                         what="the fresh snapshots in the worker")
        est = unpack((await self.nc.request(S.estimate, encode(EstimateRequest(
            query={"prompt_tokens": 300, "max_tokens": 64}, instances=list(REAL), deadline=time.time() + 2)),
            timeout=3.0)).data)
        pred = unpack((await self.nc.request(S.predict, pack({
            "v": "bear.predict/1", "prompt": "Explain KV caching in two sentences.",
            "models": ["Qwen3-8B", "Qwen3-0.6B"], "deadline": time.time() + 2}), timeout=3.0)).data)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish(S.submit, pack({"v": "bear.submit/1", "query_id": f"control-{time.time_ns()}",
                                              "prompt": "Explain KV caching in two sentences.", "max_tokens": 8,
                                              "ttft_target_s": 0.5}), reply=inbox)
        routed: dict[str, Any] = {}
        while True:
            m = unpack((await sub.next_msg(timeout=5.0)).data)
            routed = m if m["v"] == "bear.routed/1" else routed
            if m["v"] in ("bear.done/1", "bear.error/1"):
                break
        await sub.unsubscribe()
        return {"estimates": {r["instance"]: (r["method"], r["status"], r["ttft_s"], r["n_running"], r["n_waiting"])
                              for r in est["estimates"]},
                "prediction": pred["models"], "routed": (routed.get("instance"), m["v"])}

    async def stop(self) -> None:
        await self.router.stop()
        await self.calibrator.stop()
        await self.worker.stop()
        await self.predictor_svc.stop()
        for nc in self.conns:
            with contextlib.suppress(Exception):
                await nc.close()
        for e in self.engines.values():
            await e.stop()


def coded(data: bytes) -> str:
    """The reply's schema or error code ("" when it is neither)."""
    try:
        d = unpack(data)
    except BearError:
        return ""
    if not isinstance(d, dict):
        return ""
    err = d.get("error")
    if isinstance(err, dict):
        return str(err.get("code")) if err.get("code") in CODES else ""
    return str(d.get("v", ""))


async def fuzz_requests(nc: Any, subject: str, msgs: list[bytes], may_drop: Any = None,
                        wave: int = 200) -> Counter[str]:
    """Each message as a request; every one must get a coded reply (or, with ``may_drop(msg)``,
    none at all: an estimate request whose own deadline had passed)."""
    out: Counter[str] = Counter()

    async def one(m: bytes) -> None:
        droppable = may_drop is not None and may_drop(m)
        try:
            reply = await nc.request(subject, m, timeout=0.5 if droppable else 5.0)
        except nats.errors.TimeoutError:
            assert droppable, f"no reply on {subject} to {m[:200]!r}"
            out["dropped (deadline passed)"] += 1
            return
        code = coded(reply.data)
        assert code, f"uncoded reply on {subject} to {m[:200]!r}: {reply.data[:200]!r}"
        out[code] += 1

    for k in range(0, len(msgs), wave):
        await asyncio.gather(*(one(m) for m in msgs[k:k + wave]))
    return out


async def fuzz_submits(nc: Any, msgs: list[bytes], wave: int = 250) -> Counter[str]:
    """Each submit with an inbox of its own; each must end in one coded terminal message."""
    out: Counter[str] = Counter()
    prefix = nc.new_inbox()
    streams: dict[str, list[dict[str, Any]]] = {}
    done: dict[str, asyncio.Event] = {}

    async def on(msg: Any) -> None:
        d = unpack(msg.data)
        streams.setdefault(msg.subject, []).append(d)
        if d.get("v") in ("bear.done/1", "bear.error/1"):
            done[msg.subject].set()

    sub = await nc.subscribe(prefix + ".*", cb=on, pending_msgs_limit=1 << 20)
    n = 0
    for k in range(0, len(msgs), wave):
        batch = []
        for m in msgs[k:k + wave]:
            n += 1
            inbox = f"{prefix}.{n}"
            done[inbox] = asyncio.Event()
            batch.append((inbox, m))
            await nc.publish(S.submit, m, reply=inbox)
        for inbox, m in batch:
            try:
                await asyncio.wait_for(done[inbox].wait(), HANG_S)
            except TimeoutError:
                raise AssertionError(f"no terminal answer to {m[:200]!r}: {streams.get(inbox)}") from None
            last = streams[inbox][-1]
            code = last["v"] if last["v"] == "bear.done/1" else last["error"]["code"]
            assert code in CODES or code == "bear.done/1", last
            out[str(code)] += 1
    await sub.unsubscribe()
    return out


def _decodes(kind: type, data: bytes) -> bool:
    try:
        decode(kind, data)
    except BearError:
        return False
    return True


def _parses(data: bytes) -> bool:
    try:
        snap = libbea.Snapshot.from_msgpack(data)
        _ = snap.request_ids
    except (ValueError, TypeError):
        return False
    return float(snap.time) <= time.time() + MAX_CLOCK_SKEW_S


def _reads_delta(data: bytes) -> bool:
    try:
        libbea.Delta.from_msgpack(data)
    except (ValueError, TypeError):
        return False
    return True  # readable: it could gap a real instance (legitimately), so only made-up ids get it


def _instance_for(rng: random.Random, data_valid: bool) -> str:
    """A real instance only for a message that is invalid; made-up ids otherwise (and often)."""
    if not data_valid and rng.random() < 0.5:
        return rng.choice(list(REAL))
    return f"fz{rng.randrange(3000)}"


async def test_fuzz_every_subject_and_bucket(nats_server: LocalNatsServer, predictor: Predictor, tmp_path: Path,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(16)
    pool = Pool(nats_server, predictor, tmp_path)
    await pool.start()
    t0 = time.monotonic()
    counts: dict[str, Any] = {}
    phases: list[tuple[str, float]] = []
    try:
        before = await pool.control()
        await pool.control()  # allocations of the first requests are not growth
        rss0 = rss_mb()
        now = time.time()
        nc = pool.nc

        submit = {"v": "bear.submit/1", "query_id": "q", "prompt": "hello", "max_tokens": 4, "ttft_target_s": 0.5,
                  "messages": None, "model": "Qwen/Qwen3-8B", "sampling": {"temperature": 0.5}, "lam": 1e-4,
                  "prompt_tokens": 3, "deadline": now + 60}
        msgs = []
        for k in range(N):
            base = dict(submit, query_id=f"fz-{k}")
            if rng.random() < 0.5:
                base.pop("messages")
            else:
                base.pop("prompt")
                base["messages"] = [{"role": "user", "content": "hi"}]
            msgs.append(hostile(base, rng))
        phases.append(('submit', time.monotonic()))
        counts["submit"] = await fuzz_submits(nc, msgs)

        predict = {"v": "bear.predict/1", "prompt": "List three facts.", "models": ["Qwen3-8B", "Qwen3-0.6B"],
                   "prompt_tokens": {"Qwen3-8B": 5}, "id": "p", "deadline": time.time() + 60}
        phases.append(('predict', time.monotonic()))
        counts["predict"] = await fuzz_requests(nc, S.predict, [hostile(predict, rng) for _ in range(N)])

        estimate = msgspec.to_builtins(EstimateRequest(query={"id": "e", "prompt_tokens": 300, "max_tokens": 64},
                                                       instances=[*REAL, {"instance": "good-a", "prefix_hit_tokens": 2}],
                                                       deadline=time.time() + 60))

        def expired(m: bytes) -> bool:
            with contextlib.suppress(BearError):
                d = decode(EstimateRequest, m).deadline
                return d is not None and d < time.time()
            return False

        phases.append(('estimate', time.monotonic()))
        counts["estimate"] = await fuzz_requests(nc, S.estimate, [hostile(estimate, rng) for _ in range(N)],
                                                 may_drop=expired)

        phases.append(('publish', time.monotonic()))
        published: Counter[str] = Counter()
        for kind, base, valid in (("snapshot", snapshot("fz", time.time()), _parses),
                                  ("delta", a_delta("fz", time.time()), _reads_delta)):
            for _ in range(N):
                data = hostile(dict(base, time=time.time()), rng)
                inst = _instance_for(rng, valid(data))
                await nc.publish(getattr(S, kind)(inst), data)  # S.snapshot / S.delta
                published[kind + (" (real instance)" if inst in REAL else "")] += 1
        batch = {"v": "bear.batch/1", "seq": 1, "duration_s": 0.01, "items": [{"n": 100, "context": 0, "decode": False},
                                                                              {"n": 1, "context": 300, "decode": True}]}
        for _ in range(N):
            data = hostile([batch, batch] if rng.random() < 0.7 else batch, rng)
            try:
                group = unpack(data)
                group = [group] if isinstance(group, dict) else group
                valid = isinstance(group, list) and any(valid_record(r) for r in group)
            except BearError:
                valid = False
            inst = _instance_for(rng, valid)
            await nc.publish(S.batches(inst), data)
            published["batches" + (" (real instance)" if inst in REAL else "")] += 1
        dispatch = msgspec.to_builtins(Dispatch(query_id="d", request_id="r", prompt_tokens=100,
                                                predicted_output_tokens=50, max_tokens=64, t=time.time()))
        for k in range(N):
            data = hostile(dict(dispatch, request_id=f"fz-{k}", t=time.time()), rng)
            inst = _instance_for(rng, _decodes(Dispatch, data))
            await nc.publish(S.dispatch(inst), data)
            published["dispatch" + (" (real instance)" if inst in REAL else "")] += 1
        await nc.flush()

        phases.append(('kv', time.monotonic()))
        reg = await pool.js.key_value(S.instances_bucket)
        rec = msgspec.to_builtins(instance_record("x", "Qwen/Qwen3-8B", "http://127.0.0.1:9/v1"))
        cal = await pool.js.key_value(S.calibration_bucket)
        calib = msgspec.to_builtins(Calibration(instance="x", beta=BETA, n=10))
        queries = await ensure_kv(pool.js, S.queries_bucket)
        for _ in range(N):
            key = kv_key(rng, list(REAL))
            data = hostile(dict(rec, id=key, heartbeat=time.time() - 3600), rng)  # old heartbeats: never healthy
            if key in REAL and _decodes(InstanceRecord, data) and decode(InstanceRecord, data).id == key:
                key = f"fz-{key}"
            await reg.put(key, data)
            published["kv bear_instances"] += 1
            key = kv_key(rng, list(REAL))
            data = hostile(calib, rng)
            if key in REAL and _decodes(Calibration, data):
                key = f"fz-{key}"
            await cal.put(key, data)
            published["kv bear_calibration"] += 1
            await queries.put(kv_key(rng, []), hostile({"owner": "x"}, rng))
            published["kv bear_queries"] += 1
        phases.append(('control', time.monotonic()))
        counts["published"] = published
        await asyncio.sleep(MAX_CLOCK_SKEW_S + 0.2)  # sleep: wall time passing: no accepted fuzz snapshot is newer than now
        rss1 = rss_mb()
        after = await pool.control()
    finally:
        await pool.stop()
    took = time.monotonic() - t0
    out, err = capfd.readouterr()
    with capfd.disabled():
        print(f"\nfuzz: {json.dumps({k: dict(v) for k, v in counts.items()}, sort_keys=True)}")
        print(f"fuzz: RSS {rss0:.0f} → {rss1:.0f} MB, {took:.1f} s; phases "
              f"{[(n, round(t - t0, 1)) for n, t in phases]}")
    for subject in ("submit", "predict", "estimate"):
        assert sum(counts[subject].values()) == N
    for kind in ("snapshot", "delta", "batches", "dispatch", "kv bear_instances", "kv bear_calibration", "kv bear_queries"):
        assert sum(v for k, v in published.items() if k.startswith(kind)) == N, kind
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert rss1 - rss0 < 120, (rss0, rss1)
    assert after["routed"] == before["routed"]
    assert after["prediction"] == before["prediction"]
    for inst, (method, status, ttft, running, waiting) in before["estimates"].items():
        m2, s2, t2, r2, w2 = after["estimates"][inst]
        assert (m2, s2, r2, w2) == (method, status, running, waiting), inst
        assert t2 == pytest.approx(ttft, rel=0.02), inst
    # the watches kept going and counted what they skipped
    assert pool.worker.m is not None and pool.router.registry.rejected
    assert len(pool.router.registry.instances) <= pool.router.registry.max_instances
    assert len(pool.worker.store.instances) <= pool.worker.store.max_instances
