"""``bear eval --experiment prefix``: routing where prefixes matter — multi-turn chat sessions
behind a shared system prompt (``prefix_workload``) on the paper's pool, with prefix caching on
in every simulated engine.

Each engine holds a block-level prefix cache (vLLM's: blocks named by vLLM's block hashes of the
token ids, hits at admission, LRU eviction from the free queue) and publishes what every step
did to it through the instance publisher's KV stream (``bear.instance.kv_stream``); the messages
are encoded, delayed like snapshots and decoded into the estimator's mirror, the same messages a
live estimator gets on ``bear.kv.<id>``. Decisions go through the live code: the estimate with
the prompt's token ids (``bear.estimator.estimate``: exact lengths, mirrored hits into the
replay), ``build_candidates``, ``bear.router.decide`` (the request filters, the policy).

Compared (docs/prefix.md): BEAR with hits, BEAR without them (the estimator's prefix mirror
off: every prompt estimated as if nothing were cached), llm-d's default scorer set, Dynamo's KV
router and sticky sessions (``bear.router.policies.prefix_locality``) — on OnTimeUtility (paper
eq. 6), SLO attainment and TTFT, at the paper's rates.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bear.estimator.estimate import EstimatorConfig, estimate
from bear.evaluation.cluster import MAX_TOKENS, Cluster, InstanceSpec, _Live
from bear.evaluation.prefix_workload import ChatStats, Session, answer_tokens, sessions
from bear.instance.kv_stream import KvStream
from bear.load.metrics import Outcome, summary
from bear.load.targets import ttft_target_s
from bear.prefix.hashing import BlockHasher, HashSpec
from bear.protocol.messages import (
    EstimateCandidate,
    EstimateQuery,
    InstanceRecord,
    KvMessage,
    KvOp,
    PrefixCacheInfo,
    decode,
)
from bear.protocol.subjects import Subjects
from bear.router.candidates import ModelPrediction, build_candidates, dispatch_for
from bear.router.decide import profile_for
from bear.router.policies import PREFIX_BASELINES, Policy, QueryContext, make_policy

TOKENIZER = "qwen3"  # the pool's one tokenizer (the three Qwen3 models share it)
PREFIX_POLICIES = ["bear", "bear-nohits", *PREFIX_BASELINES]


def with_prefix_caching(spec: InstanceSpec) -> InstanceSpec:
    p = spec.profile
    return replace(spec, profile=replace(p, scheduler={**p.scheduler, "enable_prefix_caching": True}))


class _Wire:
    """What NATS would carry from one instance's KV stream: the encoded messages, in order, each
    with the time it was published."""

    def __init__(self) -> None:
        self.sent: deque[tuple[float, bytes]] = deque()
        self.now = 0.0
        self.is_connected = True

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((self.now, data))


def _drain(coro: Any) -> None:
    """Run a coroutine that never awaits anything real (the fake wire) to completion."""
    try:
        coro.send(None)
    except StopIteration:
        return
    raise RuntimeError("KV stream publication awaited I/O in virtual time")


class PrefixCluster(Cluster):
    """The paper's pool with prefix caching, fed multi-turn sessions in virtual time."""

    def __init__(self, specs: list[InstanceSpec], calib: dict[str, Any], seed: int, *, delay_s: float = 0.0,
                 estimator: EstimatorConfig | None = None, prices: dict[str, tuple[float, float]] | None = None) -> None:
        specs = [with_prefix_caching(s) for s in specs]
        super().__init__(specs, calib, seed, delay_s=delay_s, estimator=estimator, prices=prices)
        subjects = Subjects()
        self.hashers: dict[int, BlockHasher] = {}
        self.streams: list[KvStream] = []
        self.wires: list[_Wire] = []
        for inst in self.insts:
            cfg = inst.spec.profile.engine_config()
            self.store.get(inst.spec.name).on_registry(InstanceRecord(
                id=inst.spec.name, model=inst.spec.model, config=cfg, tokenizer=TOKENIZER,
                prefix_cache=PrefixCacheInfo(block_size=int(cfg["block_size"]), events=True)))
            self.hashers.setdefault(int(cfg["block_size"]), BlockHasher(HashSpec(block_size=int(cfg["block_size"]))))
            self.streams.append(KvStream(inst.spec.name, subjects, buffer=1 << 20))
            self.wires.append(_Wire())
            _drain(self.streams[-1].publish(self.wires[-1]))  # the epoch opens with its (empty) state
        self._step_ops: list[list[KvOp]] = [[] for _ in self.insts]  # the running step's events
        self.done_hooks: list[Any] = []

    # ------------------------------------------------------------------ engine side
    def _kv_step(self, t: float, k: int) -> None:
        """At a step boundary: the ended step's events go out (vLLM publishes them at the end of
        its update), and the events of the step just scheduled wait for its end."""
        stream, wire = self.streams[k], self.wires[k]
        if self._step_ops[k]:
            stream.events(self._step_ops[k], t)
        wire.now = t
        _drain(stream.publish(wire))
        self._step_ops[k] = [KvOp(kind, list(h)) for kind, h in self.insts[k].engine.take_kv_events()]

    def _complete(self, t: float, k: int) -> None:
        before = len(self.finished_at)
        super()._complete(t, k)  # the step that ended at t: outputs, then the next step scheduled
        self._kv_step(t, k)
        if len(self.finished_at) != before:
            for hook in self.done_hooks:
                hook(t)

    def submit_tokens(self, k: int, rid: str, tokens: list[int], answer: list[int], t: float) -> None:
        """Queue a request whose prompt is ``tokens`` and whose answer will be ``answer`` (its
        true output): the engine hashes every full block of both as vLLM does."""
        inst = self.insts[k]
        bs = int(inst.spec.profile.engine_config()["block_size"])
        hashes = self.hashers[bs].hashes(tokens + answer)
        inst.engine.add(rid, len(tokens), MAX_TOKENS, max(1, len(answer)), t, 0, block_hashes=hashes)
        self.live[rid] = _Live(arrival=t, true_out=len(answer))
        if not inst.busy:
            end = inst.boundary(t)
            self._kv_step(t, k)
            if end is not None:
                heapq.heappush(self.events, (end, k))

    # ------------------------------------------------------------------ router side
    def _deliver_kv(self, t: float) -> None:
        """What reached the estimator's mirrors by t: each stream's messages ``delay_s`` late."""
        for inst, wire in zip(self.insts, self.wires, strict=True):
            st = self.store.get(inst.spec.name)
            while wire.sent and wire.sent[0][0] <= t - self.delay_s:
                st.prefix.offer(decode(KvMessage, wire.sent.popleft()[1]))  # type: ignore[arg-type]

    def decide_prompt(self, rid: str, i: int, tokens: list[int], t: float, target_s: float, policy: Policy,
                      lam: float, session: str) -> tuple[int, float, int]:
        """Route one turn (query-set row ``i`` with prompt ``tokens``) as the live router does:
        (instance index, the policy's latency estimate, the hit the estimator found there)."""
        self._deliver_snapshots(t)
        self._deliver_kv(t)
        qs = self.qs
        n = len(tokens)
        preds = {m: ModelPrediction(acc=float(qs.pred_acc[i, j]), out_len=float(qs.pred_len[i, j]),
                                    out_p90=float(qs.pred_p90[i, j]), prompt_tokens=n,
                                    cost_usd=(n * qs.price_in[j] + qs.pred_len[i, j] * qs.price_out[j]) / 1e6)
                 for j, m in enumerate(qs.models)}
        ctx = QueryContext(rid, target_s, lam, n, session=session, context_tokens=n + MAX_TOKENS)
        profile = profile_for(policy)
        rows = None
        if profile.needs_estimate:
            query = EstimateQuery(id=rid, prompt_tokens=n, max_tokens=MAX_TOKENS)
            cands = [EstimateCandidate(instance=info.id, tokenizer=TOKENIZER, prompt_tokens=n) for info in self.infos]
            rows = {r.instance: r for r in estimate(query, cands, self.store, t, self.cfg, tokens={TOKENIZER: tokens})}
        cs, used = build_candidates(n, self.infos, preds, rows, t, default_output_tokens=self.cfg.default_output_tokens,
                                    exact_tokens={info.id: n for info in self.infos})
        d = self.decided(profile, ctx, cs, t)
        k = next(m for m, info in enumerate(self.infos) if info.id == d.candidate.instance)
        self.store.get(self.infos[k].id).on_dispatch(dispatch_for(rid, rid, used[self.infos[k].id], MAX_TOKENS, t,
                                                                  d.candidate.prefix_hit_tokens))
        return k, policy.latency_estimate(d.candidate), d.candidate.prefix_hit_tokens

    # ------------------------------------------------------------------ sessions
    def run_sessions(self, qs: Any, system: list[int], sess: list[Session], policy: Policy, lam: float,
                     seed: int, think_s: float) -> list[Outcome]:
        """Every session's turns: a turn arrives ``think`` after the previous one's answer ended."""
        self.qs = qs
        self.hit_tokens = self.prompt_tokens = 0
        rng = np.random.default_rng(seed + 5)
        targets_rng = np.random.default_rng(seed + 2)
        arrivals: list[tuple[float, int, int]] = [(s.start, n, 0) for n, s in enumerate(sess)]
        heapq.heapify(arrivals)
        history: dict[int, list[int]] = {n: list(system) for n in range(len(sess))}
        waiting: dict[str, tuple[int, int, list[int]]] = {}  # rid → (session, turn, its answer)
        rows: list[dict[str, Any]] = []

        def on_done(t: float) -> None:
            for rid in [r for r in waiting if r in self.finished_at]:
                n, k, ans = waiting.pop(rid)
                history[n] += ans
                if k + 1 < len(sess[n].turns):
                    heapq.heappush(arrivals, (self.finished_at[rid] + float(rng.exponential(think_s)), n, k + 1))

        self.done_hooks = [on_done]
        while arrivals or self.events:
            if self.events and (not arrivals or self.events[0][0] <= arrivals[0][0]):
                te, k = heapq.heappop(self.events)
                self.now = te
                self._complete(te, k)
                continue
            t, n, k = heapq.heappop(arrivals)
            self.now = max(self.now, t)
            turn = sess[n].turns[k]
            tokens = history[n] + turn.user
            history[n] = tokens
            rid = f"s{n}-t{k}"
            target = float(ttft_target_s(len(tokens), targets_rng)[0])
            inst, est, hit = self.decide_prompt(rid, turn.query, tokens, t, target, policy, lam, f"s{n}")
            col = qs.models.index(self.insts[inst].spec.model)
            ans = answer_tokens(seed, n, k, int(max(1, min(qs.true_output[turn.query, col], MAX_TOKENS))))
            waiting[rid] = (n, k, ans)
            self.submit_tokens(inst, rid, tokens, ans, t)
            cost = len(tokens) * qs.price_in[col] + len(ans) * qs.price_out[col]
            rows.append({"rid": rid, "t": t, "inst": inst, "col": col, "target": target, "est": est,
                         "utility": float(qs.true_quality[turn.query, col] - lam * cost), "task": qs.tasks[turn.query]})
            self.hit_tokens += hit
            self.prompt_tokens += len(tokens)
        self.engine_hit_tokens = sum(max(0, self.insts[r["inst"]].engine.prefix_hit_tokens(r["rid"])) for r in rows)
        return [Outcome(query_id=r["rid"], task=r["task"], instance=self.insts[r["inst"]].spec.name,
                        model=self.insts[r["inst"]].spec.model, target_s=r["target"],
                        ttft_s=self.first_token.get(r["rid"], math.inf) - r["t"], utility=r["utility"],
                        predicted_ttft_s=r["est"]) for r in rows]


