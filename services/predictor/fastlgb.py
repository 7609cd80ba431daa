"""LightGBM inference for a handful of rows without ``Booster.predict``'s per-call overhead.

``Booster.predict`` rebuilds a predictor object and parses parameters on every call (~150 µs even
for three rows); calling ``LGBM_BoosterPredictForMat`` directly through the library's own ctypes
handle costs a fraction of that. The result is checked against ``Booster.predict`` at load time
and ``Booster.predict`` is used instead if the private handle is not available or disagrees.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

_C_API_DTYPE_FLOAT64 = 1
_C_API_PREDICT_NORMAL = 0


class FastBooster:
    """Single-threaded raw-score prediction of a loaded booster (regression heads only)."""

    def __init__(self, booster: Any) -> None:
        self.booster = booster
        self.n_features = int(booster.num_feature())
        self._params = b"num_threads=1"
        self._fast = False
        try:
            from lightgbm.basic import _LIB

            self._lib = _LIB
            self._handle = booster._handle
            probe = np.linspace(-1.0, 1.0, 3 * self.n_features).reshape(3, self.n_features)
            self._fast = bool(np.allclose(self._call(probe), booster.predict(probe, num_threads=1)))
        except Exception:  # private API moved: stay correct, be slower
            self._fast = False

    @property
    def fast(self) -> bool:
        return self._fast

    def _call(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        out = np.empty(x.shape[0], dtype=np.float64)
        out_len = ctypes.c_int64(0)
        rc = self._lib.LGBM_BoosterPredictForMat(
            self._handle,
            x.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_int(_C_API_DTYPE_FLOAT64),
            ctypes.c_int32(x.shape[0]),
            ctypes.c_int32(x.shape[1]),
            ctypes.c_int(1),  # row major
            ctypes.c_int(_C_API_PREDICT_NORMAL),
            ctypes.c_int(0),  # start iteration
            ctypes.c_int(-1),  # all iterations
            ctypes.c_char_p(self._params),
            ctypes.byref(out_len),
            out.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
        )
        if rc != 0 or out_len.value != x.shape[0]:
            raise RuntimeError(f"LGBM_BoosterPredictForMat failed (rc={rc})")
        return out

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self._fast:
            return self._call(x)
        return np.asarray(self.booster.predict(x, num_threads=1), dtype=np.float64)
