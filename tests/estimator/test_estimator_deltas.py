"""The estimator's delta ingest (bear.estimator.delta_ingest): deltas applied in libbea keep the held state
equal to the instance's; a broken chain (a lost, reordered or malformed delta, a new engine
generation) is detected, answered ``resyncing`` from the analytic fallback — never BEA — and healed
by a full snapshot; over NATS with 1 % of the deltas dropped, every BEA estimate is made from
exactly the state the instance published."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import nats
import pytest

from bear import libbea
from bear.estimator import delta_ingest
from bear.estimator import worker as worker_mod
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.estimator.state import StateStore
from bear.estimator.worker import EstimatorWorker
from bear.instance.delta import encode_delta
from bear.instance.publisher import InstancePublisher
from bear.protocol.codec import pack, unpack_map
from bear.protocol.engine_ids import dispatch_id, engine_id
from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery, EstimateRequest
from bear.protocol.subjects import Subjects
from bear.sim.profile import load_profile

from waiting import wait_until

CFG = {**load_profile("qwen3-8b-h100").engine_config(), "num_gpu_blocks": 400, "max_num_seqs": 32,
       "max_num_batched_tokens": 1024}
QUERY = EstimateQuery(id="q", prompt_tokens=300, max_tokens=50)


class Instance:
    """A libbea engine with a random workload; its states as a publisher would send them."""

    def __init__(self, seed: int = 0, generation: int = 11, name: Callable[[str], str] = str) -> None:
        self.rng = random.Random(seed)
        self.name = name  # the engine's id of the request the router dispatched as ``r<k>``
        self.engine = libbea.Engine(CFG)
        self.generation = generation
        self.n = 0
        self.t = time.time() - 5.0

    def state(self) -> dict[str, Any]:
        return dict(self.engine.snapshot("i", "m", self.t), generation=self.generation)

    def step(self) -> dict[str, Any]:
        """The state after the next engine step (a publisher sends one per step; idle time passes
        without one)."""
        rng, e = self.rng, self.engine
        seq = e.seq
        for _ in range(1000):
            for _ in range(rng.choice([0, 0, 0, 1, 2]) if e.has_work else 1):
                self.n += 1
                e.add(self.name(f"r{self.n}"), rng.randint(10, 1500), rng.randint(1, 80), rng.randint(1, 80), self.t)
            if e.step():
                e.finish_step()
            self.t += 0.01
            if e.seq != seq:
                return self.state()
        raise AssertionError("the engine does not step")


def chain(inst: Instance, steps: int) -> tuple[dict[str, Any], list[tuple[dict[str, Any], bytes]]]:
    """The first state and (state, delta bytes) for each of ``steps`` steps."""
    first = prev = inst.state()
    out = []
    for _ in range(steps):
        cur = inst.step()
        d = encode_delta(prev, cur)
        assert d is not None
        out.append((cur, pack(d)))
        prev = cur
    return first, out


def holding_first(inst: Instance, steps: int) -> tuple[StateStore, Any, dict[str, Any], list[Any], float]:
    """A store whose instance ``i`` (alive) holds ``inst``'s first state, and the next steps."""
    store = StateStore()
    st = store.get("i")
    st.registry_heartbeat = time.time()
    first, out = chain(inst, steps)
    now = time.time()
    st.offer_snapshot(pack(first), now)
    st.ensure_parsed()
    return store, st, first, out, now


def rows(store: StateStore, now: float) -> Any:
    (row,) = estimate(QUERY, [EstimateCandidate(instance="i")], store, now, EstimatorConfig(max_age_s=1e9))
    return row


def same(st: Any, state: dict[str, Any]) -> bool:
    return libbea.snapshot_difference(st.snap, libbea.Snapshot.from_dict(state)) is None


