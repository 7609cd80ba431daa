"""The router's view of the pool, fed only from NATS: the ``bear_instances`` registry (base URL,
model, prices, heartbeat), the ``bear_calibration`` bucket (θ for eq. 8) and the outcome events
every router publishes (observed TTFT, time per output token, completion rate). Routers are
stateless: anything one router learns that another could use goes through NATS."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import structlog

from bear.protocol.errors import BearError
from bear.protocol.messages import NOMINAL_CALIBRATION, Calibration, InstanceRecord, Outcome, decode
from bear.protocol.provisioned import Provisioned, mismatch
from bear.protocol.subjects import Subjects
from bear.router.observations import Observations
from bear.runtime.kv import watch_kv
from bear.runtime.shutdown import cancel_all


class _Keyed(Protocol):
    id: str


K = TypeVar("K", bound=_Keyed)
log = structlog.get_logger("bear.router")

MAX_INSTANCES = 1024  # registry entries a router follows; more are refused (counted), not grown into

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
    max_model_len: int | None = None  # the engine's context (its registered config), when known
    tokenizer: str = ""  # its tokenizer bundle id ("": none registered: lengths are estimated)

    def healthy(self, now: float, down_after_s: float) -> bool:
        return (bool(self.base_url) and self.status == "up" and now - self.heartbeat <= down_after_s
                and time.monotonic() >= self.failed_until)


def predictor_name(model: str, aliases: dict[str, str]) -> str:
    """The predictor's name for a served model: an explicit alias, else the last path component
    (``Qwen/Qwen3-8B`` → ``Qwen3-8B``), as the offline evaluation names models."""
    return aliases.get(model) or model.rsplit("/", 1)[-1]


def url_allowed(url: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``url`` lies under one of the ``allowed`` base URLs (same scheme and host, the same
    port where one is given, a path below it) or, for an entry that is a network (``10.0.0.0/8``),
    has an IP address host inside it; an empty list allows every URL."""
    if not allowed:
        return True
    import ipaddress

    try:
        u = urlsplit(url)
        for a in allowed:
            if "://" not in a:
                try:
                    if u.hostname and ipaddress.ip_address(u.hostname) in ipaddress.ip_network(a, strict=False):
                        return True
                except ValueError:
                    pass
                continue
            p = urlsplit(a)
            if (u.scheme, u.hostname) == (p.scheme, p.hostname) and (p.port is None or u.port == p.port) \
                    and u.path.startswith(p.path.rstrip("/")):
                return True
    except ValueError:
        return False
    return False


