"""A pool of simulated vLLM instances in virtual time, routed by a policy — through the decision
code that runs live.

Each instance is ``libbea.Engine`` (the vLLM V1 scheduler the estimator replays) timed by the sim
engine's ground-truth roofline (never eq. 12) with noise, and fed true output lengths. What the
router side sees goes through the same pieces as on NATS:

* snapshots are published at every step boundary (and re-published while idle, every
  ``heartbeat_s``, as ``bear.instance.publisher`` does) and reach the estimator ``delay_s`` late;
* the estimator's state (``bear.estimator.state.InstanceState``) gets those snapshots, the
  router's dispatches and the calibration, and ``bear.estimator.estimate.estimate`` answers
  exactly as a worker does;
* the router's view of each instance (``bear.router.registry.InstanceInfo``: prices, θ, observed
  TTFT/TPOT/throughput from completed queries) and ``bear.router.candidates.build_candidates``
  turn predictions and estimate rows into candidates; ``bear.router.decide.decide`` runs the
  router's profile on them (its request filters, then the policy; the estimator is asked only
  when the profile reads its rows, as live); the dispatch message is the router's own
  (``dispatch_for``).

Decisions are sequenced by default: each sees every dispatch before it, even one made at the same
virtual instant (the live router's behaviour since issue 39). ``decisions="concurrent"`` models the
herd the live router had before: the queries that arrive within ``window_s`` of a group's first
(0: at the same instant) are all estimated on the view of that moment, none of them seeing the
others' dispatches or the snapshots they caused, and their dispatches reach the estimator together
after the last of them is decided.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np

from bear import libbea
from bear.calibrator.fit import BatchWindow, RefitPolicy, refit_arrays, robust_fit
from bear.calibrator.lengths import LengthWindow
from bear.calibrator.ttft_error import ratio_quantiles
from bear.estimator.estimate import EstimatorConfig, estimate
from bear.estimator.state import StateStore
from bear.evaluation.learned import Sample
from bear.evaluation.learned import features as learned_features
from bear.evaluation.workload import QuerySet
from bear.load.metrics import Outcome
from bear.predictor.synth import MAX_OUTPUT_TOKENS
from bear.protocol.batch import BatchRecord
from bear.protocol.messages import Calibration, Dispatch, EstimateCandidate, EstimateQuery, EstimateRow
from bear.router.candidates import ModelPrediction, build_candidates, dispatch_for
from bear.router.decide import Refused, RoutingProfile, decide, profile_for
from bear.router.policies import Candidate, Decision, Policy, QueryContext
from bear.router.policies.on_time import p_on_time
from bear.router.registry import InstanceInfo
from bear.router.selection import STAGE_EVERY, Cheap, Selection, SelectionConfig, select
from bear.sim.profile import Profile, load_profile
from bear.sim.roofline import RooflineModel

PAPER_POOL = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100-tp2")
MAX_TOKENS = MAX_OUTPUT_TOKENS  # every query's max_tokens
HEARTBEAT_S = 0.5  # the instance publisher's idle re-publication period
DECISIONS = ("sequenced", "concurrent")  # what a decision sees of the decisions made beside it


@dataclass(frozen=True)
class Verdict:
    """What the policy said of the instance it chose: feasible (predicted on time by its own test)
    and, where the instance had published its TTFT error deciles and the policy reads them, the
    predicted P(on time) there (nan: none) — the reliability figures' input."""

    feasible: bool
    p_on_time: float


