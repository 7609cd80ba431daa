"""A stand-in for the vLLM plugin: writes raw step records of the plugin's exact layout into a
shared-memory ring, so that the reader, the record decoder and the service can be tested without
vLLM (the real plugin is exercised by tests/vllm/)."""

from __future__ import annotations

import time
from typing import Any

from bear.snapshotter.shm import ShmWriter

CONFIG = {
    "max_num_batched_tokens": 384, "max_num_scheduled_tokens": 384, "max_num_seqs": 12,
    "long_prefill_token_threshold": 0, "enable_chunked_prefill": True, "policy": "fcfs",
    "block_size": 128, "num_gpu_blocks": 1000, "watermark_blocks": 0, "max_model_len": 4096,
    "scheduler_reserve_full_isl": True, "enable_prefix_caching": False, "async_scheduling": False,
}  # fmt: skip


def meta() -> dict[str, Any]:
    return {"record_version": 1, "vllm_version": "0.32.0", "pid": 0, "dp_rank": 0, "config": CONFIG}


def cols(reqs: list[dict[str, Any]]) -> tuple[Any, ...]:
    rows = [(r["id"], r["prompt"], r["computed"], r.get("max_tokens", 16), r.get("preemptions", 0),
             r.get("arrival", 0.0), 0) for r in reqs]  # fmt: skip
    outs = [r.get("output", 0) for r in reqs]
    nbs = [r.get("blocks", 1) for r in reqs]
    return rows, outs, nbs, None


def raw_step(
    seq: int,
    *,
    sched: dict[str, int] | None = None,
    new: dict[str, int] | None = None,
    cached: dict[str, int] | None = None,
    running: list[dict[str, Any]] | None = None,
    waiting: list[dict[str, Any]] | None = None,
    busy: bool = True,
    t0: float | None = None,
    dur: float = 0.01,
    free: int = 999,
) -> tuple[Any, ...]:
    """One record exactly as bear_vllm_plugin writes it."""
    sched = sched or {}
    t0 = time.monotonic() if t0 is None else t0
    cached = cached or {}
    return (
        1, seq, t0, t0 + 0.001, t0 + dur * 0.9, t0 + dur * 0.95, time.time(), busy,
        tuple(sched), tuple(sched.values()), tuple((new or {}).items()), tuple(cached), tuple(cached.values()),
        (), free, cols(running or []), cols(waiting or []), 12345, None, 2345,
    )  # fmt: skip


def new_writer(name: str, **kw: Any) -> ShmWriter:
    w = ShmWriter(name, meta=meta(), **kw)
    w.write(raw_step(0, busy=False))
    return w


def run_writer(name: str, period_s: float = 0.005) -> None:
    """A fake engine process: one step every ``period_s`` with one decoding request, heartbeats
    on the side — what the plugin does, minus vLLM."""
    import threading

    w = new_writer(name)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            w.heartbeat()

    threading.Thread(target=beat, daemon=True).start()
    seq = 0
    while True:
        seq += 1
        req = {"id": "R", "prompt": 10, "computed": 10 + seq, "output": seq, "max_tokens": 10**9}
        w.write(raw_step(seq, sched={"R": 1}, cached={"R": 9 + seq}, running=[req], dur=period_s))
        time.sleep(period_s)


if __name__ == "__main__":
    import sys

    run_writer(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.005)
