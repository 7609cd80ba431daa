"""The prefix experiment: sessions shaped by the published chat statistics, deterministic per
seed; the simulated engines' prefix caches reach the estimator's mirror through the KV stream's
messages; BEAR with hits finds the conversation where it is cached; a run is reproducible."""

from __future__ import annotations

import math

import numpy as np
from test_evaluation import calib, tiny_queries

from bear.evaluation.cluster import PAPER_POOL, InstanceSpec
from bear.evaluation.prefix import PrefixCell, PrefixCluster
from bear.evaluation.prefix_workload import ChatStats, answer_tokens, sessions
from bear.load.metrics import summary
from bear.router.policies import make_policy


def test_sessions_follow_the_published_statistics() -> None:
    qs = tiny_queries(4000)
    system, sess = sessions(qs, rate=8.0, seed=3)
    turns = [len(s.turns) for s in sess]
    assert sum(turns) == 4000 and len(system) == 500
    assert abs(np.mean(turns) - 2.0) < 0.15  # LMSYS-Chat-1M: 2.0 turns per conversation
    users = [len(t.user) for s in sess for t in s.turns if t.turn > 0]
    assert abs(np.mean(users) - 69.5) / 69.5 < 0.1  # LMSYS-Chat-1M: 69.5 user tokens per turn
    firsts = [len(s.turns[0].user) for s in sess]
    assert 900 < np.mean(firsts) < 1250 and max(firsts) <= 5000 + 2000  # vLLM generator: context ~ lognormal(1000)
    gaps = np.diff([s.start for s in sess])
    assert abs(len(sess) / sess[-1].start - 8.0 / 2.0) < 0.5  # sessions at rate / mean turns
    assert gaps.min() >= 0
    again = sessions(qs, rate=8.0, seed=3)
    assert again[0] == system and [t.user for s in again[1] for t in s.turns] == [t.user for s in sess for t in s.turns]
    assert answer_tokens(1, 2, 3, 50) == answer_tokens(1, 2, 3, 80)[:50]


def _cell(policy: str, n: int = 160, rate: float = 6.0) -> tuple[dict, PrefixCluster]:
    qs = tiny_queries(n, seed=5)
    specs = [InstanceSpec.from_profile(p) for p in PAPER_POOL]
    cell = PrefixCell(policy, rate)
    cl = PrefixCluster(specs, calib(), seed=9, estimator=cell.estimator())
    system, sess = sessions(qs, rate, seed=4, stats=ChatStats(think_s=2.0))
    outs = cl.run_sessions(qs, system, sess, cell.make_policy(), 5e-4, seed=0, think_s=2.0)
    return summary(outs), cl


def test_mirrors_follow_the_engines_and_bear_uses_the_hits() -> None:
    res, cl = _cell("bear")
    assert res["n"] == 160 and all(math.isfinite(o) for o in [res["mean_ttft_s"]])
    for inst, st in zip(cl.insts, (cl.store.get(i.spec.name) for i in cl.insts), strict=True):
        cl._deliver_kv(math.inf)
        assert st.prefix.synced
        assert dict(st.prefix.counts) == dict(cl.streams[cl.insts.index(inst)].mirror.counts)
        assert len(st.prefix) == libbea_cached(inst)
    assert cl.hit_tokens > 0.2 * cl.prompt_tokens  # system prompt + conversations found again
    nohits, cl2 = _cell("bear-nohits")
    assert cl2.hit_tokens == 0
    assert res["on_time_utility"] >= nohits["on_time_utility"]


def libbea_cached(inst) -> int:
    return len(set(inst.engine.cached_blocks()))


def test_prefix_cells_are_deterministic() -> None:
    a, _ = _cell("llm-d", n=80)
    b, _ = _cell("llm-d", n=80)
    assert a == b
    assert make_policy("dynamo-kv").name == "dynamo-kv"
