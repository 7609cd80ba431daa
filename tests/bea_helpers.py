"""Builders for small hand-worked scheduler states (tests only)."""

from __future__ import annotations

from typing import Any


def config(**kw: Any) -> dict[str, Any]:
    c = {
        "max_num_batched_tokens": 2048, "max_num_scheduled_tokens": None, "max_num_seqs": 256,
        "long_prefill_token_threshold": 0, "enable_chunked_prefill": True, "policy": "fcfs",
        "block_size": 16, "num_gpu_blocks": 100_000, "max_model_len": 32768,
        "enable_prefix_caching": False, "async_scheduling": False, "scheduler_reserve_full_isl": True,
        "watermark_blocks": 0,
    }
    c.update(kw)
    if c["max_num_scheduled_tokens"] is None:
        c["max_num_scheduled_tokens"] = c["max_num_batched_tokens"]
    return c


def req(rid: str, p: int, c: int = 0, o: int = 0, blocks: int | None = None, max_tokens: int = 1000,
        excl: int | None = None, arrival: float = 0.0, priority: int = 0, block_size: int = 16, **kw: Any) -> dict:
    if blocks is None:
        blocks = -(-c // block_size)
    r = {"id": rid, "prompt_tokens": p, "computed_tokens": c, "output_tokens": o, "max_tokens": max_tokens,
         "blocks": blocks, "exclusive_blocks": blocks if excl is None else excl, "preemptions": 0,
         "arrival": arrival, "priority": priority}
    r.update(kw)
    return r


def decoding(rid: str, p: int, o: int, **kw: Any) -> dict:
    """A request past its prompt with `o` outputs: C = P + O - 1."""
    return req(rid, p, c=p + o - 1, o=o, **kw)


def snapshot(running: list[dict], waiting: list[dict] | None = None, free: int | None = None,
             inflight: dict | None = None, time: float = 100.0, **cfg: Any) -> dict[str, Any]:
    c = config(**cfg)
    if free is None:
        free = c["num_gpu_blocks"] - 1 - sum(r["blocks"] for r in running)
    return {"schema": "bear.snapshot/1", "instance": "t", "seq": 1, "time": time, "config": c,
            "free_blocks": free, "running": running, "waiting": waiting or [], "inflight": inflight}
