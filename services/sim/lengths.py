"""How many tokens the simulated model generates for a request: its own configuration, since a
real model decides its output length itself and no client can tell it.

* ``max`` — a model that never emits EOS: every request runs to its ``max_tokens``.
* ``lognormal:MEDIAN:SIGMA`` — the length is drawn from a log-normal with that median and σ (of
  the log), capped by ``max_tokens``; the draw is a function of the engine's seed and the request
  id, so a run repeats exactly.

The text itself is placeholder words (the sim engine says so in its ``/v1/models`` entry).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class OutputLengths:
    kind: str = "max"  # max | lognormal
    median: float = 0.0
    sigma: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, seed: int | None = None) -> OutputLengths:
        """``max`` or ``lognormal:MEDIAN:SIGMA``; ValueError names what is wrong."""
        parts = spec.strip().split(":")
        if parts == ["max"]:
            return cls("max", seed=seed or 0)
        if parts[0] == "lognormal" and len(parts) == 3:
            try:
                median, sigma = float(parts[1]), float(parts[2])
            except ValueError:
                median = sigma = math.nan
            if math.isfinite(median) and median >= 1 and math.isfinite(sigma) and sigma >= 0:
                return cls("lognormal", median, sigma, seed or 0)
        raise ValueError(f"output lengths {spec!r}: expected 'max' or 'lognormal:MEDIAN:SIGMA' "
                         "(MEDIAN ≥ 1 tokens, SIGMA ≥ 0)")

    def tokens(self, request_id: str, max_tokens: int) -> int:
        if self.kind == "max":
            return max_tokens
        h = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        draw = self.median * math.exp(self.sigma * random.Random(int.from_bytes(h, "little")).gauss(0.0, 1.0))
        return int(max(1, min(max_tokens, round(draw))))
