"""The ``bear_tokenizers`` JetStream object store: one object per tokenizer bundle, named by its
id. The snapshotter puts its engine's bundle there (from the model directory vLLM loaded);
every router fetches the bundles its instances name — so a router needs no model files."""

from __future__ import annotations

from typing import Any

from bear.tokenizer.bundle import BundleError, TokenizerBundle


async def ensure_store(js: Any, bucket: str) -> Any:
    """The object store ``bucket``, created when it does not exist yet."""
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_object_store(bucket)


async def put_bundle(js: Any, bucket: str, bundle: TokenizerBundle) -> str:
    """Store ``bundle`` (once: an id already present is left alone); returns its id."""
    from nats.js.errors import NotFoundError, ObjectNotFoundError

    obs = await ensure_store(js, bucket)
    bid = bundle.id
    try:
        info = await obs.get_info(bid)
        if info is not None and not getattr(info, "deleted", False):
            return bid
    except (NotFoundError, ObjectNotFoundError):
        pass
    try:
        await obs.put(bid, bundle.to_bytes())
    except Exception as exc:
        # Another instance with the same tokenizer stored it between our look-up and our put:
        # nats-py then writes the object again and purges the older chunks, which an instance may
        # not do (its NATS rights: bear.runtime.nats_auth) — the object is there, and ids are
        # content hashes, so it is ours.
        try:
            info = await obs.get_info(bid)
        except (NotFoundError, ObjectNotFoundError):
            info = None
        if info is None or getattr(info, "deleted", False):
            raise exc
    return bid


async def get_bundle(js: Any, bucket: str, bundle_id: str) -> TokenizerBundle | None:
    """The bundle named ``bundle_id``; None when the store or the object is missing, or when its
    content does not hash to ``bundle_id`` (a forged or corrupt object is never used)."""
    from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError

    try:
        obs = await js.object_store(bucket)
        res = await obs.get(bundle_id)
    except (BucketNotFoundError, NotFoundError, ObjectNotFoundError):
        return None
    try:
        bundle = TokenizerBundle.from_bytes(res.data)
    except BundleError:
        return None
    return bundle if bundle.id == bundle_id else None
