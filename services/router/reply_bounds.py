"""Replies no real predictor or estimator produces, refused where the router reads them (issue 40).

A leaked predictor or estimator credential may still join its queue group and answer its share of
the requests (bear.runtime.nats_auth); what it answers is checked against bounds that follow from
the request and from what this router knows of the instance, and a reply outside them is treated
as no answer from that service — the router's fallback for silence (``bear.router.candidates``:
the fallback prediction, eq. 8 over its own load) — counted
(``bear_router_replies_rejected_total{service, reason}``) and logged (one line per service and
reason per 10 s, every one counted; the line names the replica the reply says it came from —
a claim, but the identity to look at first).

The bounds, each one a real service keeps by construction:

* **predictor** (``bear.prediction/1``): only the models asked; accuracy in [0, 1]; lengths and
  cost finite and ≥ 0, lengths below ``LENGTH_CEILING`` (no context holds more; a prediction is the
  answer's natural length, which the router caps at the query's ``max_tokens`` itself —
  ``dispatch_for`` — so a length past ``max_tokens`` is a genuine prediction, not a forgery);
  the prompt's tokens no more than the count the request gave (which a real predictor echoes) or
  the prompt's UTF-8 bytes (+ slack: no tokenizer the predictor counts with, nor its word-count
  fallback, makes more); the query id echoed.
* **estimator** (``bear.estimate-reply/1``): the query id echoed; rows only for instances asked,
  each once; no more ``also`` parts than asked; every number finite and ≥ 0 (TTFT, age, counters),
  KV blocks used ≤ total, the prefix hit ≤ the prompt; and the TTFT no lower than the physical
  floor of the query's own prefill — a BEA replay runs at least one engine step over the
  uncached prompt (β0 + β1 · uncached ≤ any step sequence that computes it, β and γ being
  non-negative), the analytic fallback at least uncached / θ — times ``FLOOR_FRACTION`` (the
  estimator may hold a newer calibration than this router: refits move by less than 4×). The
  floor uses the calibration the row says it was made with: none when this router has not yet
  read that instance's calibration but the row says it was calibrated.

Within the bounds a forged reply is believed: a leak still steers the share of queries its queue
membership hands it (docs/security.md, "A leaked service credential")."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

import structlog
from msgspec import UNSET

from bear.protocol.messages import (
    NOMINAL_CALIBRATION,
    Calibration,
    EstimateCandidate,
    EstimateQuery,
    EstimateReply,
    EstimateRequest,
    EstimateRow,
)
from bear.protocol.predict import Prediction

log = structlog.get_logger("bear.router")

LENGTH_CEILING = float(1 << 20)  # output tokens no context holds (REST_UNKNOWN_MAX_TOKENS)
PROMPT_SLACK_TOKENS = 16  # a tokenizer's added tokens beyond one per UTF-8 byte
FLOOR_FRACTION = 0.25  # of the prefill floor: the estimator's calibration may be newer than the router's
LOG_EVERY_S = 10.0


@cache
def metrics() -> Any:
    """One counter per process (prometheus_client's default registry)."""
    from prometheus_client import Counter

    return Counter("bear_router_replies_rejected_total",
                   "Predictor and estimator replies refused as no real service's (bear.router.reply_bounds): "
                   "treated as no answer", ["service", "reason"])


def _finite_nonneg(*xs: float) -> bool:
    return all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in xs)


# ----------------------------------------------------------------------------- predictor
def prediction_fault(reply: Prediction, models: list[str], prompt: str, prompt_tokens: int | None = None,
                     query_id: str = "") -> str | None:
    """Why no real predictor sends ``reply`` to this request (None: within the bounds)."""
    if query_id and reply.id is not UNSET and reply.id != query_id:
        return "wrong_query"
    asked = set(models)
    byte_bound: int | None = None
    for name, p in reply.models.items():
        if name not in asked:
            return "unasked_model"
        if not (isinstance(p.acc, int | float) and 0.0 <= p.acc <= 1.0):  # NaN fails both
            return "accuracy"
        ln = p.len
        if not _finite_nonneg(ln.mean, ln.p90) or (not math.isnan(ln.p50) and not _finite_nonneg(ln.p50)):
            return "length"
        if max(ln.mean, ln.p90, 0.0 if math.isnan(ln.p50) else ln.p50) > LENGTH_CEILING:
            return "length"
        if not _finite_nonneg(p.cost):
            return "cost"
        if p.prompt_tokens < 0:
            return "prompt_tokens"
        given = prompt_tokens or 0
        if p.prompt_tokens > max(given, len(prompt)) + PROMPT_SLACK_TOKENS:  # characters ≤ bytes: encode only then
            if byte_bound is None:
                byte_bound = max(given, len(prompt.encode("utf-8", "surrogatepass"))) + PROMPT_SLACK_TOKENS
            if p.prompt_tokens > byte_bound:
                return "prompt_tokens"
    return None


