"""An OpenAI streaming endpoint that stands in for an engine, and a registry helper."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import msgspec
from aiohttp import web

from bear.instance.record import instance_record
from bear.protocol.messages import encode
from bear.protocol.subjects import Subjects
from bear.runtime.kv import ensure_kv
from bear.runtime.nats_server import free_port


class FakeEngine:
    """Answers every completion with ``tokens`` tokens, or refuses with ``refuse = (status,
    message)``; records each request's id and Authorization header. ``held``: every answer waits
    until ``release`` is set (queries kept in flight for as long as a test needs)."""

    def __init__(self, tokens: int = 3, refuse: tuple[int, str] | None = None, stall: bool = False,
                 held: bool = False) -> None:
        self.tokens = tokens
        self.refuse = refuse
        self.stall = stall  # accept the request and never produce a token (an engine buried in work)
        self.release = asyncio.Event()
        if not held:
            self.release.set()
        self.aborted = 0  # stalled requests whose client closed the connection
        self.port = free_port()
        self.requests: list[tuple[str, str]] = []  # (X-Request-Id, Authorization)
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        with contextlib.suppress(Exception):
            await request.read()
        self.requests.append((request.headers.get("X-Request-Id", ""), request.headers.get("Authorization", "")))
        if self.refuse is not None:
            status, message = self.refuse
            return web.json_response({"object": "error", "message": message, "code": status}, status=status)
        await self.release.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.stall:  # until the client goes away (aiohttp does not cancel a handler then)
            while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # no event tells a handler its client left: the transport is polled
            self.aborted += 1
            return resp
        for k in range(self.tokens):
            await resp.write(f"data: {json.dumps({'choices': [{'text': f't{k} ', 'finish_reason': None}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def start(self) -> FakeEngine:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def register(nc: Any, inst: str, model: str, port: int, *, key: str | None = None, price_out: float = 1.0,
                   **fields: Any) -> None:
    """Put a registry entry for ``inst`` (under ``key``, default the id) with a fresh heartbeat."""
    kv = await ensure_kv(nc.jetstream(), Subjects().instances_bucket)
    rec = instance_record(inst, model, f"http://127.0.0.1:{port}/v1", price_input_per_mtok=0.1,
                          price_output_per_mtok=price_out)
    await kv.put(key or inst, encode(msgspec.structs.replace(rec, heartbeat=time.time(), **fields)))
