"""Replies no real predictor or estimator sends are refused, counted and treated as no answer
(bear.router.reply_bounds, issue 40); genuine ones — the BEA replay's own estimates — pass."""

from __future__ import annotations

import math
import time
from typing import Any

import nats
import numpy as np
import pytest

from bear import libbea
from bear.estimator.client import EstimatorClient
from bear.protocol.codec import pack
from bear.protocol.errors import BearError
from bear.protocol.messages import (
    NOMINAL_BETA,
    Calibration,
    EstimateCandidate,
    EstimatePart,
    EstimateQuery,
    EstimateReply,
    EstimateRequest,
    EstimateRow,
    decode,
    encode,
)
from bear.protocol.predict import PredictedLength, PredictedModel, Prediction
from bear.protocol.subjects import Subjects
from bear.router.predict import ask_predictor
from bear.router.reply_bounds import (
    FLOOR_FRACTION,
    ReplyGuard,
    estimate_fault,
    metrics,
    prediction_fault,
    prefill_floor,
)
from bear.sim.profile import load_profile

S = Subjects()
MODELS = ["Qwen3-0.6B", "Qwen3-8B"]
PROMPT = "Explain how a compiler works, briefly."


def _model(acc: float = 0.7, mean: float = 120.0, p90: float = 300.0, prompt_tokens: int = 9,
           cost: float = 1e-5, p50: float = math.nan) -> PredictedModel:
    return PredictedModel(acc=acc, len=PredictedLength(mean=mean, p50=p50, p90=p90), prompt_tokens=prompt_tokens,
                          cost=cost)


def _pred(**by_model: PredictedModel) -> Prediction:
    return Prediction(models=by_model or {m: _model() for m in MODELS}, id="q1", by="predictor-0")


def test_a_genuine_prediction_passes() -> None:
    assert prediction_fault(_pred(), MODELS, PROMPT, None, "q1") is None
    # a natural length past the query's max_tokens is what a real predictor says (the router caps it)
    assert prediction_fault(_pred(**{"Qwen3-8B": _model(mean=5000.0, p90=9000.0)}), MODELS, PROMPT, None, "q1") is None
    assert prediction_fault(_pred(**{"Qwen3-8B": _model(prompt_tokens=42)}), MODELS, PROMPT, 42, "q1") is None


@pytest.mark.parametrize(("model", "reason"), [
    (_model(acc=1.5), "accuracy"), (_model(acc=-0.1), "accuracy"), (_model(acc=math.nan), "accuracy"),
    (_model(mean=-3.0), "length"), (_model(p90=math.inf), "length"), (_model(mean=math.nan), "length"),
    (_model(mean=float(1 << 21)), "length"), (_model(p50=-1.0), "length"),
    (_model(cost=-1.0), "cost"), (_model(cost=math.inf), "cost"),
    (_model(prompt_tokens=-1), "prompt_tokens"), (_model(prompt_tokens=10_000), "prompt_tokens"),
])
def test_an_impossible_prediction_is_refused(model: PredictedModel, reason: str) -> None:
    assert prediction_fault(_pred(**{"Qwen3-8B": model}), MODELS, PROMPT, None, "q1") == reason


def test_a_prediction_for_something_not_asked_is_refused() -> None:
    assert prediction_fault(_pred(**{"Qwen3-32B": _model()}), MODELS, PROMPT, None, "q1") == "unasked_model"
    assert prediction_fault(_pred(), MODELS, PROMPT, None, "another-query") == "wrong_query"
    assert prediction_fault(_pred(**{"Qwen3-8B": _model(prompt_tokens=4200)}), MODELS, PROMPT, 4000, "q1") \
        == "prompt_tokens"  # beyond the count the request gave and the prompt's bytes


# ----------------------------------------------------------------------------- estimates
PROFILED = Calibration(beta=(8e-3, 4e-5, 0.0, 0.0), source="profiled", theta=20_000.0)


def _req(prompt_tokens: int = 2000, instances: tuple[str, ...] = ("a", "b"), also: int = 0) -> EstimateRequest:
    q = EstimateQuery(id="q1", prompt_tokens=prompt_tokens, max_tokens=32)
    return EstimateRequest(query=q, instances=list(instances),
                           also=[EstimatePart(query=q, instances=list(instances)) for _ in range(also)])


def _row(instance: str = "a", ttft_s: float | None = 0.2, **kw: Any) -> EstimateRow:
    base: dict[str, Any] = {"method": "bea", "status": "ok", "calibration": "profiled", "age_s": 0.01}
    return EstimateRow(instance=instance, ttft_s=ttft_s, **{**base, **kw})


