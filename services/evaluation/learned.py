"""The learned TTFT predictor — the baseline a user would pick instead of BEA: gradient-boosted
trees on an instance's queue features, trained online on the TTFTs observed earlier in the same
run, as llm-d's latency predictor does (its features: KV-cache use, input length, waiting and
running request counts, the prefix-cache score; a model per serving pod, retrained as samples
arrive).

Features of a query at the instance chosen for it, read from the estimate row the decision used
(the same snapshot BEA replays): waiting and running counts, the waiting requests' prefill
tokens, the KV blocks in use as a fraction, the query's prompt length and its prefix hit there.
The target is log TTFT (TTFTs span three orders of magnitude; a squared error on the log fits
relative error, what MAPE scores). A query's prediction comes from the model fitted on every
query of that instance whose first token had come by its arrival — nothing later leaks in;
the model is refitted once the training set has grown by a quarter (at least ``MIN_NEW``
samples) and predicts nothing before ``MIN_SAMPLES`` of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bear.protocol.messages import EstimateRow

FEATURES = ("n_waiting", "n_running", "waiting_prefill_tokens", "kv_use", "prompt_tokens", "prefix_hit_tokens")
MIN_SAMPLES = 50  # observed TTFTs before the first fit
MIN_NEW = 25  # a refit needs at least this many new observations …
GROWTH = 1.25  # … and the training set grown by this factor
PARAMS = {"objective": "regression", "num_leaves": 15, "learning_rate": 0.1, "min_data_in_leaf": 5,
          "feature_fraction": 1.0, "verbose": -1, "num_threads": 1, "deterministic": True, "seed": 0}
ROUNDS = 100


def features(row: EstimateRow, prompt_tokens: int) -> tuple[float, ...]:
    """A query's features at one instance, in FEATURES order (module doc)."""
    total = row.kv_blocks_total or 0
    return (float(row.n_waiting or 0), float(row.n_running or 0), float(row.pending_prefill_tokens or 0),
            (row.kv_blocks_used or 0) / total if total else 0.0, float(prompt_tokens), float(row.prefix_hit_tokens or 0))


@dataclass(frozen=True)
class Sample:
    """One routed query at its instance: when it was decided, its features, and when its first
    token came (inf: never) and the TTFT then observed."""

    instance: str
    decided_at: float
    x: tuple[float, ...]
    first_token_at: float
    ttft_s: float


def online_predictions(samples: Sequence[Sample]) -> np.ndarray:
    """Each sample's learned TTFT prediction (nan before its instance's first fit), in input order."""
    import lightgbm as lgb

    out = np.full(len(samples), math.nan)
    by_inst: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_inst.setdefault(s.instance, []).append(i)
    for idx in by_inst.values():
        order = sorted(idx, key=lambda i: samples[i].decided_at)
        seen = sorted((i for i in idx if math.isfinite(samples[i].first_token_at) and samples[i].ttft_s > 0),
                      key=lambda i: samples[i].first_token_at)
        model, fitted_on, k = None, 0, 0
        for i in order:
            t = samples[i].decided_at
            while k < len(seen) and samples[seen[k]].first_token_at <= t:
                k += 1
            if k >= MIN_SAMPLES and (model is None or (k - fitted_on >= MIN_NEW and k >= GROWTH * fitted_on)):
                train = seen[:k]
                x = np.array([samples[j].x for j in train])
                y = np.log(np.array([samples[j].ttft_s for j in train]))
                model = lgb.train(PARAMS, lgb.Dataset(x, y, feature_name=list(FEATURES)), num_boost_round=ROUNDS)
                fitted_on = k
            if model is not None:
                out[i] = float(np.exp(model.predict(np.array([samples[i].x]))[0]))
    return out
