"""A pool of simulated vLLM instances in virtual time, routed by a policy.

Each instance is ``libbea.Engine`` — the same vLLM V1 scheduler the estimator replays — timed by
the sim engine's ground-truth roofline (never eq. 12) with noise, and fed true output lengths.
Snapshots are taken at every step boundary, as the snapshotter publishes them, and reach the
router ``delay_s`` late. The router side builds one ``Candidate`` per instance exactly as the live
router does (predictions, BEA with staleness compensation, eq. 8, load counters, observed TTFTs)
and asks the policy, so that what is evaluated is what runs.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from bear import libbea
from bear.evaluation.metrics import Outcome
from bear.evaluation.workload import QuerySet
from bear.router.policies import Candidate, Policy, QueryContext
from bear.sim.profile import Profile, load_profile
from bear.sim.roofline import RooflineModel

PAPER_POOL = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100-tp2")
MAX_TOKENS = 4096
HISTORY = 100  # observed TTFTs kept per instance for the percentile-based baseline


@dataclass
class InstanceSpec:
    name: str
    model: str  # predictor's model name
    profile: Profile

    @classmethod
    def from_profile(cls, profile_name: str) -> InstanceSpec:
        p = load_profile(profile_name)
        return cls(name=p.name, model=p.model.rsplit("/", 1)[-1], profile=p)


@dataclass
class Calibration:
    """What the router measures offline per instance (paper §5.1: profiling queries)."""

    beta: tuple[float, float, float, float]
    batch_mape: float
    theta: float  # prefill tokens/s (eq. 8)
    tpot: float  # s per output token
    throughput_rps: float


class SimInstance:
    def __init__(self, spec: InstanceSpec, seed: int, keep_snapshots_s: float) -> None:
        self.spec = spec
        self.engine = libbea.Engine(spec.profile.engine_config())
        self.roof = RooflineModel(spec.profile, seed=seed)
        self.snaps: deque[tuple[float, object]] = deque()
        self.keep_s = keep_snapshots_s
        self.busy = False
        self.pred_len: dict[str, int] = {}
        self.observed: deque[float] = deque(maxlen=HISTORY)
        self.records: list[tuple[float, float, float, float]] | None = None  # calibration
        self.busy_s = 0.0
        self.dispatched: deque[tuple[float, dict[str, int]]] = deque()  # the router's own sends
        self.snaps.append((0.0, libbea.engine_snapshot(self.engine, spec.name, spec.model, 0.0)))

    def boundary(self, t: float) -> float | None:
        """Between steps at time t: publish the snapshot, schedule the next step, return its end."""
        self.snaps.append((t, libbea.engine_snapshot(self.engine, self.spec.name, self.spec.model, t)))
        while len(self.snaps) > 2 and self.snaps[1][0] < t - self.keep_s:
            self.snaps.popleft()
        stats = libbea.engine_step_stats(self.engine)
        if stats is None:
            self.busy = False
            return None
        reqs, tokens, ctx, attn, dec_ctx, pre_work = stats
        dur = self.roof.noisy(self.roof.mean_time_aggregate(reqs, tokens, ctx, attn))
        if self.records is not None:
            self.records.append((float(tokens), float(dec_ctx), float(pre_work), dur))
        self.busy_s += dur
        self.busy = True
        return t + dur

    def snapshot_at(self, t: float) -> tuple[float, object]:
        """The newest snapshot published at or before t (the router's view)."""
        best = self.snaps[0]
        for s in self.snaps:
            if s[0] <= t:
                best = s
            else:
                break
        return best


class Cluster:
    """One run: a fresh pool, one policy, one arrival sequence."""

    def __init__(self, specs: list[InstanceSpec], calib: dict[str, Calibration], seed: int, delay_s: float = 0.0,
                 compensate: bool = True, use_dispatches: bool = True, arrival_fill: bool = True,
                 rate_window_s: float = 10.0) -> None:
        self.insts = [SimInstance(s, seed=seed * 1000 + k, keep_snapshots_s=delay_s + 1.0) for k, s in enumerate(specs)]
        self.calib = calib
        self.delay_s = delay_s
        self.compensate = compensate
        self.use_dispatches = use_dispatches
        self.arrival_fill = arrival_fill
        self.rate_window_s = rate_window_s
        self.events: list[tuple[float, int]] = []
        self.first_token: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.now = 0.0

    # ------------------------------------------------------------------ engine side
    def _complete(self, t: float, k: int) -> None:
        inst = self.insts[k]
        first, done = libbea.engine_finish_events(inst.engine)
        for rid in first:
            self.first_token[rid] = t
            arr = self.arrival.get(rid)
            if arr is not None:
                inst.observed.append(t - arr)
        for rid in done:
            inst.pred_len.pop(rid, None)
            self.finished_at[rid] = t
        end = inst.boundary(t)
        if end is not None:
            heapq.heappush(self.events, (end, k))

    def advance_to(self, t: float) -> None:
        while self.events and self.events[0][0] <= t:
            te, k = heapq.heappop(self.events)
            self.now = te
            self._complete(te, k)
        self.now = max(self.now, t)

    def submit(self, k: int, rid: str, prompt_tokens: int, true_out: int, pred_out: float, t: float) -> None:
        inst = self.insts[k]
        inst.engine.add(rid, int(prompt_tokens), MAX_TOKENS, int(max(1, true_out)), t)
        inst.pred_len[rid] = int(max(1, round(pred_out)))
        inst.dispatched.append((t, {"prompt_tokens": int(prompt_tokens), "max_tokens": MAX_TOKENS,
                                    "predicted_output": inst.pred_len[rid]}))
        while inst.dispatched and inst.dispatched[0][0] < t - max(self.delay_s + 2.0, self.rate_window_s):
            inst.dispatched.popleft()
        if not inst.busy:
            end = inst.boundary(t)
            if end is not None:
                heapq.heappush(self.events, (end, k))

    # ------------------------------------------------------------------ router side
    def candidates(self, qs: QuerySet, i: int, t: float, policy: Policy) -> list[Candidate]:
        out = []
        for inst in self.insts:
            col = qs.models.index(inst.spec.model)
            cal = self.calib[inst.spec.name]
            snap_t, snap = inst.snapshot_at(t - self.delay_s)
            snap.set_output_lengths(inst.pred_len)
            age = max(0.0, t - snap_t)
            p_tokens = int(qs.prompt_tokens[i, col])
            c = Candidate(
                instance=inst.spec.name, model=inst.spec.model,
                acc=float(qs.pred_acc[i, col]), cost=qs.pred_cost(i, col),
                out_len=float(qs.pred_len[i, col]), out_p90=float(qs.pred_p90[i, col]),
                n_running=snap.n_running, n_waiting=snap.n_waiting,
                pending_prefill_tokens=snap.pending_prefill_tokens(),
                prefill_tps=cal.theta, tpot=cal.tpot, throughput_rps=cal.throughput_rps,
            )
            if policy.name in ("routebalance",):
                c.pending_decode_tokens = float(snap.pending_decode_tokens())
            if policy.uses_history and inst.observed:
                obs = np.fromiter(inst.observed, float)
                c.observed_ttft_p50, c.observed_ttft_p90 = (float(v) for v in np.percentile(obs, [50, 90]))
            if policy.uses_ttft:
                # Requests this router sent after the snapshot was taken queue ahead of the query.
                ahead = [d for (td, d) in inst.dispatched if td > snap_t] if self.use_dispatches else None
                # Prompt tokens/s this router has been sending there: the expected later arrivals.
                span = min(self.rate_window_s, max(t, 1e-9))
                rate = (sum(d["prompt_tokens"] for (td, d) in inst.dispatched if td > t - span) / span
                        if self.arrival_fill else 0.0)
                res = libbea.estimate(snap, {"prompt_tokens": p_tokens, "max_tokens": MAX_TOKENS},
                                      beta=list(cal.beta), age_s=age if self.compensate else 0.0, ahead=ahead,
                                      arrival_tokens_per_s=rate)
                c.ttft = res["ttft_s"]
                c.ttft_method = "bea"
                c.ttft_prefill = libbea.prefill_throughput_ttft(c.pending_prefill_tokens, p_tokens, cal.theta)
            out.append(c)
        return out

    def run(self, qs: QuerySet, times: np.ndarray, targets: np.ndarray, policy: Policy, lam: float) -> list[Outcome]:
        self.arrival: dict[str, float] = {}
        chosen: list[tuple[int, int, float]] = []
        for i in range(len(qs)):
            t = float(times[i])
            self.advance_to(t)
            q = QueryContext(qs.ids[i], float(targets[i]), lam, int(qs.prompt_tokens[i, 0]))
            cands = self.candidates(qs, i, t, policy)
            d = policy.decide(q, cands)
            k = next(n for n, inst in enumerate(self.insts) if inst.spec.name == d.candidate.instance)
            col = qs.models.index(self.insts[k].spec.model)
            self.arrival[qs.ids[i]] = t
            self.submit(k, qs.ids[i], int(qs.prompt_tokens[i, col]), int(qs.true_output[i, col]),
                        float(qs.pred_len[i, col]), t)
            chosen.append((k, col, policy.latency_estimate(d.candidate)))
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
                predicted_ttft_s=est,
            ))
        return outcomes


