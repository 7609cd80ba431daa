"""OpenAI-compatible HTTP front of the simulated instance (what the router calls on a real vLLM):
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health`` and ``GET /sim/stats``.

Lengths (docs/sim-engine.md): the prompt length is the length of a token-id prompt, else ≈ UTF-8
bytes / 4 (plus a small per-message chat template); the output length is the engine's own
(``bear.sim.lengths``: never EOS, or a seeded draw), capped by ``max_tokens``. The text is
placeholder words. A prompt plus ``max_tokens`` beyond ``max_model_len`` is refused with
HTTP 400, as vLLM does. The request id is the ``X-Request-Id`` header when present, so the
router can name the request in ``bear.dispatch`` the way the instance's snapshots name it.

The text is placeholder — the words of "lorem ipsum", one per token — not an answer: the sim
engine models an instance's timing, not its model.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from aiohttp import web

from bear.runtime import tracing
from bear.sim.engine import SimEngine, SimRequest

FILLER = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")
CHAT_TEMPLATE_TOKENS_PER_MESSAGE = 4
CHAT_TEMPLATE_TOKENS = 3


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(status, "InternalServerError")
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


def text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / 4))


def prompt_tokens_of(body: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list")
        total = CHAT_TEMPLATE_TOKENS
        for m in messages:
            if not isinstance(m, dict):
                raise ApiError(400, "each message must be an object")
            content = m.get("content", "")
            if isinstance(content, list):  # content parts
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            total += CHAT_TEMPLATE_TOKENS_PER_MESSAGE + text_tokens(str(content))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt_tokens_of({"prompt": prompt[0]}, chat=False)
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)")


def _positive_int(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ApiError(400, f"{name} must be a positive integer")
    return v


def filler(start: int, count: int) -> str:
    return "".join(" " + FILLER[(start + k) % len(FILLER)] for k in range(count))


class SimApi:
    """``tokenizer`` (a loaded ``bear.tokenizer`` bundle): prompts are tokenised as vLLM would
    tokenise them for the model, and their full blocks hashed (``hasher``) into the engine's prefix
    cache; without one the length rule above applies and nothing is cached. ``api_keys``: require
    ``Authorization: Bearer <key>`` on ``/v1/*``, as vLLM's ``--api-key`` does (``/health`` stays
    open for probes); None: no key."""

    def __init__(self, sim: SimEngine, tokenizer: Any = None, hasher: Any = None, api_keys: Any = None) -> None:
        self.sim = sim
        self.api_keys = api_keys
        self.tokenizer = tokenizer
        self.hasher = hasher

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids (None: no tokenizer, or content it cannot render exactly)."""
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            return None
        if chat:
            messages = body.get("messages")
            return self.tokenizer.encode(None, messages) if isinstance(messages, list) and messages else None
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return self.tokenizer.encode(prompt, None) if isinstance(prompt, str) else None

    def runner(self) -> web.AppRunner:
        """The server's runner. ``handler_cancellation``: a client that goes away cancels its
        handler, whose ``finally`` aborts the request in the engine — what vLLM does on a
        disconnect — also while it is still queued or a non-streaming answer is being generated
        (with aiohttp's default the handler would only notice at its next write)."""
        return web.AppRunner(self.app(), access_log=None, handler_cancellation=True)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_keys is not None and request.path.startswith("/v1/"):
            why = self.api_keys.check(request.headers.get("Authorization"))
            if why is not None:
                return web.json_response({"error": {"message": why, "type": "invalid_request_error",
                                                    "code": "invalid_api_key"}}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/sim/stats", self.stats)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({"instance": self.sim.instance, "model": self.sim.model_name, **self.sim.stats.as_dict()})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.sim.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "bear-sim",
                        "description": "simulated instance: vLLM scheduling and roofline timing; the text is "
                                       "placeholder words",
                        "max_model_len": self.sim.max_model_len,
                    }
                ],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    # ------------------------------------------------------------------ common path
    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ApiError(400, "body must be a JSON object")
            model = body.get("model")
            if model is not None and model != self.sim.model_name:
                raise ApiError(404, f"the model `{model}` does not exist (serving {self.sim.model_name})")
            ids = self.prompt_ids(body, chat)
            ptoks = len(ids) if ids else prompt_tokens_of(body, chat)
            if ptoks >= self.sim.max_model_len:
                raise ApiError(400, f"prompt of {ptoks} tokens does not fit max_model_len {self.sim.max_model_len}")
            room = self.sim.max_model_len - ptoks
            raw_max = body.get("max_completion_tokens") if chat else None
            if raw_max is None:
                raw_max = body.get("max_tokens")
            max_tokens = room if raw_max is None else _positive_int(raw_max, "max_tokens")
            if max_tokens > room:  # refused, as vLLM refuses it (it does not clamp)
                raise ApiError(400, f"This model's maximum context length is {self.sim.max_model_len} tokens. "
                                    f"However, you requested {ptoks + max_tokens} tokens ({ptoks} in the prompt, "
                                    f"{max_tokens} in the completion). Please reduce the length of the prompt "
                                    "or completion.")
            priority = body.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise ApiError(400, "priority must be an integer")
            rid = request.headers.get("X-Request-Id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                hashes = self.hasher.hashes(ids) if ids and self.hasher is not None else None
                req = self.sim.submit(rid, ptoks, max_tokens, self.sim.lengths.tokens(rid, max_tokens), priority,
                                      block_hashes=hashes)
            except ValueError as exc:
                raise ApiError(409 if "duplicate" in str(exc) else 400, str(exc)) from exc
        except json.JSONDecodeError:
            return error_response(400, "body is not valid JSON")
        except ApiError as exc:
            return error_response(exc.status, exc.message)

        # the router's trace context (traceparent header): the engine's part of the query's trace
        with tracing.child("sim.generate", request.headers, kind="server", instance=self.sim.instance,
                           request_id=req.id, prompt_tokens=ptoks) as span:
            try:
                if body.get("stream"):
                    opts = body.get("stream_options") or {}
                    usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
                    return await self._stream(request, req, chat, usage)
                return await self._complete(req, chat)
            finally:
                if not req.finished:  # client went away: free the engine's slot like vLLM's abort
                    self.sim.abort(req.id)
                if req.first_token_at is not None:
                    span.event("first_token", at=req.first_token_at)
                span.set(output_tokens=req.output_tokens, aborted=req.aborted, ttft_s=req.ttft_s)

    async def _wait_done(self, req: SimRequest) -> None:
        while not req.finished:
            await req.changed.wait()
            req.changed.clear()

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        u: dict[str, Any] = {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.output_tokens,
            "total_tokens": req.prompt_tokens + req.output_tokens,
        }
        if self.sim.engine.prefix_caching:  # as vLLM reports it with --enable-prompt-tokens-details
            u["prompt_tokens_details"] = {"cached_tokens": max(0, self.sim.engine.prefix_hit_tokens(req.id))}
        return u

    async def _complete(self, req: SimRequest, chat: bool) -> web.Response:
        await self._wait_done(req)
        text = filler(0, req.output_tokens)
        reason = req.finish_reason
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return web.json_response(
            {
                "id": req.id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(req.arrival),
                "model": self.sim.model_name,
                "choices": [choice],
                "usage": self._usage(req),
            }
        )

    async def _stream(self, request: web.Request, req: SimRequest, chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(req.arrival)

        def chunk(text: str | None, reason: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            payload = {"id": req.id, "object": obj, "created": created, "model": self.sim.model_name, "choices": [choice]}
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            await resp.write(chunk(None, None, role=True))
        sent = 0
        while True:
            await req.changed.wait()
            req.changed.clear()
            if req.aborted:
                break
            # Coalesce: everything produced since the last wake-up goes out in one write.
            out = bytearray()
            while sent < req.output_tokens:
                last = req.finished and sent == req.output_tokens - 1
                out += chunk(filler(sent, 1), req.finish_reason if last else None)
                sent += 1
            if out:
                await resp.write(bytes(out))
            if req.finished:
                break
        if include_usage:
            payload = {"id": req.id, "object": obj, "created": created, "model": self.sim.model_name,
                       "choices": [], "usage": self._usage(req)}
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
