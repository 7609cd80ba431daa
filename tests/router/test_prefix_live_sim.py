"""The live path with exact inputs on a simulated instance (in this process, real NATS): the sim
engine registers its tokenizer and publishes its prefix cache; the router tokenises chat queries
with that tokenizer (estimate request lengths = the engine's prompt tokens, tokens: exact) and
the estimator's mirrored hit equals the cached tokens the engine reports on every turn."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nats

from bear.client.submit import submit
from bear.estimator.estimate import EstimatorConfig
from bear.estimator.worker import EstimatorWorker
from bear.protocol.codec import unpack_map
from bear.protocol.messages import Dispatch, EstimateRequest, KvMessage, decode
from bear.protocol.subjects import Subjects
from bear.router.service import RouterConfig, RouterService
from bear.sim.run import serve
from bear.vllm_instance.launch import free_port
from bear.vllm_instance.tiny_model import write_tokenizer

from waiting import HANG_S, WaitTimeout, wait_until


async def test_router_sim_exact_tokens_and_mirrored_hits(nats_server, tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    ready = asyncio.Event()
    sim = asyncio.create_task(serve("qwen3-8b-h100", free_port(), "sim-0", nats_server.url, seed=1,
                                    output_lengths="lognormal:16:0.3", tokenizer_dir=str(tmp_path), ready=ready))
    await asyncio.wait_for(ready.wait(), 30)
    nc = await nats.connect(nats_server.url)
    worker = EstimatorWorker(nc, EstimatorConfig())
    router = RouterService(nc, RouterConfig(policy="bear", outcome_log=tmp_path / "out.jsonl", predict_budget_s=0.05,
                                            predict_try_s=0.025,  # no predictor here: its fallback at once
                                            # the hit read below is the estimate's: a busy host (sim engine,
                                            # worker and router share this loop) must not turn it into the
                                            # fallback that an estimate past its budget gets
                                            estimate_budget_s=HANG_S, estimate_try_s=HANG_S / 2))
    seen: dict[str, EstimateRequest] = {}

    async def snoop(msg: Any) -> None:
        r = decode(EstimateRequest, msg.data)
        seen[r.query.id] = r

    dispatched: dict[str, Dispatch] = {}

    async def on_dispatch(msg: Any) -> None:
        d = decode(Dispatch, msg.data)
        dispatched[d.query_id] = d

    # The instance's prefix-cache events and its idle re-sends, on one subscription (so in the order
    # the sim engine published them): the kv seq already out when each re-send went out.
    kv_seq = -1
    resends: list[tuple[float, int]] = []  # (the re-send's time, the newest kv seq before it)

    async def on_instance(msg: Any) -> None:
        nonlocal kv_seq
        if msg.subject == Subjects().kv("sim-0"):
            kv_seq = max(kv_seq, decode(KvMessage, msg.data).seq)  # type: ignore[arg-type]
        elif msg.subject == Subjects().snapshot("sim-0"):
            m = unpack_map(msg.data)
            if m.get("idle"):
                resends.append((float(m["time"]), kv_seq))

    def usable() -> bool:
        info = router.registry.instances.get("sim-0")
        st = worker.store.peek("sim-0")
        return (info is not None and info.tokenizer in router.tokenizers.loaded and st is not None
                and (st.snap is not None or st.raw is not None) and st.prefix.synced and st.prefix_events)

    def mirrored_since(t: float) -> bool:
        """The estimator's mirror holds every kv event the engine published before its first idle
        re-send after ``t`` (the step that ended a turn published its events before going idle)."""
        after = [seq for at, seq in resends if at > t]
        st = worker.store.peek("sim-0")
        return bool(after) and st is not None and st.prefix.synced and st.prefix.seq >= after[0]

    try:
        await nc.subscribe(Subjects().estimate, cb=snoop)
        await nc.subscribe(Subjects().dispatch("sim-0"), cb=on_dispatch)
        await nc.subscribe(f"{Subjects().prefix}.*.sim-0", cb=on_instance)
        await worker.start()
        await router.start()
        try:
            await wait_until(usable, what="the router and the estimator to use sim-0")
        except WaitTimeout:
            st = worker.store.peek("sim-0")
            raise AssertionError(("not usable", router.registry.instances.get("sim-0"), list(router.tokenizers.loaded),
                                  st and (st.snap is not None, st.prefix.synced, st.prefix_events,
                                          st.prefix.resync_reason))) from None
        done: dict[str, dict[str, Any]] = {}
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. " * 60}]
        for t in range(4):
            msgs.append({"role": "user", "content": f"turn {t}: " + "tell me more " * 30})
            out = [m async for m in submit(nc, messages=list(msgs), ttft_target_s=5.0, max_tokens=32,
                                           query_id=f"t{t}", session="s")]
            assert out[-1]["v"] == "bear.done/1", out[-1]
            t_done = time.time()
            done[f"t{t}"] = out[-1]
            msgs.append({"role": "assistant", "content": "".join(m.get("text", "") for m in out
                                                                if m["v"] == "bear.chunk/1")})
            await wait_until(lambda t_done=t_done: mirrored_since(t_done), what=f"turn {t}'s kv events in the mirror")
    finally:
        await router.stop()
        await worker.stop()
        await nc.close()
        sim.cancel()
    recs = {r["query_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for qid, d in done.items():
        (cand,) = seen[qid].candidates()
        assert cand.prompt_tokens == d["usage"]["prompt_tokens"], (qid, cand, d["usage"])
        assert recs[qid]["tokens"] == "exact"
        # the sim engine's snapshots count its pool (no block table): the dispatch carries the
        # exact length, not the ids, which only a replay of a described pool reads
        assert dispatched[qid].tokens is None and dispatched[qid].prompt_tokens == cand.prompt_tokens
        assert recs[qid]["prefix_hit_tokens"] == d["usage"]["cached_tokens"], (qid, recs[qid], d["usage"])
    assert recs["t0"]["prefix_hit_tokens"] == 0 and all(recs[f"t{t}"]["prefix_hit_tokens"] > 0 for t in (1, 2, 3))
    # every answer was encoded ahead of its next turn, and the turns' ids stayed exact (above)
    assert router.tokenizers.primed == {"queued": 4, "skipped": 0, "paused": 0}
