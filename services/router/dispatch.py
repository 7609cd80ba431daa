"""Streaming calls to an instance's OpenAI-compatible API (vLLM or the sim engine).

``stream_completion`` posts one request with ``stream: true`` and the ``X-Request-Id`` header (the
id the router announced in ``bear.dispatch``, so estimators can match the instance's residents to
their predicted lengths) and yields text pieces as the SSE chunks arrive, then the usage. A
failure before the first byte of the answer raises ``InstanceUnavailable`` (the router tries
another instance); a failure after it raises ``StreamBroken`` (the answer cannot be retried without
repeating text to the client). An engine that refuses the request itself — HTTP 400, 413 or 422:
a prompt longer than its context, a bad parameter — raises ``InstanceRefused``: another instance
would refuse it too, so the router neither retries it nor holds it against the instance."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from bear.protocol.errors import ErrorCode

REFUSED_STATUSES = (400, 413, 422)  # the request's own fault; 404/408/409/429 and 5xx are the instance's
# vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5 s);
# aiohttp keeps one for 15 s, so a query could go out on a connection the engine is closing at
# that instant, be reset, and count as the instance unavailable (rerouted, the instance backed
# off). The router lets its connections go before the engine does.
ENGINE_KEEPALIVE_S = 4.0
_CONTEXT = re.compile(r"max_model_len|maximum context length|context length|context window", re.IGNORECASE)
_TOO_LARGE = re.compile(r"too long|too large|exceeds", re.IGNORECASE)


class InstanceUnavailable(Exception):
    """Nothing was generated: connection refused, timeout before the response, 5xx (or a 4xx that
    is the instance's, not the request's: unknown model, rate limit)."""


class InstanceRefused(Exception):
    """The engine refused this request for good (HTTP 400/413/422): ``code`` is
    ``context_length_exceeded`` for a request beyond the engine's context, ``too_large`` for one
    beyond its other limits (size), else ``bad_request``; ``reason`` is the engine's own message."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason
        self.code = (ErrorCode.CONTEXT_LENGTH_EXCEEDED if _CONTEXT.search(reason)
                     else ErrorCode.TOO_LARGE if status == 413 or _TOO_LARGE.search(reason) else ErrorCode.BAD_REQUEST)


def engine_reason(text: str) -> str:
    """The message of an OpenAI-style error body (vLLM: ``{"message": …}`` or ``{"error": {"message": …}}``),
    else the body itself, on one line and at most 300 characters."""
    msg: Any = text
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    if isinstance(d, dict):
        inner = d.get("error")
        msg = (inner.get("message") if isinstance(inner, dict) else None) or d.get("message") or inner or text
    return " ".join(str(msg).split())[:300]


class StreamBroken(Exception):
    """The stream failed after the answer started."""


@dataclass
class Piece:
    text: str = ""
    usage: dict[str, int] | None = None
    finish_reason: str | None = None
    choices: list[Any] | None = None  # raw mode: the chunk's choices, verbatim
    produced: bool = False  # raw mode: the chunk carries output (text, a tool call, log-probabilities)


def _produced(choice: Any) -> bool:
    """Whether one streamed choice carries output (not only the role or a finish reason)."""
    if not isinstance(choice, dict):
        return False
    if choice.get("text") or choice.get("logprobs") or choice.get("token_ids"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v not in (None, "", []) for k, v in delta.items() if k != "role")


