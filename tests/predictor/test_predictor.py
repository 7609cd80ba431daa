"""Predictor: the served replies of the golden model directory, training on SYNTHETIC data (bear
data synth), held-out quality, cost, tokenizer counts, dataset format, CLI. (The prompt analysis
and the trees against their golden files: test_prompt_analysis.py, test_forest.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pytest
from predictor_golden import prompt_text, read_model, read_prompts, write_model_dir

from bear.predictor.dataset import Record, read_records, write_records
from bear.predictor.evaluate import evaluate, r2
from bear.predictor.features import analyse
from bear.predictor.models import DEFAULT_MODELS
from bear.predictor.runtime import Predictor, finalize
from bear.predictor.synth import TABLE2, TASKS, generate
from bear.predictor.train import HEADS, Matrix, TrainConfig, train
from bear.protocol.errors import BearError, ErrorCode

N_QUERIES = 1200  # x 3 models = 3600 records


@pytest.fixture(scope="module")
def records() -> list[Record]:
    return list(generate(N_QUERIES, seed=11))


@pytest.fixture(scope="module")
def trained(records: list[Record], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Matrix, Matrix]:
    out = tmp_path_factory.mktemp("predictor")
    m_train, m_test = train(records, out, cfg=TrainConfig(rounds=150, learning_rate=0.08, test_fraction=0.25))
    return out, m_train, m_test


@pytest.fixture(scope="module")
def predictor(trained: tuple[Path, Matrix, Matrix]) -> Predictor:
    return Predictor(trained[0])


# --- the served predictions of the golden model directory ----------------------------------------


def test_served_predictions_equal_the_golden_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Features, PCA, trees, finalize and cost together: the replies recorded for the golden model
    directory (tests/predictor/data, written by make_golden.py) to golden prompts, exactly."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf"))  # no tokenizer: the fallback counts, as recorded
    golden = read_model()
    p = Predictor(write_model_dir(golden, tmp_path / "model"))
    texts = [prompt_text(r) for r in read_prompts()[1]]
    assert len(golden["served"]) > 200
    for i, models, reply in golden["served"]:
        assert p.predict_wire(texts[i], models) == reply, ascii(texts[i][:60])


def test_finalize_clips_orders_and_propagates_nan() -> None:
    nan, inf = float("nan"), float("inf")
    acc, mean, p50, p90 = finalize([[-0.5, 0.3, 1.5, -0.0, nan], [0.2, 5.0, -inf, nan, 1.0],
                                    [0.5, 7.0, 3.0, 2.0, nan], [9.0, 6.0, 1.0, nan, 2.0]])
    assert acc[:4] == [0.0, 0.3, 1.0, -0.0] and math.copysign(1.0, acc[3]) == -1.0 and math.isnan(acc[4])
    assert mean[:3] == [1.0, 5.0, 1.0] and math.isnan(mean[3])
    assert p50[:4] == [1.0, 7.0, 3.0, 2.0] and math.isnan(p50[4])
    assert p90[:3] == [9.0, 7.0, 3.0] and math.isnan(p90[3]) and math.isnan(p90[4])  # p90 ≥ p50


# --- the synthetic data and the trained heads --------------------------------------------------


def test_synthetic_data_matches_table2_and_regimes(records: list[Record]) -> None:
    assert all(r.synthetic for r in records)
    for task in TASKS:
        for model, level in TABLE2[task].items():
            q = [r.quality for r in records if r.task == task and r.model == model]
            assert abs(np.mean(q) - level) < 0.04, (task, model)
    med_prompt = {t: np.median([r.prompt_tokens for r in records if r.task == t]) for t in TASKS}
    med_out = {t: np.median([r.output_tokens for r in records if r.task == t]) for t in TASKS}
    assert med_prompt["alpaca"] < 200 and med_prompt["writingprompts"] < 200
    assert med_prompt["hotpotqa"] > 500 and med_prompt["govreport"] > 1500
    assert med_out["hotpotqa"] < 150 and med_out["alpaca"] < 300
    assert med_out["govreport"] > 250 and med_out["writingprompts"] > 400
    assert max(r.prompt_tokens or 0 for r in records) > 5000


def test_length_model_learned(trained: tuple[Path, Matrix, Matrix], predictor: Predictor) -> None:
    report = evaluate(predictor, trained[2])
    assert report["overall"]["len_r2"] >= 0.6
    assert 0.35 <= report["overall"]["cover_p50"] <= 0.65
    assert report["overall"]["cover_p90"] >= 0.7


def test_quality_model_learned_ranking_and_beats_per_model_mean(trained: tuple[Path, Matrix, Matrix],
                                                                  predictor: Predictor) -> None:
    _, m_train, m_test = trained
    report = evaluate(predictor, m_test)
    for task, r in report["ranking"].items():
        assert r["match"], (task, r)
        assert r["true"] == ["Qwen3-32B", "Qwen3-8B", "Qwen3-0.6B"]
    # Baseline without the prompt: the training mean quality of each model.
    means = {m: m_train.quality[np.array(m_train.models) == m].mean() for m in set(m_train.models)}
    baseline = np.array([means[m] for m in m_test.models])
    pred = np.clip(predictor.raw_scores(m_test.X)[0], 0, 1)
    assert np.mean(np.abs(pred - m_test.quality)) < 0.6 * np.mean(np.abs(baseline - m_test.quality))
    assert r2(m_test.quality, pred) > 0.7


def test_the_native_forest_serves_what_train_writes(predictor: Predictor,
                                                    trained: tuple[Path, Matrix, Matrix]) -> None:
    assert predictor.forest is not None
    X = trained[2].X
    for k, head in enumerate(HEADS):
        booster = lgb.Booster(model_file=str(trained[0] / f"{head}.txt"))
        assert np.array_equal(predictor.raw_scores(X)[k], booster.predict(X, num_threads=1)), head


def test_predict_cost_and_quantile_order(predictor: Predictor) -> None:
    prompt = "Write a story in 800 words.\n\n[WP] The moon files a complaint."
    preds = predictor.predict(prompt, ["Qwen3-32B", "Qwen3-0.6B"])
    assert [p.model for p in preds] == ["Qwen3-32B", "Qwen3-0.6B"]
    specs = {s.name: s for s in DEFAULT_MODELS}
    for p in preds:
        s = specs[p.model]
        assert p.prompt_tokens == analyse(prompt).n_pieces  # no tokenizer here: the fallback
        assert np.isclose(p.cost, (p.prompt_tokens * s.price_in + p.len_mean * s.price_out) / 1e6)
        assert 1 <= p.len_p50 <= p.len_p90 and 0 <= p.acc <= 1
        assert 500 < p.len_mean < 2000  # "in 800 words" → ~1000 tokens
    assert preds[0].acc > preds[1].acc
    short = predictor.predict("Answer briefly: what is the capital of France?", ["Qwen3-8B"])[0]
    assert short.len_mean < preds[0].len_mean / 3
    given = predictor.predict(prompt, ["Qwen3-8B"], {"Qwen3-8B": 1000})[0]
    assert given.prompt_tokens == 1000
    with pytest.raises(BearError) as e:
        predictor.predict(prompt, ["gpt-9"])
    assert e.value.code == ErrorCode.NOT_FOUND


def test_local_tokenizer_is_used(trained: tuple[Path, Matrix, Matrix], tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A character-level tokenizer: its counts differ from the piece fallback on purpose.
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ,.?!")} | {"[UNK]": 99}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    (tmp_path / "Qwen3-8B").mkdir()
    tok.save(str(tmp_path / "Qwen3-8B" / "tokenizer.json"))
    p = Predictor(trained[0], tokenizer_dir=tmp_path)
    assert p.tokens.source("Qwen3-8B").endswith("tokenizer.json") and p.tokens.source("Qwen3-0.6B") == "fallback"
    text = "hello world, how are you?"
    by = {x.model: x.prompt_tokens for x in p.predict(text, ["Qwen3-8B", "Qwen3-0.6B"])}
    assert by["Qwen3-8B"] == len(tok.encode(text, add_special_tokens=False).ids) == len(text)
    assert by["Qwen3-0.6B"] == analyse(text).n_pieces == 7


def test_local_tokenizer_loads_through_the_routers_loader(trained: tuple[Path, Matrix, Matrix],
                                                          tmp_path: Path) -> None:
    """One loader (bear.tokenizer.loader): a broken tokenizer.json is the router's BundleError here too."""
    from bear.tokenizer.bundle import BundleError

    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "tokenizer.json").write_text("{not json")
    with pytest.raises(BundleError):
        Predictor(trained[0], tokenizer_dir=tmp_path)