# ---------------------------------------------------------------------------------- experiment
# the paper's lowest and highest rate, then the pool loaded further: chat turns are short next to
# the paper's task mix, so its rates leave the pool mostly idle
PREFIX_RATES = [5.0, 8.9, 16.0, 32.0, 48.0]


@dataclass(frozen=True)
class PrefixCell:
    policy: str  # a registry name, or bear-nohits (BEAR with the estimator's prefix mirror off)
    rate: float
    seed: int = 0  # the setup's seed
    lam: float = 5e-4

    @property
    def key(self) -> tuple[int, str]:
        """The setup it runs on (``experiments.run_cells``): its seed, no instance variant."""
        return self.seed, ""

    def estimator(self) -> EstimatorConfig:
        return EstimatorConfig(use_prefix_hits=self.policy != "bear-nohits")

    def make_policy(self) -> Policy:
        return make_policy("bear" if self.policy == "bear-nohits" else self.policy)

    def run(self, s: Any) -> dict[str, Any]:
        """The cell's result (what ``experiments.run_cell`` calls in its process pool)."""
        return run_prefix_cell(s, self)


def run_prefix_cell(s: Any, cell: PrefixCell, stats: ChatStats = ChatStats()) -> dict[str, Any]:
    q = s.queries
    prices = {m: (float(q.price_in[j]), float(q.price_out[j])) for j, m in enumerate(q.models)}
    cluster = PrefixCluster(s.specs(), s.calibration, seed=s.seed + 4, estimator=cell.estimator(), prices=prices)
    system, sess = sessions(q, cell.rate, seed=s.seed + 31, stats=stats)
    outcomes = cluster.run_sessions(q, system, sess, cell.make_policy(), cell.lam, s.seed, stats.think_s)
    res = summary(outcomes)
    res["turns"] = len(outcomes)
    res["sessions"] = len(sess)
    # of all prompt tokens: cached where the turn ran (the engines' own hits) and known to the router
    res["hit_share"] = cluster.engine_hit_tokens / max(1, cluster.prompt_tokens)
    res["mirror_hit_share"] = cluster.hit_tokens / max(1, cluster.prompt_tokens)
    return res


