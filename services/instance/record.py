"""The instance's entry in the ``bear_instances`` KV bucket (design.md §2): what routers need to
send it queries (model, OpenAI base URL, prices), its status and its heartbeat, which tells an idle
instance from a dead one. ``Registration`` keeps it fresh for the snapshotter and the sim engine
alike."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import structlog

from bear.protocol.messages import InstanceRecord, Prices, encode
from bear.protocol.subjects import Subjects
from bear.runtime.kv import ensure_kv

log = structlog.get_logger("bear.instance")


def instance_record(instance: str, model: str, base_url: str, *, gpu: str = "", price_input_per_mtok: float = 0.0,
                    price_output_per_mtok: float = 0.0, backend: str = "vllm",
                    config: dict[str, Any] | None = None) -> InstanceRecord:
    """The ``bear_instances`` value of one instance; ``heartbeat`` is set on every put;
    ``config``: the engine's scheduler limits (``max_model_len``: routers refuse queries that
    cannot fit before dispatching them)."""
    return InstanceRecord(id=instance, model=model, base_url=base_url, gpu=gpu, backend=backend, config=config,
                          prices=Prices(input_per_mtok=price_input_per_mtok, output_per_mtok=price_output_per_mtok))


class Registration:
    """Put the record at start, every ``heartbeat_s`` and whenever it changes (``update``); on
    ``close`` mark it down (``on_down="mark"``, heartbeats stop) or delete it. Survives NATS
    outages: a failed put is retried on the next beat with a fresh bucket handle."""

    def __init__(self, nc: Any, record: InstanceRecord, subjects: Subjects | None = None, *,
                 heartbeat_s: float = 0.5, on_down: str = "mark") -> None:
        if on_down not in ("mark", "delete"):
            raise ValueError("on_down must be mark or delete")
        self.nc = nc  # None until connected
        self.record = record
        self.subjects = subjects or Subjects()
        self.heartbeat_s = heartbeat_s
        self.on_down = on_down
        self._kv: Any = None
        self._dirty = True
        self.log = log.bind(instance=record.id)

    def update(self, **fields: Any) -> None:
        """Change fields of the record (status, generation, …); put on the next loop turn."""
        new = msgspec.structs.replace(self.record, **fields)
        if new != self.record:
            self.record = new
            self._dirty = True

    def note(self, **fields: Any) -> None:
        """Change fields that go out with the next heartbeat (the step counter, every step)."""
        self.record = msgspec.structs.replace(self.record, **fields)

    def reconnected(self) -> None:
        """After a NATS reconnect: a fresh bucket handle and an immediate put."""
        self._kv = None
        self._dirty = True

    async def put(self) -> None:
        if self.nc is None or not getattr(self.nc, "is_connected", True):
            return
        if self._kv is None:
            self._kv = await ensure_kv(self.nc.jetstream(timeout=1.0), self.subjects.instances_bucket)
        if self.record.status == "down" and self.on_down == "delete":
            await self._kv.delete(self.record.id)
        else:
            self.record = msgspec.structs.replace(self.record, heartbeat=time.time())
            await self._kv.put(self.record.id, encode(self.record))
        self._dirty = False

    async def run(self) -> None:
        last = 0.0
        while True:
            now = time.monotonic()
            if self._dirty or now - last >= self.heartbeat_s:
                try:
                    await asyncio.wait_for(self.put(), 1.0)
                    last = now
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._kv = None
                    self.log.warning("registry_put_failed", error=repr(exc))
            await asyncio.sleep(min(0.05, self.heartbeat_s))

    async def close(self) -> None:
        """The final put: down (or deleted), if the instance had come up."""
        if self.record.status != "up":
            return
        self.update(status="down")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.put(), 1.0)
