"""Issue 40, item 6: the tokenizer object store kept the chunks of refused uploads until the
server's store was thrown away — an instance identity may not purge, so nats-py's clean-up of a
failed put is refused too. Now a put that would not fit is refused before any chunk is sent, and
``sweep_orphan_chunks`` (``bear up`` runs it as admin, ``ChunkSweeper``) purges the chunks that no
object names once they were orphans at the sweep before too — never an object's own chunks, nor
those of an upload still in progress."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bear.protocol.subjects import Subjects
from bear.runtime.kv import MIB, StoreLimits, provision
from bear.runtime.nats_auth import generate
from bear.runtime.nats_server import LocalNatsServer
from bear.runtime.service import connect
from bear.tokenizer import store
from bear.tokenizer.bundle import TokenizerBundle

from waiting import wait_until_sync

S = Subjects()
BUCKET = S.tokenizers_bucket
STREAM = f"OBJ_{BUCKET}"
SMALL = StoreLimits(kv_bytes=1 * MIB, queries_bytes=1 * MIB, terminals_bytes=1 * MIB, value_bytes=16 * 1024,
                    tokenizers_bytes=2 * MIB, tokenizer_object_bytes=1 * MIB)


class Env:
    def __init__(self, srv: LocalNatsServer, files: Any) -> None:
        self.srv, self.files, self.conns = srv, files, []

    async def nc(self, name: str) -> Any:
        creds = self.files.instance(name[len("instance-"):]) if name.startswith("instance-") else self.files.path(name)
        nc = await connect(self.srv.url, f"test-{name}", creds=creds, connect_within_s=3.0)
        self.conns.append(nc)
        return nc


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    files = generate(tmp_path / "auth", ["a", "b"])
    with LocalNatsServer(config=files.config) as srv:
        e = Env(srv, files)
        admin = await e.nc("admin")
        await provision(admin.jetstream(timeout=5.0), S, limits=SMALL)
        try:
            yield e
        finally:
            for nc in e.conns:
                with contextlib.suppress(Exception):
                    await nc.close()


def _bundle(tag: str, pad: int = 0) -> TokenizerBundle:
    return TokenizerBundle(json.dumps({"model": {"tag": tag, "pad": "x" * pad}}).encode(), None, {})


async def _chunk_subjects(js: Any) -> set[str]:
    subjects = (await js.stream_info(STREAM, subjects_filter=f"$O.{BUCKET}.C.>")).state.subjects or {}
    return set(subjects)


async def test_orphan_chunks_of_a_refused_upload_are_swept(env: Env) -> None:
    a, b, admin = await env.nc("instance-a"), await env.nc("instance-b"), await env.nc("admin")
    js = admin.jetstream(timeout=3.0)
    bundle = _bundle("a")
    bid = await store.put_bundle(a.jetstream(timeout=3.0), BUCKET, bundle, "a")
    live = await _chunk_subjects(js)
    assert len(live) == 1
    # b uploads under a's name: its chunks go in, its meta is refused, and so is nats-py's purge
    obs_b = await b.jetstream(timeout=1.0).object_store(BUCKET)
    with contextlib.suppress(Exception):
        await obs_b.put("a", _bundle("forged", 300 * 1024).to_bytes())
    orphans = await _chunk_subjects(js) - live
    assert len(orphans) == 1, "the refused upload left no chunks: nothing to sweep in this test"
    stream_bytes = (await js.stream_info(STREAM)).state.bytes

    purged, suspects = await store.sweep_orphan_chunks(js, BUCKET)  # first sight: only suspected
    assert purged == 0 and {f"$O.{BUCKET}.C.{n}" for n in suspects} == orphans
    # an upload in progress: chunks sent, meta not yet — seen for the first time now
    await js.publish(f"$O.{BUCKET}.C.inprogress", b"x" * 1000)
    purged, suspects = await store.sweep_orphan_chunks(js, BUCKET, suspects)
    assert purged == 1
    assert suspects == {"inprogress"}  # not cut on its first sight
    assert await _chunk_subjects(js) == live | {f"$O.{BUCKET}.C.inprogress"}
    assert (await js.stream_info(STREAM)).state.bytes < stream_bytes - 290 * 1024  # the 300 KiB are gone
    purged, suspects = await store.sweep_orphan_chunks(js, BUCKET, suspects)  # still nothing names it
    assert purged == 1 and suspects == set()
    assert await _chunk_subjects(js) == live
    # a's object is whole
    router = await env.nc("router")
    fetched = await store.get_bundle(router.jetstream(timeout=3.0), BUCKET, bid, ["a"])
    assert fetched is not None and fetched.id == bid
    assert await store.sweep_orphan_chunks(js, BUCKET, suspects) == (0, set())


async def test_a_bundle_that_does_not_fit_sends_no_chunk(env: Env) -> None:
    a, b, admin = await env.nc("instance-a"), await env.nc("instance-b"), await env.nc("admin")
    js = admin.jetstream(timeout=3.0)
    await store.put_bundle(a.jetstream(timeout=3.0), BUCKET, _bundle("a", 1200 * 1024), "a")  # most of the 2 MiB
    before = await _chunk_subjects(js)
    not_stored = store.STATS["not_stored"]
    assert await store.store_tokenizer(b.jetstream(timeout=3.0), BUCKET, _bundle("b", 1000 * 1024), "b") == ""
    assert store.STATS["not_stored"] == not_stored + 1
    assert await _chunk_subjects(js) == before, "a refused put left chunks"
    with pytest.raises(store.StoreError, match="tokenizer store is full"):
        await store.put_bundle(b.jetstream(timeout=3.0), BUCKET, _bundle("b", 1000 * 1024), "b")


async def test_the_sweeper_thread_purges_as_admin(env: Env) -> None:
    admin = await env.nc("admin")
    js = admin.jetstream(timeout=3.0)
    await js.publish(f"$O.{BUCKET}.C.left", b"x" * 100)
    sweeper = store.ChunkSweeper(env.srv.url, env.files.path("admin"), BUCKET, every_s=0.05, connect=connect).start()
    try:
        wait_until_sync(lambda: sweeper.purged >= 1, what="the orphan purged by the sweeper")
    finally:
        sweeper.stop()
    assert await _chunk_subjects(js) == set()
