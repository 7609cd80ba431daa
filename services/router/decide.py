"""One routing decision, as a pure function: ``decide(profile, query, candidates, now)`` runs the
profile's request filters (``bear.router.filters``) in order, then its policy (the policy's own
filter → score → pick), and returns the ``Decision`` — with every dropped candidate and why — or,
when a filter left no candidate, the coded ``Refused`` the client gets. No I/O and no clock of its
own: the live router (``bear.router.service``) and ``bear eval`` (``bear.evaluation.cluster``,
``bear.evaluation.prefix``) call it with the same profile (``profile_for``), so the filters are
evaluated as they run.

The live router runs the filters that read no estimate once more before asking the predictor
and the estimator (``screen``), on bare candidates (what the registry knows): an instance they
drop is neither estimated nor tokenised for; they drop nothing further inside ``decide``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bear.protocol.errors import ErrorCode
from bear.router.filters import REQUEST_FILTERS, Filter
from bear.router.policies import Candidate, Decision, Policy, QueryContext


@dataclass(frozen=True)
class RoutingProfile:
    """The plug-ins of a decision: request filters in order, then the policy."""

    filters: tuple[Filter, ...]
    policy: Policy

    @property
    def needs_estimate(self) -> bool:
        """Whether the estimator is asked: when the policy reads its rows. The deadline filter
        judges on the estimates there are and asks for none (every client's submit carries a
        deadline): without rows, no candidate has a calibrated estimate, and it drops nothing."""
        return self.policy.needs_estimate

    @property
    def registry_filters(self) -> tuple[Filter, ...]:
        """The filters that read only what the registry knows (run before the questions)."""
        return tuple(f for f in self.filters if not f.reads_estimate)


def profile_for(policy: Policy) -> RoutingProfile:
    """The profile the router and ``bear eval`` run for ``policy``."""
    return RoutingProfile(REQUEST_FILTERS, policy)


@dataclass
class Refused:
    """No candidate left: the filter that dropped the last ones, its coded error, and every drop."""

    code: ErrorCode
    message: str
    filter: str
    dropped: dict[str, str]


def screen(filters: Sequence[Filter], q: QueryContext, cands: Sequence[Candidate], now: float,
           dropped: dict[str, str] | None = None) -> list[Candidate] | Refused:
    """The candidates every filter keeps, in order; each drop is added to ``dropped`` (instance →
    "filter: why"). The first filter that leaves none refuses the query."""
    dropped = {} if dropped is None else dropped
    kept = list(cands)
    for f in filters:
        if not f.applies(q):
            continue
        out, gone = [], []
        for c in kept:
            why = f.why_not(q, c, now)
            if why is None:
                out.append(c)
            else:
                gone.append(c)
                dropped[c.instance] = f"{f.name}: {why}"
        if not out:
            code, message = f.refusal(q, gone, now)
            return Refused(code, message, f.name, dropped)
        kept = out
    return kept


def decide(profile: RoutingProfile, q: QueryContext, cands: Sequence[Candidate], now: float,
           dropped: dict[str, str] | None = None) -> Decision | Refused:
    """Filters, then the policy. ``now``: the clock the deadline filter compares with (the
    router's when it built the candidates; the evaluation's virtual time); ``dropped``: drops
    made before (``screen``), carried into the result."""
    dropped = dict(dropped or {})
    kept = screen(profile.filters, q, cands, now, dropped)
    if isinstance(kept, Refused):
        return kept
    d = profile.policy.decide(q, kept)
    d.dropped = dropped
    return d
