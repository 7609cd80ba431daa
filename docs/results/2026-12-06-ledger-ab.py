"""One estimate from a prepared state of ``bear bench pool``'s synthetic busy pool, median time:
``python 2026-12-06-ledger-ab.py BLOCKS REPS DRAWS`` (DRAWS 0: point lengths; else that many
lengths drawn, no shortcut). Run under two builds to compare them (2026-12-06-ledger-gpu-pools.md)."""

from __future__ import annotations

import sys
import time

import numpy as np

from bear import libbea
from bear.benchmarks.pool import busy_pool_state
from bear.prefix.tracked_pool import keys_of

n, reps, draws = (int(x) for x in sys.argv[1:4])
last, pool = busy_pool_state(n, steps=40)
live = libbea.Snapshot.from_dict(last)
q = {"id": "Q", "prompt_tokens": 256, "max_tokens": 2, "block_keys": keys_of(pool.names.get("w0", [])[:4])}
kw = {"length_sigma": 0.5, "length_draws": draws, "draw_shortcut": False} if draws else {}
libbea.estimate(live, q, beta=[1e-3, 1e-5, 0, 0], **kw)  # prepares the state
ts = []
for _ in range(reps):
    t = time.perf_counter()
    libbea.estimate(live, q, beta=[1e-3, 1e-5, 0, 0], **kw)
    ts.append(time.perf_counter() - t)
print(n, draws, f"p50 {np.median(ts) * 1e3:.3f} ms")
