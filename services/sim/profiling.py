"""A profiling run of one simulated instance, before it serves: the batch records an operator
would collect by sweeping an engine with prompts of every size, in virtual time (no sleeping).

Why: until the online calibrator has fitted an instance from its own batch records, the
estimator replays with a nominal β — a placeholder that was 5× too slow on the 0.6B and 5× too
fast on the 32B's long prompts, so the first seconds of a fresh stack under load were routed on
estimates off by any factor (docs/estimator.md, "Calibration before serving"). The paper
calibrates eq. 12 offline by profiling each instance; ``bear up`` does the same for its sim
engines (``profile_records`` → ``bear.calibrator.fit.robust_fit``, published as a ``profiled``
calibration) and the online refit takes over once the instance's own records come in.

The sweep: prompt sizes log-uniform from 16 tokens to half the context, so that every term of
eq. 12 — the per-step cost, the per-token cost and the quadratic prefill attention of long
prompts — is seen; output lengths log-normal (median ≈ 200); Poisson arrivals, first at a light
rate (steps of one or two requests), then a burst that fills the batch (steps that mix chunked
prefills with many decodes). Seeded: the same profile gives the same records.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from bear import libbea
from bear.protocol.batch import BatchRecord
from bear.sim.profile import Profile
from bear.sim.roofline import RooflineModel


def profile_records(profile: Profile, *, seed: int = 0, queries: int = 400, light_rate: float = 2.0,
                    burst_rate: float = 40.0, max_output_tokens: int = 1024) -> list[BatchRecord]:
    """``bear.batch/1`` records of one profiling run of ``profile`` (module doc)."""
    rng = np.random.default_rng(seed)
    cfg = profile.engine_config()
    max_len = int(cfg["max_model_len"])
    top = max(32, max_len // 2)
    prompts = np.exp(rng.uniform(math.log(16), math.log(top), queries)).astype(int)
    outputs = np.clip(rng.lognormal(math.log(200), 0.8, queries), 1, max_output_tokens).astype(int)
    half = queries // 2
    gaps = np.concatenate([rng.exponential(1.0 / light_rate, half), rng.exponential(1.0 / burst_rate, queries - half)])
    arrivals = np.cumsum(gaps)
    engine = libbea.Engine(cfg)
    roof = RooflineModel(profile, seed=seed)
    records: list[BatchRecord] = []
    pending = [(float(arrivals[i]), i) for i in range(queries)]
    heapq.heapify(pending)
    t = 0.0
    while pending or engine.has_work:
        while pending and pending[0][0] <= t:
            _, i = heapq.heappop(pending)
            p = int(min(prompts[i], max_len - int(outputs[i]) - 1))
            engine.add(f"profile-{i}", max(1, p), int(outputs[i]), int(outputs[i]), t)
        batch = engine.step() if engine.has_work else None
        if not batch:
            if records:
                records[-1].duration_s = None  # the engine went idle: no loop period
            if not pending:
                break
            t = max(t, pending[0][0])
            continue
        dur = roof.sample([(n, ctx) for _, n, ctx, _ in batch])
        records.append(BatchRecord(instance=profile.name, seq=int(engine.seq), duration_s=dur,
                                   items=[{"n": int(n), "context": int(c), "decode": bool(d)} for _, n, c, d in batch]))
        t += dur
        engine.finish_step()
    return records
