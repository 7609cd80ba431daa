"""The evaluation workload: synthetic queries of the four task families with their true outcome
on every model (quality, output length) and the predictor's view of them, computed once per seed
and shared by every policy and rate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MUSD = 1e6  # utility counts cost in micro-USD (USD per million tokens × tokens): the scale of λ = 5e-4


@dataclass
class QuerySet:
    ids: list[str]
    tasks: list[str]
    models: list[str]  # column order of every [n, m] array
    prompt_tokens: np.ndarray  # [n, m] per model's tokenizer
    true_quality: np.ndarray  # [n, m]
    true_output: np.ndarray  # [n, m] tokens the model really generates
    pred_acc: np.ndarray  # [n, m]
    pred_len: np.ndarray  # [n, m] mean
    pred_p90: np.ndarray  # [n, m]
    price_in: np.ndarray  # [m] USD per million tokens
    price_out: np.ndarray  # [m]

    def __len__(self) -> int:
        return len(self.ids)

    def pred_cost(self, i: int, j: int) -> float:
        """Predicted cost in micro-USD (paper A.4 with the predicted output length)."""
        return float(self.prompt_tokens[i, j] * self.price_in[j] + self.pred_len[i, j] * self.price_out[j])

    def true_utility(self, i: int, j: int, lam: float) -> float:
        cost = self.prompt_tokens[i, j] * self.price_in[j] + self.true_output[i, j] * self.price_out[j]
        return float(self.true_quality[i, j] - lam * cost)


def build_queries(n: int, seed: int, predictor_dir: Path, max_prompt_tokens: int | None = None) -> QuerySet:
    """``n`` queries of the synthetic task mix with the predictor's answers; prompts longer than
    ``max_prompt_tokens`` (the pool's context less ``max_tokens``) are truncated."""
    from bear.predictor.runtime import Predictor
    from bear.predictor.synth import MAX_PROMPT_TOKENS, generate

    pred = Predictor(predictor_dir)
    models = pred.models
    recs = list(generate(n, seed=seed, models=tuple(models), max_prompt_tokens=max_prompt_tokens or MAX_PROMPT_TOKENS))
    m = len(models)
    ids, tasks = [], []
    shape = (n, m)
    pt, tq, to = np.zeros(shape, int), np.zeros(shape), np.zeros(shape, int)
    pa, pl, p9 = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for i in range(n):
        group = recs[i * m : (i + 1) * m]
        ids.append(f"q{seed}-{i}")
        tasks.append(group[0].task)
        for j, r in enumerate(group):
            tq[i, j] = r.quality
            to[i, j] = r.output_tokens
        given = {r.model: int(r.prompt_tokens) for r in group if r.prompt_tokens is not None}
        for j, p in enumerate(pred.predict(group[0].prompt, models, prompt_tokens=given or None)):
            pt[i, j] = p.prompt_tokens
            pa[i, j] = p.acc
            pl[i, j] = p.len_mean
            p9[i, j] = p.len_p90
    return QuerySet(
        ids=ids, tasks=tasks, models=models, prompt_tokens=pt, true_quality=tq, true_output=to,
        pred_acc=pa, pred_len=pl, pred_p90=p9,
        price_in=np.array([pred.by_name[x].price_in for x in models]),
        price_out=np.array([pred.by_name[x].price_out for x in models]),
    )


def length_distributions(qs: QuerySet) -> dict[str, dict]:
    """Prompt tokens per task and true response tokens per task and model (Figs. 12, 13), with
    their means."""
    tasks = sorted(set(qs.tasks))
    idx = {t: [i for i, x in enumerate(qs.tasks) if x == t] for t in tasks}
    prompt = {t: qs.prompt_tokens[idx[t], 0].tolist() for t in tasks}
    out = {t: {m: qs.true_output[idx[t], j].tolist() for j, m in enumerate(qs.models)} for t in tasks}
    return {"prompt_tokens": prompt, "output_tokens": out,
            "prompt_mean": {t: float(np.mean(v)) for t, v in prompt.items()},
            "output_mean": {t: {m: float(np.mean(v)) for m, v in per.items()} for t, per in out.items()},
            "n": {t: len(v) for t, v in idx.items()}}
