"""The router's two questions, asked concurrently with deadlines, and their fallbacks.

* ``ask_predictor``: one ``bear.predict/1`` request (all candidate models), a per-try timeout and
  one retry (the queue group hands it to another predictor) inside the budget. Returns ``None``
  when there is no answer in time, or one no real predictor sends (``bear.router.reply_bounds``).
* ``ask_estimator``: ``EstimatorClient`` (per-try timeout, one retry). ``None`` on failure.

The fallbacks for either silence are applied where candidates are built (``router.candidates``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from bear.estimator.client import EstimatorClient
from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError
from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery, EstimateReply, encode
from bear.protocol.predict import Prediction, PredictRequest, decode_prediction
from bear.protocol.subjects import Subjects
from bear.router.candidates import ModelPrediction
from bear.router.reply_bounds import ReplyGuard
from bear.runtime.request import request


async def ask_predictor(nc: Any, subject: str, prompt: str, models: list[str], budget_s: float, *,
                        try_timeout_s: float, prompt_tokens: int | None = None, query_id: str = "",
                        headers: dict[str, str] | None = None,
                        guard: ReplyGuard | None = None) -> dict[str, ModelPrediction] | None:
    """The predictor's answer per model; None when there is none in time. A reply ``guard``
    refuses as no real predictor's (bear.router.reply_bounds: counted) is no answer: asked again
    while the retry is left (the queue group hands it to another member), else the fallback."""
    deadline = Deadline.after(budget_s)
    req = PredictRequest(prompt=prompt, models=models, deadline=deadline.at, id=query_id,
                         prompt_tokens=None if prompt_tokens is None else int(prompt_tokens))
    decoded: list[Prediction | None] = []

    def accept(data: bytes) -> bool:
        reply = decode_prediction(data)  # None: not a prediction (answered None below)
        decoded.append(reply)
        return reply is None or guard is None or guard.prediction_ok(reply, models, prompt, prompt_tokens, query_id)

    try:
        data = await request(nc, subject, encode(req), deadline=deadline, try_timeout_s=try_timeout_s, headers=headers,
                             accept=accept if guard is not None else None)
    except BearError:
        return None
    reply = decoded[-1] if decoded else decode_prediction(data)  # None: an error reply, or not a prediction
    if reply is None:
        return None
    return {
        name: ModelPrediction(acc=p.acc, out_len=p.len.mean, out_p90=p.len.p90, prompt_tokens=p.prompt_tokens,
                              cost_usd=p.cost)
        for name, p in reply.models.items()
    }


async def ask_estimator(clients: list[EstimatorClient], query: EstimateQuery,
                        instances: list[str] | list[EstimateCandidate], budget_s: float,
                        headers: dict[str, str] | None = None,
                        tokens: Mapping[str, bytes | list[int]] | None = None,
                        ahead: dict[str, list[Dispatch]] | None = None) -> EstimateReply | None:
    """The estimator's answer for every candidate: with one client (an unsharded pool) one request;
    with one client per shard, one request to each shard that owns a candidate, concurrently, and
    the rows merged (a shard that does not answer leaves its instances without a row). None when
    no estimator answered in time."""
    by_shard: dict[int, list[str | EstimateCandidate]] = {}
    for inst in instances:
        name = inst if isinstance(inst, str) else inst.instance
        by_shard.setdefault(Subjects.shard_of(name, len(clients)), []).append(inst)

    async def one(k: int, ids: list[str | EstimateCandidate]) -> EstimateReply | None:
        try:
            names = {i if isinstance(i, str) else i.instance for i in ids}
            mine = {i: ds for i, ds in (ahead or {}).items() if i in names} if ahead else None
            return await clients[k].estimate(query, list(ids), budget_s=budget_s, headers=headers, tokens=tokens,
                                             ahead=mine)
        except Exception:  # BearError, NATS closed/reconnecting: decide without it
            return None

    replies = [r for r in await asyncio.gather(*(one(k, ids) for k, ids in by_shard.items())) if r is not None]
    if len(replies) <= 1:
        return replies[0] if replies else None
    return EstimateReply(query_id=query.id, worker=",".join(r.worker for r in replies),
                         estimates=[row for r in replies for row in r.estimates], at=max(r.at for r in replies))
