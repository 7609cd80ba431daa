"""Online β calibration (``bear calibrator``): fit eq. 12 per instance from the batch records on
``bear.batches.<instance>`` over a sliding window and publish the fit to the ``bear_calibration``
KV bucket that every estimator worker watches.

The fit is ``bear.calibrator.fit.robust_fit`` (NNLS with outlier trimming, θ of eq. 8), the same
that ``bear eval`` calibrates its simulated instances with.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import numpy as np
import structlog

from bear.calibrator.fit import DEFAULT_OBJECTIVE, OBJECTIVES, BatchWindow, RefitPolicy, robust_fit
from bear.calibrator.lengths import LengthWindow
from bear.calibrator.path import PathWindow
from bear.calibrator.ttft_error import ratio_quantiles
from bear.protocol.batch import BatchRecord, batch_record
from bear.protocol.codec import unpack
from bear.protocol.errors import BearError
from bear.protocol.messages import Calibration, Outcome, decode, encode
from bear.protocol.subjects import Subjects
from bear.runtime.kv import ensure_kv
from bear.runtime.service import connect, stop_event
from bear.runtime.shutdown import cancel_all, close_nats

B = TypeVar("B")

log = structlog.get_logger("bear.calibrator")

MAX_INSTANCES = 1024  # instances followed (least recently heard of forgotten first)
FIRST_FIT_POLL_S = 0.5  # how often the loop looks for instances due a fit


def valid_record(r: Any) -> bool:
    """Whether a decoded map is a ``bear.batch/1`` record (``bear.protocol.batch.batch_record``)."""
    return batch_record(r) is not None


class OnlineCalibrator:
    def __init__(self, nc: Any, subjects: Subjects | None = None, *, window: int = RefitPolicy.window,
                 min_records: int = RefitPolicy.min_records, refit_s: float = RefitPolicy.refit_s,
                 objective: str = DEFAULT_OBJECTIVE, ttft_window: int = 500) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
        self.nc = nc
        self.objective = objective
        self.ttft: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()  # (predicted, observed) BEA TTFTs
        self.ttft_window = ttft_window
        self.subjects = subjects or Subjects()
        self.window = window
        self.min_records = min_records
        self.refit_s = refit_s
        self.records: OrderedDict[str, BatchWindow[BatchRecord]] = OrderedDict()
        self.malformed = 0
        self.fits: dict[str, Calibration] = {}
        self._subs: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._kv: Any = None
        self._fitted_at: dict[str, float] = {}  # monotonic time of each instance's last fit attempt
        self.priors: dict[str, Calibration | None] = {}  # profiled calibrations (None: none), read once
        self.lengths: OrderedDict[str, LengthWindow] = OrderedDict()  # answers' lengths against the predictions
        self.paths: OrderedDict[str, PathWindow] = OrderedDict()  # observed − elapsed − engine (bear.calibrator.path)

    async def start(self) -> None:
        self._kv = await ensure_kv(self.nc.jetstream(), self.subjects.calibration_bucket)
        self._subs.append(await self.nc.subscribe(self.subjects.batches_all, cb=self._on_batches))
        self._subs.append(await self.nc.subscribe(self.subjects.outcome_all, cb=self._on_outcome))
        self._task = asyncio.create_task(self._loop())
        log.info("calibrator started", window=self.window, refit_s=self.refit_s)

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._task is not None:
            await cancel_all([self._task])

    async def _on_batches(self, msg: Any) -> None:
        instance = Subjects.instance_of(msg.subject)
        try:
            group = unpack(msg.data)
        except BearError:
            self.malformed += 1
            return
        if isinstance(group, dict):
            group = [group]
        if not isinstance(group, list):
            self.malformed += 1
            return
        buf = self._bounded(self.records, instance, lambda: BatchWindow(self.window))
        for raw in group:
            r = batch_record(raw)  # typed and validated; an item keeps only n, context, decode
            if r is None:
                self.malformed += 1
                continue
            if r.duration_s and r.items:
                buf.add(r, any(not it["decode"] for it in r.items))

    def _bounded(self, table: OrderedDict[str, B], instance: str, make: Callable[[], B]) -> B:
        """``table[instance]``, created if new; the least recently heard-of instance is forgotten
        past MAX_INSTANCES (made-up instance ids cannot grow the calibrator)."""
        buf = table.get(instance)
        if buf is None:
            buf = table[instance] = make()
            while len(table) > MAX_INSTANCES:
                table.popitem(last=False)
        else:
            table.move_to_end(instance)
        return buf

    async def _on_outcome(self, msg: Any) -> None:
        """A finished query: its BEA-predicted and observed TTFT, for the instance's TTFT error."""
        try:
            o = decode(Outcome, msg.data)
        except BearError:
            return
        if o.output_tokens is not None and o.predicted_output_tokens:
            self._bounded(self.lengths, o.instance, LengthWindow).add(o.output_tokens, o.predicted_output_tokens)
        if o.method == "bea" and o.predicted_ttft_s is not None and o.ttft_s is not None and o.ttft_s > 0:
            self._bounded(self.ttft, o.instance, lambda: deque(maxlen=self.ttft_window)).append(
                (o.predicted_ttft_s, o.ttft_s))
        if o.method == "bea" and o.ttft_s is not None and o.engine_ttft_s is not None and o.prompt_tokens is not None:
            self._bounded(self.paths, o.instance, PathWindow).add(o.prompt_tokens, o.ttft_s, o.elapsed_s or 0.0,
                                                                  o.engine_ttft_s)

    def ttft_error(self, instance: str) -> tuple[float | None, float | None, int]:
        """(MAPE, median relative error, n) of the recent BEA TTFTs at ``instance``."""
        pairs = self.ttft.get(instance)
        if not pairs:
            return None, None, 0
        rel = np.array([(p - o) / o for p, o in pairs])
        return float(np.mean(np.abs(rel))), float(np.median(rel)), len(rel)

    async def refit_once(self, due_only: bool = False) -> list[str]:
        """Refit every instance with enough new records; returns the instances updated.
        ``due_only``: only those never fitted here or last fitted ``refit_s`` ago (the loop's
        cadence: an instance's first fit comes as soon as it has ``min_records``, not up to
        ``refit_s`` later — until then its estimates use a profiled or the nominal β)."""
        done = []
        now = time.monotonic()
        for instance, buf in list(self.records.items()):
            if len(buf) < self.min_records or buf.new == 0:
                continue
            if due_only and now - self._fitted_at.get(instance, -math.inf) < self.refit_s:
                continue
            self._fitted_at[instance] = now
            for table in (self._fitted_at, self.priors):  # instances forgotten (bounded table)
                for gone in [k for k in table if k not in self.records]:
                    del table[gone]
            prior = await self.prior(instance)
            buf.new = 0
            try:
                cal = await asyncio.to_thread(robust_fit, buf.batches(), instance, self.objective, prior)
            except ValueError as exc:
                log.warning("calibration fit failed", instance=instance, error=str(exc))
                continue
            mape_t, bias_t, n_t = self.ttft_error(instance)
            lengths = self.lengths.get(instance)
            cal = msgspec.structs.replace(cal, ttft_mape=mape_t, ttft_bias=bias_t, ttft_n=n_t,
                                          length_scale=lengths.scale() if lengths is not None else None,
                                          length_sigma=lengths.sigma() if lengths is not None else None,
                                          ttft_ratio_q=ratio_quantiles(self.ttft.get(instance, ())))
            path = self.paths[instance].fit() if instance in self.paths else None
            if path is not None:
                cal = msgspec.structs.replace(cal, path_s0=path.a, path_per_token_s=path.b, path_n=path.n)
            self.fits[instance] = cal
            try:
                await self._kv.put(instance, encode(cal))
                done.append(instance)
            except Exception as exc:
                log.warning("calibration publish failed", instance=instance, error=str(exc))
        return done

    async def prior(self, instance: str) -> Calibration | None:
        """The instance's profiled calibration (``bear up``'s sim engines, an operator's ``bear
        calibrate`` put in the bucket before serving), read once: the online refit rescales it
        rather than fitting freely. An entry this calibrator refitted earlier gives it back (the
        ``profile`` an anchored refit carries, else a rescaled entry's β over its ``scale``), so a
        restarted calibrator keeps the profile."""
        if instance in self.priors:
            return self.priors[instance]
        found: Calibration | None = None
        try:
            entry = await self._kv.get(instance)
            cal = decode(Calibration, entry.value) if entry.value else None
        except Exception:  # no entry (never profiled), or unreadable: a free fit
            cal = None
        if cal is not None and cal.source == "profiled":
            found = cal
        elif cal is not None and cal.profile is not None:  # an anchored refit carries the profile itself
            b = cal.profile
            found = msgspec.structs.replace(cal, beta=tuple(b[:4]), gamma=tuple(b[4:]) if len(b) == 8 else None,
                                            source="profiled", scale=None, profile=None)
        elif cal is not None and cal.scale:
            s = cal.scale
            found = msgspec.structs.replace(
                cal, beta=tuple(b / s for b in cal.beta),
                gamma=None if cal.gamma is None else tuple(g / s for g in cal.gamma), source="profiled", scale=None)
        self.priors[instance] = found
        return found

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.refit_s, FIRST_FIT_POLL_S))
            updated = await self.refit_once(due_only=True)
            for inst in updated:
                cal = self.fits[inst]
                log.info("beta updated", instance=inst, beta=cal.beta, mape=round(cal.mape, 4), n=cal.n, theta=cal.theta,
                         ttft_mape=cal.ttft_mape, ttft_n=cal.ttft_n, scale=cal.scale, length_scale=cal.length_scale,
                         path_s0=cal.path_s0, path_per_token_s=cal.path_per_token_s, path_n=cal.path_n)


async def run_calibrator(nats_url: str, prefix: str = "bear", **kwargs: Any) -> None:
    nc = await connect(nats_url, "bear-calibrator")
    cal = OnlineCalibrator(nc, Subjects(prefix), **kwargs)
    await cal.start()
    await stop_event().wait()
    await cal.stop()
    await close_nats(nc)


