"""The decision pipeline: each request filter, the order they run in, ``decide`` (filters, then
the policy) and which profiles read the estimator's rows."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bear.protocol.errors import ErrorCode
from bear.router.candidates import bare_candidate
from bear.router.decide import Refused, decide, profile_for, screen
from bear.router.filters import REQUEST_FILTERS, ContextFilter, DeadlineFilter, HealthFilter, ModelFilter
from bear.router.policies import REGISTRY, Candidate, QueryContext, make_policy
from bear.router.registry import InstanceInfo

NOW = 1_000.0


def cand(name: str, served: str = "org/M", predictor: str = "M", **kw) -> Candidate:
    return Candidate(name, predictor, served_model=served, **kw)


def q(**kw) -> QueryContext:
    return QueryContext("q", 1.0, **kw)


def test_model_filter_keeps_the_served_or_predictor_name() -> None:
    f = ModelFilter()
    a, b = cand("a", "org/Small-1B", "Small-1B"), cand("b", "org/Big-32B", "Big-32B")
    assert not f.applies(q())
    assert f.why_not(q(model="org/Small-1B"), a, NOW) is None
    assert f.why_not(q(model="Small-1B"), a, NOW) is None
    assert f.why_not(q(model="Small-1B"), b, NOW) == "serves 'org/Big-32B', not 'Small-1B'"
    assert f.refusal(q(model="x"), [a, b], NOW) == (ErrorCode.NOT_FOUND, "no instance serves model 'x'")


def test_health_filter_names_the_model_it_found_no_healthy_instance_of() -> None:
    f = HealthFilter()
    assert f.why_not(q(), cand("a"), NOW) is None
    assert f.why_not(q(), cand("a", healthy=False), NOW) is not None
    assert f.refusal(q(), [], NOW) == (ErrorCode.UNAVAILABLE, "no healthy instance registered")
    assert f.refusal(q(model="M"), [], NOW) == (ErrorCode.UNAVAILABLE, "no healthy instance of model 'M' registered")


def test_context_filter_refuses_in_vllms_words() -> None:
    f = ContextFilter()
    short, long_, unknown = cand("s", max_model_len=1024), cand("l", max_model_len=4096), cand("u")
    need = q(context_tokens=2048)
    assert f.why_not(need, short, NOW) == "max_model_len 1024 < 2048 tokens"
    assert f.why_not(need, long_, NOW) is None and f.why_not(need, unknown, NOW) is None  # unknown: the engine judges
    assert f.why_not(q(context_tokens=1024), short, NOW) is None  # exactly full fits
    code, msg = f.refusal(q(context_tokens=9000), [short, long_], NOW)
    assert code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert msg.startswith("This model's maximum context length is 4096 tokens. However, you requested 9000 tokens")


def test_deadline_filter_drops_only_calibrated_late_estimates() -> None:
    f = DeadlineFilter()
    on_time = cand("a", ttft=0.5, ttft_calibration="online")
    late = cand("b", ttft=2.5, ttft_calibration="profiled")
    nominal = cand("c", ttft=9.0)  # β nominal: may be off by any factor
    unknown = cand("d", ttft=math.inf, ttft_calibration="online")  # no estimate to judge by
    d = q(deadline=NOW + 1.0)
    assert not f.applies(q()) and f.applies(d)
    assert [c.instance for c in (on_time, late, nominal, unknown) if f.why_not(d, c, NOW) is None] == ["a", "c", "d"]
    assert f.why_not(d, late, NOW) == "first token predicted in 2500 ms, 1500 ms after the client's deadline"
    assert f.refusal(d, [late, dataclasses.replace(late, ttft=1.5)], NOW) == (
        ErrorCode.OVERLOADED, "the soonest predicted first token (1500 ms) comes after the client's deadline; "
                              "not executed")


def test_the_first_filter_that_leaves_nothing_refuses() -> None:
    # no instance at all: a named model is not found; no model named, none is healthy
    assert screen(REQUEST_FILTERS, q(model="M"), [], NOW) == Refused(
        ErrorCode.NOT_FOUND, "no instance serves model 'M'", "model", {})
    assert isinstance(r := screen(REQUEST_FILTERS, q(), [], NOW), Refused) and r.code == ErrorCode.UNAVAILABLE
    # the model's only instance is down: unavailable, and the other model's drop is on record
    cs = [cand("a", healthy=False), cand("b", "org/N", "N")]
    r = screen(REQUEST_FILTERS, q(model="M"), cs, NOW)
    assert isinstance(r, Refused) and (r.code, r.filter) == (ErrorCode.UNAVAILABLE, "health")
    assert set(r.dropped) == {"a", "b"} and r.dropped["b"].startswith("model: ")


def test_decide_runs_the_policy_on_what_the_filters_kept_and_says_why_the_rest_went() -> None:
    cs = [cand("small", acc=0.4, max_model_len=1024, ttft=0.1, ttft_calibration="online"),
          cand("mid", acc=0.8, ttft=0.2, ttft_calibration="online"),
          cand("big", acc=0.9, ttft=3.0, ttft_calibration="online"),
          cand("other", "org/N", "N", acc=1.0)]
    ctx = q(model="M", context_tokens=2048, deadline=NOW + 1.0)
    d = decide(profile_for(make_policy("latency-agnostic")), ctx, cs, NOW, {"down": "health: not healthy"})
    assert not isinstance(d, Refused)
    assert d.candidate.instance == "mid" and set(d.scores) == {"mid"}
    assert {k: v.split(":")[0] for k, v in d.dropped.items()} == {
        "down": "health", "other": "model", "small": "context", "big": "deadline"}
    # without a model, context or deadline nothing is dropped: the policy sees every candidate
    d = decide(profile_for(make_policy("latency-agnostic")), q(), cs, NOW)
    assert not isinstance(d, Refused) and d.candidate.instance == "other" and d.dropped == {}


def test_bare_candidates_carry_what_the_filters_read() -> None:
    info = InstanceInfo("i", model="org/M", predictor_model="M", max_model_len=2048)
    c = bare_candidate(info, healthy=False)
    assert (c.instance, c.model, c.served_model, c.max_model_len, c.healthy) == ("i", "M", "org/M", 2048, False)


def test_only_a_policy_that_reads_the_estimate_asks_for_one() -> None:
    asks = {name: profile_for(make_policy(name)).needs_estimate for name in REGISTRY}
    assert {n for n, a in asks.items() if not a} == {"round-robin", "latency-agnostic", "semantic-router"}


def test_the_deadline_filter_drops_nothing_without_estimates() -> None:
    """A policy that reads no estimate is decided on eq. 8 candidates (nominal): a deadline, which
    every client's submit carries, then makes no estimator request worth asking for."""
    cs = [cand("a", ttft=50.0, ttft_method="router-eq8"), cand("b", ttft=60.0, ttft_method="router-eq8")]
    d = decide(profile_for(make_policy("round-robin")), q(deadline=NOW + 0.1), cs, NOW)
    assert not isinstance(d, Refused) and d.dropped == {}


@pytest.mark.parametrize("name", sorted(n for n in REGISTRY if not make_policy(n).needs_estimate))
def test_a_policy_that_needs_no_estimate_reads_none_of_its_fields(name: str) -> None:
    """The estimator's fields (TTFT, load, KV, prefix hit) set at random change nothing: the
    router is right not to ask for them."""
    base = [cand(f"i{k}", acc=0.3 + 0.1 * k, cost=10.0 * k, observed_ttft_p95=0.1 * (3 - k),
                 observed_tpot_p90=0.01 * (k + 1)) for k in range(3)]
    rolled = [dataclasses.replace(c, ttft=0.1 * (7 * k % 5), n_running=3 * (2 - k), n_waiting=k % 2,
                                  kv_blocks_used=k, kv_blocks_total=10, pending_prefill_tokens=100 * (2 - k),
                                  pending_decode_tokens=50.0 * k, prefix_hit_tokens=k, ttft_calibration="online")
              for k, c in enumerate(base)]
    plain, rolling = make_policy(name), make_policy(name)
    assert [plain.decide(q(), base).candidate.instance for _ in range(4)] == [
        rolling.decide(q(), rolled).candidate.instance for _ in range(4)]
