"""BEA's TTFT accuracy against a simulated instance under Poisson load (``bear bench estimator-accuracy``).

One sim engine publishes its snapshots and batch records on NATS, an estimator worker and the
online calibrator run beside it; every query is estimated right before it is submitted (as the
router does), its predicted output length is announced on ``bear.dispatch`` (true length times
log-normal noise: lengths are predicted, not known), and the estimate is compared with the TTFT
the engine actually produced. It is not 0: the engine times batches with the roofline, not eq. 12.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from bear.protocol.messages import Dispatch, encode
from bear.protocol.subjects import Subjects
from bear.runtime import aio
from bear.runtime.shutdown import cancel_all


async def measure(nats_url: str, *, profile: str = "qwen3-8b-h100", qps: float = 4.0, seconds: float = 15.0,
                  warmup_s: float = 4.0, seed: int = 0, length_noise: float = 0.3, compensate: bool = False,
                  max_prompt: int = 4000) -> dict[str, Any]:
    import nats

    from bear.calibrator.service import OnlineCalibrator
    from bear.estimator.client import EstimatorClient
    from bear.estimator.estimate import EstimatorConfig
    from bear.estimator.worker import EstimatorWorker
    from bear.instance.publisher import InstancePublisher
    from bear.sim.engine import SimEngine
    from bear.sim.profile import load_profile

    subjects = Subjects()
    instance = f"acc-{seed}"
    nc = await nats.connect(nats_url)
    pub = InstancePublisher(nc, instance, subjects)
    sim = SimEngine(load_profile(profile), instance, pub, seed=seed)
    worker = EstimatorWorker(nc, EstimatorConfig(compensate_staleness=compensate))
    cal = OnlineCalibrator(nc, subjects, window=3000, min_records=50, refit_s=1.0)
    await worker.start()
    await cal.start()
    tasks = [asyncio.create_task(pub.run()), asyncio.create_task(sim.run())]
    client = EstimatorClient(nc, try_timeout_s=1.0)
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    reqs: list[Any] = []
    t0 = time.time()
    total = warmup_s + seconds
    next_t = t0
    k = 0
    while True:
        next_t += rng.exponential(1.0 / qps)
        if next_t - t0 > total:
            break
        await asyncio.sleep(max(0.0, next_t - time.time()))
        p = int(np.clip(rng.lognormal(6.5, 0.9), 32, max_prompt))
        o = int(np.clip(rng.lognormal(5.3, 0.8), 8, 1500))
        pred = int(max(1, round(o * float(np.exp(rng.normal(0.0, length_noise))))))
        rid = f"{instance}-q{k}"
        k += 1
        rep = await client.estimate({"id": rid, "prompt_tokens": p, "max_tokens": 2048}, [instance])
        est = rep.estimates[0]
        reqs.append(sim.submit(rid, p, 2048, o))
        await nc.publish(subjects.dispatch(instance), encode(Dispatch(
            query_id=rid, request_id=rid, prompt_tokens=p, predicted_output_tokens=pred, max_tokens=2048,
            t=time.time())))
        rows.append({"id": rid, "t": time.time() - t0, "est": est.ttft_s, "method": est.method,
                     "calibrated": worker.store.get(instance).calibrated})
    for req in reqs:  # nobody else reads these events here
        while not req.finished:
            await req.changed.wait()
            req.changed.clear()
    await cancel_all(tasks)
    await cal.stop()
    await worker.stop()
    await pub.close()
    await nc.close()
    for r in rows:
        r["true"] = sim.ttft(r["id"])
    ok = [r for r in rows if r["method"] == "bea" and r["est"] is not None and r["true"]]
    measured = [r for r in ok if r["t"] >= warmup_s and r["calibrated"]]

    def mape(rs: list[dict[str, Any]]) -> float | None:
        return float(np.mean([abs(r["est"] - r["true"]) / r["true"] for r in rs])) if rs else None

    def bias(rs: list[dict[str, Any]]) -> float | None:
        return float(np.median([(r["est"] - r["true"]) / r["true"] for r in rs])) if rs else None

    trues = np.array([r["true"] for r in measured]) if measured else np.array([0.0])
    return {
        "profile": profile,
        "qps": qps,
        "queries": len(rows),
        "measured": len(measured),
        "ttft_mape": mape(measured),
        "ttft_median_rel_error": bias(measured),
        "ttft_mape_incl_warmup": mape(ok),
        "true_ttft_p50_s": float(np.percentile(trues, 50)),
        "true_ttft_p90_s": float(np.percentile(trues, 90)),
        "beta": worker.store.get(instance).calibration.coefficients,
        "batch_time_fit_mape": cal.fits[instance].mape if instance in cal.fits else None,
        "sim": sim.stats.as_dict(),
        "compensate": compensate,
    }


def run(nats_url: str | None = None, **kwargs: Any) -> dict[str, Any]:
    from bear.runtime.nats_server import LocalNatsServer

    if nats_url is not None:
        return aio.run(measure(nats_url, **kwargs))
    with LocalNatsServer() as srv:
        return aio.run(measure(srv.url, **kwargs))
