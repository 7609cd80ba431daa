"""The predictor's trees: all heads' LightGBM boosters flattened into one C++ forest
(``bear.libbea.Forest``, libbea/src/forest.cpp) and evaluated for every head and row in one call,
with LightGBM's own decision rules, so the scores are bit-identical to ``Booster.predict``.

Why not ``Booster.predict``: it builds a predictor object and wakes OpenMP threads on every call,
~150 µs for three rows on an idle host and milliseconds on a busy one; the forest takes ~20-60 µs
for 4 heads x 150 trees x 3 rows. It is what the service uses for every model that
``bear predictor train`` writes. ``build`` raises ``ForestUnsupported`` — and the caller serves
with ``Booster.predict`` — for a model it does not implement (an objective with an output
transform, which includes every multi-class one, ``average_output`` (random forest mode), linear
trees) or
whose scores differ from LightGBM's in any bit on probe rows at load time (a safety check against
a LightGBM version that changes what a model text means).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bear import libbea


class ForestUnsupported(Exception):
    """The native forest cannot serve these boosters (the message says why)."""


# Objectives whose prediction is the raw score (no output transform), and header keys of the
# model text that would change the prediction in ways the native forest does not implement.
_RAW_OBJECTIVES = ("regression", "regression_l2", "l2", "huber", "quantile", "regression_l1", "l1", "fair", "mape")
_UNSUPPORTED_HEADER = ("average_output",)


def _tree_sections(text: str) -> tuple[dict[str, str], list[dict[str, str]]] | None:
    """(header, trees) of a LightGBM text model, each as key → raw value string."""
    head, sep, rest = text.partition("\nTree=")
    if not sep:
        return None
    body = rest.split("\nend of trees", 1)[0]
    header = dict(line.split("=", 1) for line in head.splitlines() if "=" in line)
    header.update({line: "" for line in head.splitlines() if line and "=" not in line})
    trees = []
    for chunk in ("Tree=" + body).split("\nTree="):
        lines = chunk.strip().splitlines()[1:]  # drop the "Tree=k" line
        trees.append(dict(line.split("=", 1) for line in lines if "=" in line))
    return header, trees


def _floats(v: str) -> np.ndarray:
    # float() is correctly rounded, as LightGBM's own parser: the same doubles as the booster's.
    return np.asarray([float(x) for x in v.split()], dtype=np.float64)


def _ints(v: str, dtype: Any) -> np.ndarray:
    return np.asarray([int(x) for x in v.split()], dtype=dtype)


class NativeForest:
    """Several regression boosters over the same features, evaluated together in C++."""

    def __init__(self, forest: Any, names: list[str]) -> None:
        self._forest = forest
        self.names = names
        self.n_features = int(forest.n_features)

    @classmethod
    def build(cls, boosters: dict[str, Any], probe: np.ndarray | None = None) -> NativeForest:
        """The forest of ``boosters`` (heads in their order), checked against them on probe rows
        (random, integer-valued, NaN, below the zero threshold, and ``probe``)."""
        names = list(boosters)
        n_features = {int(b.num_feature()) for b in boosters.values()}
        if len(n_features) != 1:
            raise ForestUnsupported(f"heads with different feature counts {sorted(n_features)}")
        forest = libbea.Forest(n_features.pop())
        for name in names:
            try:
                cls._add_head(forest, boosters[name].model_to_string())
            except (ValueError, KeyError, IndexError) as exc:  # a tree text we cannot read
                raise ForestUnsupported(f"head {name}: unreadable tree ({exc})") from exc
            except ForestUnsupported as exc:
                raise ForestUnsupported(f"head {name}: {exc}") from None
        nf = cls(forest, names)
        bad = nf._disagreeing(boosters, probe)
        if bad:
            raise ForestUnsupported(f"scores differ from LightGBM's on probe rows for heads {bad}")
        return nf

    @staticmethod
    def _add_head(forest: Any, text: str) -> None:
        parsed = _tree_sections(text)
        if parsed is None:
            raise ForestUnsupported("no trees")
        header, trees = parsed
        objective = header.get("objective", "").split()
        if not objective or objective[0] not in _RAW_OBJECTIVES or "sqrt" in objective[1:]:
            raise ForestUnsupported(f"objective {' '.join(objective) or '(none)'} transforms the raw score")
        if any(k in header for k in _UNSUPPORTED_HEADER):
            raise ForestUnsupported("average_output (random forest mode)")
        forest.add_head()
        for t in trees:
            if t.get("is_linear", "0") != "0":
                raise ForestUnsupported("linear trees")
            n_leaves = int(t["num_leaves"])
            empty_i = np.zeros(0, dtype=np.int32)
            if n_leaves > 1:
                node = (_ints(t["split_feature"], np.int32), _floats(t["threshold"]),
                        _ints(t["decision_type"], np.int8), _ints(t["left_child"], np.int32),
                        _ints(t["right_child"], np.int32))
            else:
                node = (empty_i, np.zeros(0), np.zeros(0, dtype=np.int8), empty_i, empty_i)
            n_cat = int(t.get("num_cat", "0"))
            cat_b = _ints(t["cat_boundaries"], np.int32) if n_cat > 0 else empty_i
            cat_t = _ints(t["cat_threshold"], np.uint32) if n_cat > 0 else np.zeros(0, dtype=np.uint32)
            forest.add_tree(*node, _floats(t["leaf_value"]), cat_b, cat_t)

    def _disagreeing(self, boosters: dict[str, Any], probe: np.ndarray | None) -> list[str]:
        rng = np.random.default_rng(0)
        nf = self.n_features
        scale = rng.choice([0.01, 0.1, 1.0, 100.0, 1e4], (96, 1))
        small_ints = rng.integers(-2, 40, (64, nf)).astype(np.float64)  # categorical codes, flags
        odd = rng.normal(0.0, 1.0, (16, nf))
        odd[rng.random((16, nf)) < 0.2] = np.nan
        odd[rng.random((16, nf)) < 0.2] = 1e-40  # below LightGBM's zero threshold
        rows = [rng.normal(0.0, 1.0, (96, nf)) * scale, small_ints, odd,
                np.linspace(-2.0, 2.0, 3 * nf).reshape(3, nf)]
        if probe is not None and len(probe):
            rows.append(np.asarray(probe, dtype=np.float64))
        x = np.vstack(rows)
        got = self.predict(x)
        return [name for k, name in enumerate(self.names)
                if not np.array_equal(got[k], boosters[name].predict(x, num_threads=1))]

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Raw scores, shape (heads, rows), heads in ``names`` order."""
        return self._forest.predict(x)

    def predict_parts(self, a: np.ndarray, b: np.ndarray, parts: np.ndarray, ids: list[int]) -> np.ndarray:
        """``predict`` of the rows ``[a, b, parts[i]] for i in ids`` (assembled in C++)."""
        return self._forest.predict_parts(a, b, parts, ids)
