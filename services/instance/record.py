"""The instance's entry in the ``bear_instances`` KV bucket (design.md §2): what routers need to
send it queries (model, OpenAI base URL, prices) and its heartbeat, which tells an idle instance
from a dead one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bear.protocol.codec import pack
from bear.protocol.subjects import Subjects
from bear.runtime.kv import ensure_kv

INSTANCE_SCHEMA = "bear.instance/1"


def instance_record(
    instance: str,
    model: str,
    base_url: str,
    *,
    gpu: str = "",
    price_input_per_mtok: float = 0.0,
    price_output_per_mtok: float = 0.0,
    backend: str = "vllm",
) -> dict[str, Any]:
    """The ``bear_instances`` KV value for one instance (design.md §2); ``heartbeat`` is set on put."""
    return {
        "v": INSTANCE_SCHEMA,
        "id": instance,
        "model": model,
        "base_url": base_url,
        "gpu": gpu,
        "prices": {"input_per_mtok": price_input_per_mtok, "output_per_mtok": price_output_per_mtok},
        "backend": backend,
        "heartbeat": 0.0,
    }


async def heartbeat_registry(nc: Any, record: dict[str, Any], subjects: Subjects | None = None,
                             every_s: float = 2.0) -> None:
    """Put ``record`` into the ``bear_instances`` KV bucket every ``every_s`` seconds (creates the
    bucket if needed); runs until cancelled, surviving NATS hiccups."""
    subjects = subjects or Subjects()
    js = nc.jetstream()
    kv = None
    while True:
        try:
            if kv is None:
                kv = await ensure_kv(js, subjects.instances_bucket)
            record["heartbeat"] = time.time()
            await kv.put(record["id"], pack(record))
        except asyncio.CancelledError:
            raise
        except Exception:
            kv = None
        await asyncio.sleep(every_s)
