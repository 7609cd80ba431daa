"""Fair shares of a router between client identities (issue 40): which identity is refused first
when the router must refuse. Pure: counts in, a verdict out — no clock, no NATS, no asyncio.

An identity is the submitting client's NATS identity (``bear.submit.<identity>``: only it may
publish there, the server's word), and for submissions relayed by a trusted relay (the gateway)
the relay's own tenant: the gateway names the API key a request came with (a digest of it, never
the key) in the ``Bear-Tenant`` header, and the router takes the header only from the relays it
trusts (``RouterConfig.fair_relays``), as ``<relay>/<tenant>``.

The rule, for a submit of identity *i* holding *nᵢ* of the *N* queries in progress here:

* *i*'s own limit (``limits[i]``, else ``default_limit``; 0: none) reached → refused
  (``identity_limit``) whatever the load;
* otherwise, when the router is under pressure (``max_inflight`` reached, ``max_deciding``
  reached, the event loop lagging — ``bear.router.admission``), *i* is still taken while it holds
  less than its share of what is in progress, ``N · wᵢ / Σ wⱼ`` over the identities holding
  queries (and *i*); an identity at or over its share is refused. So the identity that floods is
  refused first, and one under its share is never refused for the load others make. A single
  identity's share is everything: alone, it is refused exactly where the router refused before.

Taken past ``max_inflight`` that way, the queries in progress stay below ``2 × max_inflight``
(``HARD_FACTOR``): the identities under their share hold less than their shares, which sum to N.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TENANT_HEADER = "Bear-Tenant"  # a trusted relay's tenant of a submission (the gateway: its API key's digest)
MAX_TENANT = 64  # characters of a tenant name kept
HARD_FACTOR = 2  # queries in progress, as a multiple of max_inflight, past which nothing is taken
MAX_TRACKED = 100_000  # identities with queries in progress tracked at once (beyond: refused)


def identity_of(client: str, headers: Mapping[str, str] | None, relays: tuple[str, ...] = ("gateway",)) -> str:
    """The identity a submission counts against: its client identity (``""`` anonymous), and
    for a relay in ``relays`` the tenant it names, as ``<relay>/<tenant>``."""
    if client in relays and headers:
        tenant = headers.get(TENANT_HEADER)
        if tenant:
            tenant = "".join(c for c in tenant[:MAX_TENANT] if c.isprintable())
            if tenant:
                return f"{client}/{tenant}"
    return client


@dataclass(frozen=True)
class Shares:
    """The configured weights and limits (``bear router --identity-weight / --identity-limit``)."""

    weights: Mapping[str, float] = field(default_factory=dict)  # identity → weight (> 0)
    limits: Mapping[str, int] = field(default_factory=dict)  # identity → most queries in progress (≥ 0; 0: none)
    default_weight: float = 1.0
    default_limit: int = 0  # every identity without its own limit (0: none)

    def weight(self, identity: str) -> float:
        return self.weights.get(identity, self.default_weight)

    def limit(self, identity: str) -> int:
        return self.limits.get(identity, self.default_limit)


class FairShare:
    """The queries in progress per identity (``add`` when one is taken, ``remove`` when it ends)
    and the verdicts on them."""

    def __init__(self, shares: Shares | None = None) -> None:
        self.shares = shares or Shares()
        self.inflight: dict[str, int] = {}
        self._weight_sum = 0.0  # Σ weights of the identities in ``inflight``
        self.total = 0  # Σ inflight

    def add(self, identity: str) -> None:
        n = self.inflight.get(identity, 0)
        if n == 0:
            self._weight_sum += self.shares.weight(identity)
        self.inflight[identity] = n + 1
        self.total += 1

    def remove(self, identity: str) -> None:
        n = self.inflight.get(identity, 0)
        if n == 0:
            return
        self.total -= 1
        if n > 1:
            self.inflight[identity] = n - 1
            return
        del self.inflight[identity]
        self._weight_sum -= self.shares.weight(identity)
        if not self.inflight:
            self._weight_sum = 0.0  # no float drift left behind

    def share(self, identity: str) -> float:
        """``identity``'s share of the queries in progress: its weight's fraction of the weights
        of the identities holding queries, itself included."""
        w = self.shares.weight(identity)
        ws = self._weight_sum + (0.0 if identity in self.inflight else w)
        return self.total * w / ws if ws > 0 else 0.0

    def over_limit(self, identity: str) -> bool:
        limit = self.shares.limit(identity)
        return limit > 0 and self.inflight.get(identity, 0) >= limit

    def within_share(self, identity: str) -> bool:
        """Whether ``identity`` holds less than its share (taken under pressure)."""
        return self.inflight.get(identity, 0) < self.share(identity)

    def verdict(self, identity: str, pressure: str | None, max_inflight: int) -> str | None:
        """Why a submit of ``identity`` is refused now (None: take it): ``pressure`` is the
        router's reason to refuse anyone (``max_inflight``, ``max_deciding``, ``loop_lag``; None:
        none)."""
        if self.over_limit(identity):
            return "identity_limit"
        if identity not in self.inflight and len(self.inflight) >= MAX_TRACKED:
            return "identities"
        if pressure is None:
            return None
        if self.total < HARD_FACTOR * max_inflight and self.within_share(identity):
            return None
        return pressure
