"""Decisions that see each other (``bear.router.sequencer``): N queries handed to the sequencer
at once are dispatched exactly as the same queries decided one by one would be — each on
estimates that include every dispatch before it — given the same estimator, whether the
estimator hears the dispatches at once or only through the reservations sent with each ask."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from bear.protocol.messages import (
    Dispatch,
    EstimatePart,
    EstimateQuery,
    EstimateReply,
    EstimateRequest,
    EstimateRow,
)
from bear.router.policies import Candidate, QueryContext
from bear.router.policies.bear_rule import BearPolicy
from bear.router.sequencer import Pending, Reservations, Sequencer

# three instances: the best model is slow to start many queries, the others less useful but roomy
BASE = {"big": 0.020, "mid": 0.010, "small": 0.005}
STEP = {"big": 0.030, "mid": 0.012, "small": 0.004}  # each query queued ahead adds this much
ACC = {"big": 0.9, "mid": 0.6, "small": 0.3}
TARGET = 0.5
POLICY = BearPolicy()


class FakeEstimator:
    """TTFT at an instance = BASE + STEP × (dispatches queued ahead: those heard, and those the
    request brings that it has not heard)."""

    def __init__(self, hears: bool) -> None:
        self.hears = hears
        self.heard: dict[str, set[str]] = {i: set() for i in BASE}
        self.requests = 0

    def ttft(self, i: str, ahead: list[Dispatch]) -> float:
        queued = self.heard[i] | {d.request_id for d in ahead}
        return BASE[i] + STEP[i] * len(queued)

    async def ask(self, instances: list[str], ahead: dict[str, list[Dispatch]]) -> EstimateReply:
        self.requests += 1
        await asyncio.sleep(0)  # a round trip: other tasks run meanwhile
        return EstimateReply(estimates=[EstimateRow(instance=i, ttft_s=self.ttft(i, ahead.get(i, [])), method="bea",
                                                    status="ok") for i in instances])

    async def ask_parts(self, instance: str, parts: list[EstimatePart]) -> EstimateReply:
        """Every part in one request: the first's rows in ``estimates``, the rest in ``also``."""
        self.requests += 1
        await asyncio.sleep(0)
        first = parts[0]  # the request the router sends: what each part queues ahead, as a worker reads it
        aheads = EstimateRequest(query=first.query, instances=first.instances, ahead=first.ahead, also=parts[1:],
                                 then=first.then).aheads()
        rows = [[EstimateRow(instance=instance, ttft_s=self.ttft(instance, ahead.get(instance, [])), method="bea",
                             status="ok")] for ahead in aheads]
        return EstimateReply(estimates=rows[0], also=rows[1:])

    def publish(self, i: str, d: Dispatch) -> None:
        if self.hears:
            self.heard[i].add(d.request_id)


def _decide(qid: str, rows: dict[str, EstimateRow]) -> tuple[Any, str | None]:
    cands = [Candidate(instance=i, model=i, acc=ACC[i], ttft=rows[i].ttft_s or float("inf"), prompt_tokens=100,
                       prefill_tps=1e5) for i in BASE if i in rows]
    d = POLICY.decide(QueryContext(qid, TARGET, 0.0, 100), cands)
    return d, d.candidate.instance


def _dispatch(qid: str) -> Dispatch:
    return Dispatch(query_id=qid, request_id=f"r-{qid}", prompt_tokens=100, predicted_output_tokens=16, t=time.time())


def one_by_one(n: int) -> list[str]:
    """The reference: each query estimated after every dispatch before it was heard."""
    est = FakeEstimator(hears=True)
    out = []
    for k in range(n):
        qid = f"q{k}"
        rows = {i: EstimateRow(instance=i, ttft_s=est.ttft(i, []), method="bea") for i in BASE}
        _, chosen = _decide(qid, rows)
        assert chosen is not None
        est.publish(chosen, _dispatch(qid))
        out.append(chosen)
    return out


