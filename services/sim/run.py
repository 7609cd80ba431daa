"""Process main of ``bear sim-engine``: NATS connection, publisher, registry heartbeat, engine
loop and HTTP server, shut down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from bear.instance.publisher import InstancePublisher
from bear.instance.record import Registration, instance_record
from bear.protocol.subjects import Subjects
from bear.runtime.service import connect, stop_event
from bear.runtime.shutdown import cancel_all, close_nats
from bear.sim.engine import SimEngine
from bear.sim.lengths import OutputLengths
from bear.sim.profile import load_profile
from bear.sim.server import SimApi

log = structlog.get_logger("bear.sim")


async def serve(profile_name: str, port: int, instance: str, nats_url: str, *, host: str = "127.0.0.1",
                prefix: str = "bear", seed: int | None = None, base_url: str | None = None,
                heartbeat_s: float = 0.5, min_interval_s: float = 0.0, output_lengths: str = "max",
                api_keys: Any = None, tokenizer_dir: str | None = None, deltas: bool = True, full_every: int = 256,
                ready: Any = None) -> None:
    """``api_keys``: a ``bear.gateway.auth.ApiKeys`` the HTTP API requires (None: open).
    ``tokenizer_dir``: a model directory with a tokenizer.json: prompts are tokenised with it,
    the engine keeps a block-level prefix cache (prompt blocks, vLLM's default sha256 hashing),
    publishes it on ``bear.kv.<id>`` and registers the tokenizer bundle (docs/sim-engine.md).
    ``deltas``/``full_every``: the publication of its states (bear.instance.publisher)."""
    from dataclasses import replace

    from aiohttp import web

    profile = load_profile(profile_name)
    subjects = Subjects(prefix)
    nc = await connect(nats_url, f"bear-sim-{instance}")
    bundle = tok = hasher = None
    if tokenizer_dir:
        from bear.prefix.hashing import BlockHasher, HashSpec
        from bear.tokenizer.bundle import from_model_dir
        from bear.tokenizer.cache import load

        bundle = from_model_dir(tokenizer_dir)
        tok = load(bundle)
        profile = replace(profile, scheduler={**profile.scheduler, "enable_prefix_caching": True})
        hasher = BlockHasher(HashSpec(block_size=int(profile.engine_config()["block_size"])))
    publisher = InstancePublisher(nc, instance, subjects, idle_snapshot_s=heartbeat_s, min_interval_s=min_interval_s,
                                  deltas=deltas, full_every=full_every, generation=time.time_ns(),
                                  kv_events=bundle is not None)
    sim = SimEngine(profile, instance, publisher, seed=seed, lengths=OutputLengths.parse(output_lengths, seed))
    publisher.initial = lambda: sim.engine.snapshot(instance, profile.model, 0.0)
    runner = SimApi(sim, tok, hasher, api_keys).runner()
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    url = base_url or f"http://{host}:{port}/v1"
    registration = Registration(nc, instance_record(
        instance, profile.model, url, gpu=f"{profile.gpu.count}x{profile.gpu.name}", backend="sim",
        price_input_per_mtok=profile.prices.get("input_per_mtok", 0.0),
        price_output_per_mtok=profile.prices.get("output_per_mtok", 0.0)), subjects)
    registration.update(config=profile.engine_config())
    if bundle is not None and hasher is not None:
        from bear.protocol.messages import PrefixCacheInfo
        from bear.tokenizer.store import store_tokenizer

        # a full or refusing store: registered without a tokenizer (lengths estimated), logged, counted
        bid = await store_tokenizer(nc.jetstream(timeout=5.0), subjects.tokenizers_bucket, bundle, instance)
        registration.update(tokenizer=bid, prefix_cache=PrefixCacheInfo(block_size=hasher.spec.block_size,
                                                                         events=True))
    tasks = [asyncio.create_task(publisher.run()), asyncio.create_task(sim.run()),
             asyncio.create_task(registration.run())]
    stop = stop_event()
    log.info("sim engine serving", instance=instance, profile=profile.name, model=profile.model, url=url,
             kv_blocks=profile.num_gpu_blocks,
             note="simulated: answers are placeholder text (lorem ipsum) with the real model's timing")
    if ready is not None:
        ready.set()
    await stop.wait()
    sim.stop()
    await cancel_all(tasks)
    await publisher.close()
    await registration.close()
    await runner.cleanup()
    await close_nats(nc)
    log.info("sim engine stopped", **sim.stats.as_dict())