@dataclass
class InstanceSpec:
    name: str
    model: str  # predictor's model name
    profile: Profile

    @classmethod
    def from_profile(cls, profile_name: str) -> InstanceSpec:
        p = load_profile(profile_name)
        return cls(name=p.name, model=p.model.rsplit("/", 1)[-1], profile=p)

    @property
    def max_model_len(self) -> int:
        """The engine's context, as the instance registers it (the router's context filter reads it)."""
        return int(self.profile.engine_config()["max_model_len"])

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the instance accepts with ``max_tokens`` = MAX_TOKENS."""
        return self.max_model_len - MAX_TOKENS


@dataclass(frozen=True)
class Oracle:
    """Inputs the estimator is handed exactly, to measure what each source of error costs (``bear
    eval --experiment decomposition``); all off in every other run."""

    lengths: bool = False  # every dispatch carries the query's true output length
    step_times: bool = False  # the engines run on eq. 12 with their calibrated β, noise-free
    arrivals: bool = False  # the replay knows the later arrivals (one instance only)


LATER_HORIZON_S = 60.0  # the arrivals oracle hands the replay the arrivals this far ahead


@dataclass
class _Live:
    arrival: float
    first: float | None = None
    true_out: int = 1


@dataclass
class SimInstance:
    """One simulated engine and what it has published."""

    spec: InstanceSpec
    seed: int
    keep_s: float
    engine: libbea.Engine = field(init=False)
    roof: RooflineModel = field(init=False)
    snaps: deque[tuple[float, object]] = field(default_factory=deque)  # (capture time, snapshot)
    busy: bool = False
    idle_since: float = 0.0
    records: list[BatchRecord] | None = None  # bear.batch/1 records, when calibrating
    busy_s: float = 0.0
    running_s: float = 0.0  # ∫ running requests dt over busy time (mean concurrency = running_s / busy_s)
    arrived: list[str] = field(default_factory=list)  # added since the last published state
    shown: deque[tuple[float, str]] = field(default_factory=deque)  # (first state that holds it, id), undelivered
    beta: list[float] | None = None  # set: steps take eq. 12's time with these coefficients, no noise (Oracle)
    # the batch records the calibrator receives: (Σn, Σ decode context, Σ prefill work, prefill tokens, seconds)
    batches: BatchWindow[tuple[float, float, float, float, float]] | None = None

    def __post_init__(self) -> None:
        self.engine = libbea.Engine(self.spec.profile.engine_config())
        self.roof = RooflineModel(self.spec.profile, seed=self.seed)
        self._publish(0.0)

    def _publish(self, t: float) -> None:
        for rid in self.arrived:
            self.shown.append((t, rid))
        self.arrived.clear()
        self.snaps.append((t, libbea.engine_snapshot(self.engine, self.spec.name, self.spec.model, t)))
        while len(self.snaps) > 2 and self.snaps[1][0] < t - self.keep_s:
            self.snaps.popleft()

    def boundary(self, t: float) -> float | None:
        """Between steps at time t: publish the snapshot, schedule the next step, return its end."""
        self._publish(t)
        if self.records is not None:
            dur = self._step_with_record()
        else:
            stats = libbea.engine_step_stats(self.engine)
            if stats is None:
                dur = None
            elif self.beta is not None:
                b = self.beta
                dur = b[0] + b[1] * stats[1] + b[2] * stats[4] + b[3] * stats[5]
                if len(b) == 8:  # a roofline: the larger line
                    dur = max(dur, b[4] + b[5] * stats[1] + b[6] * stats[4] + b[7] * stats[5])
            else:
                dur = self.roof.noisy(self.roof.mean_time_aggregate(*stats[:4]))
            if dur is not None and self.batches is not None:
                self.batches.add((stats[1], stats[4], stats[5], stats[6], dur), stats[6] > 0)
        if dur is None:
            self.busy, self.idle_since = False, t
            return None
        self.busy_s += dur
        self.running_s += self.snaps[-1][1].n_running * dur
        self.busy = True
        return t + dur

    def _step_with_record(self) -> float | None:
        batch = self.engine.step()
        if not batch:
            if self.records:
                self.records[-1].duration_s = None  # the engine went idle: no loop period
            return None
        dur = self.roof.sample([(n, ctx) for _, n, ctx, _ in batch])
        assert self.records is not None
        self.records.append(BatchRecord(instance=self.spec.name, seq=self.engine.seq, duration_s=dur,
                                        items=[{"n": n, "context": c, "decode": d} for _, n, c, d in batch]))
        return dur

    def visible(self, t: float) -> tuple[float, object]:
        """The newest snapshot published at or before t, with the time it carries (an idle
        engine's last snapshot is re-published every HEARTBEAT_S with a fresh time)."""
        best = self.snaps[0]
        for s in self.snaps:
            if s[0] <= t:
                best = s
            else:
                break
        snap_t, snap = best
        if not self.busy and snap is self.snaps[-1][1] and t > self.idle_since:
            snap_t = max(snap_t, self.idle_since + math.floor((t - self.idle_since) / HEARTBEAT_S) * HEARTBEAT_S)
        return snap_t, snap


class Cluster:
    """One run: a fresh pool, one policy, one arrival sequence."""

    def __init__(self, specs: list[InstanceSpec], calib: dict[str, Calibration], seed: int, delay_s: float = 0.0,
                 estimator: EstimatorConfig | None = None, prices: dict[str, tuple[float, float]] | None = None,
                 history: dict[str, list[tuple[float, float | None]]] | None = None,
                 oracle: Oracle | None = None, refit: RefitPolicy | None = RefitPolicy(),
                 decisions: str = "sequenced", window_s: float = 0.0,
                 selection: SelectionConfig | None = None) -> None:
        """``history``: (TTFT, TPOT) per instance observed before the run (the profiling runs), so
        that the policies that read observed latencies start from what an operator has measured;
        ``oracle``: inputs handed to the estimator exactly (the error decomposition); ``refit``:
        the calibrator's online refits of β and θ from the run's own batches, as ``bear
        calibrator`` makes them live (None: the profiled calibration throughout; never under the
        step-times oracle, whose engines run on the profiled β); ``decisions``/``window_s``: what a
        decision sees of the others made beside it (module docstring); ``selection``: the cheap
        first stage (``bear.router.selection``) before the replays, for the policies that read
        estimates (None: every instance replayed)."""
        if decisions not in DECISIONS:
            raise ValueError(f"decisions must be one of {', '.join(DECISIONS)}, not {decisions!r}")
        if window_s < 0 or (window_s > 0 and decisions == "sequenced"):
            raise ValueError("window_s: >= 0, and only for concurrent decisions")
        self.decisions, self.window_s = decisions, window_s
        self.selection = selection
        self.selections: dict[str, Selection] = {}  # every decision's stage, by query id
        self.decide_cpu_s = 0.0  # process CPU seconds inside decide (the decision path, per core)
        self.cfg = estimator or EstimatorConfig()
        self.oracle = oracle or Oracle()
        if self.oracle.arrivals and len(specs) != 1:
            raise ValueError("the arrivals oracle needs one instance (a pool's later routing is not known)")
        self.insts = [SimInstance(s, seed=seed * 1000 + k, keep_s=delay_s + 1.0) for k, s in enumerate(specs)]
        if self.oracle.step_times:
            refit = None
            for inst in self.insts:
                inst.beta = calib[inst.spec.name].coefficients
        self.refit = refit
        self.priors = dict(calib)  # what profiling fitted: the online refit rescales it (bear calibrator's rule)
        self.lengths = [LengthWindow() for _ in specs]  # answers' lengths against the dispatches' predictions
        self._predicted: dict[str, int] = {}
        self.ttft_pairs: list[deque[tuple[float, float]]] = [deque(maxlen=500) for _ in specs]
        self._estimated: dict[str, float] = {}  # the chosen instance's BEA estimate, until its first token
        self.next_refit = refit.refit_s if refit is not None else math.inf
        if refit is not None:
            for inst in self.insts:
                inst.batches = BatchWindow(refit.window)
        self.delay_s = delay_s
        self.store = StateStore()
        self.infos: list[InstanceInfo] = []
        for s in specs:
            cal = calib.get(s.name)
            st = self.store.get(s.name)
            pin, pout = (prices or {}).get(s.model, (0.0, 0.0))
            info = InstanceInfo(s.name, model=s.model, base_url="sim://", price_in=pin, price_out=pout,
                                predictor_model=s.model, max_model_len=s.max_model_len)
            if cal is not None:
                st.set_calibration(cal)
                info.calibration = cal
            for ttft, tpot in (history or {}).get(s.name, []):
                info.obs.add_outcome(0.0, ttft, tpot, False)
            self.infos.append(info)
        self.events: list[tuple[float, int]] = []
        # every decision's candidates and each instance's free KV blocks then, when set to []
        self.trace: list[tuple[list[Candidate], dict[str, int]]] | None = None
        # every query's learned-predictor sample at its chosen instance, when set to []
        self.samples: list[Sample] | None = None
        # every BEA-asking decision's estimate rows, by query id, when set to {}
        self.rows: dict[str, dict[str, EstimateRow]] | None = None
        self.verdicts: dict[str, Verdict] = {}  # every decision's, by query id
        self._features: dict[str, tuple[float, ...]] = {}
        self.live: dict[str, _Live] = {}
        self.first_token: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.now = 0.0

    # ------------------------------------------------------------------ engine side
    def _complete(self, t: float, k: int) -> None:
        inst, info = self.insts[k], self.infos[k]
        first, done = libbea.engine_finish_events(inst.engine)
        for rid in first:
            self.first_token[rid] = t
            if rid in self.live:
                self.live[rid].first = t
        for rid in done:
            self.finished_at[rid] = t
            q = self.live.pop(rid, None)
            if q is not None and q.first is not None:  # what the router's outcome event carries
                tpot = (t - q.first) / (q.true_out - 1) if q.true_out > 1 else None
                info.obs.add_outcome(t, q.first - q.arrival, tpot, True)
                predicted = self._predicted.pop(rid, None)
                if predicted is not None:  # … and what the calibrator learns the length scale from
                    self.lengths[k].add(q.true_out, predicted)
                est = self._estimated.pop(rid, None)
                if est is not None:  # … and the TTFT error distribution (BEA estimates only)
                    self.ttft_pairs[k].append((est, q.first - q.arrival))
        end = inst.boundary(t)
        if end is not None:
            heapq.heappush(self.events, (end, k))

    def advance_to(self, t: float) -> None:
        while self.events and self.events[0][0] <= t:
            te, k = heapq.heappop(self.events)
            self.now = te
            self._complete(te, k)
            if te >= self.next_refit:
                self._refit(te)
        self.now = max(self.now, t)
        if t >= self.next_refit:
            self._refit(t)

    def _refit(self, t: float) -> None:
        """The calibrator's pass at t (``RefitPolicy``): a new fit for every instance with enough
        records and something new, installed where the estimator and the router read it."""
        assert self.refit is not None
        self.next_refit = t + self.refit.refit_s
        for inst, info in zip(self.insts, self.infos, strict=True):
            b = inst.batches
            if b is None or len(b) < self.refit.min_records or b.new == 0:
                continue
            b.new = 0
            a = np.asarray(b.batches(), dtype=float)
            x = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1], a[:, 2]])
            try:
                cal = refit_arrays(x, a[:, 4], a[:, 3], inst.spec.name, prior=self.priors.get(inst.spec.name))
            except ValueError:  # the calibrator logs and keeps the last fit
                continue
            lengths = self.lengths[self.insts.index(inst)]
            cal = msgspec.structs.replace(cal, length_scale=lengths.scale(), length_sigma=lengths.sigma(),
                                          ttft_ratio_q=ratio_quantiles(self.ttft_pairs[self.insts.index(inst)]))
            st = self.store.get(inst.spec.name)
            st.set_calibration(cal)
            info.calibration = cal

    def submit(self, k: int, rid: str, prompt_tokens: int, true_out: int, t: float) -> None:
        inst = self.insts[k]
        true_out = int(max(1, min(true_out, MAX_TOKENS)))
        inst.engine.add(rid, int(prompt_tokens), MAX_TOKENS, true_out, t)
        inst.arrived.append(rid)
        self.live[rid] = _Live(arrival=t, true_out=true_out)
        if not inst.busy:
            end = inst.boundary(t)
            if end is not None:
                heapq.heappush(self.events, (end, k))

    # ------------------------------------------------------------------ router side
    def _deliver_snapshots(self, t: float) -> None:
        """What reached the estimator by t: each instance's newest snapshot ``delay_s`` late, and
        every request some state published by then has shown — a live estimator applies every
        step's delta and so sees each request, even one that came and went between two queries
        (else its dispatch would stay "ahead" of the next query for ``dispatch_grace_s``)."""
        for inst in self.insts:
            snap_t, snap = inst.visible(t - self.delay_s)
            st = self.store.get(inst.spec.name)
            shown = inst.shown
            if shown and shown[0][0] <= t - self.delay_s:
                ids = []
                while shown and shown[0][0] <= t - self.delay_s:
                    ids.append(shown.popleft()[1])
                st.see(ids)
            if st.snap is not snap or snap_t > st.snap_time:
                st.install(snap, snap_t, t)

    def decide(self, qs: QuerySet, i: int, t: float, target_s: float, policy: Policy, lam: float, *,
               deliver: bool = True, held: list[tuple[str, Dispatch]] | None = None) -> tuple[int, float]:
        """Route query i at time t as the live router does; returns (instance index, the policy's
        latency estimate for it). ``deliver`` False: on the estimator's view as it is (what reached
        it since is not delivered); ``held``: the dispatch is appended there, not applied (a
        concurrent group's, applied when the group is decided)."""
        if deliver:
            self._deliver_snapshots(t)
        preds = {m: ModelPrediction(acc=float(qs.pred_acc[i, j]), out_len=float(qs.pred_len[i, j]),
                                    out_p90=float(qs.pred_p90[i, j]), prompt_tokens=int(qs.prompt_tokens[i, j]),
                                    cost_usd=qs.pred_cost(i, j) / 1e6) for j, m in enumerate(qs.models)}
        query = EstimateQuery(id=qs.ids[i], prompt_tokens=int(qs.prompt_tokens[i, 0]), max_tokens=MAX_TOKENS)
        ctx = QueryContext(qs.ids[i], target_s, lam, query.prompt_tokens,
                           context_tokens=query.prompt_tokens + MAX_TOKENS)  # what the client asks for
        profile = profile_for(policy)
        rows = None
        infos = self.infos
        sel = Selection([], len(infos), "none")
        if profile.needs_estimate or self.samples is not None:  # the learned samples' features are rows
            sel = Selection([info.id for info in infos], len(infos), STAGE_EVERY)
            if self.selection is not None and profile.needs_estimate:
                sel = select([self._cheap(info, preds) for info in infos], self.selection)
                if sel.replayed < len(infos):
                    keep = set(sel.replay)
                    infos = [info for info in infos if info.id in keep]
            cands = [EstimateCandidate(instance=info.id, prompt_tokens=preds[info.predictor_model].prompt_tokens)
                     for info in infos]
            rows = {r.instance: r for r in estimate(query, cands, self.store, t, self.cfg,
                                                    later=self._later(qs, i, t))}
        self.selections[qs.ids[i]] = sel
        cs, used = build_candidates(query.prompt_tokens, infos, preds, rows, t,
                                    default_output_tokens=self.cfg.default_output_tokens)
        d = self.decided(profile, ctx, cs, t)
        c = d.candidate
        reads_p = getattr(policy, "uses_error_distribution", False) and c.ttft_ratio_q is not None
        self.verdicts[qs.ids[i]] = Verdict(
            d.feasible, p_on_time(policy.latency_estimate(c), target_s, c.ttft_ratio_q) if reads_p else math.nan)
        if self.rows is not None and rows is not None:
            self.rows[qs.ids[i]] = rows
        if self.trace is not None:
            self.trace.append((cs, {inst.spec.name: int(self.store.get(inst.spec.name).snap.free_blocks)
                                    for inst in self.insts}))
        k = next(n for n, info in enumerate(self.infos) if info.id == d.candidate.instance)
        sent = used[self.infos[k].id]
        if rows is not None and self.samples is not None:
            self._features[qs.ids[i]] = learned_features(rows[self.infos[k].id], sent.prompt_tokens)
        if self.oracle.lengths:
            sent = dataclasses.replace(sent, out_len=float(self._true_out(qs, i, self.insts[k].spec.model)))
        if d.candidate.ttft_method == "bea" and math.isfinite(d.candidate.ttft):
            self._estimated[qs.ids[i]] = d.candidate.ttft
        dispatch = dispatch_for(qs.ids[i], qs.ids[i], sent, MAX_TOKENS, t)
        if held is None:
            self.store.get(self.infos[k].id).on_dispatch(dispatch)
        else:
            held.append((self.infos[k].id, dispatch))
        self._predicted[qs.ids[i]] = dispatch.predicted_output_tokens
        return k, policy.latency_estimate(d.candidate)

    def _cheap(self, info: InstanceInfo, preds: dict[str, ModelPrediction]) -> Cheap:
        """The selection's cheap signals of one instance: the load counters the estimator holds
        (the snapshot's queued prefill) plus the dispatches there no snapshot has shown yet."""
        st = self.store.get(info.id)
        pending = int(st.snap.pending_prefill_tokens()) + sum(
            int(r["prompt_tokens"]) for r in st.ahead(self.cfg.dispatch_grace_s))
        return Cheap(info.id, info.predictor_model, pending, preds[info.predictor_model].prompt_tokens,
                     prefill_tps=info.calibration.prefill_tps())

    @staticmethod
    def decided(profile: RoutingProfile, ctx: QueryContext, cands: list[Candidate], t: float) -> Decision:
        """``decide`` as the router runs it; a refusal is an error here (the workload's prompts
        are cut to fit every instance's context with MAX_TOKENS, and no query has a deadline)."""
        d = decide(profile, ctx, cands, t)
        if isinstance(d, Refused):
            raise ValueError(f"query {ctx.query_id} refused: {d.message}")
        return d

    @staticmethod
    def _true_out(qs: QuerySet, i: int, model: str) -> int:
        return int(max(1, min(qs.true_output[i, qs.models.index(model)], MAX_TOKENS)))

    def _later(self, qs: QuerySet, i: int, t: float) -> dict[str, list[dict]] | None:
        """The arrivals oracle: the queries after i that reach the (only) instance within
        LATER_HORIZON_S, as the replay's ``later`` requests."""
        if not self.oracle.arrivals:
            return None
        spec = self.insts[0].spec
        col = qs.models.index(spec.model)
        out = []
        for j in range(i + 1, len(qs)):
            after = float(self._times[j]) - t
            if after > LATER_HORIZON_S:
                break
            out.append({"id": qs.ids[j], "prompt_tokens": int(qs.prompt_tokens[j, col]), "max_tokens": MAX_TOKENS,
                        "predicted_output": (self._true_out(qs, j, spec.model) if self.oracle.lengths
                                             else int(max(1, min(round(qs.pred_len[j, col]), MAX_TOKENS)))),
                        "after_s": max(0.0, after)})
        return {spec.name: out}

    def groups(self, times: np.ndarray) -> list[range]:
        """The arrivals decided together: each alone when sequenced; when concurrent, each run of
        arrivals within ``window_s`` of the run's first."""
        n = len(times)
        if self.decisions == "sequenced":
            return [range(i, i + 1) for i in range(n)]
        out, i = [], 0
        while i < n:
            j = i + 1
            while j < n and float(times[j]) - float(times[i]) <= self.window_s:
                j += 1
            out.append(range(i, j))
            i = j
        return out

    def run(self, qs: QuerySet, times: np.ndarray, targets: np.ndarray, policy: Policy, lam: float) -> list[Outcome]:
        self.arrival: dict[str, float] = {}
        self._times = times
        chosen: list[tuple[int, int, float]] = []
        for group in self.groups(times):
            held: list[tuple[str, Dispatch]] | None = None if self.decisions == "sequenced" else []
            for i in group:
                t = float(times[i])
                self.advance_to(t)
                c0 = time.process_time()
                k, est = self.decide(qs, i, t, float(targets[i]), policy, lam, deliver=i == group[0], held=held)
                self.decide_cpu_s += time.process_time() - c0
                col = qs.models.index(self.insts[k].spec.model)
                self.arrival[qs.ids[i]] = t
                self.submit(k, qs.ids[i], int(qs.prompt_tokens[i, col]), int(qs.true_output[i, col]), t)
                chosen.append((k, col, est))
            for inst_id, dispatch in held or ():
                self.store.get(inst_id).on_dispatch(dispatch)
        # Run on until every query has its first token (or nothing is left to run).
        while self.events and len(self.first_token) < len(qs):
            te, k = heapq.heappop(self.events)
            self._complete(te, k)
        outcomes = []
        for i, (k, col, est) in enumerate(chosen):
            rid = qs.ids[i]
            ttft = self.first_token.get(rid, math.inf) - self.arrival[rid]
            outcomes.append(Outcome(
                query_id=rid, task=qs.tasks[i], instance=self.insts[k].spec.name, model=self.insts[k].spec.model,
                target_s=float(targets[i]), ttft_s=ttft, utility=qs.true_utility(i, col, lam),
                predicted_ttft_s=est, stage=self.selections[rid].stage, considered=self.selections[rid].considered,
                replayed=self.selections[rid].replayed,
            ))
            if self.samples is not None:
                t0 = self.arrival[rid]
                self.samples.append(Sample(self.insts[k].spec.name, t0, self._features[rid],
                                           self.first_token.get(rid, math.inf), ttft))
        return outcomes


