"""SYNTHETIC evaluation data, for development and tests only: no real evaluation set can be
downloaded here. Queries of four task families in the paper's regimes (Fig. 12-13):

=============== ======================= ======================
task            prompt (pieces)         response (tokens)
=============== ======================= ======================
alpaca          short, ~10-200          short, ~30-500
hotpotqa        long, ~700-2500         short, ~10-150
govreport       long, ~1500-10^4        long, ~250-1200
writingprompts  short, ~15-60           long, ~400-2000
=============== ======================= ======================

Quality per (model, task) is centred on the paper's Table 2; each query moves it by a difficulty
that is a function of what is visible in the prompt (topic words, question kind, document length,
constraints) with larger slopes for smaller models, plus noise. Output length depends on the task,
the instruction kind, explicit length constraints ("in 50 words", "briefly"), the document length
and the model. Every record carries ``synthetic: true``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bear.predictor.dataset import Record
from bear.predictor.features import analyse
from bear.predictor.tasks import TASKS

# Paper Table 2 (LLM-as-judge, per-query task average).
TABLE2: dict[str, dict[str, float]] = {
    "alpaca": {"Qwen3-0.6B": 0.5349, "Qwen3-8B": 0.8267, "Qwen3-32B": 0.8885},
    "govreport": {"Qwen3-0.6B": 0.2902, "Qwen3-8B": 0.8662, "Qwen3-32B": 0.9593},
    "hotpotqa": {"Qwen3-0.6B": 0.4098, "Qwen3-8B": 0.8828, "Qwen3-32B": 0.9269},
    "writingprompts": {"Qwen3-0.6B": 0.1773, "Qwen3-8B": 0.5747, "Qwen3-32B": 0.8069},
}
# How strongly difficulty lowers quality (smaller models suffer more), length multiplier and noise.
_SLOPE = {"Qwen3-0.6B": 0.45, "Qwen3-8B": 0.25, "Qwen3-32B": 0.12}
_LEN_MULT = {"Qwen3-0.6B": 1.2, "Qwen3-8B": 1.0, "Qwen3-32B": 1.08}
_LEN_SIGMA = {"Qwen3-0.6B": 0.30, "Qwen3-8B": 0.22, "Qwen3-32B": 0.20}
_Q_SIGMA = 0.07

_TOPICS: dict[str, tuple[float, list[str]]] = {  # topic → (difficulty, words)
    "cooking": (0.1, "recipe flour oven garlic butter simmer sauce pasta spice onion bake kitchen salt "
                     "pepper dough roast grill soup salad dessert".split()),
    "travel": (0.15, "city museum beach flight hotel mountain island river village passport train "
                     "harbor castle market festival journey coast valley bridge".split()),
    "history": (0.4, "empire dynasty treaty revolution century monarch battle colony senate parliament "
                     "medieval ancient archive pharaoh crusade republic reform siege".split()),
    "finance": (0.55, "budget deficit revenue audit inflation interest bond equity portfolio dividend "
                      "liability asset fiscal appropriation procurement tariff subsidy ledger".split()),
    "science": (0.75, "quantum entropy enzyme genome protein molecule electron photon isotope catalyst "
                      "neuron plasma theorem integral derivative matrix vector eigenvalue".split()),
    "code": (0.9, "function python compiler recursion pointer thread mutex runtime algorithm array "
                  "hashmap database query kernel socket lambda iterator closure".split()),
}
_FILLER = ("the a of and to in is that for it as with was on be by this are from at or an which "
           "have has not but were their its they one all would there been more also into other").split()
_NAMES = "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Paul".split()


@dataclass
class _Query:
    prompt: str
    task: str
    difficulty: float  # in [0, 1]
    base_len: float  # expected output tokens for a neutral model


class _Words:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def text(self, n: int, topic: str, topic_share: float = 0.35, sentence: int = 14) -> str:
        words = self.rng.choice(_TOPICS[topic][1], size=n) if n else np.array([], dtype=str)
        fill = self.rng.choice(_FILLER, size=n)
        mask = self.rng.random(n) < topic_share
        out = np.where(mask, words, fill).astype(object)
        ends = np.arange(sentence - 1, n, sentence)
        out[ends] = out[ends] + "."
        return " ".join(out.tolist())


def _topic(rng: np.random.Generator) -> str:
    return str(rng.choice(list(_TOPICS)))


def _constraint(rng: np.random.Generator) -> tuple[str, float | None, float]:
    """(phrase, explicit word limit, multiplier on the natural length)."""
    r = rng.random()
    if r < 0.45:
        return "", None, 1.0
    if r < 0.65:
        n = int(rng.choice([20, 30, 50, 80, 100, 150, 200, 300]))
        return f" Answer in {n} words.", float(n), 1.0
    if r < 0.85:
        return str(rng.choice([" Be brief.", " Answer briefly.", " Keep it short and concise."])), None, 0.35
    return str(rng.choice([" Explain in detail.", " Give a detailed and comprehensive answer."])), None, 1.9


def _alpaca(rng: np.random.Generator, w: _Words) -> _Query:
    topic = _topic(rng)
    kinds = {  # kind → (template, natural length, difficulty offset)
        "list": ("List {k} facts about {t}.", 200.0, 0.0),
        "explain": ("Explain how {t} works.", 260.0, 0.15),
        "write": ("Write a short piece about {t}.", 230.0, 0.1),
        "rewrite": ("Rewrite the following text to improve it:", 0.0, -0.1),
        "question": ("What is the role of {t}?", 90.0, 0.0),
        "compare": ("Compare and contrast {t} with {u}.", 300.0, 0.25),
    }
    kind = str(rng.choice(list(kinds)))
    tmpl, natural, dk = kinds[kind]
    t, u = (str(x) for x in rng.choice(_TOPICS[topic][1], size=2, replace=False))
    head = tmpl.format(k=int(rng.integers(3, 11)), t=t, u=u)
    n_ctx = int(rng.integers(20, 160)) if kind == "rewrite" else int(rng.integers(0, 40))
    ctx = w.text(n_ctx, topic)
    if kind == "rewrite":
        natural = 1.1 * n_ctx
    elif kind == "list":
        natural *= int(head.split()[1]) / 6.0
    phrase, limit, mult = _constraint(rng)
    length = 1.35 * limit if limit is not None else natural * mult
    diff = _TOPICS[topic][0] * 0.7 + dk + 0.15 * (limit is not None)
    prompt = head + phrase + ("\n\n" + ctx if ctx else "")
    return _Query(prompt, "alpaca", diff, max(12.0, length))


def _hotpotqa(rng: np.random.Generator, w: _Words) -> _Query:
    topic = _topic(rng)
    n_par = int(rng.integers(4, 13))
    paras = [f"{rng.choice(_NAMES)} ({i + 1}): " + w.text(int(rng.integers(60, 200)), topic) for i in range(n_par)]
    kind = rng.random()
    a, b = (str(x) for x in rng.choice(_NAMES, size=2, replace=False))
    if kind < 0.3:
        q, natural, dk = f"Are {a} and {b} both associated with the same {topic} topic?", 18.0, 0.0
    elif kind < 0.7:
        q, natural, dk = f"Which {topic} work connects {a} to {b}?", 45.0, 0.2
    else:
        q, natural, dk = f"Explain why {a} influenced {b}, citing the passages.", 140.0, 0.35
    brief = rng.random() < 0.3
    if brief:
        q += " Answer briefly."
        natural *= 0.5
    diff = 0.35 * _TOPICS[topic][0] + dk + 0.03 * n_par
    prompt = "Answer the question using the passages.\n\n" + "\n\n".join(paras) + "\n\nQuestion: " + q
    return _Query(prompt, "hotpotqa", diff, natural)


def _govreport(rng: np.random.Generator, w: _Words) -> _Query:
    topic = str(rng.choice(["finance", "history", "science", "travel"]))
    n_doc = int(np.clip(rng.lognormal(math.log(3500), 0.6), 1200, 9500))
    doc = w.text(n_doc, topic, topic_share=0.25, sentence=22)
    r = rng.random()
    if r < 0.35:
        n = int(rng.choice([100, 150, 200, 300, 400, 500]))
        ask, natural = f"Summarize the report above in about {n} words.", 1.35 * n
    elif r < 0.5:
        ask, natural = "Briefly summarize the report above.", 90.0 * math.log(n_doc / 200)
    else:
        ask, natural = "Summarize the report above.", 200.0 * math.log(n_doc / 400)
    diff = 0.25 * _TOPICS[topic][0] + 0.5 * (math.log(n_doc) - math.log(1200)) / math.log(9500 / 1200)
    prompt = "Government report:\n\n" + doc + "\n\n" + ask
    return _Query(prompt, "govreport", diff, natural)


def _writingprompts(rng: np.random.Generator, w: _Words) -> _Query:
    topic = _topic(rng)
    premise = w.text(int(rng.integers(8, 35)), topic, topic_share=0.5)
    extras = [" Tell it from the perspective of a villain.", " End with an unexpected twist.",
              " Write it as a poem.", ""]
    extra = str(rng.choice(extras))
    r = rng.random()
    if r < 0.3:
        n = int(rng.choice([200, 300, 500, 800, 1000]))
        ask, natural = f"Write a story in {n} words.", 1.3 * n
    elif r < 0.45:
        ask, natural = "Write a short story.", 420.0
    else:
        ask, natural = "Write a story.", 900.0
    if "poem" in extra:
        natural *= 0.45
    diff = 0.3 * _TOPICS[topic][0] + (0.3 if extra else 0.0) + (0.15 if "words" in ask else 0.0)
    prompt = f"[WP] {premise}\n\n{ask}{extra}"
    return _Query(prompt, "writingprompts", diff, natural)


_GENERATORS = {"alpaca": _alpaca, "hotpotqa": _hotpotqa, "govreport": _govreport, "writingprompts": _writingprompts}
# Centre of the difficulty per task, so that per-task mean quality stays at Table 2.
_DIFF_CENTRE = {"alpaca": 0.45, "hotpotqa": 0.55, "govreport": 0.4, "writingprompts": 0.45}


def generate(n_queries: int, seed: int = 0, models: tuple[str, ...] | None = None,
             tasks: tuple[str, ...] = TASKS) -> Iterator[Record]:
    """``n_queries`` synthetic queries (tasks in turn), one record per (query, model)."""
    rng = np.random.default_rng(seed)
    w = _Words(rng)
    models = models or tuple(TABLE2["alpaca"])
    for i in range(n_queries):
        task = tasks[i % len(tasks)]
        q = _GENERATORS[task](rng, w)
        n_tok = analyse(q.prompt).n_pieces  # the fallback token count
        for m in models:
            base = TABLE2[task][m]
            qual = base - _SLOPE[m] * (q.difficulty - _DIFF_CENTRE[task]) + rng.normal(0.0, _Q_SIGMA)
            length = q.base_len * _LEN_MULT[m] * math.exp(rng.normal(-0.5 * _LEN_SIGMA[m] ** 2, _LEN_SIGMA[m]))
            yield Record(
                prompt=q.prompt,
                task=task,
                model=m,
                quality=float(np.clip(qual, 0.0, 1.0)),
                output_tokens=max(1, round(length)),
                prompt_tokens=n_tok,
                query_id=f"synth-{seed}-{i}",
                synthetic=True,
            )


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "bear"


def trained_predictor_dir(n_train: int, seed: int, cache: Path | None = None) -> Path:
    """Train (once, cached) the predictor on synthetic data disjoint from the evaluation queries."""
    from bear.predictor.train import train

    key = hashlib.sha1(f"synth-v1-{n_train}-{seed}".encode()).hexdigest()[:10]
    out = (cache or default_cache_dir()) / f"eval-predictor-{key}"
    if not (out / "meta.json").exists():
        records = list(generate(n_train, seed=seed))
        train(records, out)
    return out
