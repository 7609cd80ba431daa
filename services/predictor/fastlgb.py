"""LightGBM inference for a handful of rows without ``Booster.predict``'s per-call overhead.

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
