"""OpenAI's response shapes, written by the gateway: error objects with their HTTP status, the
non-streaming bodies, and the SSE chunks of a streamed answer (``data: {...}`` events, a final
chunk with ``finish_reason``, the usage chunk of ``stream_options.include_usage``, ``data:
[DONE]``; with ``continuous_usage_stats``, vLLM's usage on every chunk). A plain query's answer
is the router's text pieces, one choice (index 0); a query with engine fields (tools, ``n``,
logprobs …) gets the engine's choices as the router relays them, verbatim when streamed and
merged into whole choices (``merge_choices``) when not."""

from __future__ import annotations

from typing import Any

import orjson

from bear.protocol.errors import ErrorCode
from bear.protocol.replies import Done, Error, Routed

# router error code → (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    # OpenAI and vLLM answer a context overflow with 400: the SDK's BadRequestError, LiteLLM's
    # ContextWindowExceededError (413 reads as a generic API error to both)
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.DUPLICATE: (409, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorCode.INTERNAL: (500, "internal_error"),
    # chunks of the answer lost in transit and not sent again: never a truncated 200 (issue 40)
    ErrorCode.INCOMPLETE: (502, "api_error"),
}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
         500: "internal_error", 502: "api_error", 503: "service_unavailable_error", 504: "timeout_error"}
CODES = {400: "bad_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
         408: "request_timeout", 409: "duplicate", 413: "too_large", 415: "unsupported_media_type",
         429: "overloaded", 500: "internal", 502: "incomplete", 503: "unavailable", 504: "deadline_exceeded"}


MODEL_NOT_FOUND = "model_not_found"  # OpenAI's code for a model it does not serve (the SDK's NotFoundError)