def test_chain_gap_resync_and_buffered_deltas() -> None:
    events: list[str] = []
    store = StateStore(on_event=events.append)
    st = store.get("i")
    st.registry_heartbeat = time.time()
    first, steps = chain(Instance(), 60)
    now = time.time()
    for _, d in steps[:5]:  # no state yet: every delta is a gap, the worker wants a full snapshot
        assert st.offer_delta(d, now) == "gap"
    assert st.gapped and st.feed.wants_resync(st, 100.0) and not st.feed.wants_resync(st, 100.1)
    assert rows(store, now).status == "resyncing" and rows(store, now).method == "analytic"
    st.offer_snapshot(pack(first), now)  # the resync answer: older than the buffered deltas
    assert st.ensure_parsed() is True
    assert not st.gapped and same(st, steps[4][0])  # the buffered deltas chained onto it
    for state, d in steps[5:30]:
        assert st.offer_delta(d, now) == "applied" and same(st, state)
    assert rows(store, now).method == "bea"
    assert st.offer_delta(steps[20][1], now) == "old"  # a duplicate
    # one delta lost: the next one is a gap; estimates fall back until a full snapshot
    assert st.offer_delta(steps[31][1], now) == "gap"
    assert st.gapped and rows(store, now).status == "resyncing"
    assert not st.feed.wants_resync(st, 200.0)  # one unfit delta may be a reordering: wait for another
    assert st.offer_delta(steps[32][1], now) == "gap" and st.feed.wants_resync(st, 200.0)
    st.offer_snapshot(pack(steps[31][0]), now)
    assert st.ensure_parsed() is True and not st.gapped and same(st, steps[32][0])
    # reordered: a delta before the one it follows (a different path): both apply, no resync
    assert st.offer_delta(steps[34][1], now) == "gap"
    assert st.offer_delta(steps[33][1], now) == "applied"
    assert not st.gapped and same(st, steps[34][0]) and rows(store, now).method == "bea"
    assert {"delta_gap", "delta_applied", "delta_old"} <= set(events)


def test_a_resync_answer_clears_a_gap_that_a_later_delta_announced() -> None:
    """A delta announcing a far later state (lost since, or forged) keeps full snapshots of earlier
    states from clearing the gap; the publisher's resync answer — its newest state — does."""
    store, st, _, steps, now = holding_first(Instance(seed=6), 8)
    for _, d in steps[:4]:
        assert st.offer_delta(d, now) == "applied"
    far = {**unpack_map(steps[4][1]), "base": 10**9, "seq": 10**9 + 1}
    assert st.offer_delta(pack(far), now) == "gap" and st.gapped
    st.offer_snapshot(pack(steps[4][0]), now)  # a periodic full snapshot: a newer state is known
    assert st.ensure_parsed() and st.gapped and rows(store, now).status == "resyncing"
    delta_ingest.resynced(st, now)  # what the worker does with a resync answer
    assert not st.gapped and same(st, steps[4][0]) and rows(store, now).method == "bea"
    for state, d in steps[5:]:
        assert st.offer_delta(d, now) == "applied" and same(st, state)


def test_a_full_snapshot_of_the_state_held_checks_the_state_the_deltas_kept() -> None:
    events: list[str] = []
    store = StateStore(on_event=events.append)
    st = store.get("i")
    first, steps = chain(Instance(seed=3), 40)
    now = time.time()
    st.offer_snapshot(pack(first), now)
    st.ensure_parsed()
    for _, d in steps:
        st.offer_delta(d, now)
    last = steps[-1][0]
    st.offer_snapshot(pack(last), now)
    st.ensure_parsed()
    assert events.count("mirror_verified") == 1 and "mirror_mismatch" not in events
    wrong = dict(last, free_blocks=last["free_blocks"] - 1)
    st.offer_snapshot(pack(wrong), now)
    st.ensure_parsed()
    assert events.count("mirror_mismatch") == 1 and st.snap.free_blocks == wrong["free_blocks"]


def test_malformed_delta_drops_the_state_and_a_new_generation_resyncs() -> None:
    store, st, first, steps, now = holding_first(Instance(seed=4), 10)
    bad = libbea.Delta.from_msgpack(steps[0][1])
    assert bad.base == first["seq"]
    d = {**unpack_map(steps[0][1]), "set": [0, 10**6, 1, 1, 1, 0, 0, 0]}  # computed beyond the prompt
    assert st.offer_delta(pack(d), now) == "malformed"
    assert st.snap is None and st.gapped and rows(store, now).status == "resyncing"
    assert st.offer_delta(b"\x93garbage", now) == "unreadable"
    st.offer_snapshot(pack(steps[0][0]), now)
    assert st.ensure_parsed() and not st.gapped
    # the engine restarted: its deltas name another generation
    restarted = Instance(seed=5, generation=12)
    restarted.t = steps[-1][0]["time"] + 1.0  # it started after the old engine's last step
    first2, steps2 = chain(restarted, 3)
    assert st.offer_delta(steps2[0][1], now) == "gap" and st.gapped
    st.offer_snapshot(pack(first2), now)
    assert st.ensure_parsed() and not st.gapped and same(st, steps2[0][0])


