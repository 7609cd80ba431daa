"""The router's settings (``bear router``'s options): budgets, admission bounds, retries, the
outcome log, engine keys. One dataclass, read by the service and the submit parser."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RouterConfig:
    policy: str = "bear"
    policy_params: dict[str, float] = field(default_factory=dict)
    lam: float = 5e-4  # default λ of eq. 4 when the query gives none
    default_ttft_target_s: float = 1.0
    default_max_tokens: int = 256
    predict_budget_s: float = 0.2
    predict_try_s: float = 0.1
    estimate_budget_s: float = 0.2
    estimate_try_s: float = 0.1
    estimator_shards: int = 1  # estimator shards of the deployment (each its own queue group)
    default_output_tokens: int = 256  # fallback prediction of the output length
    max_inflight: int = 4096  # queries in progress (streaming included) before `overloaded`
    max_deciding: int = 256  # queries being decided (before dispatch) before `overloaded`
    shed_lag_s: float = 1.0  # event-loop lag beyond which new submits are refused (GC and a busy host stay below)
    # fair shares between identities (bear.router.fairshare): weights and own limits per identity
    # (a client identity, or <relay>/<tenant> for a trusted relay's tenants: gateway/<key digest>)
    identity_weights: dict[str, float] = field(default_factory=dict)
    identity_limits: dict[str, int] = field(default_factory=dict)
    identity_limit: int = 0  # queries in progress per identity without a limit of its own (0: none)
    identity_weight: float = 1.0  # the weight of every identity without one of its own
    fair_relays: tuple[str, ...] = ("gateway",)  # identities whose Bear-Tenant header names the tenant
    down_after_s: float = 10.0
    fail_backoff_s: float = 5.0  # an instance that refused a connection is avoided this long
    max_attempts: int = 2  # instances tried per query before an `unavailable` error
    connect_timeout_s: float = 2.0
    idle_timeout_s: float = 60.0
    # an engine that has produced no first token this long after dispatch is given up: its request
    # is aborted and the client gets ``deadline_exceeded`` — before the client library's own limit
    # (30 s of silence), so an accepted query never just goes silent under overload (issue 26)
    first_token_timeout_s: float = 25.0
    dedup_ttl_s: float = 600.0
    dedup_timeout_s: float = 0.1
    # submits are taken only once the registry's initial entries are in (a router restarted under
    # load answered "no healthy instance registered" to the first query it heard), waiting at most this
    registry_wait_s: float = 10.0
    outcome_log: Path | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # served model → predictor model
    name: str = ""
    engine_keys: dict[str, str] = field(default_factory=dict)  # instance (or "*") → its engine's API key
    allowed_base_urls: tuple[str, ...] = ()  # instances only under these base URLs (empty: any)
    provisioning: bool = False  # take only registry entries that match their binding (bear_provisioned)
    tokenize: bool = True  # exact prompt tokens (and prefix hits) where instances register a tokenizer
    prime_answers: bool = True  # encode each answer ahead of the next turn (TokenizerCache.prime)
    coalesce: bool = True  # the answer's chunks that arrived in one read go to the client as one message
    # decisions in order, each seeing every dispatch this router made before it (bear.router.sequencer);
    # False: each query decided on its own estimate alone (concurrent decisions do not see each other)
    sequence: bool = True
    sequence_chain: int = 8  # waiting queries a fresh estimate at the chosen instance covers too
    reserve_s: float = 0.25  # this router's dispatches are sent with every estimate this long
    # candidate selection (bear.router.selection): > 0, a model with more instances than this has
    # only the k its cheap bounds choose estimated (0: off, every instance estimated)
    selection_k_max: int = 0
    selection_k_min: int = 2
    selection_row_s: float = 2.0  # an instance's last estimate row counts in its cheap bound this long