def request_body(model: str, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                 max_tokens: int | None, extra: dict[str, Any] | None = None,
                 stream: bool = True) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a streaming completion or chat completion (``prompt``: a text or token
    ids); ``extra``: further body fields (the query's sampling fields, the sim engine's length
    hints); ``max_tokens`` None: none in the body, so the engine generates up to the rest of its
    context (vLLM's default); ``stream`` False: an unstreamed request (prompt logprobs)."""
    body: dict[str, Any] = ({"model": model, "stream": True, "stream_options": {"include_usage": True}} if stream
                            else {"model": model, "stream": False})
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if messages is not None:
        body["messages"] = messages
        path = "/chat/completions"
    else:
        body["prompt"] = "" if prompt is None else prompt
        path = "/completions"
    if extra:
        body.update(extra)
    return path, body


def engine_session(**kw: Any) -> Any:
    """The router's HTTP client for the instances (``kw``: more ``aiohttp.ClientSession``
    arguments): no connection limit, connections kept idle for at most ``ENGINE_KEEPALIVE_S``."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=ENGINE_KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, **kw)


async def stream_completion(session: Any, base_url: str, request_id: str, path: str, body: dict[str, Any], *,
                            connect_timeout_s: float = 2.0, idle_timeout_s: float = 60.0,
                            headers: dict[str, str] | None = None, raw: bool = False,
                            coalesce: bool = True) -> AsyncIterator[Piece]:
    """``headers``: extra request headers (the trace context); ``raw``: every chunk with choices
    is yielded with them verbatim (``Piece.choices``), for answers that are more than one text;
    ``coalesce``: the text chunks that arrived in one read are yielded as one piece (their texts
    joined), so that a router behind its engines relays them in one message — nothing waits for
    more to arrive, so no token is held back. Closing the iterator early (the query was
    cancelled) closes the connection, which makes the instance abort the request."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=idle_timeout_s)
    started = False
    hdrs = {"X-Request-Id": request_id, **headers} if headers else {"X-Request-Id": request_id}
    try:
        async with session.post(base_url + path, json=body, headers=hdrs, timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.text())[:4096]
                if resp.status in REFUSED_STATUSES:
                    raise InstanceRefused(resp.status, engine_reason(text))
                raise InstanceUnavailable(f"HTTP {resp.status}: {engine_reason(text)}")
            if body.get("stream") is False:
                yield whole_answer(json.loads(await resp.read()))
                return
            buf = b""
            done = False
            # read to the end of the body even after [DONE]: a response left unread closes its
            # keep-alive connection, and the next query to this instance pays a TCP connect
            async for data in resp.content.iter_any():
                if done:
                    continue
                buf += data
                read: list[Piece] = []
                while not done and b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        piece = parse_chunk(json.loads(payload), raw) if raw else parse_text_event(payload)
                        if piece is not None:
                            started = started or bool(piece.text) or piece.produced
                            read.append(piece)
                if coalesce and not raw and len(read) > 1:
                    read = [merge_pieces(read)]
                for piece in read:
                    yield piece
    except (InstanceUnavailable, InstanceRefused, StreamBroken):
        raise
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        if started:
            raise StreamBroken(f"{type(exc).__name__}: {exc}") from exc
        raise InstanceUnavailable(f"{type(exc).__name__}: {exc}") from exc


def whole_answer(d: Any) -> Piece:
    """An unstreamed answer as one piece: its choices verbatim (each whole, prompt logprobs
    included), its usage, the first choice's finish reason."""
    if not isinstance(d, dict) or not isinstance(d.get("choices"), list):
        raise StreamBroken(f"the engine's answer has no choices: {str(d)[:200]}")
    choices = d["choices"]
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    usage = d.get("usage")
    return Piece(text="", usage=_usage(usage) if isinstance(usage, dict) else None,
                 finish_reason=first.get("finish_reason"), choices=choices, produced=True)


def merge_pieces(pieces: list[Piece]) -> Piece:
    """Text pieces in the order they arrived as one: the texts joined, the last usage and finish
    reason (a stream's usage and finish come after its text)."""
    out = Piece(text="".join(p.text for p in pieces))
    for p in pieces:
        out.usage = p.usage if p.usage is not None else out.usage
        out.finish_reason = p.finish_reason if p.finish_reason is not None else out.finish_reason
    return out


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _TextEvent(msgspec.Struct):
    """What the router reads of one text chunk; the rest of it is skipped without being built."""

    object: Any = None
    error: Any = UNSET
    message: Any = None
    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None


_TEXT_EVENT = msgspec.json.Decoder(_TextEvent)


def parse_text_event(payload: bytes) -> Piece | None:
    """``parse_chunk`` of one SSE payload, for answers relayed as text: decoded straight into the
    few fields read (a third of ``json.loads``' CPU per chunk); a chunk of another shape falls back
    to ``json.loads`` and ``parse_chunk``, so both read every chunk alike."""
    try:
        ev = _TEXT_EVENT.decode(payload)
    except msgspec.DecodeError:
        return parse_chunk(json.loads(payload))  # malformed JSON raises ValueError there
    if ev.object == "error" or not isinstance(ev.error, UnsetType):
        raise StreamBroken(str(ev.message or (None if isinstance(ev.error, UnsetType) else ev.error)))
    piece = Piece()
    if ev.choices:
        c = ev.choices[0]
        piece.text = c.text or (c.delta.content if c.delta is not None else None) or ""
        piece.finish_reason = c.finish_reason
    if ev.usage is not None:
        piece.usage = _usage(ev.usage)
    if not piece.text and piece.usage is None and piece.finish_reason is None:
        return None
    return piece


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    """The usage's counts, with vLLM's prefix-cache hit (``--enable-prompt-tokens-details``) as
    ``cached_tokens``."""
    out = {k: int(v) for k, v in usage.items() if isinstance(v, int)}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["cached_tokens"] = int(details["cached_tokens"])
    return out


def parse_chunk(d: dict[str, Any], raw: bool = False) -> Piece | None:
    """One SSE chunk of vLLM's completions or chat completions stream (``raw``: keep its choices)."""
    if d.get("object") == "error" or "error" in d:
        raise StreamBroken(str(d.get("message") or d.get("error")))
    piece = Piece()
    choices = d.get("choices") or []
    if choices:
        c = choices[0]
        piece.text = c.get("text") or (c.get("delta") or {}).get("content") or ""
        piece.finish_reason = c.get("finish_reason")
        if raw:
            piece.choices = choices
            piece.produced = any(_produced(x) for x in choices)
    usage = d.get("usage")
    if isinstance(usage, dict):
        piece.usage = _usage(usage)
    if not piece.text and piece.usage is None and piece.finish_reason is None and piece.choices is None:
        return None
    return piece
