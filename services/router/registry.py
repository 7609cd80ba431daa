"""The router's view of the pool, fed only from NATS: the ``bear_instances`` registry (base URL,
model, prices, heartbeat), the ``bear_calibration`` bucket (θ for eq. 8) and the outcome events
every router publishes (observed TTFT, time per output token, completion rate). Routers are
stateless: anything one router learns that another could use goes through NATS."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from bear.protocol.errors import BearError
from bear.protocol.messages import NOMINAL_CALIBRATION, Calibration, InstanceRecord, Outcome, decode
from bear.protocol.subjects import Subjects
from bear.router.observations import Observations
from bear.runtime.kv import watch_kv
from bear.runtime.shutdown import cancel_all

log = structlog.get_logger("bear.router")

@dataclass
class InstanceInfo:
    """One registered instance with what routers have observed of it."""

    id: str
    model: str = ""  # served model name (the OpenAI ``model`` field)
    base_url: str = ""  # OpenAI base URL, ends in /v1
    price_in: float = 0.0  # USD per million tokens
    price_out: float = 0.0
    heartbeat: float = 0.0
    status: str = "up"  # the registry's: starting | up | down
    backend: str = "vllm"  # what serves it (informational: shown to clients, never decided on)
    predictor_model: str = ""  # the model name the predictor knows
    calibration: Calibration = NOMINAL_CALIBRATION  # θ for eq. 8 and SCORE (the calibrator's)
    obs: Observations = field(default_factory=Observations)
    failed_until: float = 0.0  # this router saw a connection failure: avoid until then (monotonic)
    tokenizer: str = ""  # its tokenizer bundle id ("": none registered: lengths are estimated)

    def healthy(self, now: float, down_after_s: float) -> bool:
        return (bool(self.base_url) and self.status == "up" and now - self.heartbeat <= down_after_s
                and time.monotonic() >= self.failed_until)


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
        self.on_tokenizer: Any = None  # called with each tokenizer id an entry names (to fetch it early)

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
            js, self.subjects.instances_bucket, self._on_instance, on_loaded=self.loaded.set, retry_s=0.5, log=log,
            nc=self.nc)))
        if not observe:
            return
        self._tasks.append(asyncio.create_task(watch_kv(
            js, self.subjects.calibration_bucket, self._on_calibration, retry_s=0.5, log=log, nc=self.nc)))
        self._sub = await self.nc.subscribe(self.subjects.outcome_all, cb=self._on_outcome,
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
            rec = decode(InstanceRecord, value)
        except BearError as exc:
            log.warning("malformed registry entry ignored", instance=key, error=exc.message)
            return
        info = self.get(key)
        info.model = rec.model
        info.base_url = rec.base_url.rstrip("/")
        info.price_in = rec.prices.input_per_mtok
        info.price_out = rec.prices.output_per_mtok
        info.heartbeat = rec.heartbeat
        info.status = rec.status
        info.backend = rec.backend
        info.predictor_model = rec.predictor_model or predictor_name(rec.model, self.aliases)
        info.tokenizer = rec.tokenizer
        if rec.tokenizer and self.on_tokenizer is not None:
            self.on_tokenizer(rec.tokenizer)

    def _on_calibration(self, key: str, value: bytes | None) -> None:
        info = self.get(key)
        if value is None:
            info.calibration = NOMINAL_CALIBRATION
            return
        try:
            info.calibration = decode(Calibration, value)
        except BearError:
            pass

    async def _on_outcome(self, msg: Any) -> None:
        try:
            o = decode(Outcome, msg.data)
        except BearError:
            return
        info = self.instances.get(o.instance)
        if info is not None:
            info.obs.add_outcome(o.t, o.ttft_s, o.tpot_s, o.completed)
