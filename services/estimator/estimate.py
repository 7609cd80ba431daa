"""The estimate of one query at its candidate instances, from what an estimator holds about them
— no I/O, so the worker (``bear.estimate``) and ``bear eval`` run exactly this.

Per candidate: a snapshot younger than ``max_age_s`` — counted from when the step the engine ran
from it should have ended (eq. 12), since a sync engine's state stays current while one long
prefill step runs and nothing is published — → BEA, the replay of vLLM's scheduler from
that snapshot with the replay's inputs below; an older one, or none, or one whose delta chain broke
(``resyncing``: never a BEA estimate from a state known to be behind), from an instance that is
alive (a recent snapshot or registry heartbeat) → the analytic fallback (paper eq. 13-15); else
down. Every row also carries the load counters of the snapshot held (for the load-based
policies).

The replay's inputs (``replay_inputs``), assembled in this one place:
  * the snapshot's age — residents run alone through the steps that start before the query
    arrives (staleness compensation; not for async-mode snapshots, which carry their in-flight
    batch);
  * the router's dispatches that reached the instance after the snapshot and that no snapshot
    has shown yet — they queue ahead of the query;
  * the rate of prompt tokens dispatched there recently, and the mean prompt — the later
    arrivals, which take the budget the query's steps leave over (charged as the median count of
    whole prompts: docs/estimator.md, "Arrival fill");
  * β of eq. 12 (the instance's calibration, nominal until the first fit);
  * the query's prefix-cache hit there (``prefix_hits``): computed from the prompt's token ids
    and the instance's mirrored cache with vLLM's block hashing when the router sent the ids of
    that instance's tokenizer and the mirror is in sync; else the hit the caller gave (0 unless
    it knows better). With token ids the prompt length is theirs (``tokens: exact``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bear import libbea
from bear.estimator.analytic import analytic_ttft
from bear.estimator.state import InstanceState, StateStore
from bear.prefix.hits import Target, prefix_hits
from bear.prefix.tracked_pool import keys_of
from bear.protocol.messages import Dispatch, EstimateCandidate, EstimateQuery, EstimateRow
from bear.protocol.token_ids import unpack


@dataclass(frozen=True)
class EstimatorConfig:
    max_age_s: float = 1.0  # older snapshots → analytic fallback
    down_after_s: float = 10.0  # no snapshot and no registry heartbeat for this long → down
    default_output_tokens: int = 256  # residents the router never announced
    overrun_fraction: float = 0.5  # residents already past their prediction get this much more
    compensate_staleness: bool = True  # replay the snapshot's age before inserting the query
    use_dispatches: bool = True  # queue the router's unseen dispatches ahead of the query
    arrival_fill: bool = True  # charge the later arrivals to the leftover budget
    arrival_median: bool = True  # … their median count of whole prompts (False: the expected tokens)
    dispatch_grace_s: float = 1.0  # a dispatch this much older than the snapshot may still be unseen
    rate_window_s: float = 10.0  # window of the prompt-token arrival rate
    executor_residents: int = 512  # replays over more residents run off the event loop
    # ... and so do those that must first build a tracked table of more blocks than this (a
    # state's first estimate: ~3 ms at 10,000 blocks, ~10 ms at 50,000; docs/estimator.md)
    executor_table_blocks: int = 4096
    use_prefix_hits: bool = True  # mirror the instances' prefix caches and hand the replay each hit
    # residents run to their median length given what they generated (the calibration's
    # length_sigma); off: on bear eval's seed 7301 it doubled the chosen instance's MAPE at 5 q/s
    condition_lengths: bool = False
    # > 0: the estimate is the median over this many replays, the residents' lengths drawn around
    # their predictions with the calibration's length_sigma (docs/estimator.md, "Output lengths drawn")
    length_draws: int = 15
    # a sync engine still in the step it ran from the held state past that step's eq. 12 end (by
    # at most this share of it): the query joins the next step, not the one after a phantom one
    step_overrun: float = 0.25
    # worker only (I/O):
    shards: int = 1  # estimator shards of the deployment (1: every worker serves every instance)
    shard: int = 0  # the shard this worker serves (0 … shards − 1)
    default_deadline_s: float = 1.0
    snapshot_pending_msgs: int = 256
    delta_pending_msgs: int = 65_536  # deltas are small; a slow consumer that drops one resyncs
    resync_timeout_s: float = 1.0
    worker_name: str = ""


@dataclass(frozen=True)
class ReplayInputs:
    age_s: float
    ahead: list[dict[str, int]]
    arrival_tokens_per_s: float
    beta: list[float]
    arrival_prompt_tokens: float = 0.0  # their mean prompt (> 0: the replay charges the median count)
    length_sigma: float = 0.0  # σ of the instance's answers around their predictions (0: run to the predictions)
    later: list[dict[str, Any]] | None = None  # the decomposition's oracle only: later arrivals known


def replay_inputs(st: InstanceState, now: float, cfg: EstimatorConfig,
                  keys_of: Callable[[bytes], list[int]] | None = None,
                  later: list[dict[str, Any]] | None = None) -> ReplayInputs:
    """Everything the replay of ``st``'s snapshot needs besides the query (module doc);
    ``keys_of``: token ids → block keys, for the dispatches queued ahead of a pool described
    block by block."""
    age = st.age(now) or 0.0
    compensate = cfg.compensate_staleness and not st.snap.async_scheduling
    tokens_per_s, per_s = (st.arrival_rate(now, cfg.rate_window_s) if cfg.arrival_fill and later is None
                           else (0.0, 0.0))
    if compensate and cfg.step_overrun > 0 and age > 0:
        step = st.step_in_flight_s(cfg)
        if 0 < step < age <= step * (1.0 + cfg.step_overrun):
            age = step * (1.0 - 1e-9)
    return ReplayInputs(
        age_s=max(0.0, age) if compensate else 0.0,
        ahead=st.ahead(cfg.dispatch_grace_s, keys_of) if cfg.use_dispatches else [],
        arrival_tokens_per_s=tokens_per_s,
        beta=st.calibration.coefficients,
        later=later,
        arrival_prompt_tokens=tokens_per_s / per_s if cfg.arrival_median and per_s > 0 else 0.0,
        length_sigma=(st.calibration.length_sigma or 0.0) if cfg.condition_lengths or cfg.length_draws > 0 else 0.0,
    )


@dataclass
class Job:
    """One BEA replay: the row it fills, the state it reads (``snap``: the snapshot as planned, even if
a newer one is installed while the replay runs off the loop) and the inputs."""

    row: EstimateRow
    state: InstanceState
    hit: int
    prompt_tokens: int
    inputs: ReplayInputs
    snap: Any = None
    keys: list[int] | None = None  # the prompt's block keys, for a snapshot that describes its pool block by block


@dataclass
class Plan:
    query: EstimateQuery
    rows: list[EstimateRow]
    jobs: list[Job] = field(default_factory=list)
    # dispatches queued ahead at a pool described block by block that came without token ids (a
    # router that did not tokenise): replayed by counts, their hits unknown (a metric counts them)
    unkeyed_ahead: int = 0

    @property
    def residents(self) -> int:
        return sum(j.snap.n_running + j.snap.n_waiting for j in self.jobs)

    @property
    def tables_to_build(self) -> int:
        """Blocks of the tracked tables its replays build first (their states' first estimate)."""
        return sum(j.snap.table_blocks for j in self.jobs if not j.snap.table_ready)

    def off_loop(self, cfg: EstimatorConfig) -> bool:
        """Whether its replays run in the executor: many residents, or a GPU-sized table to build
        (milliseconds of C++ that would otherwise stall the worker's event loop)."""
        return bool(self.jobs) and (self.residents > cfg.executor_residents
                                    or self.tables_to_build > cfg.executor_table_blocks)


@dataclass
class PromptAt:
    """The query's prompt as one instance sees it: length, whether it is exact, the hit."""

    tokens: int
    exact: bool
    hit: int
    how: str  # EstimateRow.prefix


def prompts_at(query: EstimateQuery, candidates: list[EstimateCandidate], store: StateStore,
               tokens: Mapping[str, Sequence[int]], cfg: EstimatorConfig) -> list[PromptAt]:
    """Each candidate's prompt length and prefix-cache hit (module doc)."""
    out: list[PromptAt] = []
    targets: dict[str, list[tuple[int, Target]]] = {}  # tokenizer → (candidate index, mirror)
    for k, c in enumerate(candidates):
        toks = tokens.get(c.tokenizer) if c.tokenizer is not None else None
        n = len(toks) if toks is not None else (query.prompt_tokens if c.prompt_tokens is None else c.prompt_tokens)
        pa = PromptAt(n, toks is not None, c.prefix_hit_tokens, "given" if c.prefix_hit_tokens else "none")
        out.append(pa)
        st = store.peek(c.instance)
        if query.skip_reading_prefix_cache:  # prompt logprobs: vLLM reads nothing from its cache
            pa.hit, pa.how = 0, "skipped"
        elif not cfg.use_prefix_hits:
            pa.hit, pa.how = 0, "none"
        elif st is None or st.prefix_spec is None:
            if st is not None and st.engine_config and st.engine_config.get("enable_prefix_caching") is False:
                pa.hit, pa.how = 0, "off"
        elif toks is None:
            pa.how = "no_tokens"
        elif not st.prefix_events or st.prefix.needs_resync:
            pa.how = "unsynced"
        else:
            targets.setdefault(c.tokenizer or "", []).append((k, Target(st.prefix, st.prefix_spec)))
    for tok_id, ts in targets.items():
        hits = prefix_hits(tokens[tok_id], [t for _, t in ts], store.hashers)
        for (k, _), h in zip(ts, hits, strict=True):
            out[k].hit, out[k].how = h, "mirror"
    return out


def plan(query: EstimateQuery, candidates: list[EstimateCandidate], store: StateStore, now: float,
         cfg: EstimatorConfig, on_parse: Any = None, tokens: Mapping[str, Sequence[int] | bytes] | None = None,
         later: Mapping[str, list[dict[str, Any]]] | None = None,
         ahead: Mapping[str, Sequence[Dispatch]] | None = None) -> Plan:
    """Rows for every candidate: analytic and down ones filled in, BEA ones left as jobs.
    ``on_parse(result)`` sees each lazy snapshot parse (True kept, False malformed); ``tokens``:
    the prompt's token ids per tokenizer id, either wire form (exact lengths, prefix hits);
    ``later``: per instance, the later arrivals known exactly (``bear eval``'s error
    decomposition only; a live estimator never knows them); ``ahead``: per instance, the
    caller's dispatches there (``EstimateRequest.ahead``), queued behind those the state holds."""
    p = Plan(query, [])
    ids = {tid: unpack(v) for tid, v in (tokens or {}).items()}  # packed bytes viewed, not copied
    for c, pa in zip(candidates, prompts_at(query, candidates, store, ids, cfg), strict=True):
        ptoks = pa.tokens
        row = EstimateRow(instance=c.instance, tokens="exact" if pa.exact else "estimated",
                          prefix_hit_tokens=pa.hit, prefix=pa.how)
        p.rows.append(row)
        st = store.peek(c.instance)
        if st is None:
            continue
        row.calibration = st.calibration.source if st.calibrated else "nominal"
        parsed = st.ensure_parsed()
        if parsed is not None and on_parse is not None:
            on_parse(parsed)
        age = st.age(now)
        row.age_s = age
        if age is not None and not st.gapped and (age <= cfg.max_age_s or age - st.step_in_flight_s(cfg) <= cfg.max_age_s):
            st.apply_lengths()
            keys = _keys_for(st, store) if st.prefix_spec is not None and st.snap.tracked_blocks > 0 else None
            inputs = replay_inputs(st, now, cfg, keys, None if later is None else later.get(c.instance, []))
            reserved = ahead.get(c.instance) if ahead and cfg.use_dispatches else None
            if reserved:
                inputs = dataclasses.replace(inputs, ahead=inputs.ahead + st.reserved(reserved, keys))
            row.ahead, row.pool_keyed = len(inputs.ahead), keys is not None
            if keys is not None:
                p.unkeyed_ahead += sum(1 for r in inputs.ahead if "block_keys" not in r)
            p.jobs.append(Job(row, st, pa.hit, ptoks, inputs, st.snap, _pool_keys(keys, c, ids)))
            continue
        if not ((age is not None and age <= cfg.down_after_s) or now - st.registry_heartbeat <= cfg.down_after_s):
            continue
        row.stale, row.method = True, "analytic"
        row.status = "resyncing" if st.gapped else "no_snapshot" if age is None else "stale"
        ttft = analytic_ttft(st, max(1, ptoks - pa.hit), now)
        row.ttft_s = ttft if math.isfinite(ttft) else None
        if not math.isfinite(ttft):
            row.status = "overloaded"
        if st.snap is not None:
            st.apply_lengths()
            load_counters(row, st, cfg)  # the last known load, aged (``age_s`` says how much)
    return p


def _keys_for(st: InstanceState, store: StateStore) -> Callable[[Sequence[int] | bytes], list[int]]:
    """Token ids (either wire form) → their full blocks' keys, with ``st``'s hashing."""
    spec = st.prefix_spec
    assert spec is not None
    hasher = store.hashers.get(spec)

    def keys(toks: Sequence[int] | bytes) -> list[int]:
        view = unpack(toks) if isinstance(toks, bytes | bytearray) else toks
        return keys_of(hasher.hashes(view, len(view) // spec.block_size))

    return keys


def _pool_keys(keys: Callable[[Sequence[int] | bytes], list[int]] | None, c: EstimateCandidate,
               ids: Mapping[str, Sequence[int]]) -> list[int] | None:
    """The prompt's block keys where the snapshot describes the pool block by block (``keys`` is
    set: its ``tracked_blocks``, ``bear.prefix.tracked_pool``): the replay then finds the hit from
    the pool itself, evictions ahead of the query included (None: the count model, with the
    mirror's hit)."""
    toks = ids.get(c.tokenizer) if c.tokenizer is not None else None
    return None if keys is None or toks is None else keys(toks)


def run_jobs(p: Plan, cfg: EstimatorConfig) -> list[tuple[float, int, str]]:
    """The BEA replays of a plan in one libbea call, each candidate with its own prompt length and
    hit (libbea only: safe off the event loop while ``in_use`` is held)."""
    if not p.jobs:
        return []
    q = p.query
    qds = [{"id": q.id, "prompt_tokens": max(1, j.prompt_tokens), "max_tokens": q.max_tokens,
            "prefix_hit_tokens": j.hit, "priority": q.priority} for j in p.jobs]
    for qd, j in zip(qds, p.jobs, strict=True):
        if j.keys:
            qd["block_keys"] = j.keys
        if q.sequences > 1:
            qd["sequences"] = q.sequences
        if q.skip_reading_prefix_cache:
            qd["skip_reading_prefix_cache"] = True
    laters = [j.inputs.later or [] for j in p.jobs] if any(j.inputs.later for j in p.jobs) else None
    try:
        res = libbea.estimate_many(
            [j.snap for j in p.jobs], qds, [j.inputs.beta for j in p.jobs],
            default_output_tokens=cfg.default_output_tokens, overrun_fraction=cfg.overrun_fraction,
            ages=[j.inputs.age_s for j in p.jobs], aheads=[j.inputs.ahead for j in p.jobs],
            arrival_rates=[j.inputs.arrival_tokens_per_s for j in p.jobs], laters=laters,
            arrival_prompts=[j.inputs.arrival_prompt_tokens for j in p.jobs],
            length_sigmas=[j.inputs.length_sigma for j in p.jobs], length_draws=cfg.length_draws)
    except ValueError:  # one bad instance must not sink the others: one at a time
        res = [_one(j, qd, cfg) for j, qd in zip(p.jobs, qds, strict=True)]
    return list(res)


def _one(j: Job, qd: dict[str, Any], cfg: EstimatorConfig) -> tuple[float, int, str]:
    try:
        r = libbea.estimate(j.snap, qd, beta=j.inputs.beta, default_output_tokens=cfg.default_output_tokens,
                            overrun_fraction=cfg.overrun_fraction, age_s=j.inputs.age_s, ahead=j.inputs.ahead,
                            arrival_tokens_per_s=j.inputs.arrival_tokens_per_s,
                            arrival_prompt_tokens=j.inputs.arrival_prompt_tokens,
                            length_sigma=j.inputs.length_sigma, length_draws=cfg.length_draws)
        return float(r["ttft_s"]), int(r["n_batches"]), str(r["status"])
    except ValueError:
        return math.inf, 0, "error"


def finish(p: Plan, results: list[tuple[float, int, str]], cfg: EstimatorConfig) -> list[EstimateRow]:
    for j, (ttft, n_batches, status) in zip(p.jobs, results, strict=True):
        row = j.row
        row.method = "bea" if status != "error" else "none"
        row.status = status
        row.n_batches = n_batches
        row.ttft_s = ttft if math.isfinite(ttft) else None
        load_counters(row, j.state, cfg)
    return p.rows


def estimate(query: EstimateQuery, candidates: list[EstimateCandidate], store: StateStore, now: float,
             cfg: EstimatorConfig, tokens: Mapping[str, Sequence[int] | bytes] | None = None,
             later: Mapping[str, list[dict[str, Any]]] | None = None,
             ahead: Mapping[str, Sequence[Dispatch]] | None = None) -> list[EstimateRow]:
    """Plan, replay and fill in one go (``bear eval``, tests)."""
    p = plan(query, candidates, store, now, cfg, tokens=tokens, later=later, ahead=ahead)
    return finish(p, run_jobs(p, cfg), cfg)


def load_counters(row: EstimateRow, st: InstanceState, cfg: EstimatorConfig) -> None:
    """The held snapshot's load counters, for the load-based policies."""
    snap = st.snap
    row.n_running = int(snap.n_running)
    row.n_waiting = int(snap.n_waiting)
    row.pending_prefill_tokens = int(snap.pending_prefill_tokens())
    row.pending_decode_tokens = int(snap.pending_decode_tokens(cfg.default_output_tokens))
    row.block_size, row.kv_blocks_used, row.kv_blocks_total = st.kv_blocks()