async def at_once(n: int, *, hears: bool, monotone: bool = True, chain: int = 8,
                  in_one: bool = False) -> tuple[list[str], Sequencer, int]:
    est = FakeEstimator(hears=hears)
    res = Reservations(keep_s=3600.0)
    seq = Sequencer(res, monotone=monotone, chain=chain, clock=lambda: 0.0,
                    ask_parts=est.ask_parts if in_one else None)
    committed: list[str] = []

    async def one(k: int) -> None:
        qid = f"q{k}"
        versions = res.versions(BASE)
        first = await est.ask(list(BASE), res.at(BASE, time.time()))  # asked concurrently, before any decision

        async def commit(result: Any) -> None:
            i = result.candidate.instance
            d = _dispatch(qid)
            est.publish(i, d)
            res.add(i, d)
            committed.append(i)

        p = Pending(qid, list(BASE), lambda rows, _elapsed: _decide(qid, rows), lambda _i: _dispatch(qid),
                    est.ask, commit, t0=0.0,
                    part=lambda ins, ahead: EstimatePart(query=EstimateQuery(id=qid, prompt_tokens=100),
                                                         instances=ins, ahead=ahead))
        p.add_reply(first, versions, 0.0)
        await seq.decide(p)

    await asyncio.gather(*(one(k) for k in range(n)))
    await seq.stop()
    return committed, seq, est.requests - n


@pytest.mark.parametrize("in_one", [False, True], ids=["request-per-query", "chain-in-one-request"])
@pytest.mark.parametrize("hears", [True, False], ids=["estimator-hears", "reservations-only"])
@pytest.mark.parametrize("n", [1, 5, 60])
def test_a_burst_is_dispatched_as_one_by_one_decisions_would_be(n: int, hears: bool, in_one: bool) -> None:
    want = one_by_one(n)
    got, seq, asked = asyncio.run(at_once(n, hears=hears, in_one=in_one))
    assert got == want
    assert seq.decided == n and seq.committed_exact == n  # every commit on an exact estimate there
    if in_one:
        assert asked == seq.asks + seq.prefetches  # each fresh ask or chain asked ahead, one request
    if n == 60:
        assert len(set(want)) > 1  # the burst does not fit the best instance: it spreads
        assert seq.asks < n // 2  # chains: far fewer round trips than queries


def test_decided_alone_the_same_burst_herds() -> None:
    """What the sequencer prevents: every query on the view before any decision."""
    est = FakeEstimator(hears=True)
    rows = {i: EstimateRow(instance=i, ttft_s=est.ttft(i, []), method="bea") for i in BASE}
    alone = [_decide(f"q{k}", rows)[1] for k in range(60)]
    assert set(alone) == {"big"} and one_by_one(60) != alone


def test_a_policy_not_monotone_has_every_estimate_made_exact_first() -> None:
    got, _, _ = asyncio.run(at_once(30, hears=False, monotone=False))
    assert got == one_by_one(30)


def test_without_chains_every_query_after_a_commit_there_is_asked_again() -> None:
    got, seq, _ = asyncio.run(at_once(20, hears=True, chain=0))
    assert got == one_by_one(20)
    assert seq.asks >= 10


def test_a_cancelled_query_waiting_its_turn_is_never_committed() -> None:
    async def run() -> list[str]:
        est = FakeEstimator(hears=True)
        res = Reservations(keep_s=3600.0)
        seq = Sequencer(res, clock=lambda: 0.0)
        committed: list[str] = []
        started, release = asyncio.Event(), asyncio.Event()

        def pending(qid: str) -> Pending:
            async def commit(result: Any) -> None:
                if qid == "q0":
                    started.set()
                    await release.wait()  # the first decision is committing while q1 is cancelled
                committed.append(qid)

            return Pending(qid, list(BASE), lambda rows, _e: _decide(qid, rows), lambda _i: _dispatch(qid), est.ask,
                           commit, t0=0.0)

        ps = [pending(f"q{k}") for k in range(3)]
        for p in ps:
            p.add_reply(await est.ask(list(BASE), {}), res.versions(BASE), 0.0)
        tasks = [asyncio.create_task(seq.decide(p)) for p in ps]
        await started.wait()
        assert seq.waiting == 3
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        release.set()
        await asyncio.gather(tasks[0], tasks[2])
        await seq.stop()
        return committed

    assert asyncio.run(run()) == ["q0", "q2"]
