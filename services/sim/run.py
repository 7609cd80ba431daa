"""Process main of ``bear sim-engine``: NATS connection, publisher, registry heartbeat, engine
loop and HTTP server, shut down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
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
                ready: Any = None) -> None:
    from aiohttp import web


    profile = load_profile(profile_name)
    subjects = Subjects(prefix)
    nc = await connect(nats_url, f"bear-sim-{instance}")
    publisher = InstancePublisher(nc, instance, subjects, idle_snapshot_s=heartbeat_s, min_interval_s=min_interval_s)
    sim = SimEngine(profile, instance, publisher, seed=seed, lengths=OutputLengths.parse(output_lengths, seed))
    publisher.initial = lambda: sim.engine.snapshot(instance, profile.model, 0.0)
    runner = SimApi(sim).runner()
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    url = base_url or f"http://{host}:{port}/v1"
    registration = Registration(nc, instance_record(
        instance, profile.model, url, gpu=f"{profile.gpu.count}x{profile.gpu.name}", backend="sim",
        price_input_per_mtok=profile.prices.get("input_per_mtok", 0.0),
        price_output_per_mtok=profile.prices.get("output_per_mtok", 0.0)), subjects)
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
