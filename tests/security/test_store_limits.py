"""Issue 26, item 4: the tokenizer object store had no size limit and any instance could write
any object name. On ``bear up``'s stack 180 MB went in; on a 300 MB JetStream store, once it was
full, registry writes failed and every query got ``unavailable``. Now every bucket and store is
bounded (bear.runtime.kv.StoreLimits: max bytes, per-entry size), JetStream reserves each
stream's bytes at creation (so a full tokenizer store leaves the registry and calibration their
room), an instance writes only the object named by its own id, and an instance whose bundle
cannot be stored registers without a tokenizer (logged, counted) — routers then estimate its
prompt lengths."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bear.protocol.subjects import Subjects
from bear.runtime.kv import LIMITS, MIB, StoreLimits, provision
from bear.runtime.nats_auth import generate
from bear.runtime.nats_server import LocalNatsServer
from bear.runtime.service import connect
from bear.tokenizer import store
from bear.tokenizer.bundle import TokenizerBundle

S = Subjects()
SMALL = StoreLimits(kv_bytes=1 * MIB, queries_bytes=1 * MIB, terminals_bytes=1 * MIB, value_bytes=16 * 1024,
                    tokenizers_bytes=4 * MIB,
                    tokenizer_object_bytes=1 * MIB)


class Env:
    def __init__(self, srv: LocalNatsServer, files: Any) -> None:
        self.srv, self.files, self.conns = srv, files, []

    async def nc(self, name: str) -> Any:
        creds = self.files.instance(name[len("instance-"):]) if name.startswith("instance-") else self.files.path(name)
        nc = await connect(self.srv.url, f"test-{name}", creds=creds, connect_within_s=3.0)
        self.conns.append(nc)
        return nc


async def _env(tmp_path: Path, limits: StoreLimits, max_file_store: str = "") -> AsyncIterator[Env]:
    files = generate(tmp_path / "auth", ["a", "b"])
    conf = files.config
    if max_file_store:  # a small JetStream store, as on a small disk
        conf = tmp_path / "auth" / "server.conf"
        conf.write_text(f'include "{files.config.name}"\njetstream {{ max_file_store: {max_file_store} }}\n')
    with LocalNatsServer(config=conf) as srv:
        e = Env(srv, files)
        admin = await e.nc("admin")
        await provision(admin.jetstream(timeout=5.0), S, limits=limits)
        try:
            yield e
        finally:
            for nc in e.conns:
                with contextlib.suppress(Exception):
                    await nc.close()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in _env(tmp_path, LIMITS):
        yield e


@pytest.fixture
async def small(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in _env(tmp_path, SMALL, "64MB"):
        yield e


def _bundle(tag: str, pad: int = 0) -> TokenizerBundle:
    return TokenizerBundle(json.dumps({"model": {"tag": tag, "pad": "x" * pad}}).encode(), None, {})


async def test_every_bucket_and_store_is_bounded(env: Env) -> None:
    js = (await env.nc("admin")).jetstream(timeout=5.0)
    names = [f"KV_{S.instances_bucket}", f"KV_{S.calibration_bucket}", f"KV_{S.queries_bucket}",
             f"KV_{S.provisioned_bucket}", f"KV_{S.terminals_bucket}", f"OBJ_{S.tokenizers_bucket}"]
    unbounded = {}
    for name in names:
        cfg = (await js.stream_info(name)).config
        if not (cfg.max_bytes or 0) > 0 or (name.startswith("KV_") and not (cfg.max_msg_size or 0) > 0):
            unbounded[name] = (cfg.max_bytes, cfg.max_msg_size)
    assert unbounded == {}, f"streams without a byte limit (max_bytes, max_msg_size): {unbounded}"


async def test_an_instance_writes_only_its_own_tokenizer_object(env: Env) -> None:
    a, b, router = await env.nc("instance-a"), await env.nc("instance-b"), await env.nc("router")
    bundle = _bundle("a")
    bid = await store.put_bundle(a.jetstream(timeout=3.0), S.tokenizers_bucket, bundle, "a")
    assert bid == bundle.id
    assert await store.put_bundle(a.jetstream(timeout=3.0), S.tokenizers_bucket, bundle, "a") == bid  # idempotent
    obs = await router.jetstream(timeout=3.0).object_store(S.tokenizers_bucket)
    before = (await obs.get_info("a")).digest
    # b writes under a's name, and under the bundle id: both refused (a publish permission)
    for name in ("a", bid):
        with contextlib.suppress(Exception):
            obs_b = await b.jetstream(timeout=3.0).object_store(S.tokenizers_bucket)
            await obs_b.put(name, _bundle("forged").to_bytes())
    assert (await obs.get_info("a")).digest == before, "instance b replaced instance a's tokenizer object"
    with pytest.raises(Exception):  # noqa: B017 - whatever nats-py makes of the refusal
        await obs.get_info(bid)
    fetched = await store.get_bundle(router.jetstream(timeout=3.0), S.tokenizers_bucket, bid, ["a"])
    assert fetched is not None and fetched.id == bid
    # b's own object: allowed
    assert await store.store_tokenizer(b.jetstream(timeout=3.0), S.tokenizers_bucket, _bundle("b"), "b")


async def test_a_full_tokenizer_store_leaves_the_registry_writable(small: Env) -> None:
    """Instance a fills the store with chunks; b's bundle is then refused — b registers without a
    tokenizer (logged, counted) — and the registry and calibration buckets still take writes."""
    a, b = await small.nc("instance-a"), await small.nc("instance-b")
    js_a = a.jetstream(timeout=3.0)
    filled = 0
    for size in (256 * 1024, 4096, 64):  # to the last byte
        with contextlib.suppress(Exception):
            for k in range(10 * SMALL.tokenizers_bytes // size):
                await js_a.publish(f"$O.{S.tokenizers_bucket}.C.fill{size}-{k}", b"x" * size)
                filled += size
    assert filled < 10 * SMALL.tokenizers_bytes, "the tokenizer store took everything offered"
    too_big = _bundle("big", SMALL.tokenizer_object_bytes)
    with pytest.raises(store.StoreError):
        await store.put_bundle(js_a, S.tokenizers_bucket, too_big, "a", max_bytes=SMALL.tokenizer_object_bytes)
    not_stored = store.STATS["not_stored"]
    assert await store.store_tokenizer(b.jetstream(timeout=3.0), S.tokenizers_bucket, _bundle("b"), "b") == ""
    assert store.STATS["not_stored"] == not_stored + 1
    kv = await b.jetstream(timeout=3.0).key_value(S.instances_bucket)
    assert await kv.put("b", b'{"instance": "b"}') > 0  # registry still writable
    cal = await (await small.nc("calibrator")).jetstream(timeout=3.0).key_value(S.calibration_bucket)
    assert await cal.put("b", b"{}") > 0


async def test_routing_goes_on_when_the_store_is_full(tmp_path: Path) -> None:
    """A sim engine whose tokenizer the full store refuses registers without one (it used to fail
    its start-up: the put raised) and the router serves its queries on estimated prompt lengths,
    counted (``bear_router_prompt_tokens_total{how="estimated"}``)."""
    import asyncio

    import nats

    from bear.client.submit import submit
    from bear.router.service import RouterConfig, RouterService
    from bear.sim.run import serve
    from bear.vllm_instance.launch import free_port
    from bear.vllm_instance.tiny_model import write_tokenizer

    from waiting import wait_until

    write_tokenizer(tmp_path)
    with LocalNatsServer() as srv:
        nc = await nats.connect(srv.url)
        await provision(nc.jetstream(timeout=5.0), S, limits=SMALL)
        js = nc.jetstream(timeout=3.0)
        for size in (256 * 1024, 4096, 64):  # the store full to the last byte
            with contextlib.suppress(Exception):
                for k in range(10 * SMALL.tokenizers_bytes // size):
                    await js.publish(f"$O.{S.tokenizers_bucket}.C.fill{size}-{k}", b"x" * size)
        not_stored = store.STATS["not_stored"]
        ready = asyncio.Event()
        sim = asyncio.create_task(serve("qwen3-8b-h100", free_port(), "sim-0", srv.url, seed=1,
                                        output_lengths="lognormal:8:0.3", tokenizer_dir=str(tmp_path), ready=ready))
        router = RouterService(nc, RouterConfig(policy="bear", outcome_log=tmp_path / "out.jsonl",
                                                predict_budget_s=0.05, predict_try_s=0.025))
        try:
            await asyncio.wait_for(asyncio.wait([sim, asyncio.ensure_future(ready.wait())],
                                                return_when=asyncio.FIRST_COMPLETED), 60)
            assert not sim.done(), f"the sim engine stopped: {sim.exception() if not sim.cancelled() else 'cancelled'}"
            assert store.STATS["not_stored"] == not_stored + 1
            await router.start()
            await wait_until(lambda: "sim-0" in router.registry.instances, what="sim-0 registered")
            assert router.registry.instances["sim-0"].tokenizer == ""
            before = router.m.prompt_tokens.labels(how="estimated")._value.get()
            out = [m async for m in submit(nc, messages=[{"role": "user", "content": "hello " * 20}],
                                           ttft_target_s=5.0, max_tokens=8)]
            assert out[-1]["v"] == "bear.done/1", out[-1]
            assert router.m.prompt_tokens.labels(how="estimated")._value.get() == before + 1
        finally:
            await router.stop()
            sim.cancel()
            with contextlib.suppress(BaseException):
                await sim
            await nc.close()