def calibrate_pool(specs: list[InstanceSpec], qs: QuerySet, seed: int, light_rate: float = 3.0,
                   burst_rate: float = 40.0) -> dict[str, Calibration]:
    """Profile every instance alone, as an operator would before serving (paper §5.1): half the
    calibration queries at a light rate, then the other half as a burst that saturates it. Fits
    eq. 12's β by NNLS on every step, θ for eq. 8 from the steps with prefill work, TPOT from
    finished requests, and the saturated request throughput from the burst."""
    from bear.calibrator.fit import fit_arrays
    from bear.load.arrivals import arrivals

    n = len(qs)
    half = n // 2
    light = arrivals("poisson", light_rate, half, seed=seed) if half else np.zeros(0)
    burst_start = float(light[-1]) + 5.0 if half else 0.0
    times = np.concatenate([light, burst_start + arrivals("poisson", burst_rate, n - half, seed=seed + 1)])
    out: dict[str, Calibration] = {}
    for k, spec in enumerate(specs):
        cl = Cluster([spec], {}, seed=seed + 17 * k)
        inst = cl.insts[0]
        inst.records = []
        cl.arrival = {}
        col = qs.models.index(spec.model)
        for i in range(n):
            t = float(times[i])
            cl.advance_to(t)
            cl.arrival[qs.ids[i]] = t
            cl.submit(0, qs.ids[i], int(qs.prompt_tokens[i, col]), int(qs.true_output[i, col]), 1.0, t)
        while cl.events:
            te, kk = heapq.heappop(cl.events)
            cl._complete(te, kk)
        rec = np.array(inst.records)
        x = np.column_stack([np.ones(len(rec)), rec[:, 0], rec[:, 1], rec[:, 2]])
        y = rec[:, 3]
        fit = fit_arrays(x, y)
        pre = rec[:, 2] > 0
        theta = float((rec[pre, 0]).sum() / y[pre].sum()) if pre.any() else 1.0
        spans = []
        for i in range(n):
            rid = qs.ids[i]
            n_out = int(qs.true_output[i, col])
            if n_out > 1 and rid in cl.finished_at and rid in cl.first_token:
                spans.append((cl.finished_at[rid] - cl.first_token[rid]) / (n_out - 1))
        burst_ids = qs.ids[half:]
        burst_end = max(cl.finished_at.get(r, burst_start) for r in burst_ids) if burst_ids else burst_start + 1
        out[spec.name] = Calibration(beta=fit.beta, batch_mape=fit.mape, theta=theta,
                                     tpot=float(np.mean(spans)) if spans else 0.0,
                                     throughput_rps=len(burst_ids) / max(burst_end - burst_start, 1e-9))
    return out
