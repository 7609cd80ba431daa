"""Caller side of ``bear.estimate``: one request per query with all its candidates (an absolute
deadline, a per-try timeout and one retry: ``bear.runtime.request``). Used by the router, the
benchmark and the tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import (
    Dispatch,
    EstimateCandidate,
    EstimatePart,
    EstimateQuery,
    EstimateReply,
    EstimateRequest,
    decode,
    encode,
)
from bear.protocol.subjects import Subjects
from bear.runtime.request import RequestStats, error_in, request


class EstimatorClient:
    def __init__(self, nc: Any, subjects: Subjects | None = None, *, try_timeout_s: float = 0.25,
                 retries: int = 1, subject: str | None = None,
                 check: Callable[[EstimateRequest, EstimateReply], str | None] | None = None) -> None:
        self.nc = nc
        # why a reply is no real estimator's (the router's bear.router.reply_bounds), or None: refused
        self.check = check
        self.subject = subject or (subjects or Subjects()).estimate  # a shard's subject when sharded
        self.try_timeout_s = try_timeout_s
        self.retries = retries
        self.stats = RequestStats()

    @property
    def timeouts(self) -> int:
        return self.stats.timeouts

    async def estimate(self, query: EstimateQuery | dict[str, Any], instances: list[str | EstimateCandidate], *,
                       budget_s: float = 1.0, headers: dict[str, str] | None = None,
                       tokens: Mapping[str, bytes | list[int]] | None = None,
                       ahead: dict[str, list[Dispatch]] | None = None,
                       also: list[EstimatePart] | None = None, then: Dispatch | None = None) -> EstimateReply:
        """The reply (``estimates`` per instance); BearError on an error reply or no answer in time.
        ``tokens``: the prompt's token ids per tokenizer id, packed or a list (candidates name theirs);
        ``ahead``: per instance, dispatches to queue ahead that the estimator may not hold; ``also``:
        more queries estimated in the same round trip (their rows in the reply's ``also``); ``then``:
        the query as it would be dispatched, queued ahead of the "chain" parts of ``also``. A reply
        ``check`` refuses (bear.router.reply_bounds) is no answer: asked again while a retry is left."""
        if isinstance(query, dict):
            try:
                query = msgspec.convert(query, EstimateQuery)
            except msgspec.ValidationError as exc:
                raise BearError(ErrorCode.BAD_REQUEST, f"query: {exc}") from exc
        deadline = Deadline.after(budget_s)
        req = EstimateRequest(query=query, instances=list(instances), deadline=deadline.at,
                              tokens=dict(tokens or {}), ahead=ahead or {}, also=also or [], then=then)
        decoded: list[EstimateReply] = []
        check = self.check

        def accept(data: bytes) -> bool:  # not an error reply: one no real estimator sends is no answer
            try:
                reply = decode(EstimateReply, data)
            except BearError:
                return True  # raised by decode_reply below, as before
            decoded.append(reply)
            return check is None or check(req, reply) is None

        data = await request(self.nc, self.subject, encode(req), deadline=deadline, try_timeout_s=self.try_timeout_s,
                             retries=self.retries, headers=headers, stats=self.stats,
                             accept=accept if check is not None else None)
        return decoded[-1] if decoded and error_in(data) is None else decode_reply(data)


def decode_reply(data: bytes) -> EstimateReply:
    """An estimate reply, or the BearError of an error reply."""
    err = error_in(data)
    if err is not None:
        raise err
    return decode(EstimateReply, data)
