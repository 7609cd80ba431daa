"""JetStream key-value helpers every service shares: open-or-create a bucket, follow all its keys."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.errors import TimeoutError as NatsTimeout

DEDUP_TTL_S = 600.0  # how long a claimed query id is remembered (bear.router.dedup)
TERMINAL_TTL_S = 60.0  # how long a terminal message is kept for a client that missed it (bear.client.submit)

MIB = 1 << 20


@dataclass(frozen=True)
class StoreLimits:
    """What each bucket may hold (issue 26: the tokenizer store had no limit, filled the server's
    JetStream store, and then the registry could not be written and every query was
    ``unavailable``). Each stream gets its own ``max_bytes``, which JetStream *reserves* against
    the server's (or account's) storage when the stream is created — a stream whose limit does not
    fit is refused then, not when it fills — so a full tokenizer store never takes the registry's
    or the calibration's room. KV entries are bounded in size too."""

    kv_bytes: int = 64 * MIB  # the registry, calibration and provisioning buckets, each
    queries_bytes: int = 256 * MIB  # the dedup claims of DEDUP_TTL_S (≈ 150 B each)
    terminals_bytes: int = 64 * MIB  # the terminal messages of TERMINAL_TTL_S (≈ 300 B each)
    value_bytes: int = 64 * 1024  # one KV entry (a registry record is ~1 KiB)
    tokenizers_bytes: int = 1024 * MIB  # the tokenizer object store (one bundle per instance)
    tokenizer_object_bytes: int = 64 * MIB  # one bundle (a large tokenizer.json is ~11 MB)


LIMITS = StoreLimits()


async def ensure_kv(js: Any, bucket: str, *, ttl_s: float | None = None, replicas: int = 1,
                    max_bytes: int | None = None, max_value_bytes: int | None = None, direct: bool | None = None) -> Any:
    """The JetStream KV bucket ``bucket``, created (history 1) when it does not exist yet. Under
    least-privilege credentials only ``admin`` may create one (``provision``): for any other
    identity a missing bucket is an error that its caller retries."""
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        from nats.js.api import KeyValueConfig

        return await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, replicas=replicas,
                                                        max_bytes=max_bytes, max_value_size=max_value_bytes,
                                                        direct=direct))


async def provision(js: Any, subjects: Any, *, replicas: int = 1, dedup_ttl_s: float = DEDUP_TTL_S,
                    limits: StoreLimits = LIMITS) -> list[str]:
    """Create the deployment's buckets (``bear up`` and ``bear nats provision`` do it as ``admin``
    before any service starts): the registry, the calibration and the dedup KV bucket (entries
    expire after ``dedup_ttl_s``), the instances' provisioning (``bind_instances``) and the
    tokenizer object store, each replicated ``replicas`` times in a cluster and bounded by
    ``limits`` (buckets that exist already are left as they are)."""
    buckets = [(subjects.instances_bucket, None), (subjects.calibration_bucket, None),
               (subjects.queries_bucket, dedup_ttl_s), (subjects.provisioned_bucket, None)]
    for bucket, ttl in buckets:
        size = limits.queries_bytes if bucket == subjects.queries_bucket else limits.kv_bytes
        await _sized(bucket, size, ensure_kv(js, bucket, ttl_s=ttl, replicas=replicas, max_bytes=size,
                                             max_value_bytes=limits.value_bytes))
    from nats.js.api import ObjectStoreConfig
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        await js.object_store(subjects.tokenizers_bucket)
    except (BucketNotFoundError, NotFoundError):
        await _sized(subjects.tokenizers_bucket, limits.tokenizers_bytes, js.create_object_store(
            subjects.tokenizers_bucket, ObjectStoreConfig(replicas=replicas, max_bytes=limits.tokenizers_bytes)))
    # terminal messages, read by key with a direct get (clients may get a key, not list the bucket)
    await _sized(subjects.terminals_bucket, limits.terminals_bytes,
                 ensure_kv(js, subjects.terminals_bucket, ttl_s=TERMINAL_TTL_S, replicas=replicas, direct=True,
                           max_bytes=limits.terminals_bytes, max_value_bytes=limits.value_bytes))
    return [*(b for b, _ in buckets), subjects.terminals_bucket, subjects.tokenizers_bucket]


async def _sized(bucket: str, max_bytes: int, create: Any) -> Any:
    """``await create``; JetStream's refusal to reserve ``max_bytes`` (err 10047) as one clear line."""
    try:
        return await create
    except Exception as exc:
        if getattr(exc, "err_code", None) != 10047:
            raise
        from bear.protocol.errors import BearError, ErrorCode

        raise BearError(ErrorCode.UNAVAILABLE, f"JetStream has no room to reserve {max_bytes // MIB} MiB for "
                                               f"bucket {bucket} (insufficient storage resources): raise the "
                                               "server's max_file_store (or the account's limit), or free its "
                                               "store's disk") from exc


async def bind_instances(js: Any, subjects: Any, bindings: list[Any]) -> list[str]:
    """Write each instance's ``bear.protocol.provisioned.Provisioned`` binding into the provisioning
    bucket (as ``admin``, the only identity that may): routers started with provisioning on take
    only registry entries that agree with it. Returns the ids bound."""
    from bear.protocol.messages import encode

    kv = await ensure_kv(js, subjects.provisioned_bucket)
    for b in bindings:
        await kv.put(b.id, encode(b))
    return [b.id for b in bindings]


@dataclass
class WatchStats:
    """What a KV watch went through (for metrics and tests)."""

    entries: int = 0
    rejected: int = 0  # entries whose handler raised: counted and skipped
    rewatches: int = 0


async def watch_kv(js: Any, bucket: str, handler: Callable[[str, bytes | None], None], *,
                   on_loaded: Callable[[], None] | None = None, retry_s: float = 1.0, log: Any = None,
                   nc: Any = None, poll_s: float = 0.5, stats: WatchStats | None = None) -> None:
    """Follow every key of a KV bucket (created if missing) until cancelled: ``handler(key,
    value)`` per update (value None on delete/purge), ``on_loaded()`` once the initial values are
    through, after every (re)watch.

    It survives anything one entry or the broker does: an entry whose handler raises is counted
    and skipped (one bad key never wedges the watch); a failed watch is stopped before the next
    one starts (no consumer left behind); and with ``nc`` given, a reconnect of that connection
    starts a fresh watch within ``poll_s`` — the old consumer may not exist on the restarted
    server, and the initial values bring the view up to date at once."""
    stats = stats if stats is not None else WatchStats()
    while True:
        watcher = None
        try:
            kv = await ensure_kv(js, bucket)
            watcher = await kv.watchall()
            reconnects = _reconnects(nc)
            while _reconnects(nc) == reconnects:
                try:
                    entry = await watcher.updates(timeout=poll_s)
                except (TimeoutError, NatsTimeout):
                    continue
                if entry is None:  # end of the initial values
                    if on_loaded is not None:
                        on_loaded()
                    continue
                stats.entries += 1
                try:
                    handler(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
                except Exception as exc:
                    stats.rejected += 1
                    if log is not None:
                        log.warning("kv entry rejected", bucket=bucket, key=entry.key, error=repr(exc)[:200])
            stats.rewatches += 1  # the connection came back: watch afresh
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            stats.rewatches += 1
            if log is not None:
                log.warning("kv watch failed; retrying", bucket=bucket, error=str(exc))
            await asyncio.sleep(retry_s)
        finally:
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watcher.stop(), 1.0)


def _reconnects(nc: Any) -> int:
    return int(nc.stats.get("reconnects", 0)) if nc is not None else 0
