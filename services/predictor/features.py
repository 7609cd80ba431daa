"""Prompt and model features of paper A.4, and the PCA that turns hashed pieces into 16 numbers.

A prompt's feature row is computed once per request and shared by every candidate model; the model
part (categorical id, log parameters, max context) is appended per candidate.

The prompt analysis is C++ (``bear.libbea.prompt_analyse``, libbea/src/prompt_text.cpp): one pass
over the UTF-8 bytes for the piece and sentence counts, the 64-bit hashes of the pieces of the
head/tail window and their signed 512-bucket vector, and the keyword and length-limit indicators
of the first and last 600 characters, with Python's Unicode semantics of the regular expressions
they were defined with (\\s, \\b, \\d, ``str.lower``). This module holds the indicators' tables
and hands them to C++ once. tests/predictor/data/prompt_golden.jsonl.gz pins every output: trained
models depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bear import libbea
from bear.predictor.models import ModelSpec

HASH_DIM = 512
PCA_DIM = 16

# "in/within/under/... N words/sentences/..." → log1p(N x words per unit): the regex
#   \b(?:lead|...)\s+(\d{1,5})\s+(unit|...)s?\b
# of the first and last 600 characters, evaluated in C++.
_UNIT_WORDS = {"word": 1.0, "token": 0.75, "sentence": 20.0, "paragraph": 100.0, "line": 10.0,
               "item": 15.0, "bullet": 15.0, "point": 15.0, "page": 500.0, "character": 0.2}
_LIMIT_LEADS = ("in", "within", "under", "at most", "no more than", "about", "around", "approximately", "up to",
                "exactly", "fewer than", "less than")
_LIMIT_UNITS = ("word", "token", "sentence", "paragraph", "line", "item", "bullet", "point", "page", "character")
_QUESTION_WORDS = frozenset("who what when where which why how is are did does do can".split())


@dataclass(frozen=True)
class _Indicator:
    """Fires when one of ``words`` is a word ([a-z]+ run) of the lower-cased text or one of
    ``phrases`` occurs in it."""

    words: frozenset[str]
    phrases: tuple[str, ...] = ()


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
    # Special-cased: the text (right-stripped) ends with "?", or the first [a-z]+ word of its first
    # 80 characters or of the first 80 of its last line (left-stripped) is a question word.
    "question": _ind(""),
    "compare": _ind("compare comparison contrast difference differences versus vs"),
    "code": _ind("code function python program script sql algorithm"),
    "translate": _ind("translate translation"),
    "rewrite": _ind("rewrite paraphrase rephrase edit improve"),
}

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


def _indicators() -> Any:
    flags = [(sorted(_BRIEF.words), list(_BRIEF.phrases), False), (sorted(_DETAIL.words), list(_DETAIL.phrases), False)]
    flags += [(sorted(ind.words), list(ind.phrases), name == "question") for name, ind in TASK_INDICATORS.items()]
    return libbea.PromptIndicators(flags, list(_LIMIT_LEADS), list(_LIMIT_UNITS),
                                   [_UNIT_WORDS[u] for u in _LIMIT_UNITS], sorted(_QUESTION_WORDS))


_INDICATORS = _indicators()


def analyse(text: str) -> PromptAnalysis:
    """Hashed vector and scalar features of one prompt (C++, ~5-60 µs by length)."""
    hashed, scalars, n_pieces = libbea.prompt_analyse(text, _INDICATORS)
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


def model_part(index: int, spec: ModelSpec) -> np.ndarray:
    return np.asarray([float(index), spec.log_params, float(spec.max_context)], dtype=np.float64)


def feature_rows(a: PromptAnalysis, pca: Pca, parts: np.ndarray) -> np.ndarray:
    """One feature row per candidate model (a row of ``parts``, see ``model_part``): the shared
    prompt features (PCA of the hashed vector, scalars) and that model's part."""
    out = np.empty((len(parts), len(FEATURE_NAMES)), dtype=np.float64)
    out[:, :PCA_DIM] = pca.project(a.hashed)
    out[:, PCA_DIM:MODEL_ID_COLUMN] = a.scalars
    out[:, MODEL_ID_COLUMN:] = parts
    return out
