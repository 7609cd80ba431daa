"""The two OpenAI request bodies the gateway accepts — ``/v1/chat/completions`` and
``/v1/completions`` — decoded and validated in one pass by msgspec, and turned into what is
submitted to the routers.

Every field of OpenAI's API and of vLLM's OpenAI server (0.32) is known here. The sampling fields
(``bear.protocol.sampling``, inherited) go to the engine; the fields the gateway handles (model,
messages/prompt, max tokens, stream options, the ``bear`` extension) shape the submission; the
rest of vLLM's fields — tools, ``n``, logprobs, structured outputs, chat-template options … — are
engine fields (``bear.protocol.engine_fields``): forwarded to the chosen engine verbatim, its
answer relayed choice by choice. Fields of OpenAI's that no vLLM engine serves (audio, web search,
``functions`` …) are either accepted and ignored because they ask nothing of the engine (``user``,
``metadata``, ``service_tier`` auto/default …) or rejected with a 400 that names the field and
says why. Unknown fields are rejected, as OpenAI does. Why each field is where it is:
docs/gateway.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from bear.gateway.openai_wire import ApiError
from bear.protocol.engine_fields import MAX_DEPTH, MAX_N, check_json
from bear.protocol.errors import BearError
from bear.protocol.sampling import SAMPLING_FIELDS, Sampling, sampling_of

MAX_TOKENS_LIMIT = 1_000_000
MAX_MESSAGES = 4096
TTFT_HEADER = "x-slo-ttft-ms"
LAMBDA_HEADER = "x-bear-lambda"

PositiveTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)]


class BearOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The ``bear`` body extension (``extra_body={"bear": {...}}`` in the openai SDK)."""

    ttft_ms: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    lam: Annotated[float, msgspec.Meta(ge=0.0)] | None = msgspec.field(default=None, name="lambda")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of streamed events: nothing to pad here
    continuous_usage_stats: bool | None = None  # vLLM's: the usage so far on every chunk


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # vLLM: an assistant turn's reasoning, given back
    reasoning_content: str | None = None
    function_call: Any = None
    audio: Any = None


class _Common(Sampling, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    max_tokens: PositiveTokens | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    bear: BearOptions | None = None
    request_id: str | None = None  # vLLM's: the router names the engine's request (docs/gateway.md)
    # engine fields (vLLM 0.32's request models): forwarded verbatim
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    logprobs: Any = None
    echo: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    include_stop_str_in_output: Any = None
    length_penalty: Any = None
    use_beam_search: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_offsets: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    add_special_tokens: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    repetition_detection: Any = None
    routed_experts_prompt_start: Any = None
    session_id: Any = None
    stream_interval: Any = None
    thinking_token_budget: Any = None
    watermarking: Any = None


class ChatRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveTokens | None = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None
    # OpenAI's, served by no vLLM engine
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    moderation: Any = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``/tokenize`` body: ``prompt`` (encoded as /v1/completions encodes it, special tokens
    added) or chat ``messages`` (through the model's chat template, as /v1/chat/completions)."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # as the endpoint the text is for (the only choice BEAR routes)
    add_generation_prompt: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]], msgspec.Meta(max_length=1 << 20)]


class CompletionRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[Any]
    suffix: Any = None  # forwarded: vLLM answers it (0.32: "not currently supported")
    prompt_embeds: Any = None
    best_of: Any = None  # OpenAI's; vLLM's V1 engine has none


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is a or (v == a and type(v) is type(a)) for a in allowed)


# field → (is the value one BEAR honours?, why not otherwise): OpenAI's fields no vLLM engine serves
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_is(None, 1), "must be 1: vLLM's V1 engine has no best_of (use n)"),
    "functions": (_is(None), "the deprecated function-calling fields are not served: use tools"),
    "function_call": (_is(None, "none"), "the deprecated function-calling fields are not served: use tool_choice"),
    "audio": (_is(None), "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (_is(None), "predicted outputs are not supported"),
    "verbosity": (_is(None), "verbosity is not a setting of the pool's engines"),
    "web_search_options": (_is(None), "web search is not supported"),
    "store": (_is(None, False), "BEAR stores no completions"),
    "moderation": (_is(None), "moderation is not supported"),
    "service_tier": (_is(None, "auto", "default"), "BEAR has one service tier (auto/default)"),
}
# handled by the gateway itself (or accepted and ignored): not forwarded as engine fields
CONSUMED = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream",
                      "stream_options", "user", "bear", "request_id", "metadata", "safety_identifier",
                      "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class Defaults:
    """What a request gets when it does not say: the routing alias, targets and lengths."""

    alias: str = "bear"
    ttft_s: float = 1.0
    lam: float | None = None  # None: the router's default λ
    # chat completions without max_tokens / max_completion_tokens: None, the rest of the chosen
    # engine's context (vLLM's and OpenAI's default); a number caps them
    max_tokens: int | None = None
    max_tokens_completions: int = 16  # OpenAI's default for /v1/completions


