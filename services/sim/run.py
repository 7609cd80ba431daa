"""Process main of ``bear sim-engine``: NATS connection, publisher, registry heartbeat, engine
loop and HTTP server, shut down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import structlog

from bear.instance.publisher import InstancePublisher
from bear.instance.record import heartbeat_registry, instance_record
from bear.protocol.subjects import Subjects
from bear.runtime.shutdown import cancel_all, close_nats
from bear.sim.engine import SimEngine
from bear.sim.profile import load_profile
from bear.sim.server import SimApi

log = structlog.get_logger("bear.sim")


async def serve(profile_name: str, port: int, instance: str, nats_url: str, *, host: str = "127.0.0.1",
                prefix: str = "bear", seed: int | None = None, base_url: str | None = None,
                heartbeat_s: float = 0.5, min_interval_s: float = 0.0, ready: Any = None) -> None:
    from aiohttp import web

    from bear.runtime.service import connect

    profile = load_profile(profile_name)
    subjects = Subjects(prefix)
    nc = await connect(nats_url, f"bear-sim-{instance}")
    publisher = InstancePublisher(nc, instance, subjects, heartbeat_s=heartbeat_s, min_interval_s=min_interval_s)
    sim = SimEngine(profile, instance, publisher, seed=seed)
    runner = web.AppRunner(SimApi(sim).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    url = base_url or f"http://{host}:{port}/v1"
    record = instance_record(instance, profile.model, url, gpu=f"{profile.gpu.count}x{profile.gpu.name}",
                             price_input_per_mtok=profile.prices.get("input_per_mtok", 0.0),
                             price_output_per_mtok=profile.prices.get("output_per_mtok", 0.0), backend="sim")
    tasks = [asyncio.create_task(publisher.run()), asyncio.create_task(sim.run()),
             asyncio.create_task(heartbeat_registry(nc, record, subjects))]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    log.info("sim engine serving", instance=instance, profile=profile.name, model=profile.model, url=url,
             kv_blocks=profile.num_gpu_blocks,
             note="simulated: answers are placeholder text (lorem ipsum) with the real model's timing")
    if ready is not None:
        ready.set()
    await stop.wait()
    sim.stop()
    await cancel_all(tasks)
    await publisher.close()
    await runner.cleanup()
    await close_nats(nc)
    log.info("sim engine stopped", **sim.stats.as_dict())
