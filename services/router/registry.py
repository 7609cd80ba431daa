"""The router's view of the pool, fed only from NATS: the ``bear_instances`` registry (base URL,
model, prices, heartbeat), the ``bear_calibration`` bucket (θ for eq. 8) and the outcome events
every router publishes (observed TTFT, time per output token, completion rate). Routers are
stateless: anything one router learns that another could use goes through NATS."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog

from bear.protocol.codec import unpack_map
from bear.protocol.errors import BearError
from bear.protocol.subjects import Subjects
from bear.runtime.kv import watch_kv
from bear.runtime.shutdown import cancel_all

log = structlog.get_logger("bear.router")

HISTORY = 100  # observed TTFTs kept per instance (as the offline evaluation keeps)
RATE_WINDOW_S = 60.0
EWMA = 0.1


@dataclass
class InstanceInfo:
    """One registered instance with what routers have observed of it."""

    id: str
    model: str = ""  # served model name (the OpenAI ``model`` field)
    base_url: str = ""  # OpenAI base URL, ends in /v1
    backend: str = "vllm"
    price_in: float = 0.0  # USD per million tokens
    price_out: float = 0.0
    heartbeat: float = 0.0
    predictor_model: str = ""  # the model name the predictor knows
    theta: float = 0.0  # prefill tokens/s (calibrator, eq. 8); 0: unknown
    observed: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    tpot: float = 0.0
    completions: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    failed_until: float = 0.0  # this router saw a connection failure: avoid until then (monotonic)
    _pcts: tuple[float, float] | None = field(default=None, repr=False)  # cache of observed_percentiles()

    def healthy(self, now: float, down_after_s: float) -> bool:
        return bool(self.base_url) and now - self.heartbeat <= down_after_s and time.monotonic() >= self.failed_until

    def add_completion(self, t: float) -> None:
        """Completion times arrive in time order (up to clock skew between routers): keep them so."""
        c = self.completions
        if c and t < c[-1]:
            t = c[-1]
        c.append(t)

    def throughput_rps(self, now: float) -> float:
        """Completions per second over the last RATE_WINDOW_S. Called per query per instance, so
        it drops what left the window from the left (amortised O(1)) instead of scanning all of
        them (up to 4 096: ~0.3 ms per instance at 200 q/s). ``now`` is expected not to go back."""
        c = self.completions
        while c and now - c[0] > RATE_WINDOW_S:
            c.popleft()
        if len(c) < 2:
            return 0.0
        return len(c) / max(now - c[0], 1e-3)

    def add_observed(self, ttft_s: float) -> None:
        self.observed.append(ttft_s)
        self._pcts = None

    def observed_percentiles(self) -> tuple[float, float]:
        """(p50, p90) of the observed TTFTs; sorted once per new observation, not per query."""
        if self._pcts is None:
            if not self.observed:
                return 0.0, 0.0
            xs = sorted(self.observed)
            self._pcts = (_pct(xs, 0.5), _pct(xs, 0.9))
        return self._pcts


def _pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of sorted values."""
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def predictor_name(model: str, aliases: dict[str, str]) -> str:
    """The predictor's name for a served model: an explicit alias, else the last path component
    (``Qwen/Qwen3-8B`` → ``Qwen3-8B``), as the offline evaluation names models."""
    return aliases.get(model) or model.rsplit("/", 1)[-1]


class Registry:
    """Watches the buckets and outcome events; ``healthy()`` is the candidate list of a query."""

    def __init__(self, nc: Any, subjects: Subjects, *, down_after_s: float = 10.0,
                 aliases: dict[str, str] | None = None) -> None:
        self.nc = nc
        self.subjects = subjects
        self.down_after_s = down_after_s
        self.aliases = aliases or {}
        self.instances: dict[str, InstanceInfo] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self.loaded = asyncio.Event()

    def get(self, instance: str) -> InstanceInfo:
        info = self.instances.get(instance)
        if info is None:
            info = InstanceInfo(instance)
            self.instances[instance] = info
        return info

    def healthy(self) -> list[InstanceInfo]:
        now = time.time()
        return [i for i in sorted(self.instances.values(), key=lambda i: i.id) if i.healthy(now, self.down_after_s)]

    async def start(self, *, observe: bool = True) -> None:
        """Follow the registry; ``observe=False``: only the instances (no θ, no outcome events —
        what the gateway needs to list the pool's models)."""
        js = self.nc.jetstream()
        self._tasks.append(asyncio.create_task(watch_kv(
            js, self.subjects.instances_bucket, self._on_instance, on_loaded=self.loaded.set, retry_s=0.5, log=log)))
        if not observe:
            return
        self._tasks.append(asyncio.create_task(watch_kv(
            js, self.subjects.calibration_bucket, self._on_calibration, retry_s=0.5, log=log)))
        self._sub = await self.nc.subscribe(f"{self.subjects.prefix}.outcome.*", cb=self._on_outcome,
                                            pending_msgs_limit=65536)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await cancel_all(self._tasks)

    # ------------------------------------------------------------------ feeds
    def _on_instance(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.instances.pop(key, None)
            return
        try:
            d = unpack_map(value)
            info = self.get(key)
            info.model = str(d.get("model", ""))
            info.base_url = str(d.get("base_url", "")).rstrip("/")
            info.backend = str(d.get("backend", "vllm"))
            prices = d.get("prices") or {}
            info.price_in = float(prices.get("input_per_mtok", 0.0))
            info.price_out = float(prices.get("output_per_mtok", 0.0))
            info.heartbeat = float(d.get("heartbeat", 0.0))
            info.predictor_model = str(d.get("predictor_model") or predictor_name(info.model, self.aliases))
        except (BearError, TypeError, ValueError, AttributeError) as exc:
            log.warning("malformed registry entry ignored", instance=key, error=str(exc))

    def _on_calibration(self, key: str, value: bytes | None) -> None:
        info = self.get(key)
        if value is None:
            info.theta = 0.0
            return
        try:
            from bear.estimator.worker import decode_calibration

            theta = decode_calibration(value).get("theta")
            info.theta = float(theta) if isinstance(theta, int | float) and theta > 0 else 0.0
        except (BearError, TypeError, ValueError):
            pass

    async def _on_outcome(self, msg: Any) -> None:
        try:
            d = unpack_map(msg.data)
            info = self.instances.get(str(d["instance"]))
            if info is None:
                return
            ttft = d.get("ttft_s")
            if isinstance(ttft, int | float) and math.isfinite(ttft):
                info.add_observed(float(ttft))
            tpot = d.get("tpot_s")
            if isinstance(tpot, int | float) and tpot > 0:
                info.tpot = float(tpot) if info.tpot == 0 else (1 - EWMA) * info.tpot + EWMA * float(tpot)
            if d.get("completed"):
                info.add_completion(float(d.get("t", time.time())))
        except (BearError, KeyError, TypeError, ValueError):
            pass
