"""The predictor's prompt analysis (C++, ``features.analyse``) against its golden file, which pins
the counts, the piece hashes, the hashed vector and the indicators of 6,000+ prompts (trained models
depend on every bit of them); properties that hold for any input; wrong inputs and random bytes
never crash (and, under ASan+UBSan, never misbehave)."""

from __future__ import annotations

import random
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from predictor_golden import PROMPT_FORMAT, prompt_outputs, prompt_text, read_prompts

from bear import libbea
from bear.predictor import features as F
from bear.predictor.features import FEATURE_NAMES, analyse

SCALARS = FEATURE_NAMES[F.PCA_DIM : F.MODEL_ID_COLUMN]


@pytest.fixture(scope="module")
def golden() -> list[dict]:
    header, records = read_prompts()
    assert header["format"] == PROMPT_FORMAT and header["count"] == len(records)
    return records


def test_golden_prompts_are_varied(golden: list[dict]) -> None:
    texts = [prompt_text(r) for r in golden]
    sizes = [len(t.encode("utf-8", "surrogatepass")) for t in texts]
    assert len(texts) > 6000 and min(sizes) == 0 and max(sizes) >= 100_000
    assert sum(t.isascii() for t in texts) > 1000 and sum(not t.isascii() for t in texts) > 4000
    assert sum(bool(re.search("[\ud800-\udfff]", t)) for t in texts) > 100  # lone surrogates
    assert sum("\x00" in t for t in texts) > 10 and sum(bool(t) and t.isspace() for t in texts) >= 5
    assert sum(bool(re.search("[\u4e00-\u9fff]", t)) for t in texts) > 20  # CJK
    assert sum(bool(re.search("[\U0001F300-\U0001FAFF]", t)) for t in texts) > 20  # emoji
    on = np.array([r["out"]["scalars"][4:] for r in golden]) != 0
    assert on.sum(axis=0).min() >= 50  # every indicator fires often, and stays off often
    assert (~on).sum(axis=0).min() >= 50


def test_analysis_equals_the_golden_file(golden: list[dict]) -> None:
    wrong = []
    for r in golden:
        text = prompt_text(r)
        got = prompt_outputs(text)
        if got != r["out"]:
            diff = {k: (got[k], r["out"][k]) for k in got if got[k] != r["out"][k]}
            wrong.append(f"{text[:60]!a}: {diff}")
    assert not wrong, f"{len(wrong)} prompts differ from the golden file, e.g.\n" + "\n".join(wrong[:5])


def test_hashes_are_stable_values() -> None:
    # Also in the golden file (as digests); here readable: a change to the hash must be deliberate.
    expected = [3705514366459756000, 4411267083497889845]
    assert libbea.prompt_piece_hashes("bear router")[0].tolist() == expected
    assert libbea.prompt_piece_hashes("BEAR Router " * 200)[0][:2].tolist() == expected  # window of a long text


def test_pieces_counts_and_case_insensitive_hashes() -> None:
    h, n_pieces, n_sentences = libbea.prompt_piece_hashes("Hello, World! This is a test.  hello world")
    assert n_pieces == 11 and len(h) == 11 and n_sentences == 3
    assert h[0] == h[9] and h[2] == h[10]  # Hello == hello
    assert len(set(h[[0, 2, 4, 5, 6, 7]].tolist())) == 6
    a = analyse("")
    assert a.n_pieces == 0 and not a.hashed.any() and a.hashed.shape == (F.HASH_DIM,)


def test_long_prompts_hash_only_their_head_and_tail() -> None:
    long = "alpha beta gamma. " * 5000
    h, n_pieces, n_sentences = libbea.prompt_piece_hashes(long)
    assert n_pieces == 20000 and n_sentences == 5000
    assert len(h) < (6144 + 2048) // 4
    # The normalised vector of the window estimates the full one (equal here: a periodic text).
    assert np.allclose(analyse(long).hashed, analyse("alpha beta gamma. " * 100).hashed, atol=0.01)
    assert np.isclose(np.abs(analyse("one two three four five six").hashed).sum(), 1.0)


def test_indicators() -> None:
    def on(text: str) -> set[str]:
        return {n for n, v in zip(SCALARS, analyse(text).scalars, strict=True)
                if v and n.startswith(("task", "brief", "det"))}

    assert on("List five fruits.") == {"task_list"}
    assert on("Summarize the report briefly.") == {"task_summarize", "brief"}
    assert on("Who wrote Hamlet") == {"task_question"}
    assert on("Explain in detail how a compiler works") == {"task_explain", "detailed"}
    assert on("\u212aeep it short") == {"brief"}  # KELVIN SIGN lower-cases to "k"
    limit = dict(zip(SCALARS, analyse("Write a story in 500 words.").scalars, strict=True))["limit_words"]
    assert limit == np.log1p(500)
    assert analyse("in ５０ words").scalars[4] == np.log1p(50)  # any script's decimal digits
    assert analyse("é" * 700 + " in 9 words").scalars[4] == np.log1p(9)  # the last 600 characters
    assert analyse("in 9 words" + "é" * 600).scalars[4] == 0.0  # ... not the last 600 bytes


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=1500))
def test_str_and_its_utf8_bytes_give_the_same_analysis(text: str) -> None:
    a, b = analyse(text), libbea.prompt_analyse(text.encode("utf-8"), F._INDICATORS)
    assert np.array_equal(a.hashed, b[0]) and np.array_equal(a.scalars, b[1]) and a.n_pieces == b[2]


def test_wrong_types_are_rejected_and_random_bytes_are_defined() -> None:
    with pytest.raises(TypeError):
        libbea.prompt_analyse(123, F._INDICATORS)
    with pytest.raises(TypeError):
        libbea.prompt_piece_hashes(None)
    rng = random.Random(5)
    for _ in range(3000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 7, 63, 64, 300, 1300, 3000])))
        hashed, scalars, n_pieces = libbea.prompt_analyse(data, F._INDICATORS)
        h, n2, n_sentences = libbea.prompt_piece_hashes(data)
        assert n_pieces == n2 >= len(h) and n_sentences >= 0 and np.isfinite(hashed).all()
        assert np.isfinite(scalars).all() and set(scalars[5:].tolist()) <= {0.0, 1.0}
        assert 0 < scalars[1] <= len(data) or scalars[1] == len(data) == 0  # code points
        assert np.array_equal(hashed, libbea.prompt_analyse(data, F._INDICATORS)[0])  # deterministic


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


@pytest.mark.slow
def test_sanitized_prompt_and_forest_fuzz(golden: list[dict], tmp_path: Path,
                                          sanitized_tool: Callable[[str], Path]) -> None:
    """libbea/fuzz/predictor_check.cpp under ASan+UBSan: golden prompts, random bytes, and the
    same bytes read as (mostly malformed) forests."""
    predictor_check = sanitized_tool("bea_predictor_check")
    rng = random.Random(9)
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    inputs = [prompt_text(r).encode("utf-8", "surrogatepass") for r in golden[::5]]
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
