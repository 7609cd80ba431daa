"""The predictor's trees (C++, ``forest.NativeForest``) against LightGBM's raw scores in the golden
file: the heads of a model directory ``bear predictor train`` wrote (categorical model id) and
boosters with NaN / zero missing types and a 45-category feature, on rows with NaN, ±0, ±inf,
values below LightGBM's zero threshold and out-of-range categories. Models the forest does not
implement, and a forest that disagrees with LightGBM at load time, are served by
``Booster.predict``. Malformed trees and wrong arguments raise, never crash."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pytest
from predictor_golden import MODEL_FORMAT, read_model, write_model_dir

from bear import libbea
from bear.predictor.features import MODEL_ID_COLUMN
from bear.predictor.forest import ForestUnsupported, NativeForest
from bear.predictor.runtime import Predictor
from bear.predictor.train import HEADS


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    g = read_model()
    assert g["format"] == MODEL_FORMAT
    return g


@pytest.fixture(scope="module")
def golden_dir(golden: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(golden, tmp_path_factory.mktemp("golden-model"))


def _rows(golden: dict[str, Any], group: str) -> np.ndarray:
    return np.asarray(golden["rows"][group], dtype=np.float64)


def test_golden_rows_and_trees_have_the_hard_cases(golden: dict[str, Any]) -> None:
    for group, cat in (("model_dir", MODEL_ID_COLUMN), ("missing_categories", 1)):
        X = _rows(golden, group)
        assert np.isnan(X).any() and np.isinf(X).any() and (X == 0).any() and np.signbit(X[X == 0]).any()
        assert ((np.abs(X) < 1e-35) & (X != 0)).any()  # below LightGBM's kZeroThreshold
        cats = X[:, cat]
        assert (cats < 0).any() and (cats > 1e9).any() and np.isnan(cats).any()
    texts = "".join(golden["boosters"].values()) + golden["model_dir"]["acc.txt"]
    kinds = {int(d) for line in re.findall(r"decision_type=([^\n]*)", texts) for d in line.split()}
    assert kinds & {1, 3} and kinds & {4, 6} and kinds & {8, 10}  # categorical, zero and NaN missing types
    assert max(len(line.split()) for line in re.findall(r"cat_threshold=([^\n]*)", texts)) > 1  # > 32 categories


def test_forest_of_a_trained_model_equals_lightgbm(golden: dict[str, Any], golden_dir: Path) -> None:
    p = Predictor(golden_dir)
    assert p.forest is not None and p.forest.names == list(HEADS)
    X = _rows(golden, "model_dir")
    got = p.forest.predict(X)
    for k, head in enumerate(HEADS):
        assert got[k].tolist() == golden["raw"]["model_dir"][head], head
    assert np.array_equal(p.raw_scores(X), got)


def test_forest_with_missing_values_and_categories_equals_lightgbm(golden: dict[str, Any]) -> None:
    boosters = {name: lgb.Booster(model_str=text) for name, text in golden["boosters"].items()}
    nf = NativeForest.build(boosters)
    X = _rows(golden, "missing_categories")
    got = nf.predict(X)
    for k, name in enumerate(nf.names):
        assert got[k].tolist() == golden["raw"]["missing_categories"][name], name
    # predict_parts assembles the same rows.
    ids = [2, 0, 1]
    parts = X[:3, 4:]
    assert np.array_equal(nf.predict_parts(X[5, :2], X[5, 2:4], parts, ids),
                          nf.predict(np.hstack([np.tile(X[5, :4], (3, 1)), parts[ids]])))


def _train(params: dict[str, Any], rounds: int = 5) -> lgb.Booster:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 3))
    y = X[:, 0] * 2 + (X[:, 1] > 0)
    if params.get("objective") == "binary":
        y = (y > 0).astype(float)
    return lgb.train({"verbose": -1, "num_threads": 1, **params}, lgb.Dataset(X, y), rounds)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"objective": "binary"}, "transforms the raw score"),
        ({"objective": "regression", "linear_tree": True}, "linear trees"),
        ({"objective": "regression", "boosting": "rf", "bagging_fraction": 0.5, "bagging_freq": 1}, "average_output"),
        ({"objective": "multiclass", "num_class": 3}, "transforms the raw score"),
    ],
)
def test_forest_refuses_what_it_does_not_implement(params: dict[str, Any], reason: str) -> None:
    if params["objective"] == "multiclass":
        rng = np.random.default_rng(2)
        X = rng.normal(size=(300, 3))
        booster = lgb.train({"verbose": -1, "num_threads": 1, **params},
                            lgb.Dataset(X, rng.integers(0, 3, 300)), 3)
    else:
        booster = _train(params)
    with pytest.raises(ForestUnsupported, match=reason):
        NativeForest.build({"h": booster})


class _Tampered(lgb.Booster):
    """A booster whose model text is not what its trees are: ``edit`` changes the text."""

    edit: Any = None

    def model_to_string(self, *args: Any, **kwargs: Any) -> str:
        return type(self).edit(super().model_to_string(*args, **kwargs))


def _leaf_plus_1e9(text: str) -> str:
    head, sep, rest = text.partition("\nleaf_value=")
    first, _, others = rest.partition(" ")
    return head + sep + repr(float(first) + 1e-9) + " " + others


def _child_out_of_range(text: str) -> str:
    return text.replace("\nleft_child=", "\nleft_child=99 ", 1)


@pytest.mark.parametrize(("edit", "reason"), [(_leaf_plus_1e9, "differ from LightGBM's on probe rows"),
                                               (_child_out_of_range, "unreadable tree")])
def test_forest_refuses_a_text_that_is_not_what_lightgbm_evaluates(edit: Any, reason: str) -> None:
    """The load-time probe (a leaf a little off) and the tree checks (a child index out of range)."""
    good = _train({"objective": "regression"})
    assert NativeForest.build({"h": good}).names == ["h"]
    tampered = type("Tampered", (_Tampered,), {"edit": staticmethod(edit)})(model_str=good.model_to_string())
    with pytest.raises(ForestUnsupported, match=reason):
        NativeForest.build({"good": good, "h": tampered})


def test_a_model_dir_with_linear_trees_is_served_by_lightgbm(golden: dict[str, Any], golden_dir: Path,
                                                             tmp_path: Path) -> None:
    """The fallback: a head the forest cannot serve (here retrained with linear trees on the golden
    rows) makes the whole model go through ``Booster.predict``, with the same served values."""
    model_dir = write_model_dir(golden, tmp_path / "linear")
    base = Predictor(golden_dir)
    X = _rows(golden, "model_dir")
    X = X[np.isfinite(X).all(axis=1)]
    y = np.asarray(golden["raw"]["model_dir"]["len_p90"])[: len(X)]
    linear = lgb.train({"objective": "quantile", "alpha": 0.9, "linear_tree": True, "verbose": -1, "num_threads": 1,
                        "min_data_in_leaf": 5}, lgb.Dataset(X, y), 5)
    linear.save_model(str(model_dir / "len_p90.txt"))
    p = Predictor(model_dir)
    assert p.forest is None
    boosters = {h: lgb.Booster(model_file=str(model_dir / f"{h}.txt")) for h in HEADS}
    assert np.array_equal(p.raw_scores(X), np.stack([boosters[h].predict(X, num_threads=1) for h in HEADS]))
    prompt = "Summarize the report above briefly, in 50 words."
    got, want = p.predict_wire(prompt, p.models), base.predict_wire(prompt, base.models)
    for m in p.models:
        assert got[m]["acc"] == want[m]["acc"] and got[m]["len"]["mean"] == want[m]["len"]["mean"]
        assert got[m]["len"]["p90"] >= got[m]["len"]["p50"]


def _tree(**kw: Any) -> tuple[np.ndarray, ...]:
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
def test_forest_rejects_malformed_trees(bad: dict[str, Any]) -> None:
    f = libbea.Forest(3)
    f.add_head()
    f.add_tree(*_tree())  # the unmodified tree is fine
    with pytest.raises(ValueError):
        f.add_tree(*_tree(**bad))
    assert f.n_trees == 1
    assert f.predict(np.zeros((2, 3))).shape == (1, 2)


def test_forest_call_errors() -> None:
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
