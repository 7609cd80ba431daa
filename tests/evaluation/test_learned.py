"""The learned TTFT baseline (``bear.evaluation.learned``): it learns from observations only once
they have been made, and it learns."""

from __future__ import annotations

import math

import numpy as np

from bear.evaluation.learned import MIN_SAMPLES, Sample, online_predictions


def _samples(n: int, seed: int = 0) -> list[Sample]:
    """Queries every 0.1 s whose TTFT is a function of the waiting count and the prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        waiting, prompt = int(rng.integers(0, 20)), int(rng.integers(50, 2000))
        ttft = 0.02 + 0.01 * waiting + prompt * 2e-5
        t = 0.1 * i
        out.append(Sample("a", t, (waiting, 1.0, waiting * 300.0, 0.2, prompt, 0.0), t + ttft, ttft))
    return out


def test_nothing_later_leaks_into_a_prediction() -> None:
    """A query's prediction depends only on the queries whose first token came by its arrival:
    appending later queries (with absurd TTFTs) leaves every earlier prediction as it was."""
    base = _samples(300)
    later = [Sample("a", 30.0 + k, (5, 1, 1500.0, 0.2, 500, 0), 30.0 + k + 100.0, 100.0) for k in range(50)]
    a, b = online_predictions(base), online_predictions(base + later)
    assert np.array_equal(a, b[: len(base)], equal_nan=True)
    first = next(i for i, p in enumerate(a) if math.isfinite(p))
    observed = sum(1 for s in base if s.first_token_at <= base[first].decided_at)
    assert observed >= MIN_SAMPLES and all(math.isnan(p) for p in a[:first])


def test_it_learns_the_queue_and_keeps_instances_apart() -> None:
    own = _samples(600, seed=1)
    other = [Sample("b", s.decided_at, s.x, s.first_token_at + 9 * s.ttft_s, 10 * s.ttft_s) for s in _samples(600, 2)]
    pred = online_predictions(own + other)
    for part, truth in ((pred[:600], own), (pred[600:], other)):
        ok = np.isfinite(part)
        obs = np.array([s.ttft_s for s in truth])[ok]
        late = slice(len(obs) // 2, None)  # once it has trained on a few hundred
        assert np.mean(np.abs(part[ok][late] - obs[late]) / obs[late]) < 0.1
