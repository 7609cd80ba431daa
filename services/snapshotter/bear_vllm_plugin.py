"""vLLM scheduler plugin: after every engine step, copy the scheduler state and the step's batch
into a shared-memory ring (``shm.py``) for the snapshotter process.

Start vLLM with ``--scheduler-cls bear_vllm_plugin.make_scheduler`` (this folder on PYTHONPATH)
or ``bear.snapshotter.bear_vllm_plugin.make_scheduler`` (bear installed) and
``BEAR_SNAPSHOT_SHM=<name>``. Only vLLM + stdlib are imported here; on the engine thread the
plugin reads attributes into tuples, marshals them and copies the bytes into the ring — no
locks, no I/O, no allocation beyond that. A heartbeat thread stamps the region twice a second so
that the snapshotter can tell a dead engine from an idle one.

The scheduler interface is not public: the supported vLLM versions are pinned below and any other
version fails at start-up unless ``BEAR_ALLOW_UNSUPPORTED_VLLM=1``.
"""

from __future__ import annotations

import atexit
import importlib.util
import operator
import os
import sys
import threading
import time
from collections import deque
from itertools import repeat
from typing import Any

import vllm
from vllm.v1.core.sched.scheduler import Scheduler

if __package__:
    from . import shm as _shm
else:  # loaded as a top-level module from PYTHONPATH=services/snapshotter
    _spec = importlib.util.spec_from_file_location(
        "_bear_snapshot_shm", os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm.py")
    )
    assert _spec is not None and _spec.loader is not None
    _shm = importlib.util.module_from_spec(_spec)
    sys.modules["_bear_snapshot_shm"] = _shm
    _spec.loader.exec_module(_shm)

SUPPORTED_VLLM = ("0.32.0",)
RECORD_VERSION = 1
HEARTBEAT_S = 0.25

# Positions in the per-step record (a tuple; the snapshotter decodes it in records.py).
# (version, seq, t_sched0, t_sched1, t_upd0, t_upd1, wall, busy_after,
#  sched_ids, sched_ns, new_reqs[(id, computed_before)], cached_ids, cached_computed_before,
#  preempted_ids, free_blocks, running, waiting, overhead_ns_prev, inflight, overhead_cpu_ns_prev)
# running/waiting: (rows[(id, prompt, computed, max_tokens, preemptions, arrival, priority)],
#                   output counts, block counts, {row index: shared leading blocks} | None)


def vllm_version() -> str:
    return str(getattr(vllm, "__version__", "unknown"))


def check_version(version: str | None = None) -> str:
    """Raise unless the running vLLM is one whose scheduler internals this plugin was written for."""
    v = version or vllm_version()
    base = v.split("+", 1)[0]
    if base not in SUPPORTED_VLLM and os.environ.get("BEAR_ALLOW_UNSUPPORTED_VLLM") != "1":
        raise RuntimeError(
            f"BEAR snapshot plugin: vLLM {v} is not supported (supported: {', '.join(SUPPORTED_VLLM)}); "
            "set BEAR_ALLOW_UNSUPPORTED_VLLM=1 to try anyway"
        )
    return v


# Columns read per request with C-level map() calls (a Python loop over 256 requests costs
# several times more); see docs/snapshotter.md for the measurements.
_ROW = operator.attrgetter(
    "request_id",
    "num_prompt_tokens",
    "num_computed_tokens",
    "max_tokens",
    "num_preemptions",
    "arrival_time",
    "priority",
)
_ID = operator.attrgetter("request_id")
_OUT_IDS = operator.attrgetter("_output_token_ids")
_REF = operator.attrgetter("ref_cnt")


class _NoBlock:
    ref_cnt = 0


_NO_BLOCK = _NoBlock()
_EMPTY: tuple[()] = ()