def _vllm_chat_id(rid: str) -> str:
    return engine_id(rid, chat=True)


@pytest.mark.parametrize("name", [str, _vllm_chat_id, lambda rid: engine_id(rid, chat=False, child=1)],
                         ids=["same-ids", "vllm-chat", "vllm-child"])
def test_arrivals_get_the_dispatched_lengths_like_a_full_snapshot(name: Callable[[str], str]) -> None:
    """Deltas and full snapshots hand the replay the router's predicted lengths, and a dispatch a
    state has shown is no longer queued ahead — also when the engine names requests its own way
    (vLLM: ``chatcmpl-<X-Request-Id>-<8 hex>``, ``<k>_…`` for n > 1)."""
    store = StateStore()
    st = store.get("i")
    inst = Instance(seed=6, name=name)
    first, steps = chain(inst, 1)
    now = time.time()
    st.offer_snapshot(pack(first), now)
    st.ensure_parsed()
    prev = steps[-1][0]
    st.offer_delta(steps[-1][1], now)
    for k in range(40):
        for rid in (f"r{inst.n + 1}", f"r{inst.n + 2}"):  # dispatched before they arrive
            st.on_dispatch(Dispatch(request_id=rid, prompt_tokens=100, predicted_output_tokens=7 + k, t=now))
        cur = inst.step()
        st.offer_delta(pack(encode_delta(prev, cur)), now)
        prev = cur
    ref = libbea.Snapshot.from_dict(prev)
    want = {rid: st.lengths[dispatch_id(rid)] for rid in ref.request_ids if dispatch_id(rid) in st.lengths}
    assert len(want) == len(ref.request_ids)  # every resident was dispatched: each has its length
    ref.set_output_lengths(want)
    st.apply_lengths()
    assert ref.pending_decode_tokens(256) == st.snap.pending_decode_tokens(256)
    assert libbea.estimate(ref, {"prompt_tokens": 300}) == libbea.estimate(st.snap, {"prompt_tokens": 300})
    shown = {dispatch_id(rid) for rid in ref.request_ids}
    assert not shown & {a["id"] for a in st.ahead(grace_s=60.0)}  # what a state showed is not ahead
    # a full snapshot of the same state: its residents get the same lengths
    full = StateStore().get("i")
    for d in st.dispatches:
        full.on_dispatch(d)
    full.offer_snapshot(pack(prev), now)
    full.ensure_parsed()
    full.apply_lengths()
    assert libbea.estimate(ref, {"prompt_tokens": 300}) == libbea.estimate(full.snap, {"prompt_tokens": 300})
    assert not shown & {a["id"] for a in full.ahead(grace_s=60.0)}


