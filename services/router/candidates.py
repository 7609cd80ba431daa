"""The candidates of one query: one ``Candidate`` per instance, built from plain inputs — the
predictor's answer per model, the estimator's row per instance, and what the router knows of
each instance (prices, θ, observed latencies). No I/O: the live router and ``bear eval`` both call
``build_candidates``, so a policy sees the same fields in both; ``bare_candidate`` is what the
registry alone knows (the request filters, ``bear.router.filters``, read only that).

Fallbacks, each visible in the candidate:
  * no prediction for a model (predictor silent or the model unknown to it) → accuracy 0, output
    length ``default_output_tokens``, cost from the registry prices (the policy then trades only
    cost against latency);
  * no estimator row (estimator silent) → eq. 8 over what this router itself has in flight at
    the instance (method ``router-eq8``).

Prompt lengths: the instance's tokenizer count when the router has it (``prompt_tokens`` per
instance: exact), else the prediction's (the predictor's count for the model). The prefix-cache
hit, the KV usage and the block size come from the estimator's row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from bear import libbea
from bear.protocol.messages import Calibration, Dispatch, EstimateRow
from bear.router.observations import Observations
from bear.router.policies import Candidate

MUSD = 1e6  # Candidate.cost is in micro-USD (USD per million tokens × tokens): the unit λ = 5e-4 is for


@dataclass
class ModelPrediction:
    """The predictor's answer for one model (``bear.prediction/1``), or the fallback."""

    acc: float
    out_len: float
    out_p90: float
    prompt_tokens: int
    cost_usd: float
    source: str = "predictor"  # predictor | fallback


def fallback_prediction(prompt_tokens: int, price_in: float, price_out: float,
                        default_output_tokens: int) -> ModelPrediction:
    cost = (prompt_tokens * price_in + default_output_tokens * price_out) / MUSD
    return ModelPrediction(acc=0.0, out_len=float(default_output_tokens), out_p90=float(default_output_tokens),
                           prompt_tokens=prompt_tokens, cost_usd=cost, source="fallback")


class InstanceView(Protocol):
    """What the decision needs to know of an instance besides the estimator's row."""

    id: str
    model: str  # served name
    predictor_model: str
    max_model_len: int | None
    price_in: float
    price_out: float
    calibration: Calibration
    obs: Observations


def bare_candidate(inst: InstanceView, healthy: bool = True) -> Candidate:
    """What the registry alone knows of an instance as a candidate (the request filters read it)."""
    return Candidate(instance=inst.id, model=inst.predictor_model, healthy=healthy, served_model=inst.model,
                     max_model_len=inst.max_model_len)


@dataclass
class LocalLoad:
    """What this router has in flight per instance (the eq. 8 fallback's queue)."""

    pending_prefill_tokens: dict[str, int] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)


def prediction_at(inst: InstanceView, prompt_tokens: int, preds: Mapping[str, ModelPrediction] | None,
                  default_output_tokens: int, exact_tokens: Mapping[str, int] | None = None) -> ModelPrediction:
    """The prediction a query is decided (and dispatched) on at ``inst``: its model's, else the
    fallback, with the instance's exact prompt length where its tokenizer counted it."""
    p = preds.get(inst.predictor_model) if preds else None
    if p is None:
        p = fallback_prediction(prompt_tokens, inst.price_in, inst.price_out, default_output_tokens)
    exact = exact_tokens.get(inst.id) if exact_tokens else None
    if exact is not None and exact != p.prompt_tokens:
        p = replace(p, prompt_tokens=exact)
    return p


