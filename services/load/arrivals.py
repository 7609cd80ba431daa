"""Query arrival processes: Poisson and the two-state Markov-modulated Poisson process (paper
Appendix B), as arrival-time arrays from a seeded generator. Used by ``bear load`` and ``bear eval``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    """``n`` arrival times of a homogeneous Poisson process of ``rate`` queries/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    return start + np.cumsum(rng.exponential(1.0 / rate, size=n))


@dataclass(frozen=True)
class Mmpp2:
    """MMPP-2 with low/high states: mean rate ᾱ, burst ratio r = α_H/α_L, switching rates
    z_{L→H}, z_{H→L} (the paper: 0.1/s and 0.4/s, so p_H = 0.2 and τ = 2 s)."""

    mean_rate: float
    ratio: float
    z_lh: float = 0.1
    z_hl: float = 0.4

    @property
    def p_high(self) -> float:
        return self.z_lh / (self.z_lh + self.z_hl)

    @property
    def rate_low(self) -> float:
        return self.mean_rate / ((1.0 - self.p_high) + self.p_high * self.ratio)

    @property
    def rate_high(self) -> float:
        return self.ratio * self.rate_low

    def arrivals(self, n: int, rng: np.random.Generator, start: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """``n`` arrival times and the state (0 low, 1 high) each arrived in.

        Simulated exactly: in each sojourn the next event is the earlier of an arrival
        (rate α_state) and a state switch (rate z_state); memorylessness makes this exact."""
        if self.mean_rate <= 0 or self.ratio < 1:
            raise ValueError("mean_rate must be > 0 and ratio >= 1")
        times = np.empty(n)
        states = np.empty(n, dtype=np.int8)
        t = start
        state = 1 if rng.random() < self.p_high else 0  # stationary start
        k = 0
        while k < n:
            lam = self.rate_high if state else self.rate_low
            z = self.z_hl if state else self.z_lh
            dt = rng.exponential(1.0 / (lam + z))
            t += dt
            if rng.random() < lam / (lam + z):
                times[k] = t
                states[k] = state
                k += 1
            else:
                state = 1 - state
        return times, states


def arrivals(kind: str, rate: float, n: int, seed: int, ratio: float = 3.0) -> np.ndarray:
    """Arrival times by name: ``poisson`` or ``mmpp`` (MMPP-2 with burst ratio ``ratio``)."""
    rng = np.random.default_rng(seed)
    if kind == "poisson":
        return poisson_arrivals(rate, n, rng)
    if kind == "mmpp":
        return Mmpp2(rate, ratio).arrivals(n, rng)[0]
    raise ValueError(f"unknown arrival process {kind!r} (poisson|mmpp)")
