"""The ``bear_tokenizers`` JetStream object store: one object per instance, named by the
instance id (its writer: an instance's NATS identity may write only that name,
bear.runtime.nats_auth), holding its tokenizer bundle; the registry entry names the bundle id (a
content hash). The snapshotter or the sim engine puts its engine's bundle there; every router
fetches the bundles its instances name — so a router needs no model files. Objects named by the
bundle id itself (``admin``, tests, older deployments) are read too.

The store is bounded (bear.runtime.kv.StoreLimits): a bundle larger than ``MAX_OBJECT_BYTES`` is
neither written nor read, and a full store refuses the put — the instance then registers without a
tokenizer and routers estimate its prompt lengths (``store_tokenizer``: logged, counted)."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from typing import Any

import structlog

from bear.tokenizer.bundle import BundleError, TokenizerBundle

MAX_OBJECT_BYTES = 64 << 20  # bear.runtime.kv.StoreLimits.tokenizer_object_bytes
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
