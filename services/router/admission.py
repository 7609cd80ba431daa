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

Under pressure (``max_inflight``, ``max_deciding``, the loop's lag) the refusal goes to the
identity holding more than its share of the queries in progress, not to whoever arrives next
(``bear.router.fairshare``): an identity under its share is still taken (at most
``2 × max_inflight`` in progress), and each identity may have a limit of its own
(``identity_limit``), whatever the load.

After the estimate, the instances predicted to start the query after its client's deadline are
dropped, and the query is refused when none is left (``bear.router.filters.DeadlineFilter``): it
would run for nobody.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bear.protocol.errors import ErrorCode
from bear.router.fairshare import FairShare, Shares

LAG_PROBE_S = 0.02
LAG_DECAY = 0.8  # per probe: a lag spike fades within ~0.2 s once the loop keeps up again
DECISION_EWMA = 0.05


@dataclass
class Refusal:
    code: ErrorCode
    reason: str  # metric label: max_inflight | max_deciding | loop_lag | deadline | expired | identity_limit | identities
    message: str


class Admission:
    def __init__(self, *, max_inflight: int, max_deciding: int, shed_lag_s: float, shares: Shares | None = None) -> None:
        self.fair = FairShare(shares)
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

    def pressure(self, inflight: int) -> str | None:
        """Why the router would refuse anyone now (None: it takes what comes)."""
        if inflight >= self.max_inflight:
            return "max_inflight"
        if self.deciding >= self.max_deciding:
            return "max_deciding"
        if self.lag > self.shed_lag_s:
            return "loop_lag"
        return None

    def refuse(self, inflight: int, deadline: float | None, now: float, identity: str = "") -> Refusal | None:
        """Why a submit of ``identity`` arriving now is not taken (None: take it; the caller then
        counts it in ``fair.add(identity)`` and ``fair.remove`` when it ends)."""
        if deadline is not None and now >= deadline:
            return Refusal(ErrorCode.DEADLINE_EXCEEDED, "expired",
                           "the client's deadline passed before the router got to the query; not executed")
        reason = self.fair.verdict(identity, self.pressure(inflight), self.max_inflight)
        if reason is not None:
            return Refusal(ErrorCode.OVERLOADED, reason, self._message(reason, identity, inflight))
        if deadline is not None and deadline - now < self.expected_wait_s():
            return Refusal(ErrorCode.OVERLOADED, "deadline",
                           f"{(deadline - now) * 1e3:.0f} ms left of the client's deadline; deciding takes "
                           f"≈{self.expected_wait_s() * 1e3:.0f} ms here")
        return None

    def _message(self, reason: str, identity: str, inflight: int) -> str:
        held = self.fair.inflight.get(identity, 0)
        who = f"identity {identity!r}" if identity else "the anonymous identity"
        if reason == "identity_limit":
            return f"{who} has {held} queries in progress here, its limit ({self.fair.shares.limit(identity)})"
        if reason == "identities":
            return "router tracking too many identities with queries in progress"
        if reason == "max_inflight":
            why = f"router at max_inflight ({self.max_inflight})"
        elif reason == "max_deciding":
            why = f"router deciding {self.deciding} queries (max_deciding {self.max_deciding})"
        else:
            why = f"router event loop {self.lag * 1e3:.0f} ms behind"
        if identity or len(self.fair.inflight) > 1:
            why += f"; {who} holds {held} of {self.fair.total} queries in progress, its share {self.fair.share(identity):.0f}"
        return why
