"""Helpers of the gateway tests. ``make_pool``: an in-process pool — a local nats-server, two sim
engines behind their real HTTP runner and a recording engine (model ``rec/echo``: it keeps each
request's body and headers), all registered in ``bear_instances`` with heartbeats, one router (no
predictor or estimator: its fallbacks decide) and the gateway with an API key."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import nats
from aiohttp import web

from bear.gateway.auth import ApiKeys
from bear.gateway.openai_types import Defaults
from bear.gateway.server import Gateway, GatewayConfig
from bear.instance.record import Registration, instance_record
from bear.protocol.subjects import Subjects
from bear.router.service import RouterConfig, RouterService
from bear.runtime.nats_server import free_port
from bear.runtime.shutdown import cancel_all
from bear.sim.engine import SimEngine
from bear.sim.profile import load_profile
from bear.sim.server import SimApi

from waiting import HANG_S, wait_until

KEY = "test-key-0123456789abcdef"
PROFILES = {"sim-small": "qwen3-0.6b-h100", "sim-big": "qwen3-8b-h100"}
RECORDER_MODEL = "rec/echo"
RECORDER_MAX_MODEL_LEN = 40960  # registered (the router's context check), not enforced by it


class RecordingEngine:
    """An OpenAI streaming endpoint that answers ``"a b"`` and records every request (body, headers)."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((body, dict(request.headers)))
        if body.get("temperature") == 99.0:  # a value the engine refuses (vLLM would say why)
            return web.json_response({"object": "error", "message": "temperature too high", "code": 400}, status=400)
        if body.get("stream") is False:  # unstreamed (prompt logprobs): vLLM's whole answer
            return web.json_response({"id": "cmpl-rec", "object": "text_completion", "model": body["model"], "choices": [{
                "index": 0, "text": "a b", "logprobs": {"tokens": ["a", " b"], "token_logprobs": [-0.5, -0.25]},
                "finish_reason": "length", "stop_reason": None, "prompt_logprobs": [None, {"7": {"logprob": -1.5}}]}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        for t in ("a", " b"):
            choice = {"delta": {"content": t}} if chat else {"text": t}
            await resp.write(f"data: {json.dumps({'choices': [{**choice, 'finish_reason': None}]})}\n\n".encode())
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@dataclass
class Pool:
    nc: Any
    router: RouterService
    gateway: Gateway
    sims: dict[str, SimEngine]
    recorder: RecordingEngine
    outcome_log: Any
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    runners: list[web.AppRunner] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def live_requests(self) -> int:
        return sum(len(s._live) for s in self.sims.values())

    def records(self) -> list[dict[str, Any]]:
        self.router.outcomes.flush()
        return [json.loads(x) for x in self.outcome_log.read_text().splitlines()] if self.outcome_log.exists() else []


async def _serve(runner: web.AppRunner) -> int:
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return port


async def _tiny_tokenizer(nc: Any, tmp_path: Any) -> str:
    """The tiny test tokenizer (with a chat template) in the pool's object store: the recorder's."""
    from bear.tokenizer.bundle import from_model_dir
    from bear.tokenizer.store import put_bundle
    from bear.vllm_instance.tiny_model import write_tokenizer

    (tmp_path / "recorder-tokenizer").mkdir(parents=True, exist_ok=True)
    write_tokenizer(tmp_path / "recorder-tokenizer")
    return await put_bundle(nc.jetstream(), Subjects().tokenizers_bucket, from_model_dir(tmp_path / "recorder-tokenizer"))


async def make_pool(nats_url: str, tmp_path: Any, *, gateway_cfg: GatewayConfig | None = None,
                    keys: ApiKeys | None = None, auth: bool = True, router_cfg: RouterConfig | None = None,
                    profiles: dict[str, str] | None = None, recorder: bool = True, router: bool = True) -> Pool:
    nc = await nats.connect(nats_url)
    tasks: list[asyncio.Task[Any]] = []
    runners: list[web.AppRunner] = []

    def register(name: str, model: str, port: int, backend: str, price: float = 0.2,
                 config: dict[str, Any] | None = None, tokenizer: str = "") -> None:
        rec = instance_record(name, model, f"http://127.0.0.1:{port}/v1", price_input_per_mtok=price / 2,
                              price_output_per_mtok=price, backend=backend, config=config)
        rec.tokenizer = tokenizer
        tasks.append(asyncio.create_task(Registration(nc, rec, Subjects(), heartbeat_s=1.0).run()))

    sims = {}
    for name, prof in (PROFILES if profiles is None else profiles).items():
        sim = SimEngine(load_profile(prof), name, None, seed=0)
        runner = SimApi(sim).runner()
        runners.append(runner)
        register(name, sim.model_name, await _serve(runner), "sim", config={"max_model_len": sim.max_model_len})
        tasks.append(asyncio.create_task(sim.run()))
        sims[name] = sim
    rec_engine = RecordingEngine()
    if recorder:
        runner = web.AppRunner(rec_engine.app(), access_log=None)
        runners.append(runner)
        register("recorder", RECORDER_MODEL, await _serve(runner), "vllm", price=1e4,  # chosen only when named
                 config={"max_model_len": RECORDER_MAX_MODEL_LEN}, tokenizer=await _tiny_tokenizer(nc, tmp_path))
    log_path = tmp_path / "outcomes.jsonl"
    # shed_lag_s: the clients under test share this process (and its GIL) with the pool's loop, so
    # a client's own CPU work (LiteLLM builds its pydantic schemas on a first call) reads to the
    # router as event-loop lag; shedding by lag is tested on its own (tests/faults)
    rcfg = router_cfg or RouterConfig(predict_budget_s=0.02, predict_try_s=0.01, estimate_budget_s=0.02,
                                      estimate_try_s=0.01, shed_lag_s=30.0)
    rcfg.outcome_log = log_path
    rt = RouterService(nc, rcfg)
    if router:
        await rt.start()
    cfg = gateway_cfg or GatewayConfig(defaults=Defaults(ttft_s=1.0))
    cfg.port = free_port()
    gw = Gateway(nc, cfg, keys if keys is not None else (ApiKeys([KEY]) if auth else None))
    await gw.start()
    n = len(sims) + recorder
    await wait_until(lambda: (not router or len(rt.registry.healthy()) == n) and len(gw.registry.healthy()) == n,
                     what=f"the pool's {n} instances registered")
    return Pool(nc, rt, gw, sims, rec_engine, log_path, tasks, runners)


async def stop_pool(pool: Pool) -> None:
    await pool.gateway.stop()
    if pool.router._sub is not None:
        await pool.router.stop()
    for s in pool.sims.values():
        s.stop()
    await cancel_all(pool.tasks)
    for r in pool.runners:
        await r.cleanup()
    await pool.nc.close()


class ThreadedPool:
    """A pool on its own event loop in a background thread: the clients under test (the sync
    ``openai`` client blocks; the async one runs on the test's loop) reach it only over HTTP, as
    they would a remote gateway. ``call(coro)`` runs a coroutine on the pool's loop."""

    def __init__(self, tmp_path: Any, **kwargs: Any) -> None:
        from bear.runtime.nats_server import LocalNatsServer

        self.nats = LocalNatsServer().start()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.pool: Pool = self.call(make_pool(self.nats.url, tmp_path, **kwargs), timeout=2 * HANG_S)

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.call(stop_pool(self.pool))
            self.call(_cancel_leftovers())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            self.nats.close()  # and its JetStream store

    def __enter__(self) -> Pool:
        return self.pool

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_leftovers() -> None:
    """Tasks the libraries leave behind (nats-py's JetStream watchers) end before the loop closes."""
    me = asyncio.current_task()
    await cancel_all([t for t in asyncio.all_tasks() if t is not me])
