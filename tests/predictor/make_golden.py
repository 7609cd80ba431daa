"""Writes the predictor's golden files (tests/predictor/data, see ``predictor_golden``) from the
current implementation.

Run only to regenerate after an intended change — a new hash or indicator, a retrained model
format, a LightGBM upgrade that changes what a model text means:

    .venv/bin/python tests/predictor/make_golden.py

``--unicode-header`` instead writes libbea/include/bea/prompt_unicode.h, the character classes
the C++ indicators use, from this Python's ``re`` (the golden prompts probe every edge of them).

The tests compare the implementation against these files, so regenerating them makes the tests
pass by definition: say in the commit which outputs changed and why. Trained models depend on the
prompt features; changing them invalidates every model directory trained before.
"""

from __future__ import annotations

import json
import random
import re
import sys
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
from predictor_golden import (
    MODEL_FILE,
    MODEL_FORMAT,
    PROMPT_FILE,
    PROMPT_FORMAT,
    prompt_outputs,
    prompt_text,
    read_prompts,
    write_gz,
)

from bear.predictor.features import TASK_INDICATORS
from bear.predictor.synth import generate

Prompt = dict[str, Any]  # {"text": str} or {"runs": [[piece, times], ...]}

# ---- prompts -------------------------------------------------------------------------------------

_KEYWORDS = sorted({w for ind in TASK_INDICATORS.values() for w in ind.words}
                   | set("briefly brief short concise detailed comprehensive thorough long lengthy".split())
                   | set("who what when where which why how is are did does do can".split()))
_PHRASES = ["one sentence", "single sentence", "one word", "a few words", "tl;dr", "in short", "in detail",
            "in depth", "in-depth", "step by step", "at length", "top 10", "top five", "key points", "how does",
            "how do", "what causes"]
_LEADS = ["in", "within", "under", "at most", "no more than", "about", "around", "approximately", "up to",
          "exactly", "fewer than", "less than", "inside", "at  most", "abouts"]
_UNITS = ["word", "token", "sentence", "paragraph", "line", "item", "bullet", "point", "page", "character",
          "words", "pages", "wordsx", "word_", "word2", "Words", "sentences."]
