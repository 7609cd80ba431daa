"""Process mains of ``bear estimator`` (one worker per process; ``--workers N`` forks N such
processes, which share nothing but NATS) and ``bear calibrator``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from typing import Any

import structlog

from bear.protocol.shutdown import close_nats
from bear.protocol.subjects import Subjects

log = structlog.get_logger("bear.estimator")


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def _connect(url: str, name: str) -> Any:
    import nats

    async def on_error(exc: Exception) -> None:  # slow-consumer drops etc.: logged, not fatal
        log.warning("nats error", error=str(exc))

    return await nats.connect(url, name=name, max_reconnect_attempts=-1, error_cb=on_error)


async def run_worker(nats_url: str, config: Any, prefix: str = "bear", with_calibrator: bool = False,
                     calibrator_kwargs: dict[str, Any] | None = None) -> None:
    from bear.estimator.calibrator import OnlineCalibrator
    from bear.estimator.worker import EstimatorWorker

    nc = await _connect(nats_url, "bear-estimator")
    worker = EstimatorWorker(nc, config, Subjects(prefix))
    await worker.start()
    cal = None
    if with_calibrator:
        cal = OnlineCalibrator(nc, Subjects(prefix), **(calibrator_kwargs or {}))
        await cal.start()
    await _stop_event().wait()
    if cal is not None:
        await cal.stop()
    await worker.stop()
    await close_nats(nc)
    log.info("estimator worker stopped", handled=worker.handled)


async def run_calibrator(nats_url: str, prefix: str = "bear", **kwargs: Any) -> None:
    from bear.estimator.calibrator import OnlineCalibrator

    nc = await _connect(nats_url, "bear-calibrator")
    cal = OnlineCalibrator(nc, Subjects(prefix), **kwargs)
    await cal.start()
    await _stop_event().wait()
    await cal.stop()
    await close_nats(nc)


def run_forked(argv: list[str], workers: int, metrics_port: int | None) -> int:
    """Start ``workers`` single-worker processes with the same arguments; forward SIGINT/SIGTERM."""
    procs: list[subprocess.Popen[bytes]] = []
    for i in range(workers):
        args = [sys.executable, "-m", "bear", "estimator", *argv, "--workers", "1"]
        if metrics_port:
            args += ["--metrics-port", str(metrics_port + i)]
        procs.append(subprocess.Popen(args))

    def forward(signum: int, _: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    codes = [p.wait() for p in procs]
    return max(codes, default=0)
