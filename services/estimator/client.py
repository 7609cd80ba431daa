"""Caller side of ``bear.estimate``: one request per query with all its candidates, an absolute
deadline, a per-try timeout shorter than the budget and one retry (another worker of the queue
group picks it up), as design.md §7 asks. Used by the router, the benchmark and the tests."""

from __future__ import annotations

from typing import Any

from bear.estimator.worker import REQUEST_SCHEMA
from bear.protocol.codec import pack, unpack_map
from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, ErrorCode, is_error
from bear.protocol.subjects import Subjects


class EstimatorClient:
    def __init__(self, nc: Any, subjects: Subjects | None = None, *, try_timeout_s: float = 0.25,
                 retries: int = 1) -> None:
        self.nc = nc
        self.subject = (subjects or Subjects()).estimate
        self.try_timeout_s = try_timeout_s
        self.retries = retries
        self.timeouts = 0

    async def estimate(self, query: dict[str, Any], instances: list[Any], *, budget_s: float = 1.0,
                       headers: dict[str, str] | None = None) -> dict[str, Any]:
        """The reply map (``estimates`` per instance); raises BearError on error replies or when
        every try timed out (DEADLINE_EXCEEDED). ``headers``: NATS headers (the trace context)."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        deadline = Deadline.after(budget_s)
        payload = pack({"v": REQUEST_SCHEMA, "query": query, "instances": instances, "deadline": deadline.at})
        last: Exception | None = None
        for _ in range(self.retries + 1):
            timeout = deadline.timeout(self.try_timeout_s)
            if timeout <= 0:
                break
            try:
                msg = await self.nc.request(self.subject, payload, timeout=timeout, headers=headers)
            except (NatsTimeout, TimeoutError) as exc:  # the worker died or is slow: retry
                self.timeouts += 1
                last = exc
                continue
            except NoRespondersError as exc:
                last = exc
                break
            reply = unpack_map(msg.data)
            if is_error(reply):
                err = reply["error"]
                raise BearError(ErrorCode(err.get("code", "internal")), str(err.get("message", "")))
            return reply
        raise BearError(ErrorCode.DEADLINE_EXCEEDED if last is None or not _is_no_responders(last)
                        else ErrorCode.UNAVAILABLE, f"no estimate within {budget_s}s: {last!r}")


def _is_no_responders(exc: Exception) -> bool:
    from nats.errors import NoRespondersError

    return isinstance(exc, NoRespondersError)