def prefix_cells(rates: list[float], policies: list[str], seed: int) -> list[PrefixCell]:
    return [PrefixCell(p, r, seed=seed) for r in rates for p in policies]


def prefix_result(rates: list[float], policies: list[str], res: dict[Any, dict[str, Any]], seed: int) -> dict[str, Any]:
    def table(key: str) -> dict[str, list[Any]]:
        return {p: [res[PrefixCell(p, r, seed=seed)][key] for r in rates] for p in policies}

    out = {"rates": rates, "policies": table("on_time_utility"), "slo_attainment": table("slo_attainment"),
           "mean_ttft_s": table("mean_ttft_s"), "hit_share": table("hit_share"),
           "mirror_hit_share": table("mirror_hit_share"), "composition": table("composition"), "turns": table("turns")}
    baselines = [p for p in policies if p not in ("bear", "bear-nohits")]
    if "bear" in policies and baselines:
        out["bear_minus_best_baseline"] = [
            out["policies"]["bear"][k] - max(out["policies"][b][k] for b in baselines) for k in range(len(rates))]
    if "bear" in policies and "bear-nohits" in policies:
        out["bear_minus_nohits"] = [out["policies"]["bear"][k] - out["policies"]["bear-nohits"][k]
                                    for k in range(len(rates))]
    return out
