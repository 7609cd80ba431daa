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
    return {"record_version": 3, "vllm_version": "0.32.0", "pid": 0, "dp_rank": 0, "delta": True, "config": CONFIG}


def cols(reqs: list[dict[str, Any]], with_ids: bool = False) -> tuple[Any, ...]:
    rows = [(r["id"], r["prompt"], r["computed"], r.get("max_tokens", 16), r.get("preemptions", 0),
             r.get("arrival", 0.0), 0) for r in reqs]  # fmt: skip
    outs = [r.get("output", 0) for r in reqs]
    nbs = [r.get("blocks", 1) for r in reqs]
    bids = [tuple(r.get("bids", ())) for r in reqs] if with_ids else None
    return rows, outs, nbs, None, bids


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
    preempted: tuple[str, ...] = (),
    reason: int = 5,
    delta: tuple[Any, ...] | None = None,
    with_ids: bool = False,
    block_ops: list[Any] | None = None,
) -> tuple[Any, ...]:
    """One full record exactly as bear_vllm_plugin writes it (reason 5: deltas off; with
    ``with_ids`` and a reason < 5 as in delta mode, optionally carrying the ``delta`` too)."""
    sched = sched or {}
    t0 = time.monotonic() if t0 is None else t0
    cached = cached or {}
    return (
        3, seq, t0, t0 + 0.001, t0 + dur * 0.9, t0 + dur * 0.95, time.time(), busy,
        tuple(sched), tuple(sched.values()), tuple((new or {}).items()), tuple(cached), tuple(cached.values()),
        preempted, free, cols(running or [], with_ids), cols(waiting or [], with_ids), 12345, None, 2345,
        reason, delta, block_ops,
    )  # fmt: skip


def delta_step(
    seq: int,
    delta: tuple[Any, ...],
    *,
    new: dict[str, int] | None = None,
    preempted: tuple[str, ...] = (),
    free: int = 999,
    busy: bool = True,
    t0: float | None = None,
    dur: float = 0.01,
) -> tuple[Any, ...]:
    """One delta-only record (full_reason 0)."""
    t0 = time.monotonic() if t0 is None else t0
    return (
        3, seq, t0, t0 + 0.001, t0 + dur * 0.9, t0 + dur * 0.95, time.time(), busy,
        None, None, tuple((new or {}).items()), None, None, preempted, free, None, None, 12345, None, 2345,
        0, delta, None,
    )  # fmt: skip


def delta(
    *,
    arrivals: list[dict[str, Any]] = (),  # type: ignore[assignment]
    fin_before: tuple[str, ...] = (),
    fin_mid: tuple[str, ...] = (),
    fin_upd: tuple[str, ...] = (),
    admitted: tuple[tuple[str, int, tuple[int, ...]], ...] = (),
    sched: int | tuple[str, ...] = 0,
    ns: tuple[int, ...] | None = None,
    new_blocks: Any = 0,
    emitted: int = 0,
    n_run: int = 0,
    n_wait: int = 0,
) -> tuple[Any, ...]:
    rows = tuple((r["id"], r["prompt"], r.get("computed", 0), r.get("max_tokens", 16), 0, r.get("arrival", 0.0), 0)
                 for r in arrivals)  # fmt: skip
    return (rows, tuple(0 for _ in arrivals), fin_before, fin_mid, fin_upd, admitted, sched, ns, new_blocks,
            emitted, n_run, n_wait)  # fmt: skip


def new_writer(name: str, **kw: Any) -> ShmWriter:
    w = ShmWriter(name, meta=meta(), **kw)
    w.write(raw_step(0, busy=False))
    return w


def run_writer(name: str, period_s: float = 0.005, deltas: bool = False, initial_full: bool = True) -> None:
    """A fake engine process: one step every ``period_s`` with one decoding request, heartbeats
    on the side — what the plugin does, minus vLLM. With ``deltas`` it writes what the plugin
    writes in delta mode: a full record first (unless ``initial_full`` is False: as if it had been
    overwritten before any reader came), then one delta per step, a full record 64 steps after
    the last one and whenever a reader asks for one (the resync counter)."""
    import threading

    w = ShmWriter(name, meta=meta())
    stop = threading.Event()
    resync = [w.resync_requests(), False]

    def beat() -> None:
        while not stop.wait(0.1):
            w.heartbeat()
            n = w.resync_requests()
            if n != resync[0]:
                resync[0], resync[1] = n, True

    threading.Thread(target=beat, daemon=True).start()
    # R: prompt 10, one block per 128 tokens; block ids 1, 2, …; 999 usable blocks
    req = {"id": "R", "prompt": 10, "computed": 10, "output": 0, "max_tokens": 10**9, "bids": [1], "blocks": 1}
    if not deltas:
        w.write(raw_step(0, busy=False))
    elif initial_full:  # an engine that already runs R (prefilled) when the plugin starts
        w.write(raw_step(0, running=[req], reason=1, with_ids=True, free=998))
    else:
        w.write(delta_step(0, delta(n_run=1), free=998))
    seq = 0
    full_at: int | None = 0 if initial_full else None
    while True:
        seq += 1
        before = req["computed"]
        req["computed"] += 1
        req["output"] += 1
        new_block = req["computed"] > 128 * len(req["bids"])
        if new_block:
            req["bids"] = [*req["bids"], len(req["bids"]) + 1]
            req["blocks"] = len(req["bids"])
        free = 999 - len(req["bids"])
        if not deltas:
            w.write(raw_step(seq, sched={"R": 1}, cached={"R": before}, running=[req], dur=period_s, free=free))
        else:
            nb = (1, (0,), ((req["bids"][-1],),)) if new_block else 1
            d = delta(sched=1, new_blocks=nb, emitted=1, n_run=1)
            if resync[1] or (full_at is not None and seq - full_at >= 64):
                resync[1] = False
                full_at = seq
                w.write(raw_step(seq, sched={"R": 1}, cached={"R": before}, running=[req], dur=period_s, free=free,
                                 reason=3, with_ids=True))  # fmt: skip
            else:
                w.write(delta_step(seq, d, free=free, dur=period_s))
        time.sleep(period_s)  # sleep: the engine's step time (a fake engine steps at a rate, not on events)


if __name__ == "__main__":
    import sys

    run_writer(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.005,
               deltas=len(sys.argv) > 3 and sys.argv[3].startswith("deltas"),
               initial_full=len(sys.argv) <= 3 or sys.argv[3] != "deltas-no-initial-full")  # fmt: skip
