"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a request is turned into the
chat completions request it means (``to_chat``) and validated and routed as one, and the answer
is written as a Response object or its stream of typed events (``ResponsesAnswer``, the same
encoder interface as ``bear.gateway.openai_wire.Answer``).

What is served, as vLLM's server serves it: ``input`` as a string or a list of items (messages
with text content or ``input_text`` parts, earlier ``function_call`` items and their
``function_call_output``), ``instructions`` (a system message first), ``max_output_tokens``,
``temperature``, ``top_p``, function ``tools`` and ``tool_choice`` (calls come back as
``function_call`` output items), ``text.format`` (``json_schema`` / ``json_object``: the chat
path's structured output), usage. Stateless: nothing is stored, so ``previous_response_id`` and
``background`` are refused with a coded 400 and a Response says ``store: false`` — a client sends
the conversation as ``input`` (as it does with ``store: false`` at OpenAI). BEAR's own fields
(``bear``, the ``x-slo-ttft-ms`` header) work as on the chat path."""

from __future__ import annotations

from typing import Any

import orjson

from bear.gateway.openai_wire import ApiError, merge_choices

# accepted and answered as documented; anything else is a 400 naming the field
_ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "metadata",
           "parallel_tool_calls", "user")
_IGNORED = ("store", "truncation", "service_tier", "include", "reasoning", "top_logprobs", "prompt_cache_key",
            "safety_identifier", "max_tool_calls")
_SAMPLING = ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty")
_KNOWN = {"model", "input", "stream", "text", "previous_response_id", "background", "bear", *_ECHOED, *_IGNORED,
          *_SAMPLING}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _text_of(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or its text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of parts", param)
    parts: list[dict[str, Any]] = []
    for k, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
            raise _bad(f"content part of type {kind!r} is not supported (text parts only: input_text, output_text)",
                       f"{param}[{k}]")
        parts.append({"type": "text", "text": p["text"]})
    return parts


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input must be a string or a non-empty list of items", "input")
    for k, item in enumerate(items):
        param = f"input[{k}]"
        if not isinstance(item, dict):
            raise _bad("an input item must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"role must be user, assistant, system or developer, not {role!r}", f"{param}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{k}"), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
        else:
            raise _bad(f"input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output)", f"{param}.type")
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """Function tools and tool_choice in the chat form."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("tools must be a list", "tools")
        chat_tools = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise _bad("only function tools are supported ({type: function, name, parameters})", f"tools[{k}]")
            fn = {key: t[key] for key in ("name", "description", "parameters", "strict") if t.get(key) is not None}
            chat_tools.append({"type": "function", "function": fn})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as the chat path's ``response_format``."""
    text = body.get("text")
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {"name": str(fmt.get("name") or "schema"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = bool(fmt["strict"])
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise _bad("text.format must be text, json_object or json_schema with a schema", "text.format")


def to_chat(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    """The chat completions request a Responses request means (a coded 400 for what is not served),
    and the request's fields a Response repeats (one parse of the body for both)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _bad(f"unknown or unsupported field {unknown[0]!r}", unknown[0])
    if body.get("previous_response_id") is not None:
        raise _bad("this gateway stores no responses (stateless): send the conversation as input instead of "
                   "previous_response_id", "previous_response_id")
    if body.get("background"):
        raise _bad("background responses need a store; this gateway is stateless", "background")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body), **_tools(body), **_format(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    for key in (*_SAMPLING, "stream", "bear", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return orjson.dumps(chat), {k: body[k] for k in _ECHOED if k in body}


def _usage(u: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": u.get("prompt_tokens", 0), "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.get("total_tokens", 0)}


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq, **fields}) \
        + b"\n\n"


class ResponsesAnswer:
    """One answer as a Response (``body``) or its events (the other methods, in stream order):
    ``response.created`` and ``response.in_progress`` first; the message item, its text part and
    ``response.output_text.delta`` per piece; at the end the text's ``done`` events, each
    function call as an item of its own, and ``response.completed`` (``incomplete`` when the
    output hit ``max_output_tokens``) with the whole Response."""

    def __init__(self, query_id: str, created: int, model: str, request: dict[str, Any]) -> None:
        self.id = "resp_" + query_id
        self.msg_id = "msg_" + query_id
        self.created = created
        self.model = model
        self.request = request
        self.completion_tokens = 0
        self._seq = 0
        self._head = False
        self._open = False
        self._text: list[str] = []
        self._raw: list[list[Any]] = []

    def _ev(self, kind: str, **fields: Any) -> bytes:
        out = _event(kind, self._seq, **fields)
        self._seq += 1
        return out

    def _start(self) -> bytes:
        if self._head:
            return b""
        self._head = True
        shell = self.response([], "in_progress", None)
        return self._ev("response.created", response=shell) + self._ev("response.in_progress", response=shell)

    def _delta(self, text: str) -> bytes:
        out = self._start()
        if not self._open:
            self._open = True
            out += self._ev("response.output_item.added", output_index=0,
                            item={"id": self.msg_id, "type": "message", "status": "in_progress", "role": "assistant",
                                  "content": []})
            out += self._ev("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
        self._text.append(text)
        return out + self._ev("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                              delta=text, logprobs=[])

    def role_chunk(self) -> bytes:
        return self._start()

    def text_chunk(self, text: str) -> bytes:
        self.completion_tokens += 1
        return self._delta(text)

    def choices_chunk(self, choices: list[Any]) -> bytes:
        """The engine's chat choices (tools, structured output): text as deltas, calls kept for the end."""
        self._raw.append(choices)
        out = self._start()
        for c in choices:
            if isinstance(c, dict) and c.get("index", 0) == 0:
                content = (c.get("delta") or {}).get("content")
                if isinstance(content, str) and content:
                    out += self._delta(content)
        return out

    def _message(self, text: str) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _calls(self, choices: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        msg = choices[0].get("message", {}) if choices else {}
        return [{"id": f"fc_{self.id[5:]}_{k}", "type": "function_call", "status": "completed",
                 "call_id": c.get("id") or f"call_{k}", "name": c["function"]["name"],
                 "arguments": c["function"]["arguments"]}
                for k, c in enumerate(msg.get("tool_calls") or [])]

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, int] | None,
                 finish_reason: str | None = None, bear: dict[str, Any] | None = None) -> dict[str, Any]:
        fmt = {"type": "text"}
        r: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.request.get("instructions"), "max_output_tokens": self.request.get("max_output_tokens"),
            "temperature": self.request.get("temperature"), "top_p": self.request.get("top_p"),
            "tools": self.request.get("tools") or [], "tool_choice": self.request.get("tool_choice") or "auto",
            "parallel_tool_calls": self.request.get("parallel_tool_calls", True),
            "metadata": self.request.get("metadata") or {}, "previous_response_id": None, "store": False,
            "text": {"format": fmt}, "truncation": "disabled", "usage": _usage(usage) if usage is not None else None,
        }
        if self.request.get("user") is not None:
            r["user"] = self.request["user"]
        if bear is not None:
            r["bear"] = bear
        return r

    def _output(self, text: str, choices: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        calls = self._calls(choices)
        return ([self._message(text)] if text or not calls else []) + calls

    @staticmethod
    def _status(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def final_chunks(self, finish_reason: str, usage: dict[str, int], bear: dict[str, Any], *,
                     relayed: bool = False) -> bytes:
        out = self._start()
        text = "".join(self._text)
        choices = merge_choices(True, self._raw) if relayed else None
        calls = self._calls(choices)
        index = 0
        if self._open or not calls:
            if not self._open:  # an empty answer still has its message
                out += self._delta("")
            item = self._message(text)
            out += self._ev("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                            text=text, logprobs=[])
            out += self._ev("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                            part=item["content"][0])
            out += self._ev("response.output_item.done", output_index=0, item=item)
            index = 1
        for k, call in enumerate(calls, start=index):
            out += self._ev("response.output_item.added", output_index=k, item={**call, "arguments": "",
                                                                                 "status": "in_progress"})
            out += self._ev("response.function_call_arguments.delta", item_id=call["id"], output_index=k,
                            delta=call["arguments"])
            out += self._ev("response.function_call_arguments.done", item_id=call["id"], output_index=k,
                            arguments=call["arguments"])
            out += self._ev("response.output_item.done", output_index=k, item=call)
        status = self._status(finish_reason)
        final = self.response(self._output(text, choices), status, usage, finish_reason, bear)
        return out + self._ev("response.completed" if status == "completed" else "response.incomplete",
                              response=final)

    def body(self, text: str, finish_reason: str, usage: dict[str, int], bear: dict[str, Any],
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if choices is not None:
            text = choices[0].get("message", {}).get("content") or "" if choices else ""
        return self.response(self._output(text, choices), self._status(finish_reason), usage, finish_reason, bear)
