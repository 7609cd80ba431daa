"""Ground-truth batch time of the simulated instance: a roofline, deliberately *not* eq. 12.

Per step: the larger of compute time (dense-layer FLOPs of every scheduled token, LM-head FLOPs of
every request in the batch, causal attention FLOPs) and memory time (all weights once, plus the KV
cache read by attention and written for the new tokens), each at a fraction of the GPU's peak and
split over the tensor-parallel GPUs; plus TP all-reduces, a fixed per-step overhead (scheduler,
launch, sampling) and a per-request overhead; times multiplicative log-normal noise with rare
outliers. The kink of the max() and the per-request terms are what eq. 12 cannot represent."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from bear.sim.profile import Profile


class RooflineModel:
    def __init__(self, profile: Profile, seed: int | None = None) -> None:
        p = profile
        self.p = p
        self.rng = random.Random(seed)
        s = p.shape
        tp = p.gpu.count
        self._flops_per_token = 2.0 * s.layer_params
        self._lm_head_flops = 2.0 * s.hidden * s.vocab
        self._attn_flops_per_unit = 4.0 * s.layers * s.heads * s.head_dim  # QK^T and PV, per (q, k) pair
        self._kv_bytes = float(s.kv_bytes_per_token)
        self._compute_rate = tp * p.gpu.peak_flops * p.compute_efficiency
        self._memory_rate = tp * p.gpu.bandwidth_bytes_s * p.memory_efficiency
        self._weights = p.weight_bytes
        self._tp = tp
        self._allreduce_bytes_per_token = 2.0 * s.hidden * s.dtype_bytes * 2 * s.layers  # 2 per layer

    def mean_time(self, items: Iterable[tuple[int, int]]) -> float:
        """Noise-free step time of a batch given ``(n, context)`` per scheduled request."""
        reqs = tokens = 0
        ctx_sum = attn = 0.0
        for n, ctx in items:
            reqs += 1
            tokens += n
            ctx_sum += ctx
            attn += n * ctx + n * (n + 1) / 2.0
        return self.mean_time_aggregate(reqs, tokens, ctx_sum, attn)

    def sample(self, items: Iterable[tuple[int, int]]) -> float:
        """One noisy draw of the step time."""
        return self.noisy(self.mean_time(items))

    def mean_time_aggregate(self, reqs: int, tokens: int, ctx_sum: float, attn_sum: float) -> float:
        """``mean_time`` from a batch's sums (requests, Σn, Σ context, Σ n·ctx + n(n+1)/2): the same
        roofline, for callers that aggregate in C++ (``libbea.engine_step_stats``)."""
        if reqs == 0:
            return 0.0
        flops = self._flops_per_token * tokens + self._lm_head_flops * reqs + self._attn_flops_per_unit * attn_sum
        nbytes = self._weights + self._kv_bytes * (ctx_sum + tokens)
        t = max(flops / self._compute_rate, nbytes / self._memory_rate)
        if self._tp > 1:
            t += 2 * self.p.shape.layers * self.p.allreduce_latency_s
            t += self._allreduce_bytes_per_token * tokens * (self._tp - 1) / self._tp / self.p.gpu.interconnect_bytes_s
        return t + self.p.step_overhead_s + self.p.per_request_overhead_s * reqs

    def noisy(self, t: float) -> float:
        """Apply one draw of the multiplicative noise (and rare outliers) to a mean step time."""
        if self.p.noise_sigma > 0:
            t *= math.exp(self.rng.gauss(-0.5 * self.p.noise_sigma**2, self.p.noise_sigma))
        if self.p.outlier_prob > 0 and self.rng.random() < self.p.outlier_prob:
            t *= self.p.outlier_factor
        return t
