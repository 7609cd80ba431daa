"""The predictor's native (C++) prompt analysis and tree evaluation against the pure-Python
reference: bit-identical features and predictions on thousands of varied prompts; bad and
fuzzed inputs to the native code never crash (and, under ASan+UBSan, never misbehave).

The REFERENCE section below is a verbatim copy of the implementation the native code replaced
(services/predictor/text.py and features.py ``analyse`` before the C++ port). It is frozen here
on purpose: if the production code and this copy ever disagree, trained models no longer mean
what they meant when they were trained.
"""

from __future__ import annotations

import functools
import math
import random
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bear import libbea
from bear.predictor import features as F
from bear.predictor.fastlgb import FastBooster, NativeForest
from bear.predictor.runtime import Predictor, finalize, finalize_lists
from bear.predictor.synth import generate
from bear.predictor.text import pieces as text_pieces
from bear.predictor.train import TrainConfig, train

# ==== REFERENCE (verbatim: text.py) =============================================================

HASH_HEAD = 6144
HASH_TAIL = 2048

_MIX = np.uint64(0x9E3779B97F4A7C15)
_WINDOW = HASH_HEAD + HASH_TAIL + 1


def _powers(base: int, n: int) -> np.ndarray:
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(out, dtype=np.uint64)


_POW = _powers(1_000_003, _WINDOW + 1)
_POW_INV = _powers(pow(1_000_003, -1, 2**64), _WINDOW + 1)


def _table(members: bytes) -> np.ndarray:
    t = np.zeros(256, dtype=bool)
    t[list(members)] = True
    return t


_IS_WORD = _table(bytes(range(48, 58)) + bytes(range(65, 91)) + bytes(range(97, 123)) + bytes(range(128, 256)))
_IS_SPACE = _table(bytes([9, 10, 11, 12, 13, 32]))
_IS_END = _table(b".!?")
_LOWER = np.arange(256, dtype=np.uint64)
_LOWER[65:91] += 32


@dataclass(frozen=True)
class Pieces:
    """Counts over the whole text and the 64-bit hashes of the pieces of its hashed window."""

    hashes: np.ndarray  # uint64, one per hashed piece, in order
    n_pieces: int  # pieces in the whole text
    n_bytes: int
    n_sentences: int


def count_pieces(raw: np.ndarray) -> tuple[int, int]:
    """(pieces, sentences) of UTF-8 bytes ``raw``: a few vectorised passes, no hashing."""
    n = len(raw)
    if n == 0:
        return 0, 0
    word = np.take(_IS_WORD, raw)
    space = np.take(_IS_SPACE, raw)
    n_words = int(np.count_nonzero(word[1:] > word[:-1])) + int(word[0])
    n_word_bytes = int(np.count_nonzero(word))
    n_punct = n - n_word_bytes - int(np.count_nonzero(space))
    # A sentence ends at . ! ? followed by whitespace or the end of the text; a trailing sentence
    # without a full stop counts too.
    end = np.take(_IS_END, raw)
    n_sent = int(np.count_nonzero(end[:-1] & space[1:])) + int(end[-1])
    last = np.flatnonzero(~space)
    if len(last) and not end[last[-1]]:
        n_sent += 1
    return n_words + n_punct, n_sent


def _hash_window(raw: np.ndarray) -> np.ndarray:
    n = len(raw)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    word = np.take(_IS_WORD, raw)
    punct = ~word & ~np.take(_IS_SPACE, raw)
    prev_word = np.empty_like(word)
    prev_word[0] = False
    prev_word[1:] = word[:-1]
    next_word = np.empty_like(word)
    next_word[-1] = False
    next_word[:-1] = word[1:]
    starts = np.flatnonzero((word & ~prev_word) | punct)
    ends = np.flatnonzero((word & ~next_word) | punct) + 1
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(np.take(_LOWER, raw) * _POW[:n], dtype=np.uint64, out=prefix[1:])
        h = (prefix[ends] - prefix[starts]) * _POW_INV[starts]
        h = (h ^ (ends - starts).astype(np.uint64)) * _MIX
        h ^= h >> np.uint64(29)
    return h


