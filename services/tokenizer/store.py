"""The ``bear_tokenizers`` JetStream object store: one object per instance, named by the
instance id (its writer: an instance's NATS identity may write only that name,
bear.runtime.nats_auth), holding its tokenizer bundle; the registry entry names the bundle id (a
content hash). The snapshotter or the sim engine puts its engine's bundle there; every router
fetches the bundles its instances name — so a router needs no model files. Objects named by the
bundle id itself (``admin``, tests, older deployments) are read too.

The store is bounded (bear.runtime.kv.StoreLimits): a bundle larger than ``MAX_OBJECT_BYTES`` is
neither written nor read, and a full store refuses the put — the instance then registers without a
tokenizer and routers estimate its prompt lengths (``store_tokenizer``: logged, counted).

Orphan chunks (issue 40): an object is its chunks (``$O.<bucket>.C.<nuid>``) and then a meta
message naming them; an upload refused half-way (the store full, a name the writer may not write)
left its chunks behind until the server's store was thrown away — nats-py purges them on a
failed put, but an instance identity has no right to purge (bear.runtime.nats_auth). So a put
that would not fit is refused *before* any chunk is sent (``put_bundle`` compares the store's free
room first), and ``sweep_orphan_chunks`` — run by ``bear up`` as ``admin`` every
``SWEEP_EVERY_S`` (``ChunkSweeper``) — purges the chunks no object names, once they were orphans
at the sweep before too (an upload in progress sends its chunks before its meta)."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from typing import Any

import structlog

from bear.tokenizer.bundle import BundleError, TokenizerBundle

MAX_OBJECT_BYTES = 64 << 20  # bear.runtime.kv.StoreLimits.tokenizer_object_bytes
SWEEP_EVERY_S = 30.0  # ChunkSweeper: an orphan chunk is gone within two of these
log = structlog.get_logger("bear.tokenizer")
STATS = {"stored": 0, "not_stored": 0}  # store_tokenizer's outcomes in this process


class StoreError(RuntimeError):
    """A bundle that cannot be stored (too large, the store full or refusing): one line."""


async def ensure_store(js: Any, bucket: str) -> Any:
    """The object store ``bucket``, created when it does not exist yet."""
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_object_store(bucket)


def _digest(data: bytes) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


def _holds(info: Any, name: str, bid: str, digest: str) -> bool:
    """Whether the object ``info`` describes holds our bundle: present and, unless it is named by
    the bundle id (a content hash), with our content's digest."""
    if info is None or getattr(info, "deleted", False):
        return False
    return name == bid or str(getattr(info, "digest", "")).upper() == digest.upper()


async def put_bundle(js: Any, bucket: str, bundle: TokenizerBundle, name: str | None = None,
                     max_bytes: int = MAX_OBJECT_BYTES) -> str:
    """Store ``bundle`` as object ``name`` (default: its id; an instance passes its own id, the
    one name its credentials may write) once — an object already holding it is left alone;
    returns the bundle id. A bundle over ``max_bytes`` raises ``StoreError``."""
    from nats.js.errors import NotFoundError, ObjectNotFoundError

    obs = await ensure_store(js, bucket)
    bid = bundle.id
    name = name or bid
    data = bundle.to_bytes()
    if len(data) > max_bytes:
        raise StoreError(f"tokenizer bundle {bid} is {len(data)} bytes, over the store's {max_bytes} per object")
    digest = _digest(data)
    try:
        if _holds(await obs.get_info(name), name, bid, digest):
            return bid
    except (NotFoundError, ObjectNotFoundError):
        pass
    await _check_room(obs, bid, len(data))
    try:
        await obs.put(name, data)
    except Exception as exc:
        # Another instance with the same tokenizer stored it between our look-up and our put:
        # nats-py then writes the object again and purges the older chunks, which an instance may
        # not do (its NATS rights: bear.runtime.nats_auth) — the object is there, and ids are
        # content hashes, so it is ours.
        try:
            info = await obs.get_info(name)
        except (NotFoundError, ObjectNotFoundError):
            info = None
        if not _holds(info, name, bid, digest):
            raise exc
    return bid


async def _check_room(obs: Any, bid: str, size: int) -> None:
    """``StoreError`` when the store's ``max_bytes`` has no room for ``size`` more bytes (with
    room for the chunks' own headers): refused before a chunk is sent, so a full store keeps no
    orphan chunks of it. A store whose state cannot be read is tried anyway."""
    try:
        info = (await obs.status()).stream_info
        limit, used = int(info.config.max_bytes or 0), int(info.state.bytes or 0)
    except Exception:
        return
    need = size + size // 64 + 4096  # a 128 KiB chunk's subject and headers, and the meta message
    if limit > 0 and used + need > limit:
        raise StoreError(f"the tokenizer store is full ({used} of {limit} bytes used): no room for bundle {bid} "
                         f"of {size} bytes")