class ApiError(Exception):
    """An error answered as an OpenAI error object with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.close = close  # answered before the body was read through: close the connection after it
        self.status = status
        self.message = message
        self.param = param
        self.code = code or CODES.get(status, "error")
        self.headers = headers or {}

    @classmethod
    def from_router(cls, error: Error, retry_after_s: int, prompt_param: str = "messages") -> ApiError:
        """The router's (or the NATS client's) ``bear.error/1`` as an HTTP error (a context
        overflow names the prompt's field, ``prompt_param``, as OpenAI does)."""
        code = str(error.code or ErrorCode.INTERNAL)
        status, _ = STATUS.get(code, (500, "internal_error"))
        headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
        param = prompt_param if code == ErrorCode.CONTEXT_LENGTH_EXCEEDED else None
        if code == ErrorCode.NOT_FOUND:  # the router's only not_found: no instance serves the model named
            code, param = MODEL_NOT_FOUND, "model"
        return cls(status, error.message, code=code, headers=headers, param=param)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Answer:
    """One answer's constant parts (id, object kinds, created, model) and its chunk encoders."""

    __slots__ = ("chat", "completion_tokens", "continuous", "created", "id", "include_usage", "model",
                 "prompt_tokens")

    def __init__(self, chat: bool, query_id: str, created: int, model: str, include_usage: bool,
                 continuous: bool = False, prompt_tokens: int = 0) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + query_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (the
        # prompt as the router counted it; the final usage chunk is the engine's own count)
        self.continuous = continuous and include_usage
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def _chunk_map(self, choices: list[Any], usage: dict[str, int] | None = None) -> dict[str, Any]:
        """One chunk: ``usage`` with ``continuous_usage_stats`` (the usage so far when not given),
        ``null`` with ``include_usage`` only, absent otherwise."""
        d: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": choices}
        if self.continuous:
            d["usage"] = usage or {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                   "total_tokens": self.prompt_tokens + self.completion_tokens}
        elif self.include_usage:
            d["usage"] = None
        return d

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return sse(self._chunk_map([choice]))

    def role_chunk(self) -> bytes:
        """The first chat chunk (OpenAI's: the assistant role, empty content); none for completions."""
        if not self.chat:
            return b""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def text_chunk(self, text: str) -> bytes:
        self.completion_tokens += 1  # one router chunk per engine token
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

    def choices_chunk(self, choices: list[Any]) -> bytes:
        """A chunk of the engine's own choices (a query with engine fields), verbatim."""
        self.completion_tokens += sum(1 for c in choices if isinstance(c, dict) and c.get("finish_reason") is None)
        return sse(self._chunk_map(choices))

    def final_chunks(self, finish_reason: str, usage: dict[str, int], bear: dict[str, Any], *,
                     relayed: bool = False) -> bytes:
        """The chunk with ``finish_reason`` (and BEAR's decision as ``bear``), the usage chunk when
        asked for, and ``[DONE]``. ``relayed``: the engine's choices came with their own finish
        reasons, so the decision goes out on a chunk without choices."""
        if relayed:
            choices: list[Any] = []
        elif self.chat:
            choices = [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}]
        else:
            choices = [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}]
        d = self._chunk_map(choices, usage)
        d["bear"] = bear
        out = sse(d)
        if self.include_usage:
            out += sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created, "model": self.model, "choices": [], "usage": usage})
        return out + SSE_DONE

    def body(self, text: str, finish_reason: str, usage: dict[str, int], bear: dict[str, Any],
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The non-streaming response (``choices``: the engine's, merged; else one of ``text``)."""
        if choices is not None:
            return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": choices, "usage": usage, "bear": bear}
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage, "bear": bear}


def _concat(into: dict[str, Any], key: str, value: Any) -> None:
    """Append a streamed piece: strings and lists concatenate, maps merge key by key."""
    if value is None:
        return
    have = into.get(key)
    if isinstance(value, str) and isinstance(have, str):
        into[key] = have + value
    elif isinstance(value, list) and isinstance(have, list):
        have.extend(value)
    elif isinstance(value, dict) and isinstance(have, dict):
        for k, v in value.items():
            _concat(have, k, v)
    else:
        into[key] = value if not isinstance(value, list | dict) else orjson.loads(orjson.dumps(value))


def _merge_tool_calls(message: dict[str, Any], calls: list[Any]) -> None:
    """Streamed tool-call deltas (``index``, then the id, name and argument pieces) into calls."""
    have: list[dict[str, Any]] = message.setdefault("tool_calls", [])
    for call in calls:
        if not isinstance(call, dict):
            continue
        k = call.get("index", len(have))
        while len(have) <= k:
            have.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        slot = have[k]
        for key, v in call.items():
            if key == "index" or v is None:
                continue
            if key == "function" and isinstance(v, dict):
                for fk, fv in v.items():
                    if isinstance(fv, str):
                        slot["function"][fk] = slot["function"].get(fk, "") + fv
            else:
                slot[key] = v


def merge_choices(chat: bool, chunks: list[list[Any]]) -> list[dict[str, Any]]:
    """The whole choices of a non-streaming answer from the engine's streamed chunks, as vLLM's
    non-streaming response has them: per ``index``, the text (chat: the message's content, tool
    calls, reasoning), the log-probabilities (lists concatenated) and the last finish reason."""
    merged: dict[int, dict[str, Any]] = {}
    for choices in chunks:
        for c in choices:
            if not isinstance(c, dict):
                continue
            k = int(c.get("index", 0))
            if k not in merged:
                merged[k] = ({"index": k, "message": {"role": "assistant", "content": None, "refusal": None},
                              "logprobs": None, "finish_reason": None} if chat
                             else {"index": k, "text": "", "logprobs": None, "finish_reason": None})
            m = merged[k]
            for key, v in c.items():
                if key in ("index", "delta", "text"):
                    continue
                if key in ("finish_reason", "stop_reason"):
                    if v is not None:
                        m[key] = v
                else:
                    _concat(m, key, v)
            if chat:
                delta = c.get("delta") or {}
                msg = m["message"]
                for key, v in delta.items():
                    if key == "role" or v is None:
                        continue
                    if key == "tool_calls":
                        _merge_tool_calls(msg, v)
                    elif key == "content" and msg["content"] is None:
                        msg["content"] = v
                    else:
                        _concat(msg, key, v)
            elif isinstance(c.get("text"), str):
                m["text"] += c["text"]
    out = [merged[k] for k in sorted(merged)]
    if chat:
        for m in out:
            msg = m["message"]
            if msg.get("tool_calls") == []:
                del msg["tool_calls"]
            elif msg.get("tool_calls") and not msg.get("content"):
                msg["content"] = None  # OpenAI's: a turn that only calls tools has no content
    return out


def sse_error(err: ApiError) -> bytes:
    """An error after the stream started (status 200 already sent): OpenAI's SDKs raise it."""
    return sse(err.body())


def usage_of(done: Done, chunks: int) -> dict[str, int]:
    u = done.usage or {}
    prompt = int(u.get("prompt_tokens", 0))
    completion = int(u.get("completion_tokens", chunks))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": int(u.get("total_tokens", prompt + completion))}


def decision_headers(query_id: str, routed: Routed | None) -> dict[str, str]:
    """What BEAR decided, as response headers (the last ``bear.routed/1`` of the query)."""
    h = {"x-bear-query-id": query_id}
    if routed is None:
        return h
    h["x-bear-instance"] = routed.instance
    h["x-bear-model"] = routed.model
    pt = routed.predicted_ttft_s
    if pt is not None:
        h["x-bear-predicted-ttft-ms"] = f"{pt * 1e3:.3f}"
    h["x-bear-ttft-method"] = routed.ttft_method
    h["x-bear-policy"] = routed.policy
    h["x-bear-feasible"] = "true" if routed.feasible else "false"
    h["x-bear-attempt"] = str(routed.attempt)
    ds = routed.decision_s
    if ds is not None:
        h["x-bear-decision-ms"] = f"{ds * 1e3:.3f}"
    return h


def decision_of(routed: Routed | None, done: Done) -> dict[str, Any]:
    """BEAR's decision and what came of it, as the ``bear`` field of the last chunk / the body."""
    r = routed
    return {"instance": done.instance, "model": done.model, "predictor_model": done.predictor_model,
            "predicted_ttft_s": done.predicted_ttft_s, "ttft_method": r and r.ttft_method,
            "feasible": r and r.feasible, "policy": r and r.policy, "attempt": r and r.attempt,
            "ttft_s": done.ttft_s, "target_s": done.target_s, "on_time": done.on_time, "utility": done.utility,
            "decision_s": done.decision_s}
