"""Process mains of ``bear estimator`` (one worker per process; ``--workers N`` forks N such
processes, which share nothing but NATS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import structlog

from bear.protocol.subjects import Subjects
from bear.runtime.identity import CREDS_ENV
from bear.runtime.service import connect, stop_event
from bear.runtime.shutdown import close_nats

log = structlog.get_logger("bear.estimator")


async def run_worker(nats_url: str, config: Any, prefix: str = "bear", with_calibrator: bool = False,
                     calibrator_kwargs: dict[str, Any] | None = None) -> None:
    from bear.calibrator.service import OnlineCalibrator
    from bear.estimator.worker import EstimatorWorker

    nc = await connect(nats_url, "bear-estimator")
    worker = EstimatorWorker(nc, config, Subjects(prefix))
    await worker.start()
    cal = None
    if with_calibrator:
        cal = OnlineCalibrator(nc, Subjects(prefix), **(calibrator_kwargs or {}))
        await cal.start()
    await stop_event().wait()
    if cal is not None:
        await cal.stop()
    await worker.stop()
    await close_nats(nc)
    log.info("estimator worker stopped", handled=worker.handled)


WORKER_FIELD = "{worker}"  # in --nats-creds / $BEAR_NATS_CREDS: each forked worker's own identity file


def worker_creds(creds: str, i: int) -> str:
    """Worker ``i``'s identity file: ``creds`` with ``{worker}`` replaced by ``i``
    (``auth/estimator-{worker}.json`` → ``auth/estimator-1.json``, the files ``bear nats config
    --service-replicas estimator=N`` writes: one identity per replica, revoked alone); a path
    without the field is every worker's (one shared identity, as before)."""
    return creds.replace(WORKER_FIELD, str(i))


def run_forked(argv: list[str], workers: int, metrics_port: int | None) -> int:
    """Start ``workers`` single-worker processes with the same arguments (and each its own
    identity where ``$BEAR_NATS_CREDS`` names a ``{worker}`` template); forward SIGINT/SIGTERM."""
    procs: list[subprocess.Popen[bytes]] = []
    creds = os.environ.get(CREDS_ENV, "")
    for i in range(workers):
        args = [sys.executable, "-m", "bear", "estimator", *argv, "--workers", "1"]
        if metrics_port:
            args += ["--metrics-port", str(metrics_port + i)]
        env = {**os.environ, CREDS_ENV: worker_creds(creds, i)} if WORKER_FIELD in creds else None
        procs.append(subprocess.Popen(args, env=env))

    def forward(signum: int, _: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    codes = [p.wait() for p in procs]
    return max(codes, default=0)
