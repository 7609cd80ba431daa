"""vLLM scheduler plugin: after every engine step, write the step's batch and what changed in the
scheduler state into a shared-memory ring (``shm.py``) for the snapshotter process.

Start vLLM with ``--scheduler-cls bear_vllm_plugin.make_scheduler`` (this folder on PYTHONPATH)
or ``bear.snapshotter.bear_vllm_plugin.make_scheduler`` (bear installed) and
``BEAR_SNAPSHOT_SHM=<name>``. Only vLLM + stdlib are imported here; on the engine thread the
plugin copies values into tuples, marshals them and copies the bytes into the ring — no locks, no
I/O. A heartbeat thread stamps the region so that the snapshotter can tell a dead engine from an
idle one.

Per-step deltas (docs/snapshotter.md): in sync mode (FCFS, one full-attention KV group, no
speculative decoding / KV connectors / pipeline parallelism) a record carries only the step's
composition (vLLM's own ``SchedulerOutput`` values), the requests that arrived / finished /
were admitted / preempted and the free-block count; the snapshotter rebuilds the full state by
applying vLLM's deterministic updates (``step_decoder.EngineState``). The plugin keeps its own
copy of the running and waiting lists (object references) and compares it with vLLM's lists
after every step (an identity comparison in C); when they differ, when a reader asks for it, and
every ``BEAR_SNAPSHOT_FULL_EVERY`` steps it writes a full record instead (the periodic one carries
the delta too, so the snapshotter checks the state it keeps against it). ``BEAR_SNAPSHOT_VERIFY=1``
writes delta + full on every step; ``BEAR_SNAPSHOT_DELTA=0`` writes only full records. Async
scheduling and the other configurations above always get full records.

The scheduler interface is not public: the supported vLLM versions are pinned below and any other
version fails at start-up unless ``BEAR_ALLOW_UNSUPPORTED_VLLM=1``.
"""

from __future__ import annotations

import atexit
import bisect
import importlib.util
import operator
import os
import sys
import threading
import time
from collections import deque
from itertools import compress, repeat
from typing import Any

import vllm
from vllm.v1.core.sched.scheduler import Scheduler

if __package__:
    from . import plugin_block_ops as _block_ops
    from . import plugin_config as _config
    from . import shm as _shm
