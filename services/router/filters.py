"""The request filters: which instances may take a query at all, before any policy scores them
(llm-d's endpoint-picker filters). Each is a plug-in of ``bear.router.decide``'s profile, run in
order, on the same ``Candidate`` fields live and in ``bear eval``:

* ``ModelFilter``: the query names a model — only instances serving it (served or predictor name);
* ``HealthFilter``: only instances the registry sees alive (heartbeat, no recent refused connection);
* ``ContextFilter``: only instances whose context (``max_model_len``) holds the prompt and the
  output the query asks for (the client's ``prompt_tokens`` + ``max_tokens``, or one token of a
  ``max_tokens_rest`` query);
* ``DeadlineFilter``: the query has a deadline (when its client stops waiting) — not the instances
  predicted to start it after then. Only estimates made with a calibrated β count: an instance on
  the nominal β (``EstimateRow.calibration``) may be off by any factor either way, and is kept.

A filter says per candidate why it drops it (the outcome log's ``dropped``), and the coded error
the client gets when it drops every candidate left. ``reads_estimate``: the filter reads the
estimator's row, so the router runs it after the estimate (with what estimates there are: it
never makes the router ask for one); the others run on what the registry knows, before the
predictor and the estimator are asked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Protocol

from bear.protocol.errors import ErrorCode
from bear.router.policies import Candidate, QueryContext


class Filter(Protocol):
    name: ClassVar[str]
    reads_estimate: ClassVar[bool]

    def applies(self, q: QueryContext) -> bool:
        """Whether the filter can drop anything for this query (else it is skipped)."""
        ...

    def why_not(self, q: QueryContext, c: Candidate, now: float) -> str | None:
        """Why ``c`` may not take the query (None: it may)."""
        ...

    def refusal(self, q: QueryContext, dropped: Sequence[Candidate], now: float) -> tuple[ErrorCode, str]:
        """The client's error when the filter left no candidate (``dropped``: those it dropped)."""
        ...


class ModelFilter:
    name: ClassVar[str] = "model"
    reads_estimate: ClassVar[bool] = False

    def applies(self, q: QueryContext) -> bool:
        return q.model is not None

    def why_not(self, q: QueryContext, c: Candidate, now: float) -> str | None:
        if q.model in (c.served_model, c.model):
            return None
        return f"serves {c.served_model or c.model!r}, not {q.model!r}"

    def refusal(self, q: QueryContext, dropped: Sequence[Candidate], now: float) -> tuple[ErrorCode, str]:
        return ErrorCode.NOT_FOUND, f"no instance serves model {q.model!r}"


class HealthFilter:
    name: ClassVar[str] = "health"
    reads_estimate: ClassVar[bool] = False

    def applies(self, q: QueryContext) -> bool:
        return True

    def why_not(self, q: QueryContext, c: Candidate, now: float) -> str | None:
        return None if c.healthy else "not healthy (heartbeat stale, or a connection refused lately)"

    def refusal(self, q: QueryContext, dropped: Sequence[Candidate], now: float) -> tuple[ErrorCode, str]:
        what = "" if q.model is None else f" of model {q.model!r}"
        return ErrorCode.UNAVAILABLE, f"no healthy instance{what} registered"


class ContextFilter:
    name: ClassVar[str] = "context"
    reads_estimate: ClassVar[bool] = False

    def applies(self, q: QueryContext) -> bool:
        return q.context_tokens > 0

    def why_not(self, q: QueryContext, c: Candidate, now: float) -> str | None:
        if c.max_model_len is None or q.context_tokens <= c.max_model_len:
            return None
        return f"max_model_len {c.max_model_len} < {q.context_tokens} tokens"

    def refusal(self, q: QueryContext, dropped: Sequence[Candidate], now: float) -> tuple[ErrorCode, str]:
        most = max((c.max_model_len or 0 for c in dropped), default=0)
        # vLLM's and OpenAI's wording: clients (LiteLLM) recognise a context overflow by it
        return ErrorCode.CONTEXT_LENGTH_EXCEEDED, (
            f"This model's maximum context length is {most} tokens. However, you requested {q.context_tokens} "
            f"tokens (prompt + max_tokens; the largest max_model_len of the candidate instances).")


class DeadlineFilter:
    name: ClassVar[str] = "deadline"
    reads_estimate: ClassVar[bool] = True

    def applies(self, q: QueryContext) -> bool:
        return q.deadline is not None

    def why_not(self, q: QueryContext, c: Candidate, now: float) -> str | None:
        assert q.deadline is not None
        if c.ttft_calibration == "nominal" or not math.isfinite(c.ttft) or now + c.ttft <= q.deadline:
            return None
        return f"first token predicted in {c.ttft * 1e3:.0f} ms, {(now + c.ttft - q.deadline) * 1e3:.0f} ms after " \
               "the client's deadline"

    def refusal(self, q: QueryContext, dropped: Sequence[Candidate], now: float) -> tuple[ErrorCode, str]:
        soonest = min((c.ttft for c in dropped), default=math.inf)
        return ErrorCode.OVERLOADED, (f"the soonest predicted first token ({soonest * 1e3:.0f} ms) comes after the "
                                      "client's deadline; not executed")


# The request filters of every profile, in order: the cheap ones first, the estimate's last.
REQUEST_FILTERS: tuple[Filter, ...] = (ModelFilter(), HealthFilter(), ContextFilter(), DeadlineFilter())