def _cut(data: bytes, lo: int, hi: int) -> tuple[int, int]:
    """Move a byte range outwards/inwards so that it does not split a piece (whitespace bound)."""
    while lo > 0 and data[lo - 1 : lo] not in (b" ", b"\n", b"\t"):
        lo += 1
        if lo >= hi:
            break
    while hi < len(data) and data[hi : hi + 1] not in (b" ", b"\n", b"\t") and hi > lo:
        hi -= 1
    return lo, hi


SHORT_BYTES = 512  # below this, the pure-Python path is faster than numpy's per-call overheads
_PIECE_RE = re.compile(rb"[0-9A-Za-z\x80-\xff]+|[^0-9A-Za-z\x80-\xff\t\n\x0b\x0c\r ]")
_SENT_RE = re.compile(rb"[.!?](?=[\t\n\x0b\x0c\r ]|$)")
_M64 = (1 << 64) - 1
_P_INT = 1_000_003
_MIX_INT = 0x9E3779B97F4A7C15


@functools.lru_cache(maxsize=65536)
def _piece_hash(piece: bytes) -> int:
    """The same 64-bit hash as ``_hash_window``, for one piece (cached: words repeat)."""
    h = 0
    for b in reversed(piece.lower()):
        h = (h * _P_INT + b) & _M64
    h = ((h ^ len(piece)) * _MIX_INT) & _M64
    return h ^ (h >> 29)


def _pieces_short(data: bytes) -> Pieces:
    found = _PIECE_RE.findall(data)
    h = np.fromiter((_piece_hash(p) for p in found), dtype=np.uint64, count=len(found))
    n_sent = len(_SENT_RE.findall(data))
    stripped = data.rstrip(b"\t\n\x0b\x0c\r ")
    if stripped and stripped[-1:] not in (b".", b"!", b"?"):
        n_sent += 1
    return Pieces(h, len(found), len(data), n_sent)


