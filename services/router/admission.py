"""Whether a router takes one more submit, decided on arrival and cheaply (the submit callback
runs once per message, in order: any work there delays every message behind it).

A router that takes everything under overload serves everything late: its event loop time-slices
thousands of queries, each decision takes seconds, clients give up, and the queries they abandoned
still run when their turn comes. So a submit is refused with ``overloaded`` — at once, so the
client can go elsewhere — when

* ``max_inflight`` queries are in progress (answers streaming included), or ``max_deciding`` are
  still being decided (predictor, estimator, policy: the CPU- and latency-bound part);
* the event loop lags by more than ``shed_lag_s`` (measured every ``LAG_PROBE_S``: it is the wait
  every new message will see on top of its own work);
* the client's ``deadline`` (``bear.submit/1``: when it stops waiting for the query to start) is
  nearer than the decision is expected to take (recent decisions' EWMA plus the lag) — the
  admission by deadline. A deadline already past is ``deadline_exceeded``: nobody waits for it.

After the estimate, the instances predicted to start the query after its client's deadline are
dropped, and the query is refused when none is left (``bear.router.filters.DeadlineFilter``): it
would run for nobody.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bear.protocol.errors import ErrorCode

LAG_PROBE_S = 0.02
LAG_DECAY = 0.8  # per probe: a lag spike fades within ~0.2 s once the loop keeps up again
DECISION_EWMA = 0.05


@dataclass
class Refusal:
    code: ErrorCode
    reason: str  # metric label: max_inflight | max_deciding | loop_lag | deadline | expired
    message: str


class Admission:
    def __init__(self, *, max_inflight: int, max_deciding: int, shed_lag_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_deciding = max_deciding
        self.shed_lag_s = shed_lag_s
        self.lag = 0.0
        self.deciding = 0
        self.decision_s = 0.0  # EWMA of submit → dispatch

    async def watch_loop(self) -> None:
        """Measure the event loop's lag until cancelled: how late a short sleep wakes up."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            over = max(0.0, time.monotonic() - t - LAG_PROBE_S)
            self.lag = max(over, self.lag * LAG_DECAY)

    def decided(self, decision_s: float) -> None:
        """A query left the deciding stage after ``decision_s``."""
        self.deciding = max(0, self.deciding - 1)
        self.decision_s = decision_s if self.decision_s == 0 else (
            (1 - DECISION_EWMA) * self.decision_s + DECISION_EWMA * decision_s)

    def expected_wait_s(self) -> float:
        return self.decision_s + self.lag

    def refuse(self, inflight: int, deadline: float | None, now: float) -> Refusal | None:
        """Why a submit arriving now is not taken (None: take it)."""
        if deadline is not None and now >= deadline:
            return Refusal(ErrorCode.DEADLINE_EXCEEDED, "expired",
                           "the client's deadline passed before the router got to the query; not executed")
        if inflight >= self.max_inflight:
            return Refusal(ErrorCode.OVERLOADED, "max_inflight", f"router at max_inflight ({self.max_inflight})")
        if self.deciding >= self.max_deciding:
            return Refusal(ErrorCode.OVERLOADED, "max_deciding",
                           f"router deciding {self.deciding} queries (max_deciding {self.max_deciding})")
        if self.lag > self.shed_lag_s:
            return Refusal(ErrorCode.OVERLOADED, "loop_lag", f"router event loop {self.lag * 1e3:.0f} ms behind")
        if deadline is not None and deadline - now < self.expected_wait_s():
            return Refusal(ErrorCode.OVERLOADED, "deadline",
                           f"{(deadline - now) * 1e3:.0f} ms left of the client's deadline; deciding takes "
                           f"≈{self.expected_wait_s() * 1e3:.0f} ms here")
        return None
