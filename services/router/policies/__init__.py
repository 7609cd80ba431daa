"""Routing policies (design.md §5): one small module per family, one registry by name."""

from __future__ import annotations

from collections.abc import Callable

from bear.router.policies.base import Candidate, Decision, Policy, QueryContext
from bear.router.policies.bear_rule import BearLagrangePolicy, BearPolicy, PrefillThroughputPolicy
from bear.router.policies.joint_routers import RouteBalancePolicy, ScorePolicy, SemanticRouterLatencyPolicy
from bear.router.policies.load_balancers import (
    LatencyAgnosticPolicy,
    LMDeployPolicy,
    RoundRobinPolicy,
    ShortestQueuePolicy,
)
from bear.router.policies.prefix_locality import DynamoKvPolicy, LlmdPolicy, SessionAffinityPolicy

REGISTRY: dict[str, Callable[..., Policy]] = {
    cls.name: cls
    for cls in (
        BearPolicy,
        BearLagrangePolicy,
        RoundRobinPolicy,
        ShortestQueuePolicy,
        LatencyAgnosticPolicy,
        LMDeployPolicy,
        ScorePolicy,
        RouteBalancePolicy,
        SemanticRouterLatencyPolicy,
        PrefillThroughputPolicy,
        LlmdPolicy,
        DynamoKvPolicy,
        SessionAffinityPolicy,
    )
}

# The paper's comparison set (Fig. 8): BEAR and its seven baselines, plus the eq. 8 ablation.
BASELINES = ["routebalance", "score", "latency-agnostic", "round-robin", "shortest-queue", "lmdeploy",
             "semantic-router"]


# The prefix-locality routers of the prefix experiment (bear.evaluation.prefix).
PREFIX_BASELINES = ["llm-d", "dynamo-kv", "session-affinity"]


def make_policy(name: str, **params: float) -> Policy:
    """A fresh policy by registry name (``bear``, ``bear-lagrange``, ...), with its parameters."""
    try:
        factory = REGISTRY[name]
    except KeyError as exc:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}") from exc
    return factory(**params)


__all__ = ["BASELINES", "PREFIX_BASELINES", "REGISTRY", "Candidate", "Decision", "Policy", "QueryContext", "make_policy"]