class Registry:
    """Watches the buckets and outcome events; ``healthy()`` is the candidate list of a query.

    An entry is taken only when its record names the key it is stored under (with NATS
    authorization on, only that instance's identity can write the key: bear.runtime.nats_auth)
    and its base URL is under ``allowed_base_urls`` (when given). At most ``max_instances``
    instances are followed; calibrations of instances not registered (yet) wait in a bounded
    buffer of the same size. What is refused is counted (``rejected``), never raised.

    With ``provisioning`` an entry is taken only when it agrees with the instance's binding in
    the ``bear_provisioned`` bucket, which only ``admin`` writes (``unprovisioned``: no binding;
    ``mismatch``: model, base URL, prices, predictor model or context differ): a leaked instance
    credential can no longer move its instance to another address, model or price (issue 26).
    Entries wait until the bindings are loaded; a binding that changes re-judges its entry."""

    def __init__(self, nc: Any, subjects: Subjects, *, down_after_s: float = 10.0,
                 aliases: dict[str, str] | None = None, allowed_base_urls: tuple[str, ...] = (),
                 max_instances: int = MAX_INSTANCES, provisioning: bool = False) -> None:
        self.nc = nc
        self.subjects = subjects
        self.down_after_s = down_after_s
        self.aliases = aliases or {}
        self.allowed_base_urls = allowed_base_urls
        self.max_instances = max_instances
        self.instances: dict[str, InstanceInfo] = {}
        self._calibrations: OrderedDict[str, Calibration] = OrderedDict()  # of instances not registered
        self.rejected: dict[str, int] = {}
        self.provisioning = provisioning
        self.provisioned: dict[str, Provisioned] = {}  # instance → its binding (with provisioning)
        self.provisioned_loaded = asyncio.Event()
        self._entries: OrderedDict[str, bytes] = OrderedDict()  # the last registry value of each key (re-judged)
        self._logged: dict[tuple[str, str], float] = {}  # (reason, key) → monotonic time of its last warning
        self._reconnects = 0
        self._reconnected_at = -1e9  # monotonic time of the last reconnect seen
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Any = None
        self.loaded = asyncio.Event()
        self.on_tokenizer: Any = None  # called with each tokenizer id an entry names (to fetch it early)
        # True while JetStream is not writing (the router's dedup claims failing: a full disk): the
        # heartbeats are stale because the broker cannot store them, not because the instances died
        self.store_failing: Callable[[], bool] | None = None

    def _reject(self, reason: str, key: str, detail: str = "") -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        with contextlib.suppress(Exception):
            from bear.router.outcomes import metrics

            metrics().registry_rejected.labels(reason=reason).inc()
        now = time.monotonic()
        last = self._logged.get((reason, key[:128]))
        if last is not None and now - last < 10.0:
            return  # the same refusal at every heartbeat: one line per 10 s, every one counted
        if len(self._logged) >= 4 * self.max_instances:
            self._logged.clear()
        self._logged[(reason, key[:128])] = now
        log.warning("registry entry refused", reason=reason, key=key[:128], detail=detail[:200],
                    refused_so_far=self.rejected[reason])

    def engine_key_allowed(self, info: InstanceInfo) -> bool:
        """Whether the instance's engine API key may go to ``info.base_url``: with provisioning,
        only to the base URL the instance was provisioned with."""
        if not self.provisioning:
            return True
        p = self.provisioned.get(info.id)
        return p is not None and p.base_url.rstrip("/") == info.base_url.rstrip("/")

    def get(self, instance: str) -> InstanceInfo:
        info = self.instances.get(instance)
        if info is None:
            info = InstanceInfo(instance)
            self.instances[instance] = info
        return info

    def healthy(self) -> list[InstanceInfo]:
        """The instances to route to. While NATS is away, or shortly after it came back, every
        heartbeat goes stale together: that is the broker's silence, not the instances dying, so
        each heartbeat is then judged against the newest one seen instead of the clock — and so
        while JetStream does not store what it is sent (``store_failing``: a full disk)."""
        now = time.time()
        ref = now
        if self._broker_silent() or (self.store_failing is not None and self.store_failing()):
            ref = min(now, max((i.heartbeat for i in self.instances.values()), default=now))
        return [i for i in sorted(self.instances.values(), key=lambda i: i.id) if i.healthy(ref, self.down_after_s)]

    def _broker_silent(self) -> bool:
        stats = getattr(self.nc, "stats", None)
        reconnects = int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self._reconnected_at = time.monotonic()
        connected = bool(getattr(self.nc, "is_connected", True))
        return not connected or time.monotonic() - self._reconnected_at < self.down_after_s

    async def start(self, *, observe: bool = True) -> None:
        """Follow the registry; ``observe=False``: only the instances (no θ, no outcome events —
        what the gateway needs to list the pool's models)."""
        js = self.nc.jetstream()
        if self.provisioning:
            self._tasks.append(asyncio.create_task(watch_kv(
                js, self.subjects.provisioned_bucket, self._on_provisioned, on_loaded=self._provisioned_loaded,
                retry_s=0.5, log=log, nc=self.nc)))
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
    def _provisioned_loaded(self) -> None:
        if self.provisioned_loaded.is_set():
            return
        self.provisioned_loaded.set()
        for key, value in list(self._entries.items()):  # the entries that waited for the bindings
            self._on_instance(key, value)

    def _decoded(self, kind: type[K], key: str, value: bytes, malformed: str, mismatch: str, what: str) -> K | None:
        """``value`` as a ``kind`` whose id is ``key`` (an entry under another's key could speak for
        it), else None: refused, counted under ``malformed`` or ``mismatch`` and logged."""
        try:
            out = decode(kind, value)
        except BearError as exc:
            self._reject(malformed, key, exc.message)
            return None
        if out.id != key:
            self._reject(mismatch, key, f"{what} names {out.id!r}")
            return None
        return out

    def _on_provisioned(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.provisioned.pop(key, None)
        else:
            p = self._decoded(Provisioned, key, value, "malformed_provisioned", "malformed_provisioned", "binding")
            if p is None:
                return
            if self.provisioned.get(key) == p:
                return  # the same binding again (a re-watch): nothing to judge
            self.provisioned[key] = p
        if self.provisioned_loaded.is_set():  # a binding changed: its instance is judged again
            self.instances.pop(key, None)
            if key in self._entries:
                self._on_instance(key, self._entries[key])

    def _on_instance(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.instances.pop(key, None)
            self._entries.pop(key, None)
            return
        if self.provisioning:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_instances:
                self._entries.popitem(last=False)
            if not self.provisioned_loaded.is_set():
                return  # judged once the bindings are loaded
        rec = self._decoded(InstanceRecord, key, value, "malformed", "id_mismatch", "record")
        if rec is None:
            return
        if not url_allowed(rec.base_url, self.allowed_base_urls):
            self._reject("base_url", key, rec.base_url)
            return
        if self.provisioning:
            bound = self.provisioned.get(key)
            if bound is None:
                self._reject("unprovisioned", key, f"no binding in {self.subjects.provisioned_bucket}")
                return
            differs = mismatch(bound, rec, lambda m: predictor_name(m, self.aliases))
            if differs:
                self._reject("mismatch", key, differs)
                return
        info = self.instances.get(key)
        if info is None:
            if len(self.instances) >= self.max_instances:
                self._reject("full", key)
                return
            info = self.instances[key] = InstanceInfo(key, calibration=self._calibrations.pop(key, NOMINAL_CALIBRATION))
        info.model = rec.model
        info.base_url = rec.base_url.rstrip("/")
        info.price_in = rec.prices.input_per_mtok
        info.price_out = rec.prices.output_per_mtok
        info.heartbeat = min(rec.heartbeat, time.time() + 2.0)  # a future heartbeat would never go stale
        info.status = rec.status
        info.backend = rec.backend
        info.predictor_model = rec.predictor_model or predictor_name(rec.model, self.aliases)
        mml = (rec.config or {}).get("max_model_len")
        info.max_model_len = mml if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0 else None
        info.tokenizer = rec.tokenizer
        if rec.tokenizer and self.on_tokenizer is not None:
            self.on_tokenizer(rec.tokenizer)

    def _on_calibration(self, key: str, value: bytes | None) -> None:
        info = self.instances.get(key)
        if value is None:
            self._calibrations.pop(key, None)
            if info is not None:
                info.calibration = NOMINAL_CALIBRATION
            return
        try:
            cal = decode(Calibration, value)
        except BearError as exc:
            self._reject("malformed_calibration", key, exc.message)
            return
        if info is not None:
            info.calibration = cal
            return
        self._calibrations[key] = cal
        self._calibrations.move_to_end(key)
        while len(self._calibrations) > self.max_instances:
            self._calibrations.popitem(last=False)

    async def _on_outcome(self, msg: Any) -> None:
        try:
            o = decode(Outcome, msg.data)
        except BearError:
            return
        info = self.instances.get(o.instance)
        if info is not None:
            info.obs.add_outcome(o.t, o.ttft_s, o.tpot_s, o.completed)
