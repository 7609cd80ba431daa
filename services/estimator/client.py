"""Caller side of ``bear.estimate``: one request per query with all its candidates (an absolute
deadline, a per-try timeout and one retry: ``bear.runtime.request``). Used by the router, the
benchmark and the tests."""

from __future__ import annotations

from typing import Any

import msgspec

from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.messages import (
    EstimateCandidate,
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
                 retries: int = 1, subject: str | None = None) -> None:
        self.nc = nc
        self.subject = subject or (subjects or Subjects()).estimate  # a shard's subject when sharded
        self.try_timeout_s = try_timeout_s
        self.retries = retries
        self.stats = RequestStats()

    @property
    def timeouts(self) -> int:
        return self.stats.timeouts

    async def estimate(self, query: EstimateQuery | dict[str, Any], instances: list[str | EstimateCandidate], *,
                       budget_s: float = 1.0, headers: dict[str, str] | None = None,
                       tokens: dict[str, list[int]] | None = None) -> EstimateReply:
        """The reply (``estimates`` per instance); BearError on an error reply or no answer in time.
        ``tokens``: the prompt's token ids per tokenizer id (candidates name theirs)."""
        if isinstance(query, dict):
            try:
                query = msgspec.convert(query, EstimateQuery)
            except msgspec.ValidationError as exc:
                raise BearError(ErrorCode.BAD_REQUEST, f"query: {exc}") from exc
        deadline = Deadline.after(budget_s)
        payload = encode(EstimateRequest(query=query, instances=list(instances), deadline=deadline.at,
                                         tokens=tokens or {}))
        data = await request(self.nc, self.subject, payload, deadline=deadline, try_timeout_s=self.try_timeout_s,
                             retries=self.retries, headers=headers, stats=self.stats)
        return decode_reply(data)


def decode_reply(data: bytes) -> EstimateReply:
    """An estimate reply, or the BearError of an error reply."""
    err = error_in(data)
    if err is not None:
        raise err
    return decode(EstimateReply, data)
