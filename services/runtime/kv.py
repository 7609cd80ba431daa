"""JetStream key-value helpers every service shares: open-or-create a bucket, follow all its keys."""

from __future__ import annotations

import asyncio
from typing import Any


async def ensure_kv(js: Any, bucket: str) -> Any:
    """The JetStream KV bucket ``bucket``, created (history 1) when it does not exist yet."""
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        from nats.js.api import KeyValueConfig

        return await js.create_key_value(KeyValueConfig(bucket=bucket, history=1))


async def watch_kv(js: Any, bucket: str, handler: Any, *, on_loaded: Any = None, retry_s: float = 1.0,
                   log: Any = None) -> None:
    """Follow every key of a KV bucket (created if missing) forever: ``handler(key, value)`` per
    update, value None on delete/purge; ``on_loaded()`` once the initial values are through (after
    each (re)watch). Errors re-watch after ``retry_s``; cancellation stops it."""
    while True:
        try:
            kv = await ensure_kv(js, bucket)
            watcher = await kv.watchall()
            async for entry in watcher:
                if entry is None:  # end of the initial values
                    if on_loaded is not None:
                        on_loaded()
                    continue
                handler(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if log is not None:
                log.warning("kv watch failed; retrying", bucket=bucket, error=str(exc))
            await asyncio.sleep(retry_s)
