"""At-most-once execution of a ``query_id`` across stateless routers: the first router to
``create`` the key in the JetStream KV bucket ``<prefix>_queries`` (create-only: fails when the
key exists) owns the query; any resubmission finds the key and is not executed again. Keys expire
after ``ttl_s``. When JetStream does not answer within ``timeout_s`` (NATS restarting), the router
falls back to its own memory of recent ids — it still never runs an id twice itself — and counts
the fallback (``bear_router_dedup_fallback_total``). The same when JetStream cannot write the
bucket (a full disk: nats-server 2.15 then acknowledges nothing on that stream until it restarts):
the router goes on, ``bear_router_degraded{part="dedup"}`` is 1 and one warning line says so, one
more when a claim is written again."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from bear.runtime.kv import DEDUP_TTL_S, ensure_kv

log = structlog.get_logger("bear.router")

LOCAL_IDS = 100_000


class Deduplicator:
    def __init__(self, nc: Any, bucket: str, *, ttl_s: float = DEDUP_TTL_S, timeout_s: float = 0.1) -> None:
        self.nc = nc
        self.bucket = bucket
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._kv: Any = None
        self._local: OrderedDict[str, float] = OrderedDict()
        self.fallbacks = 0
        self.failing = False  # the last claim fell back
        self._since = 0  # fallbacks since claims last worked

    @staticmethod
    def key(query_id: str, client: str = "") -> str:
        """The router's key of a client's query id: a hash (KV keys allow only [-/_=.a-zA-Z0-9]),
        scoped by the client identity it came from — a client can neither choose a key nor claim
        another client's ids."""
        return hashlib.sha1((f"{client}\0{query_id}" if client else query_id).encode()).hexdigest()

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await ensure_kv(self.nc.jetstream(timeout=self.timeout_s), self.bucket, ttl_s=self.ttl_s)
        return self._kv

    async def claim(self, query_id: str, owner: str, client: str = "") -> bool:
        """True when this router may execute ``query_id`` of ``client`` (first claim), False for a
        duplicate."""
        now = time.monotonic()
        k = self.key(query_id, client)
        if k in self._local:
            return False
        self._local[k] = now
        while len(self._local) > LOCAL_IDS:
            self._local.popitem(last=False)
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task per claim, unlike wait_for
                kv = self._kv if self._kv is not None else await self._bucket()
                await kv.create(k, owner.encode())
            self._working()
            return True
        except KeyWrongLastSequenceError:
            self._working()
            return False
        except Exception as exc:  # JetStream unavailable: this router's memory is the fallback
            if "wrong last sequence" in str(exc).lower():
                return False
            self._kv = None
            self._fell_back(exc)
            return True

    async def take_over(self, query_id: str, owner: str, client: str,
                        gone: Callable[[str], Awaitable[bool]]) -> tuple[str, str]:
        """A takeover resubmission of ``query_id`` (``bear.router.takeover``): ``taken`` when its
        claim's owner is ``gone`` and the claim is now ``owner``'s (compare-and-set: one router wins),
        ``gone`` when the owner is gone but the claim could not be rewritten (another router took it),
        ``held`` when the owner is this router, is alive, or cannot be known (JetStream away, no claim);
        with the claim's owner ("" where none was read)."""
        k = self.key(query_id, client)
        try:
            async with asyncio.timeout(self.timeout_s):
                kv = self._kv if self._kv is not None else await self._bucket()
                entry = await kv.get(k)
        except Exception:  # no claim (expired, never written) or JetStream away: nothing to take over
            return "held", ""
        held_by = (entry.value or b"").decode(errors="replace")
        if not held_by or held_by == owner or not await gone(held_by):
            return "held", held_by
        try:
            async with asyncio.timeout(self.timeout_s):
                await kv.update(k, owner.encode(), last=entry.revision)
        except Exception:
            return "gone", held_by
        self._local[k] = time.monotonic()
        log.warning("query taken over from a router that is gone", query_id=query_id, router=held_by)
        return "taken", held_by

    def _fell_back(self, exc: Exception) -> None:
        from bear.router.outcomes import metrics

        self.fallbacks += 1
        self._since += 1
        m = metrics()
        m.dedup_fallback.inc()
        if not self.failing:
            self.failing = True
            m.degraded.labels(part="dedup").set(1)
            log.warning("dedup claims failing (JetStream not answering or not writing the bucket); routing goes on "
                        "with this router's memory of recent ids", bucket=self.bucket, error=repr(exc)[:200])

    def _working(self) -> None:
        if self.failing:
            from bear.router.outcomes import metrics

            self.failing = False
            metrics().degraded.labels(part="dedup").set(0)
            log.warning("dedup claims written again", bucket=self.bucket, fell_back=self._since)
            self._since = 0
