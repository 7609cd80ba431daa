"""``bear gateway``: an aiohttp server that speaks the OpenAI API and puts every request through
the routers — ``bear.client.submit.submit`` over NATS, the router's ``routed`` / ``chunk`` /
``done`` / ``error`` messages back as OpenAI responses. Stateless like the routers: any number of
gateways can run behind a load balancer.

Per request: API key → in-flight bound → body (size limit, time limit) → one msgspec pass that
decodes and validates → submit (trace context in the NATS headers) → the answer. A streamed
answer's status and headers (BEAR's decision: instance, model, predicted TTFT, method) are sent
with its first token, so an error before any token still gets its own HTTP status and a reroute
(the router's second ``routed``) is what the headers report. A client that goes away cancels its
handler (``handler_cancellation``): closing the submit iterator publishes ``bear.cancel`` and the
router aborts the engine's generation. Reference: docs/gateway.md."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from msgspec import UNSET

from bear.client.submit import Inboxes, submit
from bear.gateway.auth import ApiKeys
from bear.gateway.connections import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedHandler,
    default_total,
    open_file_limit,
)
from bear.gateway.cors import CorsPolicy
from bear.gateway.docs_page import CSP as DOCS_CSP
from bear.gateway.docs_page import PAGE as DOCS_PAGE
from bear.gateway.metrics import metrics
from bear.gateway.openai_types import (
    Defaults,
    DetokenizeRequest,
    Submission,
    TokenizeRequest,
    decode,
    openapi_document,
    parse_chat,
    parse_completion,
    router_messages,
)
from bear.gateway.openai_wire import (
    MODEL_NOT_FOUND,
    Answer,
    ApiError,
    decision_headers,
    decision_of,
    dumps,
    merge_choices,
    sse_error,
    usage_of,
)
from bear.gateway.prompt_list import PromptListAnswer, decode_ids, merged, one_prompt, query_ids
from bear.gateway.responses import ResponsesAnswer, to_chat
from bear.protocol.engine_fields import sequences
from bear.protocol.replies import Chunk, Done, Error, Routed
from bear.protocol.subjects import Subjects
from bear.router.fairshare import TENANT_HEADER
from bear.router.registry import Registry
from bear.runtime import tracing

log = structlog.get_logger("bear.gateway")

ENDPOINTS = ("chat", "completions", "responses")
NATS_HEADROOM = 64 * 1024  # room for the submission's other fields within NATS's max_payload
REQUEST_ID = "x-request-id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)
_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # a client's id is echoed if it is this
LINGER_S = 1.0  # after an error answered before the body was read: let the client read it, then close


class _OpenAIErrorsHandler(GuardedHandler):
    """aiohttp's connection handler, but what its HTTP parser rejects (header folding, both
    Content-Length and Transfer-Encoding, an oversized header line) is answered with an OpenAI
    error object too, not aiohttp's plain text; and under the gateway's connection caps and
    header timeout (bear.gateway.connections)."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        log.debug("malformed request", status=status, error=repr(exc))
        if request.writer.output_size > 0:  # as aiohttp: part of a response went out already
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        why = getattr(exc, "message", None) or str(exc or "") or HTTPStatus(status).phrase
        resp = web.Response(body=dumps(ApiError(status, f"malformed HTTP request: {why}").body()), status=status,
                            content_type="application/json")
        resp.force_close()
        return resp


class _OpenAIErrorsServer(web.Server):
    guard: ConnectionGuard | None = None

    def __call__(self) -> GuardedHandler:
        return _OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, guard: ConnectionGuard | None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorsServer  # the same server, its connections handled as above
        server.guard = self._guard  # type: ignore[attr-defined]
        return server