def build_candidates(prompt_tokens: int, insts: Sequence[InstanceView],
                     preds: Mapping[str, ModelPrediction] | None, rows: Mapping[str, EstimateRow] | None,
                     now: float, *, default_output_tokens: int, local: LocalLoad | None = None,
                     exact_tokens: Mapping[str, int] | None = None,
                     sequences: int = 1,
                     elapsed_s: float | Mapping[str, float] = 0.0) -> tuple[list[Candidate], dict[str, ModelPrediction]]:
    """One Candidate per instance, and the prediction each used (by instance id). Prompt lengths
    are per instance: ``exact_tokens`` (its tokenizer's count), else the prediction's (per model),
    else ``prompt_tokens``. ``sequences``: the engine generates that many answers (``n``), each
    paid for: the cost counts the predicted output once per sequence, the prompt once.
    ``elapsed_s``: how long the query had been in the router when the estimator was asked (one
    figure, or per instance: a sequenced decision's estimates were asked at different times) — its
    target runs from its submit, the estimate's engine part from then, so every TTFT is the sum."""
    cands: list[Candidate] = []
    used: dict[str, ModelPrediction] = {}
    for inst in insts:
        p = prediction_at(inst, prompt_tokens, preds, default_output_tokens, exact_tokens)
        exact = exact_tokens.get(inst.id) if exact_tokens else None
        used[inst.id] = p
        theta = inst.calibration.prefill_tps()
        waited = elapsed_s if isinstance(elapsed_s, float | int) else elapsed_s.get(inst.id, 0.0)
        p50, p90 = inst.obs.percentiles()
        ttft95, tpot90 = inst.obs.semantic_router_percentiles()
        extra = (sequences - 1) * p.out_len * inst.price_out if sequences > 1 and math.isfinite(p.out_len) else 0.0
        c = replace(bare_candidate(inst), acc=p.acc, cost=p.cost_usd * MUSD + extra, out_len=p.out_len,
                    out_p90=p.out_p90, prefill_tps=theta, tpot=inst.obs.tpot,
                    throughput_rps=inst.obs.throughput_rps(now), observed_ttft_p50=p50, observed_ttft_p90=p90,
                    observed_ttft_p95=ttft95, observed_tpot_p90=tpot90,
                    prompt_tokens=p.prompt_tokens, tokens_exact=exact is not None)
        row = rows.get(inst.id) if rows is not None else None
        if row is not None:
            c.n_running, c.n_waiting = row.n_running, row.n_waiting
            c.prefix_hit_tokens = min(row.prefix_hit_tokens, max(0, p.prompt_tokens - 1))
            c.block_size, c.kv_blocks_used, c.kv_blocks_total = row.block_size, row.kv_blocks_used, row.kv_blocks_total
            c.pending_prefill_tokens = row.pending_prefill_tokens
            c.pending_decode_tokens = float(row.pending_decode_tokens)
            if row.ttft_s is not None:  # the replay's engine TTFT, plus the path around it (bear.calibrator.path)
                c.ttft_path = inst.calibration.path_s(p.prompt_tokens) if row.method == "bea" else 0.0
                c.ttft = waited + row.ttft_s + c.ttft_path
            else:
                c.ttft = math.inf
            c.ttft_method = row.method
            c.ttft_calibration = row.calibration
            if row.method == "bea" and row.calibration != "nominal":
                c.ttft_ratio_q = inst.calibration.ttft_ratio_q
        else:  # no estimate (estimator or its shard silent): eq. 8 over what this router has in flight there
            local = local or LocalLoad()
            c.n_running = local.running.get(inst.id, 0)
            c.pending_prefill_tokens = local.pending_prefill_tokens.get(inst.id, 0)
            c.ttft = waited + libbea.prefill_throughput_ttft(c.pending_prefill_tokens, p.prompt_tokens, theta)
            c.ttft_method = "router-eq8"
        c.ttft_elapsed = waited
        c.ttft_prefill = waited + libbea.prefill_throughput_ttft(c.pending_prefill_tokens,
                                                                    max(1, p.prompt_tokens - c.prefix_hit_tokens), theta)
        cands.append(c)
    return cands, used


def dispatch_tokens(tokens: Mapping[str, bytes], tokenizer: str | None, row: EstimateRow | None) -> bytes | None:
    """The packed prompt ids a dispatch to an instance carries: only where the estimate row says
    its snapshot describes the pool block by block (``pool_keyed``) — no other replay reads them,
    and an 8k-token prompt's ids are 32 kB on every estimator worker's dispatch subscription."""
    if tokenizer is None or row is None or not row.pool_keyed:
        return None
    return tokens.get(tokenizer)


def dispatch_for(query_id: str, request_id: str, p: ModelPrediction, max_tokens: int | None, t: float,
                 prefix_hit_tokens: int = 0, tokens: bytes | None = None, *, sequences: int = 1,
                 skip_reading_prefix_cache: bool = False) -> Dispatch:
    """The ``bear.dispatch`` message of sending the query to an instance, under prediction ``p``
    (and the prefix-cache hit the estimator found there, and the prompt's packed token ids);
    ``max_tokens`` None: no cap known (the rest of a context the instance did not register);
    ``sequences``: the engine's n, each sequence predicted at ``p``'s length."""
    cap = float(max_tokens) if max_tokens is not None else math.inf
    out = p.out_len if math.isfinite(p.out_len) else cap  # a prediction of inf/nan: the cap
    if not math.isfinite(out):
        out = float(p.out_p90) if math.isfinite(p.out_p90) and p.out_p90 > 0 else 1.0
    return Dispatch(query_id=query_id, request_id=request_id, prompt_tokens=min(p.prompt_tokens, 2**31 - 1),
                    predicted_output_tokens=int(max(1, min(round(min(out, cap)), 2**31 - 1))),
                    max_tokens=None if max_tokens is None else min(max_tokens, 2**31 - 1),
                    prefix_hit_tokens=prefix_hit_tokens, t=t, tokens=tokens,
                    sequences=sequences, skip_reading_prefix_cache=skip_reading_prefix_cache)
