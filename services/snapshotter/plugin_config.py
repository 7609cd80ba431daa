"""The vLLM plugin's configuration, read once at start-up from the scheduler: whether per-step
deltas describe this engine's steps, and the metadata the ring's header carries for readers
(engine config, vLLM version, prefix-cache hashing). Imported into the engine process by
``bear_vllm_plugin``; vLLM is imported only inside the functions that need it."""

from __future__ import annotations

import os
from collections import deque
from typing import Any


def delta_unsupported(sched: Any) -> str | None:
    """Why per-step deltas are off here (None: on). The delta rules are those of the sync
    scheduler with FCFS queues and one full-attention KV group; anything else gets full
    records every step."""
    if os.environ.get("BEAR_SNAPSHOT_DELTA", "1") == "0":
        return "BEAR_SNAPSHOT_DELTA=0"
    vc, sc, cc = sched.vllm_config, sched.scheduler_config, sched.cache_config
    if getattr(sc, "async_scheduling", False) or "Async" in type(sched).__name__:
        return "async scheduling (full records; deltas are proven for the sync scheduler only)"
    if str(getattr(sc.policy, "value", sc.policy)) != "fcfs" or not isinstance(sched.waiting, deque):
        return f"policy {sc.policy}"
    if vc.speculative_config is not None or getattr(sched, "num_lookahead_tokens", 0):
        return "speculative decoding"
    if getattr(sched, "connector", None) is not None or getattr(sched, "ec_connector", None) is not None:
        return "KV/EC connector"
    if getattr(sched, "num_sampled_tokens_per_step", 1) != 1 or getattr(sched, "is_encoder_decoder", False):
        return "not a decoder-only generative model"
    pc = sched.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        return "pipeline parallelism"
    if getattr(sched, "dcp_world_size", 1) > 1 or getattr(sched, "pcp_world_size", 1) > 1:
        return "context parallelism"
    groups = sched.kv_cache_config.kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        return "not a single full-attention KV cache group"
    unit = getattr(cc, "prefix_match_unit", None)
    if unit not in (None, sched.block_size):
        return "sub-block prefix matching"
    if getattr(sched, "prefix_replay_tokens", 0):
        return "prefix replay"
    return None

def plugin_meta(sched: Any, delta: bool, no_delta: str | None, record_version: int, vllm_version: str,
                pid_namespace: int | None, default_full_every: int) -> dict[str, Any]:
    sc, cc = sched.scheduler_config, sched.cache_config
    mgr = sched.kv_cache_manager
    lpt_adaptive = getattr(sc, "long_prefill_token_threshold_adaptive", None)
    config = {
        "max_num_batched_tokens": int(sc.max_num_batched_tokens),
        "max_num_scheduled_tokens": int(
            getattr(sched, "max_num_scheduled_tokens", sc.max_num_batched_tokens)
        ),
        "max_num_seqs": int(sc.max_num_seqs),
        "long_prefill_token_threshold": int(sc.long_prefill_token_threshold or 0),
        "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
        "policy": str(getattr(sc.policy, "value", sc.policy)),
        "block_size": int(sched.block_size),
        "num_gpu_blocks": int(cc.num_gpu_blocks or 0),
        "watermark_blocks": int(getattr(mgr, "watermark_blocks", 0) or 0),
        "max_model_len": int(sched.max_model_len),
        "scheduler_reserve_full_isl": bool(getattr(sc, "scheduler_reserve_full_isl", True)),
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
    }
    if lpt_adaptive is not None:
        config["long_prefill_token_threshold_adaptive"] = bool(lpt_adaptive)
    model_config = getattr(sched.vllm_config, "model_config", None)
    return {
        "record_version": record_version,
        "vllm_version": vllm_version,
        "pid": os.getpid(),
        "pid_namespace": pid_namespace,
        "dp_rank": int(getattr(sched.parallel_config, "data_parallel_rank", 0) or 0),
        "delta": delta,
        "delta_off": no_delta,
        "verify": delta and os.environ.get("BEAR_SNAPSHOT_VERIFY") == "1",
        "full_every": max(1, int(os.environ.get("BEAR_SNAPSHOT_FULL_EVERY", default_full_every))),
        "config": config,
        "prefix_cache": prefix_meta(sched),
        "tokenizer": str(getattr(model_config, "tokenizer", "") or ""),
    }

def prefix_meta(sched: Any) -> dict[str, Any]:
    """How this engine names its cached blocks and where it publishes its KV events: what a
    prefix-cache mirror outside needs (``bear.prefix``). The seed is the one vLLM resolved (PYTHONHASHSEED
    or its fixed default; random per process for the xxhash algorithms without it)."""
    cc = sched.cache_config
    out: dict[str, Any] = {
        "enabled": bool(cc.enable_prefix_caching),
        "block_size": int(sched.block_size),
        "hash_algo": str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
        "events": False,
    }
    try:
        from vllm import envs
        from vllm.v1.core import kv_cache_utils

        out["hash_seed"] = str(kv_cache_utils.get_none_hash_seed())
        out["int_hashes"] = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    except Exception as exc:  # an internal that moved: the mirror says so rather than guess
        out["problem"] = repr(exc)
    pub = getattr(sched, "kv_event_publisher", None)
    cfg = pub.get_publisher_config() if pub is not None else None
    if cfg is not None and getattr(cfg, "enable_kv_cache_events", False) and getattr(cfg, "publisher", "") == "zmq":
        out.update(events=True, endpoint=cfg.endpoint, replay_endpoint=cfg.replay_endpoint,
                   topic=cfg.topic or "")
    return out