# Whitespace and look-alikes: ASCII, the \x1c-\x1f separators Python counts as space, Unicode spaces.
_SPACES = [" ", "  ", "\n", "\t", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u2028", "\u3000", ""]
_DIGITS = ["5", "50", "300", "12345", "123456", "007", "٣", "５", "1 000", "2.5", "²", "𝟓𝟎", "߃", "৪২"]
_ODD = ["é", "ß", "İ", "\u212a", "ﬁ", "Σ", "ΑΣ", "日本語", "😀", "\x00", "\ud800", "\udfff", "a\u0301", "Ⅻ", "_", "-",
        "'", ";", "?", ".", "!", "...", "?!", "\u200b", "\ufeff", "한국어", "Ⓐ", "½", "\u0307", "\U0010ffff"]


def _t(text: str) -> Prompt:
    return {"text": text}


def _runs(*runs: tuple[str, int]) -> Prompt:
    return {"runs": [[piece, times] for piece, times in runs]}


def special() -> list[Prompt]:
    texts = ["", " ", "\n", "\t\n \r", "   \x1c\x1d\x1e\x1f  ", "?", ".", "a", "A.", "!?", "\x00", "\x00\x00a\x00",
             "\ud800\udfff", "\ud83d\ude00", "😀", "who", "Who is he", "  who is he", "\nwhat\n", "bear router",
             "Hello, World! This is a test.  hello world", "Write a story in 500 words.", "Answer in 5 words",
             "in 12345 words", "in 123456 words", "in ５ words", "in ٣ words", "in\u00a05 words", "in 5\u2028words",
             "at most 3 pages", "at  most 3 pages", "In 50 Words", "about 7 bulletsx", "about 7 bullet_",
             "about 7 points!", "within 2 paragraphs", "in 0 words", "in 00000 words", "in 99999 characters",
             "tl;dr", "TL;DR", "in-depth", "top 10", "key points", "How does it work", "how do i",
             "\u212a" + "eep it short", "İstanbul?", "İn 5 words", "wİth 5 words", "in 5 words\u0307",
             "tab\tsep\tlist\tof\titems", "it is done?\udfff", "it is done?\ud800 ", "done? \x85", "done?\u3000",
             "ΑΣ list", "ὈΔΥΣΣΕΎΣ summary", "ǅ ǈ ǋ", "ﬃ ﬆ", "Straße in 3 words", "\ufeffwho", "\u200bwho",
             "a\u0301 list", "e\u0301xplain", "日本語で説明してください", "請用50個字總結", "😀 write a poem 😀",
             "\U0001F468\u200d\U0001F469\u200d\U0001F467 story", "x" * 511, "x" * 512, "x" * 513,
             "Summarize:" + " word" * 300 + " in 20 words."]
    out = [_t(t) for t in texts]
    out += [
        _runs(("x", 100_000)),
        _runs((" ", 70_000)),
        _runs(("é", 30_000)),
        _runs(("日", 20_000), ("?", 1)),
        _runs(("alpha beta gamma. ", 5000)),
        _runs(("summarize", 1), ("x", 1300), ("list", 1)),
        _runs(("List", 1), (" word", 2000), (" why?", 1)),
        _runs(("a", 6144), (" ", 1), ("b", 4000)),
        _runs(("a ", 5000), ("b", 2100)),
        _runs(("Explain in detail ", 1), ("the budget deficit was audited. ", 3200), ("Summarize briefly.", 1)),
        _runs(("Who wrote this? ", 1), ("ü ", 50_000), ("in 40 words", 1)),
        _runs(("😀", 25_000), (" in 3 sentences", 1)),
    ]
    return out


def _python_classes() -> tuple[list[list[int]], list[int], list[int]]:
    """Non-ASCII code points as Python's ``re`` sees them: ranges of \\w, the \\s code points,
    the \\d code points."""
    w, s, d = re.compile(r"\w"), re.compile(r"\s"), re.compile(r"\d")
    ranges: list[list[int]] = []
    spaces, digits = [], []
    for cp in range(0x80, 0x110000):
        c = chr(cp)
        if w.match(c):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
        if s.match(c):
            spaces.append(cp)
        if d.match(c):
            digits.append(cp)
    return ranges, spaces, digits


def unicode_probes() -> list[Prompt]:
    """Prompts whose indicators depend on one code point's class: \\w at both ends of every \\w
    range (before a limit lead, after a unit), \\s between the limit's parts and at the ends of a
    question, every \\d code point as the limit's number, case mappings that yield ASCII."""
    ranges, spaces, digits = _python_classes()
    out: list[Prompt] = []
    edges = sorted({cp for a, b in ranges for cp in (a - 1, a, b, b + 1) if cp >= 0x80})
    for k, cp in enumerate(edges):
        c = chr(cp)
        out.append(_t(f"{c}in 5 words"))
        if k % 4 == 0:
            out.append(_t(f"about 7 lines{c}"))
        if k % 8 == 0:
            out.append(_t(f"{c}{c.upper()} who?"))
    for cp in sorted({*spaces, *(x + 1 for x in spaces), *(x - 1 for x in spaces), *range(0x1C, 0x21)}):
        c = chr(cp)
        out += [_t(f"in{c}5{c}words"), _t(f"is it done?{c}"), _t(f"{c}who knows"), _t(f"under 9 pages{c}{c}")]
    for k, cp in enumerate(digits):
        c = chr(cp)
        out.append(_t(f"in {c} words"))
        if k % 7 == 0:
            out.append(_t(f"at most {c}{chr(digits[(k * 13) % len(digits)])}{c}0 tokens"))
        if k % 11 == 0:
            out.append(_t(f"in {c * 6} words"))
    for cp in range(0x80, 0x110000):  # non-ASCII code points whose lower case has ASCII or many code points
        low = chr(cp).lower()
        if len(low) != 1 or low.isascii():
            c = chr(cp)
            # The ASCII it yields joins words and phrases; what follows it is \w or not.
            out += [_t(f"{c} in 5 words"), _t(f"x{c}in 5 words"), _t(f"{c}n 5 words"), _t(f"in 5 words{c}"),
                    _t(f"w{c}th 3 items"), _t(f"{c}ey points"), _t(f"the {c}ey points?"), _t(f"\u212aeep {c} short"),
                    _t(f"{c}s it"), _t(f"{c * 40}who")]
    return out


def window_probes() -> list[Prompt]:
    """Prompts at the edges of the windows: the indicators' first/last 600 code points (counted in
    code points, so multi-byte characters move the byte offsets), the question rule's first 80
    code points, the hash window's head/tail cut points, and 64-byte blocks of the counts."""
    out: list[Prompt] = []
    span = 600  # bea::prompt::kIndicatorSpan
    for fill in ("x", "é", "日", "😀", " ", "\u3000", "\ud800"):
        for n in (2 * span - 1, 2 * span, 2 * span + 1):
            for word, at in (("list", 0), ("list", span - 4), ("list", span - 3), ("why?", n - 4), ("brief", n - span),
                             ("brief", n - span - 1)):
                body = fill * n
                out.append(_t(body[:at] + word + body[at + len(word) :]))
    for fill in (" ", "\u3000", "\xa0", "é"):
        for k in (76, 77, 78, 79, 80):
            out.append(_t(fill * k + "who is it"))
            out.append(_t("intro\n" + fill * k + "what now"))
    for n in (8192, 8193, 8194, 9000, 12000):
        for ws_at in (6143, 6144, 6145, n - 2049, n - 2048, n - 2047):
            for ws in (" ", "\n", "\t", "\r", "\x0b"):
                out.append(_runs(("y", ws_at), (ws, 1), ("y", n - ws_at - 1)))
    for n in (62, 63, 64, 65, 127, 128, 129, 191, 192, 193):
        for tail in (".", "a", " ", ". ", "?\n", "é"):
            out.append(_t(("ab. " * 64)[: n - len(tail)] + tail))
    return out


def synthetic() -> list[Prompt]:
    """Prompts of the four synthetic task families (the long ones fewer: they are most of the bytes)."""
    recs = list(generate(160, seed=99, models=("Qwen3-8B",)))
    short = [r.prompt for r in recs if r.task in ("alpaca", "writingprompts")]
    long = [r.prompt for r in recs if r.task not in ("alpaca", "writingprompts") and len(r.prompt) < 12_000]
    return [_t(p) for p in short + long[:16]]


def _phrase(rng: random.Random, ascii_only: bool) -> str:
    pick = [x for x in (_SPACES, _DIGITS, _ODD)]
    spaces, digits, odd = ([x for x in p if x.isascii()] for p in pick) if ascii_only else pick
    kind = rng.random()
    if kind < 0.25:
        return rng.choice(_LEADS) + rng.choice(spaces) + rng.choice(digits) + rng.choice(spaces) + rng.choice(_UNITS)
    if kind < 0.45:
        w = rng.choice(_KEYWORDS)
        return w.upper() if rng.random() < 0.2 else (w.capitalize() if rng.random() < 0.3 else w)
    if kind < 0.6:
        return rng.choice(_PHRASES)
    if kind < 0.9:
        return rng.choice(odd)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABC0123456789") for _ in range(rng.randint(1, 12)))


def _mix(rng: random.Random, target: int, ascii_only: bool) -> str:
    spaces = [x for x in _SPACES if x.isascii()] if ascii_only else _SPACES
    parts: list[str] = []
    size = 0
    while size < target:
        p = _phrase(rng, ascii_only) + rng.choice(spaces)
        parts.append(p)
        size += len(p)
    text = "".join(parts)
    if rng.random() < 0.3 and text:
        text = text[: rng.randint(0, len(text))]
    if rng.random() < 0.1:
        text += rng.choice(["?", "? ", "?\n\n", ".", "\n", " \x1c", "?\u3000"])
    return text


def random_mixes(n: int) -> list[Prompt]:
    """Random mixes of keywords, phrases, limit phrases with odd spacing and digits, and odd
    characters; some of them long (a random head and tail around a repeated middle)."""
    rng = random.Random(20261130)
    out: list[Prompt] = []
    for _ in range(n):
        ascii_only = rng.random() < 0.6
        if rng.random() < 0.06:
            head = _mix(rng, rng.choice([600, 1300, 1300, 6200]), ascii_only)
            middle = rng.choice(["x", "é", " ", "\n", ".", "word ", "a.b "])
            tail = _mix(rng, rng.choice([300, 700, 700, 2100]), ascii_only)
            out.append(_runs((head, 1), (middle, rng.randint(100, 9000)), (tail, 1)))
        else:
            out.append(_t(_mix(rng, rng.choice([0, 1, 3, 20, 40, 80, 150, 300, 511, 512, 513, 600, 1201, 1300]),
                               ascii_only)))
    return out


def _split_pairs(s: str) -> list[str]:
    """``s`` cut between every high surrogate and a low surrogate after it."""
    cuts = [m.end() for m in re.finditer("[\\ud800-\\udbff](?=[\\udc00-\\udfff])", s)]
    return [s[i:j] for i, j in zip([0, *cuts], [*cuts, len(s)], strict=True)]


def _json_safe(p: Prompt) -> Prompt:
    """JSON reads an escaped high + low surrogate as one character: split such pairs into runs."""
    runs = [[p["text"], 1]] if "text" in p else p["runs"]
    out: list[list[Any]] = []
    for piece, times in runs:
        parts = _split_pairs(piece)
        if len(parts) > 1 and times != 1:
            raise ValueError("a repeated run with a surrogate pair")
        out += [[x, times] for x in parts]
    return p if len(out) == len(runs) else {"runs": out}


def write_prompts() -> list[str]:
    prompts = [_json_safe(p) for p in special() + unicode_probes() + window_probes() + synthetic() + random_mixes(1200)]
    header = {"format": PROMPT_FORMAT, "python": sys.version.split()[0], "unicode": unicodedata.unidata_version,
              "count": len(prompts), "note": "written by tests/predictor/make_golden.py; see predictor_golden.py"}
    lines = [json.dumps(header)]
    texts = []
    for p in prompts:
        text = prompt_text(p)
        texts.append(text)
        lines.append(json.dumps({**p, "out": prompt_outputs(text)}, separators=(",", ":")))
    write_gz(PROMPT_FILE, lines)
    assert [prompt_text(r) for r in read_prompts()[1]] == texts, "the file does not give back the prompts"
    print(f"{PROMPT_FILE}: {len(prompts)} prompts, {PROMPT_FILE.stat().st_size} bytes")
    return texts


# ---- models ------------------------------------------------------------------------------------


def _boosters_with_missing_and_categories() -> dict[str, Any]:
    import lightgbm as lgb

    rng = np.random.default_rng(4)
    n = 3000
    X = rng.normal(size=(n, 6))
    X[:, 1] = rng.integers(0, 45, n)  # categorical with > 32 categories: multi-word bitsets
    X[rng.random(n) < 0.15, 2] = np.nan  # NaN missing type
    X[rng.random(n) < 0.3, 3] = 0.0  # zero as missing
    y = X[:, 0] + np.where(np.isnan(X[:, 2]), 2.0, X[:, 2]) + (X[:, 1] % 7) * 0.3 + (X[:, 3] == 0) + rng.normal(0, 0.1, n)
    params = {"objective": "regression", "num_leaves": 15, "verbose": -1, "num_threads": 1, "min_data_in_leaf": 5,
              "zero_as_missing": False, "max_cat_to_onehot": 4, "cat_smooth": 1, "min_data_per_group": 5, "seed": 1}
    return {
        "nan_categories": lgb.train(params, lgb.Dataset(X, y, categorical_feature=[1]), num_boost_round=25),
        "zero_missing_huber": lgb.train({**params, "objective": "huber", "zero_as_missing": True},
                                        lgb.Dataset(X, y, categorical_feature=[1]), num_boost_round=20),
    }


def _special_rows(rng: np.random.Generator, n: int, nf: int, cat: int) -> np.ndarray:
    X = rng.normal(size=(n, nf)) * rng.choice([0.01, 1.0, 1e3], (n, 1))
    X[:, cat] = rng.choice([-3.0, -0.5, -0.0, 0.0, 0.7, 1.0, 2.0, 7.0, 31.0, 32.0, 44.0, 45.0, 63.0, 64.0, 1e9, 3e9,
                            1e300, np.nan, np.inf], n)
    for value, frac in ((np.nan, 0.08), (0.0, 0.08), (-0.0, 0.03), (1e-40, 0.04), (-1e-40, 0.02), (np.inf, 0.03),
                        (-np.inf, 0.03)):
        mask = rng.random((n, nf)) < frac
        mask[:, cat] = False
        X[mask] = value
    return X


def write_model(texts: list[str], tmp: Path) -> None:
    import lightgbm as lgb

    from bear.predictor.features import MODEL_ID_COLUMN, analyse, model_part
    from bear.predictor.runtime import Predictor
    from bear.predictor.train import HEADS, TrainConfig, train

    model_dir = tmp / "model"
    train(list(generate(300, seed=21)), model_dir, cfg=TrainConfig(rounds=25, test_fraction=0.0))
    files = {p.name: p.read_text() for p in sorted(model_dir.iterdir()) if p.suffix in (".json", ".txt")}
    predictor = Predictor(model_dir)
    assert predictor.forest is not None, "the native forest must serve a model that train writes"
    heads = {name: lgb.Booster(model_file=str(model_dir / f"{name}.txt")) for name in HEADS}
    extra = _boosters_with_missing_and_categories()
    rng = np.random.default_rng(8)
    # Feature rows as the model sees them: PCA of the hashed vector, the scalars, the model's part.
    real = np.vstack([np.concatenate([predictor.pca.project(a.hashed), a.scalars, model_part(i, spec)])
                      for a in map(analyse, texts[::400]) for i, spec in enumerate(predictor.specs)])
    rows = {
        "model_dir": np.vstack([real, _special_rows(rng, 100, real.shape[1], MODEL_ID_COLUMN)]),
        "missing_categories": _special_rows(rng, 500, 6, 1),
    }
    raw = {
        "model_dir": {k: b.predict(rows["model_dir"], raw_score=True, num_threads=1).tolist() for k, b in heads.items()},
        "missing_categories": {k: b.predict(rows["missing_categories"], raw_score=True, num_threads=1).tolist()
                               for k, b in extra.items()},
    }
    rng_p = random.Random(3)
    served = []
    for i in range(0, len(texts), 29):
        models = rng_p.sample(predictor.models, rng_p.randint(1, len(predictor.models)))
        served.append([i, models, predictor.predict_wire(texts[i], models)])
    golden = {
        "format": MODEL_FORMAT,
        "note": "written by tests/predictor/make_golden.py; see predictor_golden.py",
        "model_dir": files,
        "boosters": {k: b.model_to_string() for k, b in extra.items()},
        "rows": {k: v.tolist() for k, v in rows.items()},
        "raw": raw,
        "served": served,
    }
    write_gz(MODEL_FILE, [json.dumps(golden, separators=(",", ":"))])
    print(f"{MODEL_FILE}: {sum(len(v) for v in rows.values())} rows, {len(served)} served prompts, "
          f"{MODEL_FILE.stat().st_size} bytes")


UNICODE_HEADER = Path(__file__).parents[2] / "libbea" / "include" / "bea" / "prompt_unicode.h"


def write_unicode_header(path: Path = UNICODE_HEADER) -> None:
    ranges, spaces, digits = _python_classes()
    zeros = [cp for cp in digits if unicodedata.decimal(chr(cp)) == 0]
    assert all(unicodedata.decimal(chr(cp)) == cp - max(z for z in zeros if z <= cp) for cp in digits)
    assert all(chr(cp).lower() == chr(cp) or len(chr(cp).lower()) == 1 for cp in spaces + digits)

    def rows(items: list[str], per_line: int) -> str:
        return "\n".join("    " + " ".join(items[i : i + per_line]) for i in range(0, len(items), per_line))

    text = f"""// Generated by tests/predictor/make_golden.py --unicode-header: do not edit.
// The non-ASCII character classes of Python {sys.version.split()[0]}'s re module (Unicode {unicodedata.unidata_version}), which the
// predictor's indicators were defined with: \\s, \\d (decimal digits, in runs 0..9) and \\w.
#pragma once

#include <cstdint>

namespace bea {{
namespace prompt {{
namespace unicode {{

constexpr uint32_t kSpaces[] = {{
{rows([f"0x{cp:X}," for cp in spaces], 10)}
}};

// First code point (digit 0) of each run of ten decimal digits.
constexpr uint32_t kDigitZeros[] = {{
{rows([f"0x{cp:X}," for cp in zeros], 10)}
}};

// [first, last] code point ranges of \\w (letters, digits, numbers and '_' as Python's str.isalnum).
constexpr uint32_t kWordRanges[][2] = {{
{rows([f"{{0x{a:X}, 0x{b:X}}}," for a, b in ranges], 6)}
}};

}}  // namespace unicode
}}  // namespace prompt
}}  // namespace bea
"""
    path.write_text(text)
    print(f"{path}: {len(spaces)} spaces, {len(zeros)} digit runs, {len(ranges)} word ranges")


def main() -> None:
    import os
    import tempfile

    if sys.argv[1:] == ["--unicode-header"]:
        write_unicode_header()
        return

    os.environ["HF_HOME"] = tempfile.mkdtemp()  # no tokenizer files: the served counts are the fallback
    PROMPT_FILE.parent.mkdir(parents=True, exist_ok=True)
    texts = write_prompts()
    with tempfile.TemporaryDirectory() as tmp:
        write_model(texts, Path(tmp))


if __name__ == "__main__":
    main()
