"""Per-query TTFT targets, paper Appendix A.2: a linear function of the prompt length with a
little random variation, clipped to [150 ms, 1120 ms]."""

from __future__ import annotations

import numpy as np


def ttft_target_s(prompt_tokens: np.ndarray | int, rng: np.random.Generator) -> np.ndarray:
    """τ = min(1120, max(150, u + (155 + 3.5e-3·p)·v)) ms, u ~ U(1, 5) ms, v ~ U(0.98, 1.02); seconds."""
    p = np.atleast_1d(np.asarray(prompt_tokens, dtype=float))
    u = rng.uniform(1.0, 5.0, size=p.shape)
    v = rng.uniform(0.98, 1.02, size=p.shape)
    ms = np.minimum(1120.0, np.maximum(150.0, u + (155.0 + 3.5e-3 * p) * v))
    return ms / 1e3