@dataclass
class Submission:
    """One validated request, ready for ``bear.client.submit.submit``."""

    chat: bool
    model: str  # as the client named it
    route_model: str | None  # the candidates' model; None: the routing alias (BEAR chooses)
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the rest of the chosen engine's context
    ttft_target_s: float
    lam: float | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # engine fields: the answer comes as the engine's choices
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    responses: dict[str, Any] | None = None  # the Responses API's request fields a Response repeats (None: not it)
    # completions whose prompt is not one string: each a text or token ids, each routed as its own
    # query (bear.gateway.prompt_list); None: the one ``prompt``
    prompts: list[str | list[int]] | None = None
    prompt_ids: list[int] | None = None  # one prompt's token ids (``prompt`` is then their text)


def _param_of(exc: msgspec.ValidationError) -> str | None:
    """The field a msgspec error is about: ``temperature`` from ``... - at `$.temperature```,
    ``messages[0].foo`` from ``Object contains unknown field `foo` - at `$.messages[0]```."""
    msg = str(exc)
    at = msg.rfind(" - at `$")
    path = msg[at + 8:].rstrip("`").lstrip(".") if at >= 0 else ""
    head = msg[:at] if at >= 0 else msg
    for marker in ("unknown field `", "missing required field `"):
        k = head.find(marker)
        if k >= 0:
            name = head[k + len(marker):].rstrip("`")
            return f"{path}.{name}" if path else name
    return path or None


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc), param=_param_of(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from exc


def _check_supported(req: msgspec.Struct) -> None:
    for name in _RULED[type(req)]:
        v = getattr(req, name)
        if v is not None and not UNSUPPORTED[name][0](v):  # None: not asked for, always fine
            raise ApiError(400, f"{name}: {UNSUPPORTED[name][1]}", param=name)


def _float_header(headers: Mapping[str, str], name: str, lo: float, strict: bool) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < lo or (strict and v == lo):
        raise ApiError(400, f"header {name} must be a number {'>' if strict else '≥'} {lo:g}", param=name)
    return v


def _targets(req: _Common, headers: Mapping[str, str], d: Defaults) -> tuple[float, float | None]:
    """(TTFT target in s, λ): the ``bear`` body field, else the headers, else the defaults."""
    opts = req.bear or BearOptions()
    ttft_ms = opts.ttft_ms if opts.ttft_ms is not None else _float_header(headers, TTFT_HEADER, 0.0, True)
    lam = opts.lam if opts.lam is not None else _float_header(headers, LAMBDA_HEADER, 0.0, False)
    if ttft_ms is not None and not math.isfinite(ttft_ms):
        raise ApiError(400, "bear.ttft_ms must be finite", param="bear.ttft_ms")
    return (d.ttft_s if ttft_ms is None else ttft_ms / 1e3), (d.lam if lam is None else lam)


def router_messages(msgs: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as the router submits them: text content as one string (text parts joined
    with newlines, as vLLM joins them), ``developer`` as ``system``; tool calls, tool results and
    reasoning kept as they are (the engine's chat template renders them)."""
    out = []
    for i, m in enumerate(msgs):
        role = ROLES.get(m.role)
        if role is None:
            why = "the deprecated function role is not served: use tool" if m.role == "function" else "unknown role"
            raise ApiError(400, f"messages[{i}].role {m.role!r}: {why} (system, developer, user, assistant, tool)",
                           param=f"messages[{i}].role")
        for extra in ("function_call", "audio"):
            if getattr(m, extra) is not None:
                raise ApiError(400, f"messages[{i}].{extra}: not served (use tool_calls; no audio)",
                               param=f"messages[{i}].{extra}")
        content = m.content
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{k}]: only text parts are supported, not "
                                        f"{part.type!r}", param=f"messages[{i}].content[{k}]")
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": role, "content": content or ""}
        if content is None and m.tool_calls:
            d["content"] = None  # an assistant turn that only called tools
        for name in ("name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"):
            v = getattr(m, name)
            if v is not None:
                d[name] = v
        if m.tool_calls:
            _carried(m.tool_calls, f"messages[{i}].tool_calls")
        out.append(d)
    return out


def _carried(v: Any, where: str) -> None:
    """400 unless the submission can carry ``v`` to the engine (``check_json``: a 2^70 integer
    would fail to pack — a 500 — rather than be refused)."""
    try:
        check_json(v, where, MAX_DEPTH)
    except BearError as exc:
        raise ApiError(400, exc.message, param=where) from None


def _common(req: _Common, chat: bool, headers: Mapping[str, str], d: Defaults, max_tokens: int | None,
            default_max: int | None) -> Submission:
    _check_supported(req)
    ttft_s, lam = _targets(req, headers, d)
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return Submission(chat=chat, model=req.model, route_model=None if req.model == d.alias else req.model,
                      stream=bool(req.stream), include_usage=bool(opts and opts.include_usage),
                      continuous_usage=bool(opts and opts.continuous_usage_stats),
                      max_tokens=max_tokens or default_max, ttft_target_s=ttft_s, lam=lam,
                      sampling=sampling_of(req), engine=_checked(_engine_fields(req)))


def _checked(engine: dict[str, Any]) -> dict[str, Any]:
    for k, v in engine.items():
        _carried(v, k)
    return engine


_RULED = {t: tuple(f for f in t.__struct_fields__ if f in UNSUPPORTED) for t in (ChatRequest, CompletionRequest)}
# the engine fields of each request type: every field neither consumed, sampling nor refused
_ENGINE = {t: tuple(f for f in t.__struct_fields__ if f not in CONSUMED and f not in SAMPLING_FIELDS
                    and f not in UNSUPPORTED) for t in (ChatRequest, CompletionRequest)}
_ENGINE_AT = {t: tuple(t.__struct_fields__.index(f) for f in names) for t, names in _ENGINE.items()}


def _runs(at: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Field positions as contiguous (start, stop) runs."""
    runs: list[list[int]] = []
    for i in sorted(at):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


_ENGINE_RUNS = {t: _runs(at) for t, at in _ENGINE_AT.items()}


def _engine_fields(req: msgspec.Struct) -> dict[str, Any]:
    """The engine fields a request sets. A plain request sets none: its fields are read in one C
    call (``astuple``) and the engine fields' runs checked with ``count``, so the plain path stays
    about as cheap as before engine fields (≈ 0.6 µs)."""
    values = msgspec.structs.astuple(req)
    if all(values[a:b].count(None) == b - a for a, b in _ENGINE_RUNS[type(req)]):
        return {}
    return {f: values[i] for f, i in zip(_ENGINE[type(req)], _ENGINE_AT[type(req)], strict=True)
            if values[i] is not None}


def parse_chat(body: bytes, headers: Mapping[str, str], d: Defaults) -> Submission:
    req: ChatRequest = decode(body, ChatRequest)
    sub = _common(req, True, headers, d, req.max_completion_tokens or req.max_tokens, d.max_tokens)
    sub.messages = router_messages(req.messages)
    return sub


MAX_PROMPTS = 128  # prompts of one completions request: each is a query
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _token_ids(v: Any, where: str) -> list[int] | None:
    """``v`` as a token-id prompt (a non-empty list of ids in [0, 2^31)), None when it is not a list of ints."""
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    if not all(0 <= t < 2**31 for t in v):
        raise ApiError(400, f"{where}: token ids must lie in [0, 2^31)", param=where)
    return v


def prompts_of(prompt: str | list[Any]) -> list[str | list[int]]:
    """vLLM's prompt forms as a list of prompts (each a text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    ids = _token_ids(prompt, "prompt")
    if ids is not None:
        return [ids]
    if not prompt:
        raise ApiError(400, f"prompt must be {_PROMPT_SHAPES}, not an empty list", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request ({len(prompt)} given)", param="prompt")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        one = p if isinstance(p, str) else _token_ids(p, f"prompt[{i}]")
        if one is None:
            raise ApiError(400, f"prompt must be {_PROMPT_SHAPES}: prompt[{i}] is neither a string nor a "
                                "non-empty list of token ids", param=f"prompt[{i}]")
        if out and isinstance(one, str) != isinstance(out[0], str):  # vLLM refuses a mixed list too
            raise ApiError(400, f"prompt must be {_PROMPT_SHAPES}: prompt[{i}] is "
                                f"{'a string' if isinstance(one, str) else 'token ids'} in a list of "
                                f"{'strings' if isinstance(out[0], str) else 'token-id lists'}", param=f"prompt[{i}]")
        out.append(one)
    return out


def parse_completion(body: bytes, headers: Mapping[str, str], d: Defaults) -> Submission:
    req: CompletionRequest = decode(body, CompletionRequest)
    prompts = prompts_of(req.prompt)
    sub = _common(req, False, headers, d, req.max_tokens, d.max_tokens_completions)
    if len(prompts) == 1 and isinstance(prompts[0], str):
        sub.prompt = prompts[0]
        return sub
    if sub.route_model is None and any(not isinstance(p, str) for p in prompts):
        raise ApiError(400, f"a token-id prompt must name its model, not the routing alias {d.alias!r}: "
                            "token ids mean something to one tokenizer only", param="model")
    sub.prompts = prompts
    return sub


def _error_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _completion_schema(chat: bool) -> dict[str, Any]:
    if chat:
        choice = {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]}, "logprobs": {},
            "message": {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"type": "string"}, "content": {"type": ["string", "null"]},
                "refusal": {"type": ["string", "null"]}}}}}
    else:
        choice = {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "text": {"type": "string"}, "logprobs": {},
            "finish_reason": {"type": ["string", "null"]}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": usage,
        "bear": {"type": "object"}}}


