"""LightGBM inference for a handful of rows without ``Booster.predict``'s per-call overhead.

Two levels. ``NativeForest`` (the service's path): all heads' trees flattened into arrays in C++
(``bear.libbea.Forest``) and evaluated for every head and row in one call, with LightGBM's own
decision rules, so the raw scores are bit-identical. 4 heads x 150 trees x 3 rows take ~20 µs when
one prompt repeats and ~60 µs over distinct prompts (the branch predictor cannot learn the paths) on
the shared 2-CPU host, against ~15 µs per head and row, ~0.2 ms for the 12, through the C API below.
It is built from the model text and used only if it reproduces ``FastBooster`` exactly on probe rows
at load time.

``Booster.predict`` builds a predictor object, parses parameters and (unless told otherwise) wakes
OpenMP threads on every call: ~150 µs for three rows on an idle host, milliseconds on a busy one.
LightGBM's C API has a single-row path with the configuration prepared once
(``LGBM_BoosterPredictForMatSingleRowFast``), which we call through the library's own ctypes
handle: ~10-15 µs per row. A prepared configuration must not be shared between threads, so each
thread gets its own. The result is checked against ``Booster.predict`` at load time, and
``Booster.predict`` is used instead if the private handle is missing or disagrees.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

_C_API_DTYPE_FLOAT64 = 1
_C_API_PREDICT_NORMAL = 0


class _ThreadState:
    def __init__(self, lib: Any, handle: Any, n_features: int) -> None:
        self.config = ctypes.c_void_p()
        rc = lib.LGBM_BoosterPredictForMatSingleRowFastInit(
            handle,
            ctypes.c_int(_C_API_PREDICT_NORMAL),
            ctypes.c_int(0),  # start iteration
            ctypes.c_int(-1),  # all iterations
            ctypes.c_int(_C_API_DTYPE_FLOAT64),
            ctypes.c_int32(n_features),
            ctypes.c_char_p(b"num_threads=1"),
            ctypes.byref(self.config),
        )
        if rc != 0:
            raise RuntimeError("LGBM_BoosterPredictForMatSingleRowFastInit failed")
        self.out = np.empty(1, dtype=np.float64)
        self.out_ptr = self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        self.out_len = ctypes.c_int64(0)
        self.out_len_ref = ctypes.byref(self.out_len)


class FastBooster:
    """Single-threaded raw-score prediction of a loaded regression booster."""

    def __init__(self, booster: Any) -> None:
        self.booster = booster
        self.n_features = int(booster.num_feature())
        self._local = threading.local()
        self._states: list[_ThreadState] = []
        self._lock = threading.Lock()
        self._fast = False
        try:
            from lightgbm.basic import _LIB

            self._lib = _LIB
            # Our own view of the library, so that declaring argument types (which saves most of
            # ctypes' per-call conversion work) does not touch LightGBM's shared function objects.
            own = ctypes.CDLL(_LIB._name)
            self._predict_row = own.LGBM_BoosterPredictForMatSingleRowFast
            self._predict_row.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.POINTER(ctypes.c_double)]
            self._predict_row.restype = ctypes.c_int
            self._handle = booster._handle
            probe = np.linspace(-1.0, 1.0, 3 * self.n_features).reshape(3, self.n_features)
            self._fast = bool(np.allclose(self._call(probe), booster.predict(probe, num_threads=1)))
        except Exception:  # private API moved: stay correct, be slower
            self._fast = False

    @property
    def fast(self) -> bool:
        return self._fast

    def _state(self) -> _ThreadState:
        st = getattr(self._local, "state", None)
        if st is None:
            st = _ThreadState(self._lib, self._handle, self.n_features)
            self._local.state = st
            with self._lock:
                self._states.append(st)
        return st

    def _call(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"expected rows of {self.n_features} features, got shape {x.shape}")
        st = self._state()
        res = np.empty(x.shape[0], dtype=np.float64)
        fn = self._predict_row
        base = x.ctypes.data
        stride = x.strides[0]
        config = st.config.value
        for i in range(x.shape[0]):
            rc = fn(config, base + i * stride, st.out_len_ref, st.out_ptr)
            if rc != 0:
                raise RuntimeError("LGBM_BoosterPredictForMatSingleRowFast failed")
            res[i] = st.out[0]
        return res

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self._fast:
            return self._call(x)
        return np.asarray(self.booster.predict(x, num_threads=1), dtype=np.float64)

    def close(self) -> None:
        """Free the prepared configurations (the booster itself is freed by LightGBM)."""
        with self._lock:
            for st in self._states:
                self._lib.LGBM_FastConfigFree(st.config)
            self._states.clear()
        self._local = threading.local()


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
    """Several regression boosters over the same features, evaluated together in C++.

    ``build`` returns None (the caller keeps ``FastBooster``) when the extension lacks the forest,
    a model uses something it does not implement (linear trees, multi-class, transformed output),
    or its scores differ from LightGBM's in any bit on the probe rows.
    """

    def __init__(self, forest: Any, names: list[str]) -> None:
        self._forest = forest
        self.names = names
        self.n_features = int(forest.n_features)

    @classmethod
    def build(cls, boosters: dict[str, Any], probe: np.ndarray | None = None) -> NativeForest | None:
        try:
            from bear import libbea

            if not hasattr(libbea, "Forest"):
                return None
            names = list(boosters)
            n_features = {int(b.num_feature()) for b in boosters.values()}
            if len(n_features) != 1:
                return None
            forest = libbea.Forest(n_features.pop())
            for name in names:
                if not cls._add_head(forest, boosters[name].model_to_string()):
                    return None
            nf = cls(forest, names)
            if not nf._agrees(boosters, probe):
                return None
            return nf
        except Exception:  # a model text we do not understand: stay correct, be slower
            return None

    @staticmethod
    def _add_head(forest: Any, text: str) -> bool:
        parsed = _tree_sections(text)
        if parsed is None:
            return False
        header, trees = parsed
        objective = header.get("objective", "").split()
        if not objective or objective[0] not in _RAW_OBJECTIVES or "sqrt" in objective[1:]:
            return False
        if header.get("num_tree_per_iteration", "1") != "1" or any(k in header for k in _UNSUPPORTED_HEADER):
            return False
        forest.add_head()
        for t in trees:
            if t.get("is_linear", "0") != "0":
                return False
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
        return True

    def _agrees(self, boosters: dict[str, Any], probe: np.ndarray | None) -> bool:
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
        for k, name in enumerate(self.names):
            fb = FastBooster(boosters[name])
            try:
                if not np.array_equal(got[k], fb.predict(x)):
                    return False
            finally:
                fb.close()
        return True

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Raw scores, shape (heads, rows), heads in ``names`` order."""
        return self._forest.predict(x)

    def predict_parts(self, a: np.ndarray, b: np.ndarray, parts: np.ndarray, ids: list[int]) -> np.ndarray:
        """``predict`` of the rows ``[a, b, parts[i]] for i in ids`` (assembled in C++)."""
        return self._forest.predict_parts(a, b, parts, ids)