class ClientGone(Exception):
    """The client closed the connection while its answer was being written."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__("client went away")
        self.resp = resp


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefix: str = "bear"
    defaults: Defaults = field(default_factory=Defaults)
    max_body_bytes: int = 1024 * 1024
    body_timeout_s: float = 10.0  # the whole body must arrive within this (slow clients get a 408)
    request_timeout_s: float = 600.0  # request received → answer ended; then 504 (or an SSE error)
    accept_timeout_s: float = 2.0  # no router answer in this → resubmit once, then 503
    idle_timeout_s: float = 65.0  # a started answer silent this long → 504 (the router gives up at 60 s)
    max_inflight: int = 4096  # completion requests in progress before 429
    retry_after_s: int = 1
    down_after_s: float = 10.0  # registry heartbeat older than this: the instance is not listed
    drain_s: float = 5.0  # on SIGTERM: stop listening, let requests in progress end this long
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this (then 408, closed); 0: off
    max_conns_per_peer: int = 512  # open connections from one client address before 429 (closed; at most half the total); 0: no cap
    max_connections: int | None = None  # open connections in all before 503; None: the open-file limit less 256; 0: none
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # browsers' cross-origin requests (off: no origins)

    def connection_limits(self) -> ConnectionLimits:
        total = default_total(open_file_limit()) if self.max_connections is None else self.max_connections
        per_peer = self.max_conns_per_peer
        if total and per_peer:  # one address never holds more than half of them: the others keep room
            per_peer = min(per_peer, max(1, total // 2))
        return ConnectionLimits(header_timeout_s=self.header_timeout_s, per_peer=per_peer, total=total)


class Gateway:
    """The HTTP application; ``nc`` is a connected NATS client, ``keys`` None means no auth."""

    def __init__(self, nc: Any, cfg: GatewayConfig | None = None, keys: ApiKeys | None = None) -> None:
        self.nc = nc
        self.cfg = cfg or GatewayConfig()
        self.keys = keys
        self.subjects = Subjects(self.cfg.prefix)
        self.registry = Registry(nc, self.subjects, down_after_s=self.cfg.down_after_s)
        self.inboxes = Inboxes(nc)
        self.m = metrics()
        self._ttfb = {e: self.m.ttfb.labels(endpoint=e) for e in ENDPOINTS}  # label lookups once, not per request
        self._counted: dict[tuple[str, str], Any] = {}
        self.inflight = 0
        self.started = int(time.time())
        self._runner: web.AppRunner | None = None
        self.guard: ConnectionGuard | None = None  # made at start (it needs the running loop)
        self._tokenizers: Any = None  # bear.tokenizer.cache.TokenizerCache, made at the first /tokenize

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        if self.cfg.cors.enabled:
            app.on_response_prepare.append(self._cors_headers)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_route("GET", "/ping", self.ping)
        app.router.add_route("POST", "/ping", self.ping)
        app.router.add_get("/version", self.version)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/docs", self.docs)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    async def start(self) -> None:
        await self.registry.start(observe=False)
        await self.inboxes.start()
        # handler_cancellation: a client that disconnects cancels its handler (and so its generation)
        self.guard = ConnectionGuard(self.cfg.connection_limits(), self.m)
        self._runner = _Runner(self.app(), self.guard, access_log=None, handler_cancellation=True,
                               shutdown_timeout=self.cfg.drain_s, keepalive_timeout=75.0, lingering_time=LINGER_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.host, self.cfg.port, backlog=1024).start()
        lim = self.guard.limits
        log.info("gateway serving", url=self.base_url, auth=self.keys is not None, prefix=self.cfg.prefix,
                 header_timeout_s=lim.header_timeout_s, max_conns_per_peer=lim.per_peer, max_connections=lim.total,
                 open_files=open_file_limit())

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # stops listening, lets requests in progress end (drain_s)
        if self.guard is not None:
            self.guard.close()
        if self._tokenizers is not None:
            await self._tokenizers.close()
        await self.inboxes.stop()
        await self.registry.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}/v1"

    # ------------------------------------------------------------------ plumbing
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error as an OpenAI error object, aiohttp's own (404 path, 405 with its ``Allow``,
        413) and a bug's included; ``x-request-id`` on every response: the client's own (printable,
        at most 128 characters), else a fresh one."""
        rid = request.headers.get(REQUEST_ID, "")
        if not _CLIENT_REQUEST_ID.fullmatch(rid):
            rid = os.urandom(16).hex()
        request[REQUEST_ID_KEY] = rid
        try:
            resp = self.cfg.cors.preflight(request) or await handler(request)
        except ApiError as exc:
            resp = self._error(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            allow = exc.headers.get("Allow")
            resp = self._error(ApiError(exc.status, exc.reason, headers={"Allow": allow} if allow else None))
        except Exception as exc:  # a bug: still an OpenAI error (logged with its traceback)
            log.exception("request failed", path=request.path)
            resp = self._error(ApiError(500, f"internal error: {exc!r}"))
        if not resp.prepared:  # a streamed answer got it with its headers (_start_stream)
            resp.headers[REQUEST_ID] = rid
        return resp

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        self.cfg.cors.decorate(request, response)

    def _error(self, exc: ApiError, force_close: bool = False) -> web.Response:
        resp = web.Response(body=dumps(exc.body()), status=exc.status, content_type="application/json",
                            headers=exc.headers)
        if force_close:
            resp.force_close()
        return resp

    def _authorize(self, request: web.Request) -> None:
        if self.keys is None:
            return
        why = self.keys.check(request.headers.get("Authorization"))
        if why is not None:
            raise ApiError(401, why, headers={"WWW-Authenticate": "Bearer"})

    def _tenant(self, request: web.Request, headers: dict[str, str] | None) -> dict[str, str] | None:
        """The submission's NATS headers: the trace context, and the tag of the request's API key
        (``Bear-Tenant``: the routers' fair shares are per key, bear.router.fairshare)."""
        tag = ApiKeys.tenant(request.headers.get("Authorization")) if self.keys is not None else ""
        return {**(headers or {}), TENANT_HEADER: tag} if tag else headers

    async def _body(self, request: web.Request) -> bytes:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body of {request.content_length} bytes exceeds {limit}")
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise ApiError(408, f"request body not received within {self.cfg.body_timeout_s:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body exceeds {limit} bytes") from None
        except (web.HTTPException, OSError, asyncio.CancelledError):
            raise
        except Exception as exc:  # e.g. Content-Encoding: gzip on a body that is not gzip
            enc = request.headers.get("Content-Encoding") or "identity"
            raise ApiError(400, f"the request body could not be read ({enc} encoding): {' '.join(str(exc).split())}",
                           close=True) from None

    # ------------------------------------------------------------------ completions
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, over the chat path (bear.gateway.responses)."""
        return await self._complete(request, "responses")

    def _parse(self, endpoint: str, body: bytes, headers: Any) -> Submission:
        if endpoint == "responses":
            chat, echoed = to_chat(body)
            sub = parse_chat(chat, headers, self.cfg.defaults)
            sub.responses = echoed
            return sub
        return (parse_chat if endpoint == "chat" else parse_completion)(body, headers, self.cfg.defaults)

    async def _complete(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = "500"
        counted = False
        weight = 1
        try:
            try:
                self._authorize(request)
                if self.inflight >= self.cfg.max_inflight:
                    raise ApiError(429, "gateway at its in-flight limit", headers={"Retry-After": str(self.cfg.retry_after_s)})
                body = await self._body(request)
                sub = self._parse(endpoint, body, request.headers)
                if len(body) + NATS_HEADROOM > self.nc.max_payload:
                    raise ApiError(413, f"request of {len(body)} bytes does not fit a NATS message "
                                        f"({self.nc.max_payload} bytes)")
                weight = len(sub.prompts) if sub.prompts is not None else 1  # a query per prompt
                if weight > 1 and self.inflight + weight > self.cfg.max_inflight:
                    raise ApiError(429, f"gateway at its in-flight limit ({weight} prompts)",
                                   headers={"Retry-After": str(self.cfg.retry_after_s)})
            except ApiError as exc:
                status = str(exc.status)
                return self._error(exc, force_close=exc.close or exc.status in (408, 413))
            self.inflight += weight
            self.m.inflight.inc(weight)
            counted = True
            with tracing.child(f"gateway {request.path}", request.headers, kind="server",
                               **{"http.route": request.path, "bear.model": sub.model}) as span:
                resp = await (self._answer_prompts(request, sub, span, t0, endpoint) if sub.prompts is not None
                              else self._answer(request, sub, span, t0, endpoint))
                span.set(**{"http.status_code": resp.status})
            status = str(resp.status)
            return resp
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            status = "499"
            self.m.cancelled.inc()
            raise
        except ClientGone as gone:  # it went away while we wrote
            status = "499"
            self.m.cancelled.inc()
            return gone.resp
        finally:
            if counted:
                self.inflight -= weight
                self.m.inflight.dec(weight)
            counter = self._counted.get((endpoint, status))
            if counter is None:
                counter = self._counted[endpoint, status] = self.m.requests.labels(endpoint=endpoint, status=status)
            counter.inc()

    async def _answer(self, request: web.Request, sub: Submission, span: tracing.Span, t0: float,
                      endpoint: str) -> web.StreamResponse:
        qid = os.urandom(16).hex()  # as unique as uuid4().hex, a sixth of its cost
        span.set(**{"bear.query_id": qid})
        it = self._submit(request, sub, qid, span)
        routed: Routed | None = None
        resp: web.StreamResponse | None = None
        answer: Answer | ResponsesAnswer | None = None
        texts: list[str] = []
        raw: list[list[Any]] = []  # the engine's choices, chunk by chunk (non-streaming, engine fields)
        relayed = False
        chunks = 0
        own = time.perf_counter() - t0  # the gateway's own time before the submission
        try:
            async with contextlib.aclosing(it), asyncio.timeout(self.cfg.request_timeout_s):
                async for m in it:
                    if isinstance(m, Routed):
                        routed = m
                        span.event("routed", instance=m.instance, attempt=m.attempt)
                        continue
                    if isinstance(m, Chunk):
                        chunks += 1
                        relay = m.choices is not UNSET  # engine fields: the engine's choices, verbatim
                        if relay:
                            relayed = True
                            choices = m.choices or []
                        else:
                            text = m.text or ""
                        if not sub.stream:
                            if relay:
                                raw.append(choices)
                            else:
                                texts.append(text)
                            continue
                        if resp is None:
                            t_msg = time.perf_counter()
                            answer = self._new_answer(sub, qid, routed)
                            resp = await self._start_stream(request, qid, routed)
                            await resp.write(answer.choices_chunk(choices) if relay
                                             else answer.role_chunk() + answer.text_chunk(text))
                            self._first_byte(endpoint, t0, own, t_msg, span)
                        else:
                            assert answer is not None
                            await resp.write(answer.choices_chunk(choices) if relay else answer.text_chunk(text))
                        continue
                    if isinstance(m, Done):
                        t_msg = time.perf_counter()
                        usage = usage_of(m, chunks)
                        finish = m.finish_reason or "stop"
                        bear = decision_of(routed, m)
                        if not sub.stream:
                            answer = self._new_answer(sub, qid, routed, m)
                            merged = merge_choices(sub.chat, raw) if relayed else None
                            out = web.Response(body=dumps(answer.body("".join(texts), finish, usage, bear, merged)),
                                               content_type="application/json",
                                               headers=self._headers(qid, routed, m))
                            self._first_byte(endpoint, t0, own, t_msg, span)
                            return out
                        if resp is None:  # an empty answer
                            answer = self._new_answer(sub, qid, routed, m)
                            resp = await self._start_stream(request, qid, routed)
                            await resp.write(answer.role_chunk())
                            self._first_byte(endpoint, t0, own, t_msg, span)
                        assert answer is not None
                        await resp.write(answer.final_chunks(finish, usage, bear, relayed=relayed))
                        await resp.write_eof()
                        return resp
                    if isinstance(m, Error):
                        err = ApiError.from_router(m, self.cfg.retry_after_s, "input" if sub.responses is not None
                                                   else "messages" if sub.chat else "prompt")
                        span.error(err.message)
                        return await self._fail(resp, err)
        except TimeoutError:
            return await self._fail(resp, ApiError(504, f"no complete answer within {self.cfg.request_timeout_s:g} s"))
        except ConnectionResetError:  # closing the iterator above cancelled the generation
            assert resp is not None
            raise ClientGone(resp) from None
        except Exception as exc:  # NATS closed under us (503), or a bug (500): still an OpenAI error
            from nats.errors import Error as NatsError

            if isinstance(exc, NatsError):
                err = ApiError(503, f"NATS: {exc}", headers={"Retry-After": str(self.cfg.retry_after_s)})
            else:
                log.exception("answer failed", query_id=qid)
                err = ApiError(500, f"internal error: {exc!r}")
            return await self._fail(resp, err)
        # the iterator always ends with a terminal message; this is defensive
        return self._error(ApiError(500, "the router's stream ended without a terminal message"))

    def _submit(self, request: web.Request, sub: Submission, qid: str, span: tracing.Span) -> Any:
        """The router's answer stream of one submission (``bear.client.submit.submit``)."""
        return submit(self.nc, sub.prompt, messages=sub.messages, ttft_target_s=sub.ttft_target_s,
                      max_tokens=sub.max_tokens, lam=sub.lam, query_id=qid, model=sub.route_model,
                      sampling=sub.sampling, engine=sub.engine, headers=self._tenant(request, span.headers),
                      subjects=self.subjects, accept_timeout_s=self.cfg.accept_timeout_s,
                      idle_timeout_s=self.cfg.idle_timeout_s, inboxes=self.inboxes, prompt_ids=sub.prompt_ids)

    async def _answer_prompts(self, request: web.Request, sub: Submission, span: tracing.Span, t0: float,
                              endpoint: str) -> web.StreamResponse:
        """A completions request of several prompts or token ids (bear.gateway.prompt_list): a
        query per prompt, their answers merged into one."""
        prompts = sub.prompts or []
        async def tokenizer() -> Any:
            return (await self._tokenizer(sub.model))[0]

        texts = await decode_ids(tokenizer, prompts)
        qid, qids = query_ids(len(prompts))
        span.set(**{"bear.query_id": qid, "bear.prompts": len(prompts)})
        merged_answer = PromptListAnswer(len(prompts), sequences(sub.engine))
        streams = [self._submit(request, one_prompt(sub, p, t), q, span) for p, t, q in zip(prompts, texts, qids,
                                                                                          strict=True)]
        resp: web.StreamResponse | None = None
        answer: Answer | None = None
        own = time.perf_counter() - t0
        try:
            async with contextlib.aclosing(merged(streams)) as replies, asyncio.timeout(self.cfg.request_timeout_s):
                async for i, m in replies:
                    if isinstance(m, Routed):
                        merged_answer.prompts[i].routed = m
                        continue
                    if isinstance(m, Error):
                        err = ApiError.from_router(m, self.cfg.retry_after_s, f"prompt[{i}]" if len(prompts) > 1
                                                   else "prompt")
                        span.error(err.message)
                        return await self._fail(resp, err)
                    choices = (merged_answer.chunk(i, m) if isinstance(m, Chunk)
                               else merged_answer.finish(i, m) if isinstance(m, Done) else None)
                    if choices is not None and not sub.stream:
                        merged_answer.kept.append(choices)
                    elif choices is not None:
                        if resp is None:
                            t_msg = time.perf_counter()
                            answer = Answer(False, qid, int(time.time()), self._model_of(sub, merged_answer),
                                            sub.include_usage, False)
                            resp = await self._start_stream(request, qid, merged_answer.prompts[i].routed,
                                                            {"x-bear-prompts": str(len(prompts))})
                            self._first_byte(endpoint, t0, own, t_msg, span)
                        assert answer is not None
                        await resp.write(answer.choices_chunk(choices))
                    if not merged_answer.finished:
                        continue
                    return await self._end_prompts(request, sub, merged_answer, qid, resp, answer, endpoint, t0, own,
                                                   span)
        except TimeoutError:
            return await self._fail(resp, ApiError(504, f"no complete answer within {self.cfg.request_timeout_s:g} s"))
        except ConnectionResetError:
            assert resp is not None
            raise ClientGone(resp) from None
        return self._error(ApiError(500, "the router's stream ended without a terminal message"))

    def _model_of(self, sub: Submission, a: PromptListAnswer) -> str:
        for p in a.prompts:
            m = (p.done and p.done.model) or (p.routed and p.routed.model)
            if m:
                return str(m)
        return sub.model

    async def _end_prompts(self, request: web.Request, sub: Submission, a: PromptListAnswer, qid: str,
                           resp: web.StreamResponse | None, answer: Answer | None, endpoint: str, t0: float,
                           own: float, span: tracing.Span) -> web.StreamResponse:
        """Every prompt answered: the one body, or the stream's last chunks."""
        t_msg = time.perf_counter()
        usage = a.usage()
        decisions = [decision_of(p.routed, p.done) for p in a.prompts if p.done is not None]
        bear: dict[str, Any] = decisions[0] if len(decisions) == 1 else {"prompts": decisions}
        first = a.prompts[0]
        if answer is None:
            answer = Answer(False, qid, int(time.time()), self._model_of(sub, a), sub.include_usage, False)
        if not sub.stream:
            headers = {**self._headers(qid, first.routed, first.done), "x-bear-prompts": str(len(a.prompts))}
            out = web.Response(body=dumps(answer.body("", "stop", usage, bear, a.body_choices())),
                               content_type="application/json", headers=headers)
            self._first_byte(endpoint, t0, own, t_msg, span)
            return out
        if resp is None:  # no prompt produced a chunk
            resp = await self._start_stream(request, qid, first.routed, {"x-bear-prompts": str(len(a.prompts))})
            self._first_byte(endpoint, t0, own, t_msg, span)
        await resp.write(answer.final_chunks("stop", usage, bear, relayed=True))
        await resp.write_eof()
        return resp

    async def _fail(self, resp: web.StreamResponse | None, err: ApiError) -> web.StreamResponse:
        """``err`` as the answer: its own HTTP status before the stream started, an SSE error event
        (and the end of the stream) after."""
        if resp is None:
            return self._error(err)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(sse_error(err))
            await resp.write_eof()
        return resp

    def _new_answer(self, sub: Submission, qid: str, routed: Routed | None,
                    done: Done | None = None) -> Answer | ResponsesAnswer:
        model = (done and done.model) or (routed and routed.model) or sub.model
        if sub.responses is not None:
            return ResponsesAnswer(qid, int(time.time()), str(model), sub.responses)
        prompt = routed.prompt_tokens if routed is not None else 0
        return Answer(sub.chat, qid, int(time.time()), str(model), sub.include_usage, sub.continuous_usage, prompt)

    def _headers(self, qid: str, routed: Routed | None, done: Done | None = None) -> dict[str, str]:
        h = decision_headers(qid, routed)
        if done is not None and done.ttft_s is not None:
            h["x-bear-ttft-ms"] = f"{done.ttft_s * 1e3:.3f}"
            h["x-bear-on-time"] = "true" if done.on_time else "false"
        return h

    async def _start_stream(self, request: web.Request, qid: str, routed: Routed | None,
                            more: dict[str, str] | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID: request[REQUEST_ID_KEY], **self._headers(qid, routed),
                                           **(more or {})})
        await resp.prepare(request)
        return resp

    def _first_byte(self, endpoint: str, t0: float, own: float, t_msg: float, span: tracing.Span) -> None:
        now = time.perf_counter()
        self._ttfb[endpoint].observe(now - t0)
        self.m.overhead.observe(own + (now - t_msg))
        span.event("first_byte")

    # ------------------------------------------------------------------ models, health, metrics
    def _models(self) -> dict[str, list[str]]:
        """Served model name → healthy instances serving it."""
        out: dict[str, list[str]] = {}
        for inst in self.registry.healthy():
            out.setdefault(inst.model, []).append(inst.id)
        return out

    def _model_entry(self, name: str, instances: list[str]) -> dict[str, Any]:
        """vLLM's model card (``root``, ``parent``, ``max_model_len``: the largest context among
        the instances, None when none registered one) and BEAR's instances."""
        lens = [i.max_model_len for i in self.registry.healthy() if i.id in instances and i.max_model_len]
        return {"id": name, "object": "model", "created": self.started, "owned_by": "bear", "root": name,
                "parent": None, "max_model_len": max(lens) if lens else None,
                "bear": {"instances": sorted(instances), "routing_alias": name == self.cfg.defaults.alias}}

    async def models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        models = self._models()
        every = [i for ids in models.values() for i in ids]
        data = [self._model_entry(self.cfg.defaults.alias, every)]
        data += [self._model_entry(name, ids) for name, ids in sorted(models.items())]
        return web.Response(body=dumps({"object": "list", "data": data}), content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        self._authorize(request)
        name = request.match_info["model"]
        models = self._models()
        if name == self.cfg.defaults.alias:
            entry = self._model_entry(name, [i for ids in models.values() for i in ids])
        else:
            ids = models.get(name) or [i.id for i in self.registry.healthy() if i.predictor_model == name]
            if not ids:
                raise ApiError(404, f"the model {name!r} is not served by any healthy instance", param="model",
                               code=MODEL_NOT_FOUND)
            entry = self._model_entry(name, ids)
        return web.Response(body=dumps(entry), content_type="application/json")

    # ------------------------------------------------------------------ tokenize, detokenize
    async def _tokenizer(self, model: str | None) -> tuple[Any, int | None]:
        """The tokenizer of the instances ``model`` names (the routing alias or none: all of
        them, which must then share one) and their largest ``max_model_len``."""
        from bear.tokenizer.cache import TokenizerCache

        name = model or self.cfg.defaults.alias
        insts = [i for i in self.registry.healthy()
                 if name == self.cfg.defaults.alias or name in (i.model, i.predictor_model)]
        if not insts:
            raise ApiError(404, f"the model {name!r} is not served by any healthy instance", param="model",
                               code=MODEL_NOT_FOUND)
        ids = {i.tokenizer for i in insts}
        if "" in ids:
            raise ApiError(404, f"an instance of {name!r} registered no tokenizer", param="model")
        if len(ids) > 1:
            raise ApiError(400, f"the instances of {name!r} tokenize differently: name one model", param="model")
        if self._tokenizers is None:
            self._tokenizers = TokenizerCache(self.nc, self.subjects.tokenizers_bucket, sources=lambda bid: [
                i.id for i in self.registry.instances.values() if i.tokenizer == bid])
        tok = await self._tokenizers.get(ids.pop(), timeout_s=10.0)
        if tok is None:
            raise ApiError(503, f"the tokenizer of {name!r} could not be fetched; try again",
                           headers={"Retry-After": str(self.cfg.retry_after_s)})
        lens = [i.max_model_len for i in insts if i.max_model_len]
        return tok, max(lens) if lens else None

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids the engine will see for a prompt or chat messages."""
        self._authorize(request)
        req: TokenizeRequest = decode(await self._body(request), TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "exactly one of prompt or messages is required", param="prompt")
        chat = req.messages is not None
        if req.add_special_tokens not in (None, not chat) or req.add_generation_prompt not in (None, True):
            raise ApiError(400, "the ids are those the routed request gets: add_special_tokens "
                                f"{not chat} and add_generation_prompt true", param="add_special_tokens")
        tok, max_len = await self._tokenizer(req.model)
        messages = router_messages(req.messages) if req.messages is not None else None
        ids = await self._tokenizers.run(lambda: tok.encode(req.prompt, messages))
        if ids is None:
            raise ApiError(400, "the model's tokenizer has no chat template", param="messages")
        strs = await self._tokenizers.run(lambda: [tok.tokenizer.id_to_token(i) for i in ids]) \
            if req.return_token_strs else None
        return web.Response(body=dumps({"count": len(ids), "max_model_len": max_len, "tokens": ids,
                                        "token_strs": strs}), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        self._authorize(request)
        req: DetokenizeRequest = decode(await self._body(request), DetokenizeRequest)
        tok, _ = await self._tokenizer(req.model)
        size = tok.tokenizer.get_vocab_size(with_added_tokens=True)
        if any(t >= size for t in req.tokens):
            raise ApiError(400, f"token ids must be below the vocabulary size {size}", param="tokens")
        text = await self._tokenizers.run(lambda: tok.tokenizer.decode(req.tokens, skip_special_tokens=False))
        return web.Response(body=dumps({"prompt": text}), content_type="application/json")

    async def ping(self, _: web.Request) -> web.Response:
        """vLLM's liveness probe (GET or POST, no key): 200 while NATS is connected, else 503."""
        ok = bool(self.nc.is_connected)
        return web.Response(body=b"{}", status=200 if ok else 503, content_type="application/json")

    async def version(self, _: web.Request) -> web.Response:
        from bear import __version__

        return web.Response(body=dumps({"version": __version__}), content_type="application/json")

    async def openapi(self, _: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of what this gateway serves (its request bodies from the
        same msgspec types that decode them)."""
        return web.Response(body=dumps(openapi_document()), content_type="application/json")

    async def docs(self, _: web.Request) -> web.Response:
        """The API reference page (``bear.gateway.docs_page``: self-contained, no outside asset)."""
        return web.Response(text=DOCS_PAGE, content_type="text/html", headers={"Content-Security-Policy": DOCS_CSP})

    async def health(self, _: web.Request) -> web.Response:
        ok = bool(self.nc.is_connected)
        body = {"status": "ok" if ok else "unavailable", "nats": "connected" if ok else "disconnected",
                "healthy_instances": len(self.registry.healthy()), "inflight": self.inflight}
        return web.Response(body=dumps(body), status=200 if ok else 503, content_type="application/json")

    async def metrics(self, _: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class StartError(RuntimeError):
    """The gateway cannot start (one line for the person starting it)."""


async def serve(nats_url: str, cfg: GatewayConfig, keys: ApiKeys | None, ready: Any = None,
                connect_within_s: float = 10.0) -> None:
    """Process main of ``bear gateway``: runs until SIGINT/SIGTERM. NATS must answer within
    ``connect_within_s`` at start (later outages are reconnected forever, answering 503 meanwhile)."""
    from bear.runtime.service import connect, stop_event
    from bear.runtime.shutdown import close_nats

    try:
        async with asyncio.timeout(connect_within_s):
            nc = await connect(nats_url, f"bear-gateway-{cfg.port}")
    except (TimeoutError, OSError) as exc:
        raise StartError(f"cannot reach NATS at {nats_url} within {connect_within_s:g} s") from exc
    gw = Gateway(nc, cfg, keys)
    try:
        await gw.start()
    except OSError as exc:  # the port is taken, the address is not ours
        await close_nats(nc)
        raise StartError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
    stop = stop_event()
    if ready is not None:
        ready.set()
    await stop.wait()
    await gw.stop()
    await close_nats(nc)
    tracing.shutdown()
    log.info("gateway stopped")