ERROR_STATUSES = ("400", "401", "404", "408", "409", "413", "415", "429", "500", "502", "503", "504")


def _responses_request_schema() -> dict[str, Any]:
    """The Responses request as bear.gateway.responses accepts it (it checks the rest itself)."""
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}}}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
    return {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string"}, "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": message}]},
        "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "stream": {"type": "boolean"}, "tools": {"type": "array", "items": tool},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {
            "type": "object", "required": ["type", "name"],
            "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]},
        "text": {"type": "object", "properties": {"format": {"type": "object"}}},
        "metadata": {"type": "object"}, "store": {"type": "boolean"}}}


def _response_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created_at", "model", "status", "output"],
            "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                           "created_at": {"type": "integer"}, "model": {"type": "string"},
                           "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]},
                           "output": {"type": "array", "items": {"type": "object"}},
                           "usage": {"type": ["object", "null"]}}}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of the gateway: request bodies from the msgspec types that
    decode them (so the document cannot drift from what is accepted), OpenAI's response shapes,
    every error as an OpenAI error object."""
    from bear import __version__

    (chat, comp, tok, detok), components = msgspec.json.schema_components(
        (ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest), ref_template="#/components/schemas/{name}")
    components.update(ErrorResponse=_error_schema(), ChatCompletion=_completion_schema(True),
                      Completion=_completion_schema(False), Response=_response_schema())
    err = {"description": "an OpenAI error object",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}

    def post(body: dict[str, Any], answer: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "security": [{"bearer": []}],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": {"description": "the answer (JSON; with stream: true, server-sent "
                                                              "events of chunks, then data: [DONE])",
                                               "content": {"application/json": {"schema": {
                                                   "$ref": f"#/components/schemas/{answer}"}},
                                                   "text/event-stream": {"schema": {"type": "string"}}}},
                                       **{s: err for s in ERROR_STATUSES}}}}

    def get(summary: str, schema: dict[str, Any], *, auth: bool, params: list[Any] | None = None) -> dict[str, Any]:
        op: dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
            **{s: err for s in (("401", "404") if auth else ()) + ("500", "503")}}}
        if auth:
            op["security"] = [{"bearer": []}]
        if params:
            op["parameters"] = params
        return {"get": op}

    def tokenize_op(body: dict[str, Any], summary: str, answer: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"summary": summary, "security": [{"bearer": []}],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": answer}}},
                                       **{s: err for s in ("400", "401", "404", "408", "413", "500", "503")}}}}

    model_card = {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                 "created": {"type": "integer"}, "owned_by": {"type": "string"},
                                 "root": {"type": ["string", "null"]}, "parent": {"type": ["string", "null"]},
                                 "max_model_len": {"type": ["integer", "null"]}, "bear": {"type": "object"}}}
    ping = get("liveness (vLLM's /ping): 200 while NATS is connected", {"type": "object"}, auth=False)
    ping["post"] = ping["get"]
    return {
        "openapi": "3.1.0",
        "info": {"title": "BEAR gateway (OpenAI API)", "version": __version__},
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/chat/completions": post(chat, "ChatCompletion", "a chat completion, routed by BEAR"),
            "/v1/completions": post(comp, "Completion", "a text completion, routed by BEAR"),
            "/v1/responses": post(_responses_request_schema(), "Response",
                                  "OpenAI's Responses API (stateless), routed by BEAR as a chat completion"),
            "/v1/models": get("the served models and the routing alias",
                              {"type": "object", "properties": {"object": {"type": "string"},
                                                                "data": {"type": "array", "items": model_card}}},
                              auth=True),
            "/v1/models/{model}": get("one model", model_card, auth=True,
                                      params=[{"name": "model", "in": "path", "required": True,
                                               "schema": {"type": "string"}}]),
            "/tokenize": tokenize_op(tok, "vLLM's /tokenize: the ids the routed request gets", {
                "type": "object", "required": ["count", "tokens"],
                "properties": {"count": {"type": "integer"}, "max_model_len": {"type": ["integer", "null"]},
                               "tokens": {"type": "array", "items": {"type": "integer"}},
                               "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}}),
            "/detokenize": tokenize_op(detok, "vLLM's /detokenize", {
                "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
            "/health": get("readiness: NATS and the healthy instances", {"type": "object"}, auth=False),
            "/ping": ping,
            "/version": get("the gateway's version", {"type": "object", "properties": {"version": {"type": "string"}}},
                            auth=False),
        },
    }
