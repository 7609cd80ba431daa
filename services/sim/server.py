"""OpenAI-compatible HTTP front of the simulated instance (what the router calls on a real vLLM):
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health`` and ``GET /sim/stats``.

Lengths (docs/sim-engine.md): the prompt length is the length of a token-id prompt, else ≈ UTF-8
bytes / 4 (plus a small per-message chat template); the output length is the engine's own
(``bear.sim.lengths``: never EOS, or a seeded draw), capped by ``max_tokens``. The text is
placeholder words. A prompt plus ``max_tokens`` beyond ``max_model_len`` is refused with
HTTP 400, as vLLM does. The engine names a request as vLLM's does (``bear.protocol.engine_ids``:
``chatcmpl-<X-Request-Id>-<8 hex>``), so its snapshots and the router's ``bear.dispatch`` meet
at the same join as a real vLLM's.

The text is placeholder — the words of "lorem ipsum", one per token — not an answer: the sim
engine models an instance's timing, not its model. The answer's shape follows vLLM's
(``bear.sim.shapes``): ``n`` choices (``n`` engine requests, named ``<i>_<id>`` as vLLM names its
child requests), log-probabilities, a schema-valid call of a named tool, schema-valid JSON for
structured outputs.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any

from aiohttp import web

from bear.protocol.engine_ids import engine_id
from bear.runtime import tracing
from bear.sim.engine import SimEngine, SimRequest
from bear.sim.shapes import Shape, ShapeError, chat_logprobs, completion_logprobs, shape_of

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
                # vLLM 0.32's wording (vllm/renderers/params.py): clients such as LiteLLM recognise it
                raise ApiError(400, f"This model's maximum context length is {self.sim.max_model_len} tokens. However, "
                                    f"your prompt contains {ptoks} input tokens, which exceeds this limit even without "
                                    "any output tokens. Please reduce the length of the input prompt.")
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
                shape = shape_of(body, chat)
            except (ShapeError, ValueError, TypeError) as exc:
                raise ApiError(400, str(exc)) from exc
            hashes = self.hasher.hashes(ids) if ids and self.hasher is not None else None
            draws = [rid] if shape.n == 1 else [f"{i}_{rid}" for i in range(shape.n)]  # length draws' keys
            reqs: list[SimRequest] = []
            try:
                for i, r in enumerate(draws):
                    length = shape.length(max_tokens) or self.sim.lengths.tokens(r, max_tokens)
                    name = engine_id(rid, chat, None if shape.n == 1 else i)  # as vLLM's engine names it
                    reqs.append(self.sim.submit(name, ptoks, max_tokens, length, priority, block_hashes=hashes))
            except ValueError as exc:
                for q in reqs:
                    self.sim.abort(q.id)
                raise ApiError(409 if "duplicate" in str(exc) else 400, str(exc)) from exc
        except json.JSONDecodeError:
            return error_response(400, "body is not valid JSON")
        except ApiError as exc:
            return error_response(exc.status, exc.message)

        # the router's trace context (traceparent header): the engine's part of the query's trace
        req = reqs[0]
        with tracing.child("sim.generate", request.headers, kind="server", instance=self.sim.instance,
                           request_id=req.id, prompt_tokens=ptoks) as span:
            try:
                if body.get("stream"):
                    opts = body.get("stream_options") or {}
                    usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
                    return await self._stream(request, reqs, chat, usage, shape, rid)
                return await self._complete(reqs, chat, shape, rid)
            finally:
                for q in reqs:
                    if not q.finished:  # client went away: free the engine's slot like vLLM's abort
                        self.sim.abort(q.id)
                if req.first_token_at is not None:
                    span.event("first_token", at=req.first_token_at)
                span.set(output_tokens=sum(q.output_tokens for q in reqs), aborted=req.aborted, ttft_s=req.ttft_s)

    async def _wait_done(self, req: SimRequest) -> None:
        while not req.finished:
            await req.changed.wait()
            req.changed.clear()

    async def _wait_any(self, reqs: list[SimRequest]) -> None:
        """Until one of ``reqs`` changes (one request: its event, without a task)."""
        if len(reqs) == 1:
            await reqs[0].changed.wait()
        elif not any(q.changed.is_set() for q in reqs):
            waits = [asyncio.ensure_future(q.changed.wait()) for q in reqs]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        for q in reqs:
            q.changed.clear()

    def _usage(self, reqs: list[SimRequest]) -> dict[str, Any]:
        out = sum(q.output_tokens for q in reqs)
        u: dict[str, Any] = {
            "prompt_tokens": reqs[0].prompt_tokens,
            "completion_tokens": out,
            "total_tokens": reqs[0].prompt_tokens + out,
        }
        if self.sim.engine.prefix_caching:  # as vLLM reports it with --enable-prompt-tokens-details
            u["prompt_tokens_details"] = {"cached_tokens": max(0, self.sim.engine.prefix_hit_tokens(reqs[0].id))}
        return u

    @staticmethod
    def _text(shape: Shape, start: int, count: int) -> str:
        return "".join(shape.piece(k, filler(k, 1)) for k in range(start, start + count))

    def _logprobs(self, shape: Shape, chat: bool, start: int, count: int, offset: int) -> Any:
        """The log-probabilities of tokens ``start`` … of one choice (None: not asked for)."""
        k = shape.top_logprobs
        if k is None:
            return None
        parts = [shape.piece(j, filler(j, 1)) for j in range(start, start + count)]
        if chat:
            return {"content": [c for p in parts for c in chat_logprobs(p, k)["content"]]}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for p in parts:
            for key, v in completion_logprobs(p, k, offset).items():
                out[key].extend(v)
            offset += len(p)
        return out

    def _choice(self, shape: Shape, chat: bool, index: int, req: SimRequest, rid: str) -> dict[str, Any]:
        text = self._text(shape, 0, req.output_tokens)
        lp = self._logprobs(shape, chat, 0, req.output_tokens, 0)
        if not chat:
            return {"index": index, "text": text, "finish_reason": req.finish_reason, "logprobs": lp}
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        reason = req.finish_reason
        if shape.tool is not None:
            msg = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"chatcmpl-tool-{index}-{rid[-12:]}", "type": "function",
                 "function": {"name": shape.tool, "arguments": text}}]}
            reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": msg, "finish_reason": reason, "logprobs": lp}

    async def _complete(self, reqs: list[SimRequest], chat: bool, shape: Shape, rid: str) -> web.Response:
        for q in reqs:
            await self._wait_done(q)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(reqs[0].arrival),
                "model": self.sim.model_name,
                "choices": [self._choice(shape, chat, i, q, rid) for i, q in enumerate(reqs)],
                "usage": self._usage(reqs),
            }
        )

    async def _stream(self, request: web.Request, reqs: list[SimRequest], chat: bool, include_usage: bool,
                      shape: Shape, rid: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(reqs[0].arrival)
        tool = shape.tool

        def chunk(index: int, k: int, reason: str | None, offset: int) -> bytes:
            """Token ``k`` of choice ``index`` (k < 0: the role chunk of a chat answer)."""
            text = None if k < 0 else shape.piece(k, filler(k, 1))
            lp = None if k < 0 else self._logprobs(shape, chat, k, 1, offset)
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if k < 0 else {}
                if text is not None and tool is None:
                    delta["content"] = text
                elif text is not None:
                    call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                    if k == 0:
                        call.update(id=f"chatcmpl-tool-{index}-{rid[-12:]}", type="function")
                        call["function"]["name"] = tool
                    delta["tool_calls"] = [call]
                if tool is not None and reason == "stop":
                    reason = "tool_calls"
                choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
            payload = {"id": rid, "object": obj, "created": created, "model": self.sim.model_name, "choices": [choice]}
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            await resp.write(b"".join(chunk(i, -1, None, 0) for i in range(len(reqs))))
        sent = [0] * len(reqs)
        offsets = [0] * len(reqs)
        while True:
            await self._wait_any(reqs)
            if any(q.aborted for q in reqs):
                break
            # Coalesce: everything produced since the last wake-up goes out in one write.
            out = bytearray()
            for i, q in enumerate(reqs):
                while sent[i] < q.output_tokens:
                    last = q.finished and sent[i] == q.output_tokens - 1
                    out += chunk(i, sent[i], q.finish_reason if last else None, offsets[i])
                    offsets[i] += len(shape.piece(sent[i], filler(sent[i], 1)))
                    sent[i] += 1
            if out:
                await resp.write(bytes(out))
            if all(q.finished for q in reqs):
                break
        if include_usage:
            payload = {"id": rid, "object": obj, "created": created, "model": self.sim.model_name,
                       "choices": [], "usage": self._usage(reqs)}
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
