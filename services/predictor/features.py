"""Prompt and model features of paper A.4, and the PCA that turns hashed pieces into 16 numbers.

A prompt's feature row is computed once per request and shared by every candidate model; the model
part (categorical id, log parameters, max context) is appended per candidate.

Speed: ``analyse`` runs in C++ (``bear.libbea.prompt_analyse``: one pass over the bytes for the
counts, the hashes of the head/tail window, and the keyword indicators), ~5-60 µs by prompt length
instead of ~0.1-0.7 ms. The Python code below stays the definition: ``analyse_py`` is the same computation in
pure Python/numpy, used when the extension lacks the native functions and, for the indicators,
whenever the indicator text is not ASCII (Python's regexes and ``str.lower`` have Unicode semantics
for whitespace, word boundaries and digits that the C++ code does not reproduce). The tests compare
the two on thousands of prompts, bit for bit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from bear.predictor.models import ModelSpec
from bear.predictor.text import hashed_vector, pieces

try:
    from bear import libbea as _native

    _HAVE_NATIVE = hasattr(_native, "prompt_analyse")
except ImportError:  # extension not built: the pure-Python path
    _native = None
    _HAVE_NATIVE = False

HASH_DIM = 512
PCA_DIM = 16
# Instructions sit at the start or the end of a prompt; the indicators only look there so that a
# 10^4-token document costs no more than a short question. One regex pass yields the words; the
# indicators are set look-ups and substring tests (a regex per indicator cost ~10x more).
INDICATOR_SPAN = 600

_UNIT_WORDS = {"word": 1.0, "token": 0.75, "sentence": 20.0, "paragraph": 100.0, "line": 10.0,
               "item": 15.0, "bullet": 15.0, "point": 15.0, "page": 500.0, "character": 0.2}
_LIMIT_LEADS = ("in", "within", "under", "at most", "no more than", "about", "around", "approximately", "up to",
                "exactly", "fewer than", "less than")
_LIMIT_UNITS = ("word", "token", "sentence", "paragraph", "line", "item", "bullet", "point", "page", "character")
_LIMIT = re.compile(r"\b(?:" + "|".join(_LIMIT_LEADS) + r")\s+(\d{1,5})\s+(" + "|".join(_LIMIT_UNITS) + r")s?\b")
_WORD = re.compile(r"[a-z]+")
_QUESTION_WORDS = frozenset("who what when where which why how is are did does do can".split())


@dataclass(frozen=True)
class _Indicator:
    """Fires when one of ``words`` is a word of the text or one of ``phrases`` occurs in it."""

    words: frozenset[str]
    phrases: tuple[str, ...] = ()

    def __call__(self, words: set[str], low: str) -> bool:
        return not self.words.isdisjoint(words) or any(ph in low for ph in self.phrases)


def _ind(words: str, *phrases: str) -> _Indicator:
    return _Indicator(frozenset(words.split()), phrases)


_BRIEF = _ind("briefly brief short shortly concise concisely succinct succinctly",
              "one sentence", "single sentence", "one word", "a few words", "tl;dr", "in short")
_DETAIL = _ind("detailed comprehensive thorough thoroughly elaborate extensive long lengthy",
               "in detail", "in depth", "in-depth", "step by step", "at length")
TASK_INDICATORS: dict[str, _Indicator] = {
    "list": _ind("list enumerate bullet bullets", "top 10", "top five"),
    "summarize": _ind("summarize summarise summary summarization abstract overview", "tl;dr", "key points"),
    "explain": _ind("explain explanation describe why", "how does", "how do", "what causes"),
    "write": _ind("write story poem essay narrative compose letter"),
    "question": _ind(""),  # special-cased: a question word opens a line, or a question mark ends it
    "compare": _ind("compare comparison contrast difference differences versus vs"),
    "code": _ind("code function python program script sql algorithm"),
    "translate": _ind("translate translation"),
    "rewrite": _ind("rewrite paraphrase rephrase edit improve"),
}


def _is_question(low: str) -> bool:
    tail = low.rstrip()
    if tail.endswith("?"):
        return True
    for line in (low[:80], tail[tail.rfind("\n") + 1 :][:80]):
        first = _WORD.match(line.lstrip())
        if first is not None and first.group(0) in _QUESTION_WORDS:
            return True
    return False


SCALAR_NAMES = ["n_pieces", "n_chars", "n_sentences", "chars_per_piece", "limit_words", "brief", "detailed"]
PROMPT_NAMES = [f"pca{i}" for i in range(PCA_DIM)] + SCALAR_NAMES + [f"task_{k}" for k in TASK_INDICATORS]
MODEL_NAMES = ["model_id", "log_params", "max_context"]
FEATURE_NAMES = PROMPT_NAMES + MODEL_NAMES
MODEL_ID_COLUMN = len(PROMPT_NAMES)


@dataclass(frozen=True)
class PromptAnalysis:
    """What one pass over the prompt yields: the hashed vector, the scalar features, the count
    of pieces (also the fallback token count)."""

    hashed: np.ndarray
    scalars: np.ndarray
    n_pieces: int


def _indicator_text(text: str) -> str:
    if len(text) <= 2 * INDICATOR_SPAN:
        return text.lower()
    return (text[:INDICATOR_SPAN] + "\n" + text[-INDICATOR_SPAN:]).lower()


def _indicators_py(low: str) -> list[float]:
    """[limit_words, brief, detailed, task_*...] of the indicator text (lower-cased)."""
    words = set(_WORD.findall(low))
    limit = 0.0
    m = _LIMIT.search(low)
    if m is not None:
        limit = math.log1p(float(m.group(1)) * _UNIT_WORDS[m.group(2)])
    out = [
        limit,
        1.0 if _BRIEF(words, low) else 0.0,
        1.0 if _DETAIL(words, low) else 0.0,
    ]
    out += [
        1.0 if (_is_question(low) if name == "question" else ind(words, low)) else 0.0
        for name, ind in TASK_INDICATORS.items()
    ]
    return out


def analyse_py(text: str) -> PromptAnalysis:
    """Hashed vector and scalar features of one prompt, in Python (the definition of ``analyse``)."""
    p = pieces(text)
    scalars = [
        float(p.n_pieces),
        float(len(text)),
        float(p.n_sentences),
        len(text) / max(1, p.n_pieces),
        *_indicators_py(_indicator_text(text)),
    ]
    return PromptAnalysis(hashed_vector(p, HASH_DIM), np.asarray(scalars, dtype=np.float64), p.n_pieces)


def _native_indicators() -> Any:
    flags = [(sorted(_BRIEF.words), list(_BRIEF.phrases), False), (sorted(_DETAIL.words), list(_DETAIL.phrases), False)]
    flags += [(sorted(ind.words), list(ind.phrases), name == "question") for name, ind in TASK_INDICATORS.items()]
    return _native.PromptIndicators(flags, list(_LIMIT_LEADS), list(_LIMIT_UNITS),
                                    [_UNIT_WORDS[u] for u in _LIMIT_UNITS], sorted(_QUESTION_WORDS))


_INDICATORS = _native_indicators() if _HAVE_NATIVE else None


def analyse(text: str) -> PromptAnalysis:
    """Hashed vector and scalar features of one prompt (C++; equal to ``analyse_py``)."""
    if _INDICATORS is None:
        return analyse_py(text)
    low = _indicator_text(text)
    hashed, scalars, n_pieces, done = _native.prompt_analyse(text, len(text), low, _INDICATORS)
    if not done:  # non-ASCII indicator text: Python's Unicode-aware regexes decide
        scalars[4:] = _indicators_py(low)
    return PromptAnalysis(hashed, scalars, n_pieces)


@dataclass
class Pca:
    """Mean and top principal directions of the hashed vectors of the training prompts."""

    mean: np.ndarray  # (HASH_DIM,)
    components: np.ndarray  # (HASH_DIM, PCA_DIM)

    @classmethod
    def fit(cls, hashed: np.ndarray, dim: int = PCA_DIM) -> Pca:
        mean = hashed.mean(axis=0)
        _, _, vt = np.linalg.svd(hashed - mean, full_matrices=False)
        comps = np.zeros((hashed.shape[1], dim))
        k = min(dim, vt.shape[0])
        comps[:, :k] = vt[:k].T
        return cls(mean, comps)

    def project(self, hashed: np.ndarray) -> np.ndarray:
        return (hashed - self.mean) @ self.components

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "components": self.components.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Pca:
        return cls(np.asarray(d["mean"], dtype=np.float64), np.asarray(d["components"], dtype=np.float64))


def prompt_row(a: PromptAnalysis, pca: Pca) -> np.ndarray:
    return np.concatenate([pca.project(a.hashed), a.scalars])


def model_part(index: int, spec: ModelSpec) -> np.ndarray:
    return np.asarray([float(index), spec.log_params, float(spec.max_context)], dtype=np.float64)


def rows_for_models(prompt: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    """One feature row per candidate model: shared prompt features + that model's part."""
    out = np.empty((len(parts), len(FEATURE_NAMES)), dtype=np.float64)
    out[:, : len(prompt)] = prompt
    for i, part in enumerate(parts):
        out[i, len(prompt) :] = part
    return out