async def sweep_orphan_chunks(js: Any, bucket: str, suspects: set[str] | frozenset[str] = frozenset()
                              ) -> tuple[int, set[str]]:
    """Purge the chunks of object store ``bucket`` that no object's meta message names and that
    were orphans at the previous sweep too (``suspects``, what that sweep returned: an upload in
    progress sends its chunks before its meta, and is not cut). Needs the right to read the
    stream's subjects and to purge (``admin``). Returns (chunk subjects purged, the suspects for
    the next sweep)."""
    import json

    stream = f"OBJ_{bucket}"
    chunk_pre, meta_pre = f"$O.{bucket}.C.", f"$O.{bucket}.M."
    subjects = (await js.stream_info(stream, subjects_filter=f"$O.{bucket}.>")).state.subjects or {}
    named: set[str] = set()
    for subj in subjects:
        if not subj.startswith(meta_pre):
            continue
        try:
            meta = json.loads((await js.get_last_msg(stream, subj)).data or b"{}")
        except Exception:  # gone meanwhile, or not JSON: names nothing
            continue
        if isinstance(meta, dict) and not meta.get("deleted") and meta.get("nuid"):
            named.add(str(meta["nuid"]))
    orphans = {subj[len(chunk_pre):] for subj in subjects if subj.startswith(chunk_pre)} - named
    purged = 0
    for nuid in sorted(orphans & set(suspects)):
        await js.purge_stream(stream, subject=chunk_pre + nuid)
        purged += 1
    return purged, orphans - set(suspects)


class ChunkSweeper:
    """``sweep_orphan_chunks`` every ``every_s`` on a thread of its own (its own event loop and
    NATS connection, as ``creds``: ``bear up``'s admin), until ``stop()``. A failed sweep (NATS
    away) is logged once until one succeeds again."""

    def __init__(self, url: str, creds: Any, bucket: str, every_s: float = SWEEP_EVERY_S, *,
                 connect: Any = None) -> None:
        """``connect(url, name, creds=...)``: how to open the NATS connection (the caller's: a
        layer below bear.runtime cannot import it)."""
        self.connect = connect
        import threading

        self.url, self.creds, self.bucket, self.every_s = url, creds, bucket, every_s
        self.purged = 0
        self.sweeps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bear-chunk-sweeper", daemon=True)

    def start(self) -> ChunkSweeper:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._loop())

    async def _loop(self) -> None:
        import asyncio
        import contextlib

        connect = self.connect
        assert connect is not None, "ChunkSweeper needs connect="

        loop = asyncio.get_running_loop()
        nc: Any = None
        suspects: set[str] = set()
        failing = False
        try:
            while not await loop.run_in_executor(None, self._stop.wait, self.every_s):
                try:
                    if nc is None:
                        nc = await connect(self.url, "bear-up-chunk-sweeper", creds=self.creds or "")
                    n, suspects = await sweep_orphan_chunks(nc.jetstream(timeout=5.0), self.bucket, suspects)
                except Exception as exc:
                    if not failing:
                        log.warning("tokenizer_chunk_sweep_failed", bucket=self.bucket, error=_one_line(exc))
                    failing = True
                    continue
                failing = False
                self.sweeps += 1
                if n:
                    self.purged += n
                    log.info("tokenizer_orphan_chunks_purged", bucket=self.bucket, objects=n)
        finally:
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()


async def store_tokenizer(js: Any, bucket: str, bundle: TokenizerBundle, instance: str) -> str:
    """``put_bundle`` under the instance's own name; the bundle id, or "" when it cannot be stored
    (the store full, the bundle too large, no rights) — logged and counted, never raised: the
    instance then registers without a tokenizer and routers estimate its prompt lengths."""
    try:
        bid = await put_bundle(js, bucket, bundle, instance)
    except Exception as exc:
        STATS["not_stored"] += 1
        log.warning("tokenizer_not_stored", instance=instance, tokenizer=bundle.id, error=_one_line(exc),
                    effect="registered without a tokenizer: routers estimate its prompt lengths")
        return ""
    STATS["stored"] += 1
    return bid


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:300]


async def get_bundle(js: Any, bucket: str, bundle_id: str, names: Iterable[str] = (),
                     max_bytes: int = MAX_OBJECT_BYTES) -> TokenizerBundle | None:
    """The bundle ``bundle_id`` from the first of the objects ``names`` (the instances that name
    it), then ``bundle_id`` itself, that holds it; None when none does: a missing store or object,
    one over ``max_bytes`` (not downloaded), or content that does not hash to ``bundle_id`` (a
    forged or corrupt object is never used)."""
    from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError

    try:
        obs = await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        return None
    for name in dict.fromkeys([*names, bundle_id]):
        try:
            info = await obs.get_info(name)
            if info is None or getattr(info, "deleted", False) or (info.size or 0) > max_bytes:
                continue
            res = await obs.get(name)
        except (NotFoundError, ObjectNotFoundError):
            continue
        try:
            bundle = TokenizerBundle.from_bytes(res.data)
        except BundleError:
            continue
        if bundle.id == bundle_id:
            return bundle
    return None
