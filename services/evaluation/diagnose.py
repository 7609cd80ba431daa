"""Evidence for the findings that do not reproduce (docs/evaluation.md §7): every decision of a
BEAR run traced with both TTFT estimates of every candidate, so that the two estimators can be
compared on the same states — how often each calls the chosen instance feasible when it was, or
was not, on time; how often the eq. 8 rule would have picked another instance; which tasks go
where; and how much of the OnTimeUtility the cost term takes."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from bear.evaluation.cluster import Cluster
from bear.evaluation.experiments import PAPER_RATES, Setup, arrival_times, cell
from bear.router.policies import QueryContext, make_policy


def traced_run(s: Setup, entry: str, rate: float) -> dict[str, Any]:
    c = cell(entry, rate, s.seed)
    q = s.queries
    prices = {m: (float(q.price_in[j]), float(q.price_out[j])) for j, m in enumerate(q.models)}
    cl = Cluster(s.specs(), s.calibration, seed=s.seed + 4, delay_s=c.delay_s, estimator=c.estimator_config(),
                 prices=prices, history=s.history)
    cl.trace = []
    targets = s.targets()
    outs = cl.run(q, arrival_times(s, c), targets, make_policy(c.policy, **dict(c.params)), c.lam)
    eq8_rule = make_policy("prefill-throughput", overflow=0)  # the section 7.1 diagnosis is of the paper's rule
    confusion = {k: Counter() for k in ("bea", "eq8")}
    agree = differs = 0
    none_feasible = Counter()
    blocks = {sp.name: sp.profile.num_gpu_blocks for sp in s.specs()}
    kv_use: dict[str, list[float]] = {k: [] for k in blocks}
    for i, (o, (cands, free)) in enumerate(zip(outs, cl.trace, strict=True)):
        for k, f in free.items():
            kv_use[k].append(1.0 - f / blocks[k])
        chosen = next(x for x in cands if x.instance == o.instance)
        for key, est in (("bea", chosen.ttft), ("eq8", chosen.ttft_prefill)):
            confusion[key][("feasible" if est <= o.target_s else "infeasible") + "/" + ("on time" if o.on_time else "late")] += 1
        other = eq8_rule.decide(QueryContext(o.query_id, float(targets[i]), c.lam, int(q.prompt_tokens[i, 0])), cands)
        agree += other.candidate.instance == o.instance
        differs += {x.instance for x in cands if x.ttft <= o.target_s} != {
            x.instance for x in cands if x.ttft_prefill <= o.target_s}
        none_feasible["bea"] += not any(x.ttft <= o.target_s for x in cands)
        none_feasible["eq8"] += not any(x.ttft_prefill <= o.target_s for x in cands)
    n = len(outs)
    by_task: dict[str, Any] = {}
    for task in sorted(set(q.tasks)):
        ts = [o for o in outs if o.task == task]
        routed = Counter(o.instance for o in ts)
        by_task[task] = {"n": len(ts), "on_time": float(np.mean([o.on_time for o in ts])),
                         "share": {k: v / len(ts) for k, v in sorted(routed.items())},
                         "mean_utility_on_time": float(np.mean([o.utility for o in ts if o.on_time] or [math.nan]))}
    neg = [o.utility for o in outs if o.on_time and o.utility < 0]
    quarters = [outs[k * n // 4:(k + 1) * n // 4] for k in range(4)]
    return {"entry": entry, "rate": rate, "n": n,
            "confusion": {k: {kk: v / n for kk, v in sorted(cf.items())} for k, cf in confusion.items()},
            "eq8_rule_agrees": agree / n, "feasible_sets_differ": differs / n, "none_feasible": {k: v / n for k, v in none_feasible.items()},
            "by_task": by_task,
            "kv_use": {k: {"mean": float(np.mean(v)), "share_above_95": float(np.mean(np.array(v) >= 0.95))}
                       for k, v in kv_use.items()}, "on_time_negative_utility_share": len(neg) / n,
            "on_time_negative_utility_sum_per_query": sum(neg) / n,
            "by_quarter": [{"on_time": float(np.mean([o.on_time for o in qs])),
                            "median_predicted_s": float(np.median([o.predicted_ttft_s for o in qs])),
                            "median_observed_s": float(np.median([o.ttft_s for o in qs]))} for qs in quarters]}


ENTRIES = ("bear", "prefill-throughput")
RATES = (PAPER_RATES[0], PAPER_RATES[-1])