# ----------------------------------------------------------------------------- estimator
def prefill_floor(row: EstimateRow, prompt_tokens: int, calibration: Calibration | None) -> float:
    """The least TTFT a real estimator gives ``row`` (0: no floor known): see the module doc."""
    if row.method not in ("bea", "analytic"):
        return 0.0
    if row.calibration == "nominal":
        cal = NOMINAL_CALIBRATION
    elif calibration is None or calibration is NOMINAL_CALIBRATION:
        return 0.0  # calibrated there, not known here yet
    else:
        cal = calibration
    p = max(1, prompt_tokens)
    # a pool described block by block: the replay finds the hit from the pool (maybe more than the row's)
    hit = p - 1 if row.pool_keyed else min(max(0, row.prefix_hit_tokens), p - 1)
    uncached = max(1, p - hit)
    b0, b1, _, _ = cal.beta
    floor = b0 + b1 * uncached if row.method == "bea" else uncached / cal.prefill_tps()
    return FLOOR_FRACTION * floor if math.isfinite(floor) else 0.0


def _rows_fault(rows: list[EstimateRow], query: EstimateQuery, cands: list[EstimateCandidate],
                calibration_of: Callable[[str], Calibration | None] | None) -> str | None:
    by_id: Mapping[str, EstimateCandidate] = {c.instance: c for c in cands}
    seen: set[str] = set()
    for row in rows:
        c = by_id.get(row.instance)
        if c is None:
            return "unasked_instance"
        if row.instance in seen:
            return "duplicate_row"
        seen.add(row.instance)
        if not _finite_nonneg(row.n_batches, row.n_running, row.n_waiting, row.pending_prefill_tokens,
                              row.pending_decode_tokens, row.ahead, row.prefix_hit_tokens, row.block_size,
                              row.kv_blocks_used, row.kv_blocks_total):
            return "counters"
        if row.kv_blocks_total and row.kv_blocks_used > row.kv_blocks_total:
            return "counters"
        if row.age_s is not None and not (isinstance(row.age_s, int | float) and math.isfinite(row.age_s)):
            return "age"
        ptoks = query.prompt_tokens if c.prompt_tokens is None else c.prompt_tokens
        if row.prefix_hit_tokens > max(ptoks, 0):
            return "prefix_hit"
        if row.ttft_s is not None:
            if not _finite_nonneg(row.ttft_s):
                return "ttft"
            cal = calibration_of(row.instance) if calibration_of is not None else None
            if row.ttft_s < prefill_floor(row, ptoks, cal):
                return "ttft_floor"
    return None


def estimate_fault(req: EstimateRequest, reply: EstimateReply,
                   calibration_of: Callable[[str], Calibration | None] | None = None) -> str | None:
    """Why no real estimator sends ``reply`` to ``req`` (None: within the bounds);
    ``calibration_of``: this router's calibration of an instance (None: unknown)."""
    if reply.query_id and reply.query_id != req.query.id:
        return "wrong_query"
    if len(reply.also) > len(req.also):
        return "unasked_part"
    why = _rows_fault(reply.estimates, req.query, req.candidates(), calibration_of)
    if why is not None:
        return why
    for rows, part in zip(reply.also, req.also, strict=False):
        why = _rows_fault(rows, part.query, part.candidates(), calibration_of)
        if why is not None:
            return why
    return None


# ----------------------------------------------------------------------------- counting
class ReplyGuard:
    """Checks the router's predictor and estimator replies, counts and logs the refused ones."""

    def __init__(self, calibration_of: Callable[[str], Calibration | None] | None = None) -> None:
        self.calibration_of = calibration_of
        self.rejected: dict[tuple[str, str], int] = {}
        self._logged: dict[tuple[str, str], float] = {}

    def refuse(self, service: str, reason: str, replica: str = "", query_id: str = "") -> None:
        key = (service, reason)
        self.rejected[key] = self.rejected.get(key, 0) + 1
        try:
            metrics().labels(service=service, reason=reason).inc()
        except Exception:  # metrics off (a second registry in tests): still counted here
            pass
        now = time.monotonic()
        last = self._logged.get(key)
        if last is not None and now - last < LOG_EVERY_S:
            return
        self._logged[key] = now
        log.warning("reply refused: no real service sends it", service=service, reason=reason,
                    replica=replica[:128], query_id=query_id[:128], refused=self.rejected[key])

    def prediction_ok(self, reply: Prediction, models: list[str], prompt: str, prompt_tokens: int | None,
                      query_id: str) -> bool:
        why = prediction_fault(reply, models, prompt, prompt_tokens, query_id)
        if why is None:
            return True
        self.refuse("predictor", why, reply.by if isinstance(reply.by, str) else "", query_id)
        return False

    def estimate_check(self, req: EstimateRequest, reply: EstimateReply) -> str | None:
        """``EstimatorClient``'s ``check``: the reason (counted, logged), or None."""
        why = estimate_fault(req, reply, self.calibration_of)
        if why is not None:
            self.refuse("estimator", why, reply.worker, req.query.id)
        return why
