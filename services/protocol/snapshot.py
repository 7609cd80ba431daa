"""The fields of ``bear.snapshot/1`` (docs/contract.md §2) as msgspec structs: the Python side's
description of what libbea's parser reads (libbea/core/src/snapshot.cpp, request_fields.cpp).

libbea's bounds-checked parser stays the one decoder of snapshots (it builds the replay's state
straight from the bytes, with the ranges that depend on other fields); these structs give
Python producers and tools the field list and types, and tests/protocol/test_snapshot_fields.py
fails when the C++ parser reads a field these do not name, or the other way round."""

from __future__ import annotations

import msgspec


class SnapshotConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """``config``: the engine's scheduler and cache configuration."""

    max_num_batched_tokens: int
    max_num_scheduled_tokens: int | None = None  # default: max_num_batched_tokens
    max_num_seqs: int
    max_num_active_seqs: int | None = None  # default: max_num_seqs
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"
    block_size: int
    num_gpu_blocks: int
    watermark_blocks: int = 0
    max_model_len: int
    scheduler_reserve_full_isl: bool = True
    enable_prefix_caching: bool = False
    async_scheduling: bool = False
    priority_self_preempt_continues: bool = False


class SnapshotRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One request of ``running`` / ``waiting``."""

    id: str
    prompt_tokens: int
    output_tokens: int
    placeholders: int = 0
    computed_tokens: int
    max_tokens: int
    blocks: int
    exclusive_blocks: int | None = None  # default: blocks
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    priority: int = 0
    arrival: float = 0.0
    tracked: list[int] | None = None  # indices into tracked_blocks
    hit_blocks: list[int] | None = None
    block_keys: list[int] | None = None
    tracked_ids: list[int] | None = None  # the pool table's ids of the blocks it holds (--pool-deltas)


class InflightItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    id: str
    n: int
    context: int


class Inflight(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A step scheduled but not finished (async scheduling)."""

    started: float | None = None  # default: the snapshot's time
    items: list[InflightItem]


class Snapshot(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One instance's state right after an engine step. The schema id is in ``schema`` (what
    the snapshotter writes) or ``v`` (what libbea writes); either is optional."""

    schema: str | None = None
    v: str | None = None
    instance: str = ""
    model: str = ""
    generation: int = 0
    seq: int = 0
    time: float = 0.0
    config: SnapshotConfig
    free_blocks: int
    running: list[SnapshotRequest]
    waiting: list[SnapshotRequest]
    inflight: Inflight | None = None
    tracked_blocks: list[int] | None = None
    tracked_keys: list[int] | None = None
