"""An instance's TTFT error as a distribution: the deciles of observed / predicted TTFT over its
recent BEA estimates, published with its calibration (``Calibration.ttft_ratio_q``).

Why: the feasibility test "predicted TTFT ≤ target" is right about half the time at the target
whatever the estimator's spread. With the error's distribution the router can ask instead how
likely the query is to be on time there (``bear.router.policies.on_time``) and demand a
confidence — the probability of being on time of issue 24, item 5. It is measured, per instance,
on exactly what the policy reads (the chosen instances' BEA estimates against the first tokens
their clients saw, from the routers' outcomes), so it is calibrated by construction: a
conformal estimate, not a model of where the error comes from. (The replay at length quantiles
the issue suggested needs a length model: the conditioned log-normal one did not hold up,
docs/estimator.md "Output lengths as they turn out".)
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from bear.protocol.messages import TTFT_RATIO_LEVELS

MIN_PAIRS = 30  # estimates with an observed first token before a distribution is published


def ratio_quantiles(pairs: Iterable[tuple[float, float]]) -> tuple[float, ...] | None:
    """Deciles of observed / predicted over (predicted, observed) TTFT pairs with both > 0 (None:
    fewer than MIN_PAIRS)."""
    r = np.array([o / p for p, o in pairs if p > 0 and o > 0], dtype=float)
    r = r[np.isfinite(r)]
    if len(r) < MIN_PAIRS:
        return None
    return tuple(float(x) for x in np.quantile(r, TTFT_RATIO_LEVELS))