def test_model_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(BearError) as e:
        Predictor(tmp_path)
    assert e.value.code == ErrorCode.UNAVAILABLE


# --- dataset format and CLI ------------------------------------------------------------------


def test_dataset_roundtrip_and_validation(tmp_path: Path, records: list[Record]) -> None:
    path = tmp_path / "d.jsonl.gz"
    assert write_records(path, records[:30]) == 30
    back = read_records(path)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in records[:30]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "task": "t", "model": "m", "quality": 1.5, "output_tokens": 3}) + "\n")
    with pytest.raises(BearError, match=r"bad.jsonl:1"):
        read_records(bad)
    bad.write_text('{"prompt": "x"\n')
    with pytest.raises(BearError, match="not JSON"):
        read_records(bad)


def test_cli_synth_and_train(tmp_path: Path) -> None:
    import subprocess
    import sys

    def bear(*args: str) -> None:
        res = subprocess.run([sys.executable, "-m", "bear", *args, "--log-format", "json"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr

    data = tmp_path / "s.jsonl"
    bear("data", "synth", "--out", str(data), "--queries", "120", "--seed", "3")
    assert len(read_records(data)) == 360
    out = tmp_path / "model"
    bear("predictor", "train", "--data", str(data), "--out", str(out), "--rounds", "20")
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"overall", "by_task_model", "ranking"}
    assert (out / "report.png").stat().st_size > 10_000
    assert Predictor(out).models == ["Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B"]
