"""A secured pool in the test's process for the attacks of issue 26: a nats-server with the
credentials ``bear up`` generates (bear.runtime.nats_auth), echo engines that require their API
key and record every request, instances registered under their own identities, and a real
router (no predictor or estimator: its fallbacks decide) connected as ``router``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from bear.instance.record import Registration, instance_record
from bear.protocol.subjects import Subjects
from bear.router.service import RouterConfig, RouterService
from bear.runtime.kv import provision
from bear.runtime.nats_auth import AuthFiles, generate
from bear.runtime.nats_server import LocalNatsServer, free_port
from bear.runtime.service import connect
from bear.runtime.shutdown import cancel_all

S = Subjects()
MODEL = "Qwen/Qwen3-8B"


class EchoEngine:
    """An OpenAI streaming endpoint answering ``<name>: <prompt>`` in two chunks; it records every
    request's prompt and ``Authorization`` header. A prompt containing ``hold`` waits for
    ``release``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[tuple[str, str]] = []  # (prompt, Authorization header)
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/v1"
        return self.url

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = str(body.get("prompt", ""))
        self.requests.append((prompt, request.headers.get("Authorization", "")))
        if "hold" in prompt:
            await self.release.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for t in (f"{self.name}: ", prompt):
            await resp.write(f"data: {json.dumps({'choices': [{'text': t, 'finish_reason': None}]})}\n\n".encode())
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class SecuredPool:
    srv: LocalNatsServer
    files: AuthFiles
    conns: list[Any] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    engines: list[EchoEngine] = field(default_factory=list)
    routers: list[RouterService] = field(default_factory=list)

    async def nc(self, name: str, **options: Any) -> Any:
        creds = self.files.instance(name[len("instance-"):]) if name.startswith("instance-") else self.files.path(name)
        nc = await connect(self.srv.url, f"test-{name}", creds=creds, connect_within_s=3.0, **options)
        self.conns.append(nc)
        return nc

    async def engine(self, name: str) -> EchoEngine:
        e = EchoEngine(name)
        await e.start()
        self.engines.append(e)
        return e

    async def register(self, instance: str, engine_url: str, *, as_identity: str | None = None, model: str = MODEL,
                       price_in: float = 0.1, price_out: float = 0.2) -> Registration:
        """Keep ``instance``'s registry entry fresh, written with ``as_identity``'s credentials
        (default: the instance's own)."""
        nc = await self.nc(as_identity or f"instance-{instance}")
        reg = Registration(nc, instance_record(instance, model, engine_url, price_input_per_mtok=price_in,
                                               price_output_per_mtok=price_out, backend="vllm"), S,
                           heartbeat_s=0.2)
        self.tasks.append(asyncio.create_task(reg.run()))
        return reg

    async def router(self, engine_keys: dict[str, str], **cfg: Any) -> RouterService:
        nc = await self.nc("router")
        rcfg = RouterConfig(predict_budget_s=0.02, predict_try_s=0.01, estimate_budget_s=0.02, estimate_try_s=0.01,
                            shed_lag_s=30.0, engine_keys=engine_keys, tokenize=False, **cfg)
        rt = RouterService(nc, rcfg)
        await rt.start()
        self.routers.append(rt)
        return rt

    async def close(self) -> None:
        for rt in self.routers:
            with contextlib.suppress(Exception):
                await rt.stop(drain_s=1.0)
        await cancel_all(self.tasks)
        for e in self.engines:
            e.release.set()
            await e.stop()
        for nc in self.conns:
            with contextlib.suppress(Exception):
                await nc.close()


@contextlib.asynccontextmanager
async def secured_pool(tmp_path: Path, instances: list[str], clients: tuple[str, ...]) -> Any:
    files = generate(tmp_path / "auth", instances, S, clients=clients)
    with LocalNatsServer(config=files.config) as srv:
        pool = SecuredPool(srv, files)
        admin = await pool.nc("admin")
        await provision(admin.jetstream(timeout=5.0), S)
        try:
            yield pool
        finally:
            await pool.close()


async def publish_quietly(nc: Any, subject: str, data: bytes, reply: str = "") -> None:
    """A publish the server may refuse (a permission violation is reported asynchronously)."""
    with contextlib.suppress(Exception):
        await nc.publish(subject, data, reply=reply)
        await nc.flush()