else:  # loaded as a top-level module from PYTHONPATH=services/snapshotter: its siblings by path

    def _sibling(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(
            f"_bear_snapshot_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    _shm = _sibling("shm")
    _config = _sibling("plugin_config")
    _block_ops = _sibling("plugin_block_ops")

SUPPORTED_VLLM = ("0.32.0",)
RECORD_VERSION = 3
HEARTBEAT_S = 0.25
DEFAULT_FULL_EVERY = 256

# Positions in the per-step record (a tuple; the snapshotter decodes it in records.py).
# (version, seq, t_sched0, t_sched1, t_upd0, t_upd1, wall, busy_after,
#  sched_ids, sched_ns, new_reqs[(id, computed_before)], cached_ids, cached_computed_before,
#  preempted_ids, free_blocks, running, waiting, overhead_ns_prev, inflight, overhead_cpu_ns_prev,
#  full_reason, delta, block_ops)
# sched_ids/sched_ns/cached_*/running/waiting are None in a delta-only record (full_reason 0).
# running/waiting: (rows[(id, prompt, computed, max_tokens, preemptions, arrival, priority)],
#                   output counts, block counts, {row index: shared leading blocks} | None,
#                   block ids per row (delta mode) | None)
# delta: (arrival rows, arrival output counts, finished before schedule, finished between schedule
#         and update (aborts), finished in update, admitted[(id, computed_before, block ids)],
#         scheduled ids (tuple, or m: the first m ids of running-after-preemption + admitted),
#         scheduled counts (tuple; None: all 1; ("tail", counts): all 1 but the admitted requests',
#         which come last), new blocks of the scheduled running requests
#         (n, or (n, positions, block ids): vLLM's CachedRequestData.new_block_ids without the
#         None entries), outputs emitted, len(running), len(waiting))
FULL_NONE = 0  # delta only
FULL_FIRST = 1  # engine start / after an error
FULL_PERIODIC = 2  # every BEAR_SNAPSHOT_FULL_EVERY steps (carries the delta too)
FULL_RESYNC = 3  # a reader asked for one
FULL_CHECK = 4  # vLLM's lists differ from the plugin's copy: the delta would not describe the step
FULL_MODE = 5  # deltas not supported in this configuration (async, priority, …)
FULL_VERIFY = 6  # BEAR_SNAPSHOT_VERIFY=1: delta + full every step

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
_BID = operator.attrgetter("block_id")


class _NoBlock:
    ref_cnt = 0


_NO_BLOCK = _NoBlock()
_EMPTY: tuple[()] = ()
_NOSET: frozenset[str] = frozenset()
_DEQUE_LEN = deque.__len__  # FCFSRequestQueue is a deque whose __len__/__iter__ are Python wrappers
_DEQUE_ITER = deque.__iter__


def _drop_objs(objs: list[Any], gone: list[Any]) -> None:
    for o in gone:
        try:
            objs.remove(o)
        except ValueError:
            pass


class _SnapshotMixin:
    """Wraps ``add_request``, ``schedule`` and ``update_from_output``; everything else is the stock
    scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        name = os.environ.get("BEAR_SNAPSHOT_SHM", "bear-snapshot")
        dp_rank = int(getattr(self.parallel_config, "data_parallel_rank", 0) or 0)  # type: ignore[attr-defined]
        if dp_rank:
            name = f"{name}-dp{dp_rank}"
        mgr = self.kv_cache_manager  # type: ignore[attr-defined]
        self._bear_pool = mgr.block_pool
        self._bear_ops = _block_ops.BlockOps(mgr.block_pool) if os.environ.get("BEAR_SNAPSHOT_BLOCK_OPS") == "1" else None
        self._bear_req_blocks = mgr.coordinator.single_type_managers[0].req_to_blocks
        self._bear_prefix = bool(self.cache_config.enable_prefix_caching)  # type: ignore[attr-defined]
        self._bear_no_delta = _config.delta_unsupported(self)
        self._bear_delta = self._bear_no_delta is None
        self._bear_verify = self._bear_delta and os.environ.get("BEAR_SNAPSHOT_VERIFY") == "1"
        self._bear_full_every = max(1, int(os.environ.get("BEAR_SNAPSHOT_FULL_EVERY", DEFAULT_FULL_EVERY)))
        self._bear_writer = _shm.ShmWriter(
            name,
            slot_count=int(os.environ.get("BEAR_SNAPSHOT_SLOTS", _shm.DEFAULT_SLOT_COUNT)),
            slot_bytes=int(os.environ.get("BEAR_SNAPSHOT_SLOT_BYTES", _shm.DEFAULT_SLOT_BYTES)),
            meta=self._bear_meta(),
        )
        self._bear_seq = 0
        self._bear_pending: deque[tuple[Any, ...]] = deque()
        self._bear_overhead_ns = 0  # wall time the hooks added since the last record
        self._bear_overhead_cpu_ns = 0  # the same in this thread's CPU time (no GIL waits, no preemption)
        self._bear_dropped = 0
        # the plugin's copy of vLLM's lists (what the snapshotter rebuilds from the deltas)
        self._bear_arrivals: list[Any] = []
        self._bear_run: list[Any] = []
        self._bear_run_ids: list[str] = []
        self._bear_wait: list[Any] = []
        self._bear_by_id: dict[str, Any] = {}
        # Finished requests leave the list copy here; the list is cleared after vLLM's next
        # update_from_output. The copy often holds a finished request's last reference, and
        # freeing it (its token lists, hashes, …) is vLLM's cost, paid in update_from_output
        # without the plugin: keep it there instead of in the plugin's timed section.
        self._bear_graveyard: list[Any] = []
        # where each running request sits in _bear_run without scanning for it: its position when
        # it was appended ("original"), minus the originals deleted before it (sorted list)
        self._bear_pos: dict[str, int] = {}
        self._bear_deleted: list[int] = []
        self._bear_next_pos = 0
        self._bear_fin_seen: frozenset[str] = _NOSET
        self._bear_since_full = 0
        self._bear_force_full = FULL_FIRST
        self._bear_resync_seen = self._bear_writer.resync_requests()
        self._bear_resync = False
        self._bear_stop = threading.Event()
        self._bear_write_initial()
        t = threading.Thread(target=self._bear_beat, name="bear-snapshot-heartbeat", daemon=True)
        t.start()
        atexit.register(self._bear_close)

    def _bear_meta(self) -> dict[str, Any]:
        return _config.plugin_meta(self, self._bear_delta, self._bear_no_delta, RECORD_VERSION, vllm_version(),
                                   _shm.pid_namespace(), DEFAULT_FULL_EVERY)

    # ---- engine-thread hooks --------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        if self._bear_ops is not None and request.block_hashes:  # one slice per full block
            self._bear_ops.ops.append(_block_ops.names_op(request))
        if self._bear_delta:
            # the row as the next schedule() will see it (nothing changes a waiting request
            # before then but an abort); timed with perf_counter only (CPU ≈ wall for ~1 µs, and
            # the thread-CPU clock is a system call that costs as much as the read)
            c0 = time.perf_counter_ns()
            self._bear_arrivals.append((request, _ROW(request), len(request._output_token_ids)))
            dt = time.perf_counter_ns() - c0
            self._bear_overhead_ns += dt
            self._bear_overhead_cpu_ns += dt

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if not self._bear_delta:
            return self._bear_schedule_full(*args, **kwargs)
        t0 = time.monotonic()
        arr = self._bear_arrivals
        if arr:
            self._bear_arrivals = []
        try:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._bear_force_full = FULL_FIRST
            raise
        # Everything else about the step is read from ``out`` in update_from_output (one timed
        # section per step): vLLM does not change a SchedulerOutput after schedule() returned (the
        # model runner extends the block lists it adopted only in later steps). Not timed: two
        # monotonic() reads and this append (< 1 µs; timing them would cost more).
        self._bear_pending.append((out, t0, time.monotonic(), arr))
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not self._bear_delta:
            return self._bear_update_full(scheduler_output, model_runner_output)
        t2 = time.monotonic()
        fin = self.finished_req_ids  # type: ignore[attr-defined]
        fin_mid = frozenset(fin) if fin else _NOSET  # aborted while the batch ran
        outs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._bear_graveyard:  # last step's finished requests, freed where vLLM frees them
            self._bear_graveyard = []
        t3 = time.monotonic()
        c0, u0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            self._bear_capture_delta(scheduler_output, outs, fin_mid, t2, t3)
        except Exception:  # never let the observer break the engine
            self._bear_dropped += 1
            self._bear_force_full = FULL_FIRST
        self._bear_overhead_ns += time.perf_counter_ns() - c0
        self._bear_overhead_cpu_ns += time.thread_time_ns() - u0
        return outs

    # ---- delta mode ------------------------------------------------------------------------------
    def _bear_pop_pending(self, so: Any) -> tuple[tuple[Any, ...] | None, bool]:
        """The entry schedule() left for ``so`` and whether older entries had to be dropped to
        reach it (a step whose update vLLM never ran)."""
        pending = self._bear_pending
        lost = False
        while pending:
            cand = pending.popleft()
            if cand[0] is so:
                return cand, lost
            lost = True
        return None, lost

    def _bear_capture_delta(self, so: Any, outs: Any, fin_mid: frozenset[str], t2: float, t3: float) -> None:
        pending = self._bear_pending
        entry, lost = self._bear_pop_pending(so)
        if entry is None or lost or pending:  # not the sync schedule → update alternation
            self._bear_force_full = self._bear_force_full or FULL_FIRST
            if entry is None:
                return
        _, t0, t1, arr = entry
        self._bear_seq += 1
        # the step's composition, from vLLM's own SchedulerOutput
        nst = so.num_scheduled_tokens
        ids = list(nst)
        cr = so.scheduled_cached_reqs
        new = so.scheduled_new_reqs
        adm: list[tuple[Any, ...]] = []
        new_pairs: tuple[Any, ...] = _EMPTY
        if new:
            adm = [(nr.req_id, nr.num_computed_tokens, tuple(nr.block_ids[0])) for nr in new]
            new_pairs = tuple([(a[0], a[1]) for a in adm])
        nbids = cr.new_block_ids
        resumed = cr.resumed_req_ids
        if resumed:  # the tail of the cached list (vLLM: running, then resumed)
            r = len(cr.req_ids) - len(resumed)
            for rid, c, b in zip(cr.req_ids[r:], cr.num_computed_tokens[r:], nbids[r:], strict=True):
                adm.append((rid, c, tuple(b[0]) if b else _EMPTY))
            nbids = nbids[:r]
        # new blocks of the running requests: (n, positions in the cached list, group-0 block ids);
        # None entries (no new block: most decode steps) are skipped in C
        n_nb = len(nbids)
        if nbids.count(None) == n_nb:  # C scan, identity compares
            nbids = n_nb
        else:
            pos = tuple(compress(range(n_nb), nbids))
            nbids = (n_nb, pos, tuple([tuple(nbids[j][0]) for j in pos]))
        # token counts: None when all are 1 (decode), ("tail", counts of the admitted requests) when
        # only those (the end of vLLM's order) differ from 1, else all of them
        total = so.total_num_scheduled_tokens
        if total == len(ids):
            ns: Any = None
        else:
            tail = [nst[r] for r in ids[len(ids) - len(adm) :]] if adm else []  # n >= 1: the sum test
            ns = ("tail", tuple(tail)) if total - sum(tail) == len(ids) - len(tail) else tuple(nst.values())
        fin_before_set = so.finished_req_ids
        pre = tuple(so.preempted_req_ids) if so.preempted_req_ids else _EMPTY
        fin_all = self.finished_req_ids  # type: ignore[attr-defined]
        fin_before = fin_before_set - self._bear_fin_seen if fin_before_set else _NOSET
        fin_upd = fin_all - fin_mid if fin_all else _NOSET
        self._bear_fin_seen = frozenset(fin_all) if fin_all else _NOSET

        reason = self._bear_force_full
        if self._bear_resync:  # set by the heartbeat thread when a reader asked for a full record
            self._bear_resync = False
            reason = reason or FULL_RESYNC
        self._bear_since_full += 1
        if not reason and self._bear_since_full >= self._bear_full_every:
            reason = FULL_PERIODIC
        if not reason and self._bear_verify:
            reason = FULL_VERIFY
        if _DEQUE_LEN(self.kv_holding_waiting):  # type: ignore[attr-defined]
            reason = FULL_CHECK  # waiting requests that hold blocks: not in the delta's rules

        delta = None
        if reason in (FULL_NONE, FULL_PERIODIC, FULL_VERIFY):
            try:
                delta = self._bear_lists_step(ids, ns, adm, nbids, arr, fin_before, fin_mid, fin_upd, pre, outs)
            except Exception:  # e.g. an id the list copy never saw: describe this step in full
                delta = None
            if delta is None:
                reason = FULL_CHECK
        busy = bool(self.running or _DEQUE_LEN(self.waiting) or pending)  # type: ignore[attr-defined]
        free = self._bear_pool.get_num_free_blocks()
        if reason == FULL_NONE:
            record = (
                RECORD_VERSION, self._bear_seq, t0, t1, t2, t3, time.time(), busy,
                None, None, new_pairs, None, None, pre, free, None, None, self._bear_overhead_ns, None,
                self._bear_overhead_cpu_ns,
                FULL_NONE, delta, self._bear_block_ops(False),
            )  # fmt: skip
        else:
            cr = so.scheduled_cached_reqs
            ns_full = tuple(so.num_scheduled_tokens.values())
            run_cols, wait_cols = self._bear_state_cols(with_ids=True)
            record = (
                RECORD_VERSION, self._bear_seq, t0, t1, t2, t3, time.time(), busy,
                tuple(ids), ns_full, new_pairs, tuple(cr.req_ids), tuple(cr.num_computed_tokens), pre, free,
                run_cols, wait_cols, self._bear_overhead_ns, None, self._bear_overhead_cpu_ns, reason, delta,
                self._bear_block_ops(reason in (FULL_FIRST, FULL_RESYNC)),
            )  # fmt: skip
            if reason != FULL_VERIFY:  # (a verify record's delta matched: the chain of deltas goes on)
                self._bear_reset_lists()  # also compacts the position index every full_every steps
                self._bear_since_full = 0
            self._bear_force_full = FULL_NONE
        self._bear_overhead_ns = self._bear_overhead_cpu_ns = 0
        try:
            self._bear_writer.write(record)
        except _shm.RecordTooLarge:
            if reason == FULL_NONE:  # a huge delta (a burst of arrivals): a full record next step
                self._bear_dropped += 1
                self._bear_force_full = FULL_FIRST
            else:
                self._bear_delta_off(record)

    def _bear_delta_off(self, record: tuple[Any, ...]) -> None:
        """A full record with block ids does not fit a ring slot (many residents with long
        contexts): without one the snapshotter could never apply a delta, so this engine goes
        back to full records without block ids (the region's metadata says why)."""
        self._bear_delta = self._bear_verify = False
        self._bear_no_delta = "a full record with block ids exceeds the ring slot (BEAR_SNAPSHOT_SLOT_BYTES)"
        self._bear_arrivals = []
        self._bear_graveyard.extend((self._bear_run, self._bear_wait, self._bear_by_id))
        self._bear_run, self._bear_run_ids, self._bear_wait, self._bear_by_id = [], [], [], {}
        try:
            self._bear_writer.set_meta(self._bear_meta())
        except Exception:
            pass
        run_cols, wait_cols = self._bear_state_cols()
        try:
            self._bear_writer.write((*record[:15], run_cols, wait_cols, *record[17:20], FULL_MODE, None))
        except _shm.RecordTooLarge:
            self._bear_dropped += 1

    def _bear_run_index(self, rid: str) -> int:
        """Index of running request ``rid`` in the list copy (-1: not running). A dict probe and a
        bisection: finding it by scanning would compare (and so touch) every other request's id,
        a cache miss each on a busy host."""
        orig = self._bear_pos.get(rid)
        if orig is None:
            return -1
        i = orig - bisect.bisect_left(self._bear_deleted, orig)
        return i if 0 <= i < len(self._bear_run_ids) and self._bear_run_ids[i] is rid else -2

    def _bear_run_drop(self, rids: Any) -> list[str] | None:
        """Remove running requests from the list copy (in place; ``del`` only moves pointers, where
        copying the list would incref — touch — every request). Returns the ids that were not
        running, None if the position index is inconsistent."""
        idx = []
        missing = []
        for rid in rids:
            i = self._bear_run_index(rid)
            if i == -2:
                return None
            if i < 0:
                missing.append(rid)
            else:
                idx.append(i)
        run, run_ids, pos, deleted = self._bear_run, self._bear_run_ids, self._bear_pos, self._bear_deleted
        grave = self._bear_graveyard
        for i in sorted(idx, reverse=True):
            bisect.insort(deleted, pos.pop(run_ids[i]))
            grave.append(run[i])
            del run[i]
            del run_ids[i]
        return missing

    def _bear_lists_step(
        self, ids: list[str], ns: Any, adm: list[tuple[Any, ...]], nbids: Any, arr: list[tuple[Any, ...]],
        fin_before: frozenset[str], fin_mid: frozenset[str], fin_upd: frozenset[str], pre: tuple[str, ...],
        outs: Any,
    ) -> tuple[Any, ...] | None:  # fmt: skip
        """Apply the step to the plugin's copy of the running / waiting lists (object references,
        changed in place) with the rules the snapshotter uses (step_decoder.EngineState) and compare
        with vLLM's lists: identity comparisons in C that never touch the requests themselves.
        Returns the delta, or None when the copy does not match (→ full record; the copy is
        rebuilt from vLLM's lists then)."""
        by_id = self._bear_by_id
        run, run_ids, wait = self._bear_run, self._bear_run_ids, self._bear_wait
        arr_rows: tuple[Any, ...] = _EMPTY
        arr_outs: tuple[int, ...] = _EMPTY
        if arr:
            objs = [a[0] for a in arr]
            for o in objs:
                by_id[o.request_id] = o
            wait.extend(objs)
            arr_rows = tuple([a[1] for a in arr])
            arr_outs = tuple([a[2] for a in arr])
        if fin_before:  # finished (aborted) between the last update and this schedule
            rest = self._bear_run_drop(fin_before)
            if rest is None:
                return None
            if rest:
                _drop_objs(wait, [by_id[i] for i in rest if i in by_id])
            grave = self._bear_graveyard
            for i in fin_before:
                grave.append(by_id.pop(i, None))
        if pre:  # preempted: out of running, to the front of waiting in running order
            idx = sorted(self._bear_run_index(rid) for rid in pre)
            if idx[0] < 0:
                return None
            front = [run[i] for i in idx]
            if self._bear_run_drop(pre) != []:
                return None
            wait[0:0] = front
        k = len(adm)
        if k:
            admitted = wait[:k]
            del wait[:k]
            adm_ids = list(map(_ID, admitted))
            if set(adm_ids) != {a[0] for a in adm}:
                return None
            pos = self._bear_pos
            n = self._bear_next_pos
            for rid in adm_ids:
                pos[rid] = n
                n += 1
            self._bear_next_pos = n
            run.extend(admitted)
            run_ids.extend(adm_ids)
        m = len(ids)
        if m == len(run_ids):
            sched: Any = m if ids == run_ids else tuple(ids)
        else:
            sched = m if ids == run_ids[:m] else tuple(ids)
        if fin_mid or fin_upd:
            rest = self._bear_run_drop(fin_mid | fin_upd if fin_mid else fin_upd)
            if rest is None:
                return None
            if rest and wait:
                _drop_objs(wait, [by_id[i] for i in rest if i in by_id])
            grave = self._bear_graveyard
            for i in fin_mid:
                grave.append(by_id.pop(i, None))
            for i in fin_upd:
                grave.append(by_id.pop(i, None))
        vw = self.waiting  # type: ignore[attr-defined]
        if self.running != run or _DEQUE_LEN(vw) != len(wait):  # type: ignore[attr-defined]
            return None
        if wait and list(_DEQUE_ITER(vw)) != wait:  # every waiting request, in queue order
            return None
        emitted = 0
        for eco in outs.values():
            emitted += len(eco.outputs)
        return (
            arr_rows, arr_outs, tuple(fin_before), tuple(fin_mid), tuple(fin_upd), tuple(adm), sched, ns,
            nbids, emitted, len(run), len(wait),
        )  # fmt: skip

    def _bear_reset_lists(self) -> None:
        self._bear_graveyard.extend((self._bear_run, self._bear_wait, self._bear_by_id))
        run = list(self.running)  # type: ignore[attr-defined]
        wait = list(self.waiting)  # type: ignore[attr-defined]
        self._bear_run, self._bear_run_ids, self._bear_wait = run, list(map(_ID, run)), wait
        self._bear_pos = {rid: i for i, rid in enumerate(self._bear_run_ids)}
        self._bear_deleted = []
        self._bear_next_pos = len(run)
        self._bear_by_id = {o.request_id: o for o in (*run, *wait)}
        fin = self.finished_req_ids  # type: ignore[attr-defined]
        self._bear_fin_seen = frozenset(fin) if fin else _NOSET
        self._bear_arrivals = []  # anything added after this point is in the next step's arrivals

    # ---- full capture (every step when deltas are off) -----------------------------------------------
    def _bear_schedule_full(self, *args: Any, **kwargs: Any) -> Any:
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

    def _bear_update_full(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t2 = time.monotonic()
        outs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._bear_graveyard:  # (deltas were switched off)
            self._bear_graveyard = []
        t3 = time.monotonic()
        c0, u0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            self._bear_capture_full(scheduler_output, t2, t3)
        except Exception:  # never let the observer break the engine
            self._bear_dropped += 1
        self._bear_overhead_ns += time.perf_counter_ns() - c0
        self._bear_overhead_cpu_ns += time.thread_time_ns() - u0
        return outs

    def _bear_rows(self, reqs: Any, with_ids: bool = False) -> tuple[Any, ...]:
        """(rows, output counts, block counts, {index: shared leading blocks} or None, block ids
        per row or None) of a queue."""
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
        bids = list(map(tuple, map(map, repeat(_BID), blocks))) if with_ids else None
        return rows, outs, nbs, shared, bids

    def _bear_state_cols(self, with_ids: bool = False) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        holding = getattr(self, "kv_holding_waiting", None)
        queue = self.waiting  # type: ignore[attr-defined]
        waiting = self._bear_rows([*holding, *queue] if holding else queue, with_ids)
        return self._bear_rows(self.running, with_ids), waiting  # type: ignore[attr-defined]

    def _bear_capture_full(self, scheduler_output: Any, t2: float, t3: float) -> None:
        pending = self._bear_pending
        entry, _ = self._bear_pop_pending(scheduler_output)
        if entry is None:
            return
        _, t0, t1, ids, ns, new, cids, cctx, pre = entry
        self._bear_seq += 1
        inflight = None
        if pending:  # async scheduling: the next batch was launched before this update
            nxt = pending[0]
            inflight = (nxt[2], nxt[3], nxt[4], nxt[5], nxt[6], nxt[7])
        free = self._bear_pool.get_num_free_blocks()
        running, waiting = self._bear_state_cols()
        busy = bool(running[0] or waiting[0] or pending)
        record = (
            RECORD_VERSION, self._bear_seq, t0, t1, t2, t3, time.time(), busy,
            ids, ns, new, cids, cctx, pre, free, running, waiting, self._bear_overhead_ns, inflight,
            self._bear_overhead_cpu_ns, FULL_MODE, None, self._bear_block_ops(False),
        )  # fmt: skip
        self._bear_overhead_ns = self._bear_overhead_cpu_ns = 0
        try:
            self._bear_writer.write(record)
        except _shm.RecordTooLarge:
            self._bear_dropped += 1

    def _bear_block_ops(self, dump: bool) -> tuple[Any, ...] | None:
        """The step's block ops; with ``dump`` (first and resync records) the whole pool and the
        block names of every request the scheduler holds, so that a reader that attached late, or
        lost records, knows the requests added before as the ones logged at ``add_request``."""
        if self._bear_ops is None:
            return None
        if not dump:
            return self._bear_ops.take(False)
        names = tuple(_block_ops.names_op(r) for r in self.requests.values() if r.block_hashes)
        return (*names, *self._bear_ops.take(True))

    def _bear_write_initial(self) -> None:
        free = self._bear_pool.get_num_free_blocks()
        running, waiting = self._bear_state_cols(with_ids=self._bear_delta)
        now = time.monotonic()
        record = (
            RECORD_VERSION, 0, now, now, now, now, time.time(), False,
            _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, free, running, waiting, 0, None, 0,
            FULL_FIRST if self._bear_delta else FULL_MODE, None, self._bear_block_ops(True),
        )  # fmt: skip
        self._bear_writer.write(record)
        if self._bear_delta:
            self._bear_reset_lists()
            self._bear_force_full = FULL_NONE

    # ---- housekeeping (not the engine thread) -----------------------------------------------------
    def _bear_beat(self) -> None:
        """Stamp the heartbeat; notice readers' resync requests here, off the engine thread (a
        header read there costs a few µs of cache/TLB misses per step on a busy host)."""
        while not self._bear_stop.wait(HEARTBEAT_S):
            try:
                self._bear_writer.heartbeat()
                n = self._bear_writer.resync_requests()
            except ValueError:  # unmapped at shutdown
                return
            if n != self._bear_resync_seen:
                self._bear_resync_seen = n
                self._bear_resync = True

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
    """Sync-mode stock scheduler with snapshots (per-step deltas where supported)."""


def _async_class() -> type:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    class SnapshotAsyncScheduler(_SnapshotMixin, AsyncScheduler):
        """Async-mode stock scheduler with snapshots (full records; they carry the in-flight batch)."""

    return SnapshotAsyncScheduler


def make_scheduler(**kwargs: Any) -> Any:
    """The ``--scheduler-cls`` entry: vLLM calls it with keyword arguments only; picks the base
    class matching the resolved ``async_scheduling`` flag."""
    check_version()
    cfg = kwargs["vllm_config"].scheduler_config
    cls = _async_class() if getattr(cfg, "async_scheduling", False) else SnapshotScheduler
    return cls(**kwargs)


check_version()
