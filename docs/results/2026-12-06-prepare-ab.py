"""A state's first estimates as the estimator worker makes them — the estimate (15 lengths drawn,
with the shortcut) and then the point form the load counters and the step in flight read — on
``bear bench pool``'s synthetic busy pool after 40 steps, each on a fresh snapshot object:
``python 2026-12-06-prepare-ab.py BLOCKS REPS``. Prints the median and p90 of the two calls
together, and the longest the interpreter was held (a Python thread ticking every 0.2 ms beside
the estimate: its longest gap, median over the reps). Run under two builds to compare them
(2026-12-06-ledger-gpu-pools.md)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from bear import libbea
from bear.benchmarks.pool import busy_pool_state
from bear.prefix.tracked_pool import keys_of

n, reps = (int(x) for x in sys.argv[1:3])
last, pool = busy_pool_state(n, steps=40)
q = {"id": "Q", "prompt_tokens": 256, "max_tokens": 2, "block_keys": keys_of(pool.names.get("w0", [])[:4])}
beta = [1e-3, 1e-5, 0, 0]
lives = [libbea.Snapshot.from_dict(last) for _ in range(reps)]
both, held = [], []
for live in lives:
    gaps: list[float] = []
    stop = threading.Event()

    def tick(gaps: list[float] = gaps, stop: threading.Event = stop) -> None:
        last_t = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0002)
            now = time.perf_counter()
            gaps.append(now - last_t)
            last_t = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.005)
    t = time.perf_counter()
    libbea.estimate(live, q, beta=beta, length_sigma=0.5, length_draws=15)
    libbea.estimate(live, q, beta=beta)
    both.append(time.perf_counter() - t)
    time.sleep(0.005)
    stop.set()
    ticker.join()
    held.append(max(gaps))
print(n, f"both forms p50 {np.median(both) * 1e3:.2f} ms p90 {np.percentile(both, 90) * 1e3:.2f} ms;",
      f"interpreter held p50 {np.median(held) * 1e3:.2f} ms")
