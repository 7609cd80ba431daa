"""The caller's dispatches in an estimate request (``EstimateRequest.ahead``: a router's
reservations, a burst's queries before the one estimated): queued ahead of the query exactly as
the same dispatches heard on ``bear.dispatch`` are, and never counted twice."""

from __future__ import annotations

from bear.benchmarks.prefix_micro import candidate_store
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.prefix.hashing import HashSpec
from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery, EstimateRequest, decode, encode

SPEC = HashSpec(block_size=16)
QUERY = EstimateQuery(id="q", prompt_tokens=800, max_tokens=16)
CFG = EstimatorConfig(length_draws=0)


def _dispatch(rid: str, t: float, prompt: int = 3000) -> Dispatch:
    return Dispatch(query_id=rid, request_id=rid, prompt_tokens=prompt, predicted_output_tokens=64, t=t)


def _ttft(ahead: dict[str, list[Dispatch]] | None = None, heard: list[Dispatch] = ()) -> tuple[float, int]:
    store, t0 = candidate_store([], SPEC)
    for d in heard:
        assert store.get("a").on_dispatch(d, t0)
    [row] = estimate(QUERY, [EstimateCandidate(instance="a")], store, t0 + 0.001, CFG, ahead=ahead)
    assert row.method == "bea" and row.ttft_s is not None
    return row.ttft_s, row.ahead


def test_a_reserved_dispatch_queues_ahead_as_the_same_dispatch_heard_does() -> None:
    _, t0 = candidate_store([], SPEC)
    ds = [_dispatch("r1", t0), _dispatch("r2", t0)]
    alone, n0 = _ttft()
    reserved, n1 = _ttft(ahead={"a": ds})
    heard, n2 = _ttft(heard=ds)
    assert n0 == 0 and n1 == n2 == 2
    assert reserved == heard > alone


def test_a_reservation_the_state_holds_is_not_counted_twice() -> None:
    _, t0 = candidate_store([], SPEC)
    ds = [_dispatch("r1", t0), _dispatch("r2", t0)]
    heard, _ = _ttft(heard=ds)
    both, n = _ttft(ahead={"a": [*ds, _dispatch("r3", t0)]}, heard=ds)
    assert n == 3  # r1 and r2 once (heard), r3 from the request
    three, _ = _ttft(heard=[*ds, _dispatch("r3", t0)])
    assert both == three > heard


def test_reservations_for_another_instance_change_nothing_here() -> None:
    _, t0 = candidate_store([], SPEC)
    assert _ttft(ahead={"b": [_dispatch("r1", t0)]}) == _ttft()


def test_a_request_with_reservations_round_trips_and_an_old_one_decodes_without() -> None:
    d = _dispatch("r1", 1.0)
    req = EstimateRequest(query=QUERY, instances=["a"], ahead={"a": [d]})
    assert decode(EstimateRequest, encode(req)).ahead == {"a": [d]}
    old = encode({"v": "bear.estimate/1", "query": {"id": "q", "prompt_tokens": 3}, "instances": ["a"]})
    assert decode(EstimateRequest, old).ahead == {}


def test_more_queries_in_one_request_round_trip() -> None:
    from bear.protocol.messages import EstimatePart, EstimateReply, EstimateRow

    part = EstimatePart(query=QUERY, instances=["a"], ahead={"a": [_dispatch("r1", 1.0)]})
    req = EstimateRequest(query=QUERY, instances=["a"], also=[part, part])
    assert decode(EstimateRequest, encode(req)).also == [part, part]
    rep = EstimateReply(estimates=[EstimateRow(instance="a")], also=[[EstimateRow(instance="a", ttft_s=0.1)]])
    assert decode(EstimateReply, encode(rep)).also == rep.also


def test_a_worker_answers_each_query_in_also_as_it_would_alone() -> None:
    import asyncio

    from bear.estimator.worker import EstimatorWorker
    from bear.protocol.messages import EstimatePart

    store, t0 = candidate_store([], SPEC)
    w = EstimatorWorker(None, CFG)
    w.store = store
    d = _dispatch("r1", t0)
    parts = [EstimatePart(query=QUERY, instances=["a"], ahead={"a": [d]}),
             EstimatePart(query=EstimateQuery(id="q2", prompt_tokens=100, max_tokens=4), instances=["a", "b"])]
    both = asyncio.run(w.estimate(EstimateRequest(query=QUERY, instances=["a"], also=parts)))
    alone = [asyncio.run(w.estimate(EstimateRequest(query=p.query, instances=p.instances, ahead=p.ahead)))
             for p in parts]
    assert len(both.also) == 2
    # the same replays (the clock differs by microseconds; the states' ages with it)
    for rows, one in zip(both.also, alone, strict=True):
        assert [(r.instance, r.ahead, r.method) for r in rows] == [(r.instance, r.ahead, r.method) for r in one.estimates]
    assert both.also[0][0].ahead == 1 and both.also[0][0].ttft_s > both.estimates[0].ttft_s