@dataclass
class Profiling:
    """What profiling each instance alone gives: its calibration (β, θ) and the (TTFT, TPOT) of
    the light phase's queries."""

    calibration: dict[str, Calibration]
    history: dict[str, list[tuple[float, float | None]]]


def calibrate_pool(specs: list[InstanceSpec], qs: QuerySet, seed: int, light_rate: float = 3.0,
                   burst_rate: float = 40.0) -> Profiling:
    """Profile every instance alone, as an operator would before serving (paper §5.1): half the
    calibration queries at a light rate, then the other half as a burst that saturates it; the
    batch records go through the online calibrator's own fit (``robust_fit``: β and θ)."""
    from bear.load.arrivals import arrivals

    n = len(qs)
    half = n // 2
    light = arrivals("poisson", light_rate, half, seed=seed) if half else np.zeros(0)
    burst_start = float(light[-1]) + 5.0 if half else 0.0
    times = np.concatenate([light, burst_start + arrivals("poisson", burst_rate, n - half, seed=seed + 1)])
    out: dict[str, Calibration] = {}
    history: dict[str, list[tuple[float, float | None]]] = {}
    for k, spec in enumerate(specs):
        cl = Cluster([spec], {}, seed=seed + 17 * k)
        inst = cl.insts[0]
        inst.records = []
        col = qs.models.index(spec.model)
        for i in range(n):
            t = float(times[i])
            cl.advance_to(t)
            cl.submit(0, qs.ids[i], int(qs.prompt_tokens[i, col]), int(qs.true_output[i, col]), t)
        while cl.events:
            te, kk = heapq.heappop(cl.events)
            cl._complete(te, kk)
        out[spec.name] = msgspec.structs.replace(robust_fit(inst.records, spec.name), source="profiled")
        hist = []
        for i in range(half):
            rid, n_out = qs.ids[i], int(min(qs.true_output[i, col], MAX_TOKENS))
            first, done = cl.first_token[rid], cl.finished_at[rid]
            hist.append((first - float(times[i]), (done - first) / (n_out - 1) if n_out > 1 else None))
        history[spec.name] = hist
    return Profiling(out, history)