def _reply(*rows: EstimateRow, also: list[list[EstimateRow]] | None = None) -> EstimateReply:
    return EstimateReply(query_id="q1", worker="estimator-1@h:1:ab", estimates=list(rows), at=time.time(),
                         also=also or [])


def test_the_floor_is_what_a_replay_can_never_beat() -> None:
    """The BEA replay on real snapshots (idle and busy, hits, lengths drawn, snapshot ages) never
    estimates below β0 + β1 · uncached: the floor (before FLOOR_FRACTION) holds with no slack."""
    cfg = {**load_profile("qwen3-8b-h100").engine_config(), "num_gpu_blocks": 3000, "max_num_seqs": 32}
    worst = math.inf
    for seed in range(6):
        rng = np.random.default_rng(seed)
        e = libbea.Engine(cfg)
        for k in range(int(rng.integers(0, 40))):
            e.add(f"r{k}", int(rng.integers(1, 3000)), 2048, int(rng.integers(1, 1500)))
        for _ in range(int(rng.integers(0, 20))):
            if e.step():
                e.finish_step()
        snap = libbea.Snapshot.from_dict(e.snapshot("a", "m", time.time()))
        for beta in (NOMINAL_BETA, PROFILED.beta):
            for p, hit in ((1, 0), (100, 0), (2000, 0), (2000, 1600), (8000, 4000)):
                r = libbea.estimate(snap, {"id": "q", "prompt_tokens": p, "max_tokens": 16, "prefix_hit_tokens": hit},
                                    beta=list(beta), default_output_tokens=256, age_s=float(rng.uniform(0, 0.2)),
                                    length_sigma=0.5, length_draws=int(rng.integers(0, 16)))
                row = _row(ttft_s=r["ttft_s"], prefix_hit_tokens=hit,
                           calibration="nominal" if beta == NOMINAL_BETA else "profiled")
                floor = prefill_floor(row, p, PROFILED) / FLOOR_FRACTION
                if math.isfinite(r["ttft_s"]):
                    worst = min(worst, r["ttft_s"] / floor)
    assert worst >= 1.0 - 1e-9


def test_a_genuine_estimate_passes() -> None:
    cal = {"a": PROFILED, "b": PROFILED}
    ok = _reply(_row("a", 0.12), _row("b", None, method="none", status="down"))
    assert estimate_fault(_req(), ok, cal.get) is None
    stale = _row("a", 0.15, method="analytic", status="stale")  # ≥ 2000 / θ (0.1 s)
    assert estimate_fault(_req(), _reply(stale), cal.get) is None
    # calibrated there but not known to this router yet: no floor to hold it to
    assert estimate_fault(_req(), _reply(_row("a", 1e-4)), {}.get) is None


@pytest.mark.parametrize(("row", "reason"), [
    (_row(ttft_s=-0.5), "ttft"), (_row(ttft_s=math.nan), "ttft"), (_row(ttft_s=math.inf), "ttft"),
    (_row(ttft_s=1e-3), "ttft_floor"),  # 2000 uncached tokens in 1 ms: β says ≥ 88 ms
    (_row(ttft_s=1e-3, method="analytic"), "ttft_floor"),
    (_row(ttft_s=1e-3, calibration="nominal"), "ttft_floor"),
    (_row(n_waiting=-4), "counters"), (_row(pending_prefill_tokens=-1), "counters"),
    (_row(kv_blocks_used=900, kv_blocks_total=100), "counters"),
    (_row(age_s=math.nan), "age"), (_row(prefix_hit_tokens=5000), "prefix_hit"),
    (_row("z"), "unasked_instance"),
])
def test_an_impossible_estimate_is_refused(row: EstimateRow, reason: str) -> None:
    assert estimate_fault(_req(), _reply(row), {"a": PROFILED}.get) == reason


def test_estimates_for_what_was_not_asked_are_refused() -> None:
    cal = {"a": PROFILED}.get
    assert estimate_fault(_req(), _reply(_row("a"), _row("a")), cal) == "duplicate_row"
    wrong = _reply(_row("a"))
    wrong.query_id = "another"
    assert estimate_fault(_req(), wrong, cal) == "wrong_query"
    assert estimate_fault(_req(also=0), _reply(_row("a"), also=[[_row("a")]]), cal) == "unasked_part"
    assert estimate_fault(_req(also=1), _reply(_row("a"), also=[[_row("a", ttft_s=-1.0)]]), cal) == "ttft"
    assert estimate_fault(_req(also=1), _reply(_row("a"), also=[[_row("a")]]), cal) is None


