"""The router's two questions, asked concurrently with deadlines, and their fallbacks.

* ``ask_predictor``: one ``bear.predict/1`` request (all candidate models), a per-try timeout and
  one retry (the queue group hands it to another predictor) inside the budget. Returns ``None``
  when there is no answer in time; the caller then uses ``fallback_prediction`` — the documented
  latency-preserving fallback: accuracy 0 for every model (the policy then only trades cost against
  latency, i.e. the cheapest instance predicted to meet the target), output length
  ``default_output_tokens``, cost from the registry prices.
* ``ask_estimator``: ``EstimatorClient`` (per-try timeout, one retry). ``None`` on failure; the
  caller then uses the eq. 8 prefill-throughput estimate over the tokens this router itself has
  in flight at each instance (method ``router-eq8``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bear.protocol.codec import pack, unpack_map
from bear.protocol.deadline import Deadline
from bear.protocol.errors import BearError, is_error

PREDICT_SCHEMA = "bear.predict/1"


@dataclass
class ModelPrediction:
    acc: float
    out_len: float
    out_p90: float
    prompt_tokens: int
    cost_usd: float
    source: str = "predictor"


async def ask_predictor(nc: Any, subject: str, prompt: str, models: list[str], budget_s: float, *,
                        try_timeout_s: float, prompt_tokens: int | None = None, query_id: str = "",
                        headers: dict[str, str] | None = None) -> dict[str, ModelPrediction] | None:
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    deadline = Deadline.after(budget_s)
    req: dict[str, Any] = {"v": PREDICT_SCHEMA, "prompt": prompt, "models": models, "deadline": deadline.at,
                           "id": query_id}
    if prompt_tokens is not None:
        req["prompt_tokens"] = int(prompt_tokens)
    payload = pack(req)
    for _ in range(2):
        timeout = deadline.timeout(try_timeout_s)
        if timeout <= 0.0:
            return None
        try:
            msg = await nc.request(subject, payload, timeout=timeout, headers=headers)
        except (NatsTimeout, TimeoutError):
            continue
        except NoRespondersError:
            return None
        except Exception:  # connection closed / reconnecting
            return None
        try:
            reply = unpack_map(msg.data)
        except BearError:
            return None
        if is_error(reply):
            if reply["error"].get("code") == "overloaded":
                continue
            return None
        try:
            return {
                name: ModelPrediction(
                    acc=float(p["acc"]), out_len=float(p["len"]["mean"]), out_p90=float(p["len"]["p90"]),
                    prompt_tokens=int(p["prompt_tokens"]), cost_usd=float(p["cost"]),
                )
                for name, p in reply["models"].items()
            }
        except (KeyError, TypeError, ValueError):
            return None
    return None


def fallback_prediction(prompt_tokens: int, price_in: float, price_out: float,
                        default_output_tokens: int) -> ModelPrediction:
    cost = (prompt_tokens * price_in + default_output_tokens * price_out) / 1e6
    return ModelPrediction(acc=0.0, out_len=float(default_output_tokens), out_p90=float(default_output_tokens),
                           prompt_tokens=prompt_tokens, cost_usd=cost, source="fallback")


async def ask_estimator(client: Any, query: dict[str, Any], instances: list[str], budget_s: float,
                        headers: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Rows by instance, or None when the estimator gave no answer in time."""
    try:
        reply = await client.estimate(query, instances, budget_s=budget_s, headers=headers)
    except BearError:
        return None
    except Exception:
        return None
    return {row["instance"]: row for row in reply.get("estimates", []) if isinstance(row, dict)}


def prefill_eq8(pending_tokens: float, prompt_tokens: int, theta: float) -> float:
    """Paper eq. 8: (queued prompt tokens + this prompt) / prefill throughput."""
    if theta <= 0:
        return math.inf
    return (pending_tokens + prompt_tokens) / theta