class _SnapshotMixin:
    """Wraps ``schedule`` and ``update_from_output``; everything else is the stock scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        name = os.environ.get("BEAR_SNAPSHOT_SHM", "bear-snapshot")
        dp_rank = int(getattr(self.parallel_config, "data_parallel_rank", 0) or 0)  # type: ignore[attr-defined]
        if dp_rank:
            name = f"{name}-dp{dp_rank}"
        self._bear_writer = _shm.ShmWriter(
            name,
            slot_count=int(os.environ.get("BEAR_SNAPSHOT_SLOTS", _shm.DEFAULT_SLOT_COUNT)),
            slot_bytes=int(os.environ.get("BEAR_SNAPSHOT_SLOT_BYTES", _shm.DEFAULT_SLOT_BYTES)),
            meta=self._bear_meta(),
        )
        mgr = self.kv_cache_manager  # type: ignore[attr-defined]
        self._bear_pool = mgr.block_pool
        self._bear_req_blocks = mgr.coordinator.single_type_managers[0].req_to_blocks
        self._bear_prefix = bool(self.cache_config.enable_prefix_caching)  # type: ignore[attr-defined]
        self._bear_seq = 0
        self._bear_pending: deque[tuple[Any, ...]] = deque()
        self._bear_overhead_ns = 0  # wall time the hooks added since the last record
        self._bear_overhead_cpu_ns = 0  # the same in this thread's CPU time (no GIL waits, no preemption)
        self._bear_dropped = 0
        self._bear_stop = threading.Event()
        self._bear_write_initial()
        t = threading.Thread(target=self._bear_beat, name="bear-snapshot-heartbeat", daemon=True)
        t.start()
        atexit.register(self._bear_close)

    # ---- metadata (once) ----------------------------------------------------------------------
    def _bear_meta(self) -> dict[str, Any]:
        sc, cc = self.scheduler_config, self.cache_config  # type: ignore[attr-defined]
        mgr = self.kv_cache_manager  # type: ignore[attr-defined]
        lpt_adaptive = getattr(sc, "long_prefill_token_threshold_adaptive", None)
        config = {
            "max_num_batched_tokens": int(sc.max_num_batched_tokens),
            "max_num_scheduled_tokens": int(
                getattr(self, "max_num_scheduled_tokens", sc.max_num_batched_tokens)
            ),
            "max_num_seqs": int(sc.max_num_seqs),
            "long_prefill_token_threshold": int(sc.long_prefill_token_threshold or 0),
            "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
            "policy": str(getattr(sc.policy, "value", sc.policy)),
            "block_size": int(self.block_size),  # type: ignore[attr-defined]
            "num_gpu_blocks": int(cc.num_gpu_blocks or 0),
            "watermark_blocks": int(getattr(mgr, "watermark_blocks", 0) or 0),
            "max_model_len": int(self.max_model_len),  # type: ignore[attr-defined]
            "scheduler_reserve_full_isl": bool(getattr(sc, "scheduler_reserve_full_isl", True)),
            "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
        }
        if lpt_adaptive is not None:
            config["long_prefill_token_threshold_adaptive"] = bool(lpt_adaptive)
        return {
            "record_version": RECORD_VERSION,
            "vllm_version": vllm_version(),
            "pid": os.getpid(),
            "pid_namespace": _shm.pid_namespace(),
            "dp_rank": int(getattr(self.parallel_config, "data_parallel_rank", 0) or 0),  # type: ignore[attr-defined]
            "config": config,
        }

    # ---- engine-thread hooks --------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        t1 = time.monotonic()
        c0, u0 = time.perf_counter_ns(), time.thread_time_ns()
        nst = out.num_scheduled_tokens
        cr = out.scheduled_cached_reqs
        self._bear_pending.append(
            (
                out,
                t0,
                t1,
                tuple(nst),
                tuple(nst.values()),
                tuple([(nr.req_id, nr.num_computed_tokens) for nr in out.scheduled_new_reqs]),
                tuple(cr.req_ids),
                tuple(cr.num_computed_tokens),
                tuple(getattr(out, "preempted_req_ids", None) or _EMPTY),
            )
        )
        self._bear_overhead_ns += time.perf_counter_ns() - c0
        self._bear_overhead_cpu_ns += time.thread_time_ns() - u0
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t2 = time.monotonic()
        outs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        t3 = time.monotonic()
        c0, u0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            self._bear_capture(scheduler_output, t2, t3)
        except Exception:  # never let the observer break the engine
            self._bear_dropped += 1
        self._bear_overhead_ns += time.perf_counter_ns() - c0
        self._bear_overhead_cpu_ns += time.thread_time_ns() - u0
        return outs

    # ---- capture ---------------------------------------------------------------------------------
    def _bear_rows(self, reqs: Any) -> tuple[Any, ...]:
        """(rows, output counts, block counts, {index: shared leading blocks} or None) of a queue."""
        reqs = list(reqs)
        rows = list(map(_ROW, reqs))
        outs = list(map(len, map(_OUT_IDS, reqs)))
        blocks = list(map(self._bear_req_blocks.get, map(_ID, reqs), repeat(_EMPTY)))
        nbs = list(map(len, blocks))
        shared = None
        if self._bear_prefix:
            # shared blocks form a prefix of a request's list (prefix-cache hits): look closer only
            # at requests whose first block is shared
            firsts = list(map(_REF, map(next, map(iter, blocks), repeat(_NO_BLOCK))))
            shared = {}
            for i in [i for i, rc in enumerate(firsts) if rc > 1]:
                k = 0
                for b in blocks[i]:
                    if b.ref_cnt <= 1:
                        break
                    k += 1
                shared[i] = k
        return rows, outs, nbs, shared

    def _bear_state(self) -> tuple[int, tuple[Any, ...], tuple[Any, ...]]:
        holding = getattr(self, "kv_holding_waiting", None)
        queue = self.waiting  # type: ignore[attr-defined]
        waiting = self._bear_rows([*holding, *queue] if holding else queue)
        return self._bear_pool.get_num_free_blocks(), self._bear_rows(self.running), waiting  # type: ignore[attr-defined]

    def _bear_capture(self, scheduler_output: Any, t2: float, t3: float) -> None:
        pending = self._bear_pending
        entry = None
        while pending:
            cand = pending.popleft()
            if cand[0] is scheduler_output:
                entry = cand
                break
        if entry is None:
            return
        _, t0, t1, ids, ns, new, cids, cctx, pre = entry
        self._bear_seq += 1
        inflight = None
        if pending:  # async scheduling: the next batch was launched before this update
            nxt = pending[0]
            inflight = (nxt[2], nxt[3], nxt[4], nxt[5], nxt[6], nxt[7])
        free, running, waiting = self._bear_state()
        busy = bool(running[0] or waiting[0] or pending)
        record = (
            RECORD_VERSION, self._bear_seq, t0, t1, t2, t3, time.time(), busy,
            ids, ns, new, cids, cctx, pre, free, running, waiting, self._bear_overhead_ns, inflight,
            self._bear_overhead_cpu_ns,
        )  # fmt: skip
        self._bear_overhead_ns = self._bear_overhead_cpu_ns = 0
        try:
            self._bear_writer.write(record)
        except _shm.RecordTooLarge:
            self._bear_dropped += 1

    def _bear_write_initial(self) -> None:
        free, running, waiting = self._bear_state()
        now = time.monotonic()
        record = (
            RECORD_VERSION, 0, now, now, now, now, time.time(), False,
            _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, free, running, waiting, 0, None, 0,
        )  # fmt: skip
        self._bear_writer.write(record)

    # ---- housekeeping (not the engine thread) -----------------------------------------------------
    def _bear_beat(self) -> None:
        while not self._bear_stop.wait(HEARTBEAT_S):
            try:
                self._bear_writer.heartbeat()
            except ValueError:  # unmapped at shutdown
                return

    def _bear_close(self) -> None:
        self._bear_stop.set()
        try:
            self._bear_writer.close()
        except Exception:
            pass

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            self._bear_close()


class SnapshotScheduler(_SnapshotMixin, Scheduler):
    """Sync-mode stock scheduler with snapshots."""


def _async_class() -> type:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    class SnapshotAsyncScheduler(_SnapshotMixin, AsyncScheduler):
        """Async-mode stock scheduler with snapshots (records carry the in-flight batch)."""

    return SnapshotAsyncScheduler


def make_scheduler(**kwargs: Any) -> Any:
    """The ``--scheduler-cls`` entry: vLLM calls it with keyword arguments only; picks the base
    class matching the resolved ``async_scheduling`` flag."""
    check_version()
    cfg = kwargs["vllm_config"].scheduler_config
    cls = _async_class() if getattr(cfg, "async_scheduling", False) else SnapshotScheduler
    return cls(**kwargs)


check_version()