def test_refusals_are_counted_and_logged_once_per_interval(capsys: pytest.CaptureFixture[str]) -> None:
    guard = ReplyGuard({"a": PROFILED}.get)
    before = metrics().labels(service="estimator", reason="ttft")._value.get()
    for _ in range(3):
        assert guard.estimate_check(_req(), _reply(_row(ttft_s=-1.0))) == "ttft"
    assert not guard.prediction_ok(_pred(**{"Qwen3-8B": _model(acc=7.0)}), MODELS, PROMPT, None, "q1")
    assert guard.rejected == {("estimator", "ttft"): 3, ("predictor", "accuracy"): 1}
    assert metrics().labels(service="estimator", reason="ttft")._value.get() == before + 3
    out = capsys.readouterr().out
    assert out.count("reply refused") == 2  # one line per service and reason per 10 s
    assert "estimator-1@h:1:ab" in out and "predictor-0" in out  # the replica each reply says it is


# ----------------------------------------------------------------------------- where the router reads them
async def test_a_refused_reply_is_no_answer(nats_server: Any) -> None:
    """The router's readers: a refused reply is asked again, and refused again it is none — a
    prediction None (the fallback), an estimate raises like no answer (ask_estimator and the
    sequencer then decide without it)."""
    nc = await nats.connect(nats_server.url)
    forged = {"predict": pack({"v": "bear.prediction/1", "id": "q1",
                               "models": {"Qwen3-8B": {"acc": 3.0, "len": {"mean": 10.0, "p90": 20.0},
                                                       "prompt_tokens": 9, "cost": 0.0}}}),
              "estimate": encode(_reply(_row("a", ttft_s=-2.0)))}

    async def answer(msg: Any) -> None:
        await msg.respond(forged["predict" if msg.subject == S.predict else "estimate"])

    await nc.subscribe(S.predict, cb=answer)
    await nc.subscribe(S.estimate, cb=answer)
    await nc.flush()
    try:
        guard = ReplyGuard({"a": PROFILED}.get)
        got = await ask_predictor(nc, S.predict, PROMPT, MODELS, 2.0, try_timeout_s=1.0, query_id="q1", guard=guard)
        assert got is None
        assert await ask_predictor(nc, S.predict, PROMPT, MODELS, 2.0, try_timeout_s=1.0, query_id="q1") is not None
        client = EstimatorClient(nc, try_timeout_s=1.0, check=guard.estimate_check)
        with pytest.raises(BearError, match="refused"):
            await client.estimate(EstimateQuery(id="q1", prompt_tokens=2000, max_tokens=32),
                                  [EstimateCandidate(instance="a")], budget_s=2.0)
        # each refused answer was asked again (the retry: the queue group's next member), refused again
        assert guard.rejected == {("predictor", "accuracy"): 2, ("estimator", "ttft"): 2}
        assert client.stats.refused == 2
        plain = EstimatorClient(nc, try_timeout_s=1.0)  # no check: the reply as it came
        reply = await plain.estimate(EstimateQuery(id="q1", prompt_tokens=2000), ["a"], budget_s=2.0)
        assert decode(EstimateReply, encode(reply)).estimates[0].ttft_s == -2.0
    finally:
        await nc.close()


async def test_a_refused_reply_is_asked_again(nats_server: Any) -> None:
    """A leaked queue member's forged reply, then a genuine member's: the retry's answer is used."""
    nc = await nats.connect(nats_server.url)
    turn = {"n": 0}

    async def answer(msg: Any) -> None:
        turn["n"] += 1
        acc = 3.0 if turn["n"] == 1 else 0.5
        await msg.respond(pack({"v": "bear.prediction/1", "id": "q1", "models": {
            "Qwen3-8B": {"acc": acc, "len": {"mean": 10.0, "p90": 20.0}, "prompt_tokens": 9, "cost": 0.0}}}))

    await nc.subscribe(S.predict, cb=answer)
    await nc.flush()
    try:
        guard = ReplyGuard()
        got = await ask_predictor(nc, S.predict, PROMPT, MODELS, 2.0, try_timeout_s=1.0, query_id="q1", guard=guard)
        assert got is not None and got["Qwen3-8B"].acc == 0.5
        assert guard.rejected == {("predictor", "accuracy"): 1}
    finally:
        await nc.close()