class LossyPublisher(InstancePublisher):
    """Drops a fraction of its delta messages (pretending they went out); ``sent_after_loss``:
    deltas sent since the first one dropped; resync answers wait while ``answer_resyncs`` is clear."""

    def __init__(self, *args: Any, drop: float, seed: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.drop = drop
        self.rng = random.Random(seed)
        self.dropped = 0
        self.sent_after_loss = 0
        self.answer_resyncs = asyncio.Event()
        self.answer_resyncs.set()

    async def _send(self, subject: str, payload: bytes) -> bool:
        if subject == self._delta_subject:
            if self.rng.random() < self.drop:
                self.dropped += 1
                return True
            self.sent_after_loss += self.dropped > 0
        return await super()._send(subject, payload)

    async def _on_resync(self, msg: Any) -> None:
        await self.answer_resyncs.wait()
        await super()._on_resync(msg)


async def test_worker_under_delta_loss_never_estimates_from_a_gapped_state(
    nats_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 % of the deltas dropped, no periodic full snapshots: every loss is detected, the worker
    asks for a resync and answers ``resyncing`` meanwhile; every BEA estimate it makes is from a
    state equal to the one the instance published with that seq."""
    nc_w = await nats.connect(nats_server.url)
    nc_p = await nats.connect(nats_server.url)
    worker = EstimatorWorker(nc_w, EstimatorConfig(max_age_s=1e9))
    await worker.start()
    pub = LossyPublisher(nc_p, "lossy", Subjects(), full_every=0, drop=0.01, seed=1)
    truth: dict[tuple[int, int], bytes] = {}
    checked = {"bea": 0, "wrong": 0}
    real_plan = worker_mod.plan

    def checking_plan(*args: Any, **kw: Any) -> Any:
        p = real_plan(*args, **kw)
        for j in p.jobs:  # the replays read exactly these snapshots, unchanged (deltas wait for them)
            assert not j.state.gapped
            want = libbea.Snapshot.from_msgpack(truth[(j.snap.generation, j.snap.seq)])
            checked["bea"] += 1
            checked["wrong"] += libbea.snapshot_difference(j.snap, want) is not None
        return p

    monkeypatch.setattr(worker_mod, "plan", checking_plan)
    inst = Instance(seed=9, generation=21)
    answers: list[str] = []  # the statuses, in order
    before = {k[0]: v for k, v in _counts(worker).items()}  # the counters are process-wide
    pub.answer_resyncs.clear()  # the first loss's resync waits until the worker was seen gapped
    try:
        for step in range(2000):
            state = inst.step()
            state["time"] = time.time()
            truth[(inst.generation, state["seq"])] = pack(state)
            pub.snapshot(state)
            await pub.serve_resync()
            await pub.publish_snapshots()
            await nc_p.flush()
            await asyncio.sleep(0)
            st = worker.store.get("lossy")
            st.registry_heartbeat = time.time()
            if not pub.answer_resyncs.is_set() and pub.sent_after_loss:  # a delta after the first loss is out
                await wait_until(lambda st=st: st.gapped, what="the worker to detect the first lost delta")
            gapped = st.gapped  # the plan is made before the estimate's first await
            if step % 3 == 0 or gapped:
                reply = await worker.estimate(EstimateRequest(query=QUERY, instances=["lossy"]))
                answers.append(reply.estimates[0].status)
                assert not gapped or answers[-1] == "resyncing", (step, answers[-1])
                if gapped:
                    pub.answer_resyncs.set()
        # the end: one more step, not dropped, so that a loss at the very end is detected too; the
        # worker then holds the last state, by the deltas or a resync
        pub.drop = 0.0
        state = inst.step()
        state["time"] = time.time()
        truth[(inst.generation, state["seq"])] = pack(state)
        pub.snapshot(state)
        await pub.publish_snapshots()
        await nc_p.flush()
        st = worker.store.get("lossy")
        await wait_until(lambda: st.snap is not None and st.snap.seq == state["seq"] and not st.gapped,
                         what="the worker to hold the last state")
        reply = await worker.estimate(EstimateRequest(query=QUERY, instances=["lossy"]))
        answers.append(reply.estimates[0].status)
        events = {k[0]: v - before.get(k[0], 0) for k, v in _counts(worker).items()}
    finally:
        pub.answer_resyncs.set()
        await worker.stop()
        await pub.close()
        await nc_w.close()
        await nc_p.close()
    while answers and answers[0] == "no_snapshot":  # asked before the first state arrived (a busy host)
        answers.pop(0)
    statuses = {k: answers.count(k) for k in set(answers)}
    runs = sum(1 for a, b in zip(["ok", *answers], answers, strict=False) if a == "ok" and b != "ok")
    print(f"delta loss: {pub.dropped} dropped, answers {statuses}, {runs} stretches of resyncing, checked {checked}")
    assert pub.dropped >= 10, pub.dropped
    # every BEA answer was a replay of exactly the published state; every other answer "resyncing",
    # in at most one stretch per lost delta, and the worker healed from the last
    assert checked["wrong"] == 0 and checked["bea"] == statuses.get("ok", 0) > 0, (checked, statuses)
    assert set(statuses) <= {"ok", "resyncing"} and statuses.get("resyncing", 0) > 0, statuses
    assert runs <= pub.dropped and answers[-1] == "ok", (runs, pub.dropped, answers[-5:])
    assert events.get("delta_gap", 0) >= pub.dropped and events.get("delta_malformed", 0) == 0, events
    assert pub.metrics.resyncs.labels("answered")._value.get() >= 1  # type: ignore[attr-defined]


def _counts(worker: EstimatorWorker) -> dict[tuple[str, ...], float]:
    """The worker's state-event counters (process-wide: tests share them, so read the samples)."""
    out: dict[tuple[str, ...], float] = {}
    for metric in worker.m.state_events.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[(s.labels["event"],)] = s.value
    return out