def pieces(text: str) -> Pieces:
    """Counts over ``text`` and hashes of the pieces of its head and tail (stable across hosts)."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= SHORT_BYTES:
        return _pieces_short(data)
    raw = np.frombuffer(data, dtype=np.uint8)
    n_pieces, n_sent = count_pieces(raw)
    if len(data) <= HASH_HEAD + HASH_TAIL:
        h = _hash_window(raw)
    else:
        _, head_end = _cut(data, 0, HASH_HEAD)
        tail_start, _ = _cut(data, len(data) - HASH_TAIL, len(data))
        h = np.concatenate([_hash_window(raw[:head_end]), _hash_window(raw[tail_start:])])
    return Pieces(h, n_pieces, len(data), n_sent)


def hashed_vector(p: Pieces, dim: int = 512) -> np.ndarray:
    """Signed feature hashing of the hashed pieces, normalised by their count (paper A.4)."""
    if len(p.hashes) == 0:
        return np.zeros(dim, dtype=np.float64)
    bucket = ((p.hashes >> np.uint64(32)) % np.uint64(dim)).astype(np.intp)
    sign = ((p.hashes >> np.uint64(7)) & np.uint64(1)).astype(np.float64) * 2.0 - 1.0
    return np.bincount(bucket, weights=sign, minlength=dim) / len(p.hashes)


# ==== REFERENCE (verbatim: features.py, the prompt analysis) ====================================

HASH_DIM = 512
PCA_DIM = 16
# Instructions sit at the start or the end of a prompt; the indicators only look there so that a
# 10^4-token document costs no more than a short question. One regex pass yields the words; the
# indicators are set look-ups and substring tests (a regex per indicator cost ~10x more).
INDICATOR_SPAN = 600

_UNIT_WORDS = {"word": 1.0, "token": 0.75, "sentence": 20.0, "paragraph": 100.0, "line": 10.0,
               "item": 15.0, "bullet": 15.0, "point": 15.0, "page": 500.0, "character": 0.2}
_LIMIT = re.compile(
    r"\b(?:in|within|under|at most|no more than|about|around|approximately|up to|exactly|fewer than|less than)"
    r"\s+(\d{1,5})\s+(word|token|sentence|paragraph|line|item|bullet|point|page|character)s?\b"
)
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
    hashed: np.ndarray
    scalars: np.ndarray
    n_pieces: int


def _indicator_text(text: str) -> str:
    if len(text) <= 2 * INDICATOR_SPAN:
        return text.lower()
    return (text[:INDICATOR_SPAN] + "\n" + text[-INDICATOR_SPAN:]).lower()


def analyse(text: str) -> PromptAnalysis:
    """Hashed vector and scalar features of one prompt."""
    p = pieces(text)
    low = _indicator_text(text)
    words = set(_WORD.findall(low))
    limit = 0.0
    m = _LIMIT.search(low)
    if m is not None:
        limit = math.log1p(float(m.group(1)) * _UNIT_WORDS[m.group(2)])
    scalars = [
        float(p.n_pieces),
        float(len(text)),
        float(p.n_sentences),
        len(text) / max(1, p.n_pieces),
        limit,
        1.0 if _BRIEF(words, low) else 0.0,
        1.0 if _DETAIL(words, low) else 0.0,
    ]
    scalars += [
        1.0 if (_is_question(low) if name == "question" else ind(words, low)) else 0.0
        for name, ind in TASK_INDICATORS.items()
    ]
    return PromptAnalysis(hashed_vector(p, HASH_DIM), np.asarray(scalars, dtype=np.float64), p.n_pieces)



# ==== corpus ====================================================================================

_KEYWORDS = sorted({w for ind in [_BRIEF, _DETAIL, *TASK_INDICATORS.values()] for w in ind.words} | _QUESTION_WORDS)
_PHRASES = sorted({p for ind in [_BRIEF, _DETAIL, *TASK_INDICATORS.values()] for p in ind.phrases})
_LEADS = ["in", "within", "under", "at most", "no more than", "about", "around", "approximately", "up to",
          "exactly", "fewer than", "less than", "inside", "at  most", "abouts"]
_UNITS = [*_UNIT_WORDS, "words", "pages", "wordsx", "word_", "word2", "Words", "sentences."]
# Whitespace and look-alikes: ASCII, the \x1c-\x1f separators Python counts as space, Unicode spaces.
_SPACES = [" ", "  ", "\n", "\t", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u2028", "\u3000", ""]
_DIGITS = ["5", "50", "300", "12345", "123456", "007", "٣", "５", "1 000", "2.5"]
_ODD = ["é", "ß", "İ", "\u212a", "ﬁ", "Σ", "日本語", "😀", "\x00", "\ud800", "a\u0301", "Ⅻ", "_", "-", "'", ";", "?", ".", "!", "...", "?!"]


def _ascii(items: list[str]) -> list[str]:
    return [x for x in items if x.isascii()]


def _phrase(rng: random.Random, ascii_only: bool) -> str:
    kind = rng.random()
    spaces, digits, odd = (_ascii(_SPACES), _ascii(_DIGITS), _ascii(_ODD)) if ascii_only else (_SPACES, _DIGITS, _ODD)
    if kind < 0.25:
        return rng.choice(_LEADS) + rng.choice(spaces) + rng.choice(digits) + rng.choice(spaces) + rng.choice(_UNITS)
    if kind < 0.45:
        w = rng.choice(_KEYWORDS)
        return w.upper() if rng.random() < 0.2 else (w.capitalize() if rng.random() < 0.3 else w)
    if kind < 0.6:
        return rng.choice(_PHRASES)
    if kind < 0.75:
        return rng.choice(odd)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABC0123456789") for _ in range(rng.randint(1, 12)))


def _random_prompt(rng: random.Random) -> str:
    target = rng.choice([0, 1, 3, 20, 80, 300, 511, 512, 513, 600, 1199, 1200, 1201, 1300, 4000, 8191, 8192,
                         8193, 9000, 20000, 70000])
    ascii_only = rng.random() < 0.6
    spaces = _ascii(_SPACES) if ascii_only else _SPACES
    parts: list[str] = []
    size = 0
    while size < target:
        p = _phrase(rng, ascii_only) + rng.choice(spaces)
        if rng.random() < 0.02:  # long runs without whitespace (cut points), or of whitespace
            p = rng.choice(["x", " ", "\n", "."] if ascii_only else ["x", "é", " ", "\n", "."]) * rng.randint(100, 9000)
        parts.append(p)
        size += len(p)
    text = "".join(parts)
    if rng.random() < 0.3 and text:
        text = text[: rng.randint(0, len(text))]
    if rng.random() < 0.1:
        text += rng.choice(["?", "? ", "?\n\n", ".", "\n", " \x1c"])
    return text


def _special_prompts() -> list[str]:
    out = ["", " ", "\n", "\t\n \r", "   \x1c\x1d\x1e\x1f  ", "?", ".", "a", "A.", "!?", "\x00", "\ud800\udfff",
           "who", "Who is he", "  who is he", "\nwhat\n", "x" * 100000, " " * 70000, "é" * 30000,
           "Write a story in 500 words.", "Answer in 5 words", "in 12345 words", "in 123456 words",
           "in ５ words", "in ٣ words", "in\u00a05 words", "in 5\u2028words", "at most 3 pages", "at  most 3 pages",
           "In 50 Words", "about 7 bulletsx", "about 7 bullet_", "about 7 points!", "within 2 paragraphs",
           "tl;dr", "TL;DR", "in-depth", "top 10", "key points", "How does it work", "how do i",
           "\u212a" + "eep it short", "İstanbul?", "summarize" + "x" * 1300 + "list",
           "List" + " word" * 2000 + " why?", "a" * 6144 + " " + "b" * 4000, "a " * 5000 + "b" * 2100,
           ("alpha beta gamma. " * 5000), "tab\tsep\tlist\tof\titems"]
    # Around the hash window and block boundaries, with whitespace at and next to the cut points.
    for n in (8192, 8193, 8194, 9000, 12000):
        for ws_at in (6143, 6144, 6145, n - 2049, n - 2048, n - 2047):
            s = list("y" * n)
            if 0 <= ws_at < n:
                s[ws_at] = " "
            out.append("".join(s))
    return out


@functools.lru_cache(maxsize=1)
def corpus() -> list[str]:
    rng = random.Random(20261130)
    synth = [r.prompt for r in generate(700, seed=99, models=("Qwen3-8B",))]
    randoms = [_random_prompt(rng) for _ in range(2300)]
    return _special_prompts() + synth + randoms


# ==== prompt analysis ===========================================================================


def test_corpus_is_varied() -> None:
    c = corpus()
    lengths = [len(t.encode("utf-8", "replace")) for t in c]
    assert len(c) >= 3000
    assert min(lengths) == 0 and max(lengths) > 60_000
    assert sum(1 for t in c if not t.isascii()) > 300 and sum(1 for t in c if t.isascii()) > 1500
    assert sum(1 for t in c if t and t.isspace()) >= 5


def test_native_analysis_is_bit_identical_to_reference() -> None:
    assert F._INDICATORS is not None, "bear.libbea was built without the predictor functions"
    mismatches = []
    for text in corpus():
        ref = analyse(text)
        got = F.analyse(text)
        if not (np.array_equal(got.hashed, ref.hashed) and np.array_equal(got.scalars, ref.scalars)
                and got.n_pieces == ref.n_pieces and got.hashed.dtype == np.float64):
            mismatches.append(text[:80])
    assert not mismatches, mismatches[:5]


def test_python_fallback_is_the_reference() -> None:
    for text in corpus()[::7]:
        ref = analyse(text)
        got = F.analyse_py(text)
        assert np.array_equal(got.hashed, ref.hashed) and np.array_equal(got.scalars, ref.scalars)


def test_native_piece_hashes_and_counts_equal_reference() -> None:
    for text in corpus():
        ref = pieces(text)
        h, n_pieces, n_sent = libbea.prompt_piece_hashes(text)
        assert (n_pieces, n_sent) == (ref.n_pieces, ref.n_sentences), text[:80]
        assert h.dtype == np.uint64 and np.array_equal(h, ref.hashes), text[:80]
        vec, n2, s2, n_hashed = libbea.prompt_hashed(text.encode("utf-8", errors="replace"))
        assert (n2, s2, n_hashed) == (ref.n_pieces, ref.n_sentences, len(ref.hashes))
        assert np.array_equal(vec, hashed_vector(ref))
        assert text_pieces(text).n_pieces == ref.n_pieces  # text.py itself is unchanged


def test_native_indicators_equal_reference_on_ascii_and_decline_the_rest() -> None:
    done = 0
    for text in corpus():
        low = _indicator_text(text)
        got = F._INDICATORS.evaluate(low)
        if not low.isascii():
            assert got is None
            continue
        done += 1
        ref = analyse(text).scalars[4:]
        assert np.array_equal(got, ref), low[:80]
    assert done > 1500


def test_limit_regex_and_keyword_tables_unchanged() -> None:
    assert F._LIMIT.pattern == _LIMIT.pattern
    assert F._UNIT_WORDS == _UNIT_WORDS and F._QUESTION_WORDS == _QUESTION_WORDS
    assert list(F.TASK_INDICATORS) == list(TASK_INDICATORS)
    for name, ind in TASK_INDICATORS.items():
        assert F.TASK_INDICATORS[name].words == ind.words and F.TASK_INDICATORS[name].phrases == ind.phrases
    for mine, ref in ((F._BRIEF, _BRIEF), (F._DETAIL, _DETAIL)):
        assert (mine.words, mine.phrases) == (ref.words, ref.phrases)
    assert F.INDICATOR_SPAN == INDICATOR_SPAN and F.HASH_DIM == HASH_DIM


def test_native_prompt_functions_reject_wrong_types_and_survive_random_bytes() -> None:
    with pytest.raises(TypeError):
        libbea.prompt_hashed(123)
    with pytest.raises(TypeError):
        libbea.prompt_analyse("x", 1, 5, F._INDICATORS)
    rng = random.Random(5)
    for _ in range(3000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        vec, n_pieces, n_sent, n_hashed = libbea.prompt_hashed(data)
        assert n_pieces >= 0 and n_sent >= 0 and 0 <= n_hashed <= n_pieces and np.isfinite(vec).all()
        assert F._INDICATORS.evaluate(data.decode("latin-1").encode("ascii", "ignore").decode()) is not None
        _, _, n, ok = libbea.prompt_analyse(data, len(data), data, F._INDICATORS)
        assert n == n_pieces and ok == data.isascii()


@pytest.mark.parametrize(
    ("flags", "leads", "units", "factors", "qwords"),
    [
        ([(["Caps"], [], False)], [], [], [], []),  # words must be [a-z]+
        ([(["ok"], ["é"], False)], [], [], [], []),  # phrases must be ASCII
        ([([""], [], False)], [], [], [], []),
        ([(["a"], [], False)] * 65, [], [], [], []),  # at most 64 flags
        ([], ["9 lead"], ["word"], [1.0], []),  # leads start with a letter
        ([], ["in"], ["word", "page"], [1.0], []),  # one factor per unit
        ([("not a tuple of three",)], [], [], [], []),
    ],
)
def test_prompt_indicators_reject_bad_specs(flags, leads, units, factors, qwords) -> None:
    with pytest.raises((ValueError, TypeError)):
        libbea.PromptIndicators(flags, leads, units, factors, qwords)


# ==== trees =====================================================================================


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("native-model")
    train(list(generate(400, seed=21)), out, cfg=TrainConfig(rounds=60, test_fraction=0.0))
    return out


def _reference_predict(p: Predictor, prompt: str, models: list[str]) -> list[tuple[float, ...]]:
    """The predictor's computation before the native port: reference features, rows built by
    features.py, one LightGBM C-API call per head and row, numpy finalize."""
    a = analyse(prompt)
    X = F.rows_for_models(F.prompt_row(a, p.pca), [p._parts[m] for m in models])
    y = finalize({name: head.predict(X) for name, head in p.heads.items()})
    counts = p.tokens.counts(prompt, models, a.n_pieces)
    return [(y["acc"][i], y["len_mean"][i], y["len_p50"][i], y["len_p90"][i], counts[m],
             p.by_name[m].cost_usd(counts[m], float(y["len_mean"][i]))) for i, m in enumerate(models)]


def test_predictions_are_bit_identical_to_the_reference_pipeline(model_dir: Path) -> None:
    p = Predictor(model_dir)
    assert p.forest is not None, "native forest rejected at load time"
    models = p.models
    rng = random.Random(3)
    for prompt in corpus()[::3]:
        ms = rng.sample(models, rng.randint(1, len(models)))
        ref = _reference_predict(p, prompt, ms)
        got = p.predict(prompt, ms)
        wire = p.predict_wire(prompt, ms)
        for r, g in zip(ref, got, strict=True):
            assert (g.acc, g.len_mean, g.len_p50, g.len_p90) == tuple(float(x) for x in r[:4])
            assert (g.prompt_tokens, g.cost) == (r[4], r[5])
            assert wire[g.model] == g.to_wire()


def test_fallback_without_native_forest_gives_the_same_predictions(model_dir: Path) -> None:
    p = Predictor(model_dir)
    q = Predictor(model_dir)
    q.forest = None
    for prompt in corpus()[:: 23]:
        assert p.predict_wire(prompt, p.models) == q.predict_wire(prompt, q.models)


def _booster_with_missing_and_categories():
    import lightgbm as lgb

    rng = np.random.default_rng(4)
    n = 3000
    X = rng.normal(size=(n, 6))
    X[:, 1] = rng.integers(0, 45, n)  # categorical with > 32 categories: multi-word bitsets
    X[rng.random(n) < 0.15, 2] = np.nan  # NaN missing type
    X[rng.random(n) < 0.3, 3] = 0.0  # zero as missing
    y = X[:, 0] + np.where(np.isnan(X[:, 2]), 2.0, X[:, 2]) + (X[:, 1] % 7) * 0.3 + (X[:, 3] == 0) + rng.normal(0, 0.1, n)
    params = {"objective": "regression", "num_leaves": 31, "verbose": -1, "num_threads": 1, "min_data_in_leaf": 5,
              "zero_as_missing": False, "max_cat_to_onehot": 4, "cat_smooth": 1, "min_data_per_group": 5}
    b1 = lgb.train(params, lgb.Dataset(X, y, categorical_feature=[1]), num_boost_round=40)
    b2 = lgb.train({**params, "objective": "huber", "zero_as_missing": True},
                   lgb.Dataset(X, y, categorical_feature=[1]), num_boost_round=30)
    return b1, b2


def test_native_forest_matches_lightgbm_with_missing_values_and_categories() -> None:
    b1, b2 = _booster_with_missing_and_categories()
    text = b1.model_to_string() + b2.model_to_string()
    assert "cat_threshold" in text and "decision_type" in text
    nf = NativeForest.build({"a": b1, "b": b2})
    assert nf is not None
    rng = np.random.default_rng(8)
    X = rng.normal(size=(3000, 6)) * rng.choice([0.01, 1.0, 1e3], (3000, 1))
    X[:, 1] = rng.choice([-3.0, -0.5, 0.0, 0.7, 1.0, 7.0, 31.0, 32.0, 44.0, 45.0, 63.0, 64.0, 1e9, 3e9, 1e300, np.nan], 3000)
    X[rng.random(3000) < 0.1, 2] = np.nan
    X[rng.random(3000) < 0.1, 3] = 0.0
    X[rng.random(3000) < 0.05, 0] = 1e-40
    X[rng.random(3000) < 0.05, 4] = np.inf
    X[rng.random(3000) < 0.05, 5] = -np.inf
    got = nf.predict(X)
    for k, b in enumerate((b1, b2)):
        assert np.array_equal(got[k], FastBooster(b).predict(X))
        assert np.array_equal(got[k], b.predict(X, num_threads=1))
    # predict_parts builds the same rows.
    ids = [2, 0, 1]
    parts = X[:3, 4:]
    assert np.array_equal(nf.predict_parts(X[5, :2], X[5, 2:4], parts, ids),
                          nf.predict(np.hstack([np.tile(X[5, :4], (3, 1)), parts[ids]])))


def test_native_forest_declines_what_it_does_not_implement() -> None:
    import lightgbm as lgb

    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 3))
    y = (X[:, 0] > 0).astype(float)
    binary = lgb.train({"objective": "binary", "verbose": -1, "num_threads": 1}, lgb.Dataset(X, y), 5)
    assert NativeForest.build({"b": binary}) is None  # sigmoid output transform
    linear = lgb.train({"objective": "regression", "linear_tree": True, "verbose": -1, "num_threads": 1},
                       lgb.Dataset(X, X[:, 0] * 2), 5)
    assert NativeForest.build({"l": linear}) is None


def _tree(**kw):
    t = {"split_feature": [0, 1], "threshold": [0.5, 1.5], "decision_type": [2, 2], "left_child": [1, -1],
         "right_child": [-2, -3], "leaf_value": [0.1, 0.2, 0.3], "cat_boundaries": [], "cat_threshold": []}
    t.update(kw)
    return (np.asarray(t["split_feature"], dtype=np.int32), np.asarray(t["threshold"], dtype=np.float64),
            np.asarray(t["decision_type"], dtype=np.int8), np.asarray(t["left_child"], dtype=np.int32),
            np.asarray(t["right_child"], dtype=np.int32), np.asarray(t["leaf_value"], dtype=np.float64),
            np.asarray(t["cat_boundaries"], dtype=np.int32), np.asarray(t["cat_threshold"], dtype=np.uint32))


@pytest.mark.parametrize(
    "bad",
    [
        {"leaf_value": []},
        {"split_feature": [0]},  # wrong lengths
        {"left_child": [0, -1]},  # self loop
        {"left_child": [1, -1], "right_child": [-2, 0]},  # back edge
        {"left_child": [5, -1]},  # out of range
        {"right_child": [-4, -3]},  # leaf out of range
        {"split_feature": [0, 9]},  # feature out of range
        {"split_feature": [-1, 0]},
        {"threshold": [np.nan, 1.0]},
        {"leaf_value": [0.1, np.inf, 0.3]},
        {"leaf_value": [0.1, np.nan, 0.3]},
        {"decision_type": [1, 2]},  # categorical without bitsets
        {"decision_type": [1, 2], "threshold": [1.0, 1.5], "cat_boundaries": [0, 1], "cat_threshold": [3]},
        {"decision_type": [1, 2], "threshold": [0.5, 1.5], "cat_boundaries": [0, 1], "cat_threshold": [3]},
        {"decision_type": [1, 2], "threshold": [0.0, 1.5], "cat_boundaries": [0, 2], "cat_threshold": [3]},
        {"decision_type": [1, 2], "threshold": [0.0, 1.5], "cat_boundaries": [1, 1], "cat_threshold": []},
        {"cat_threshold": [1]},
        {"decision_type": [12, 2]},  # missing type 3 does not exist
    ],
)
def test_native_forest_rejects_malformed_trees(bad: dict) -> None:
    f = libbea.Forest(3)
    f.add_head()
    f.add_tree(*_tree())  # the unmodified tree is fine
    with pytest.raises(ValueError):
        f.add_tree(*_tree(**bad))
    assert f.n_trees == 1
    assert f.predict(np.zeros((2, 3))).shape == (1, 2)


def test_native_forest_call_errors() -> None:
    f = libbea.Forest(3)
    with pytest.raises(ValueError):
        f.add_tree(*_tree())  # no head yet
    f.add_head()
    f.add_tree(*_tree())
    with pytest.raises(ValueError):
        f.predict(np.zeros((2, 4)))
    with pytest.raises(ValueError):
        f.predict(np.zeros(3))
    with pytest.raises(ValueError):
        f.predict_parts(np.zeros(1), np.zeros(1), np.zeros((2, 1)), [2])
    with pytest.raises(ValueError):
        f.predict_parts(np.zeros(1), np.zeros(1), np.zeros((2, 2)), [0])
    assert f.predict(np.zeros((0, 3))).shape == (1, 0)
    assert f.predict_parts(np.zeros(1), np.zeros(1), np.zeros((2, 1)), []).shape == (1, 0)


def test_finalize_lists_equals_numpy_finalize() -> None:
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 1.5, np.inf, -np.inf, np.nan, 1e-300, 1 + 1e-15, 2.0])
    heads = ["acc", "len_mean", "len_p50", "len_p90"]
    for _ in range(5000):
        raw = rng.choice(special, (4, 3)) if rng.random() < 0.5 else rng.normal(1, 2, (4, rng.integers(1, 5)))
        ref = np.array([finalize(dict(zip(heads, raw.copy(), strict=True)))[h] for h in heads])
        got = np.array(finalize_lists(raw.tolist()))
        assert np.array_equal(ref, got, equal_nan=True) and np.array_equal(np.signbit(ref), np.signbit(got))


# ==== speed (a smoke bound, not the benchmark: see docs/predictor.md) ===========================


def test_native_analysis_is_much_faster_than_the_reference() -> None:
    texts = [t for t in corpus() if t.isascii()][:400]
    def clock(fn) -> float:
        best = math.inf
        for _ in range(3):
            t0 = time.process_time()
            for t in texts:
                fn(t)
            best = min(best, time.process_time() - t0)
        return best
    assert clock(F.analyse) * 3 < clock(analyse)


# ==== sanitizers ================================================================================


@pytest.mark.slow
def test_sanitized_predictor_fuzz(tmp_path: Path, sanitized_tool: Callable[[str], Path]) -> None:
    predictor_check = sanitized_tool("bea_predictor_check")
    rng = random.Random(9)
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    inputs = [t.encode("utf-8", "replace") for t in corpus()[::4]]
    inputs += [bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 63, 64, 65, 500, 9000]))) for _ in range(300)]
    for k, data in enumerate(inputs):
        (corpus_dir / f"{k:05d}").write_bytes(data)
    files = sorted(str(p) for p in corpus_dir.iterdir())
    accepted = 0
    for k in range(0, len(files), 300):
        out = subprocess.run([str(predictor_check), *files[k : k + 300]], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-4000:]
        m = re.search(r"checked (\d+) inputs, (\d+) trees accepted", out.stdout)
        assert m is not None, out.stdout
        accepted += int(m.group(2))
    assert accepted > 100  # valid forests were built and evaluated, not only rejected
