"""Engine fields (issue 27): every request field of vLLM's OpenAI server is accepted, those BEAR's
decision does not consume reach the chosen engine verbatim, and the engine's answer comes back
whole — ``n`` choices, tool calls, log-probabilities, structured output — streamed as the engine
streams it and merged as vLLM merges it when not streamed. Through the official ``openai`` SDK,
gateway → router → sim engines (which mimic these shapes) and a recording engine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import openai
import pytest

from bear.gateway.openai_types import (
    CONSUMED,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    Defaults,
    parse_chat,
    parse_completion,
)
from bear.gateway.openai_wire import ApiError, merge_choices
from bear.protocol.engine_fields import (
    OWNED,
    check_engine,
    check_streamable,
    prompt_logprobs,
    skips_prefix_cache,
)
from bear.protocol.errors import BearError
from bear.protocol.messages import Dispatch, decode
from bear.protocol.sampling import SAMPLING_FIELDS
from bear.sim.shapes import instance_of

from gateway_helpers import KEY, RECORDER_MODEL
from waiting import wait_until

FIELDS = json.loads((Path(__file__).parents[1] / "data" / "vllm_openai_request_fields.json").read_text())
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}}]
SIM_MODEL = "Qwen/Qwen3-0.6B"


def aclient(pool) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pool.base_url, api_key=KEY, max_retries=0, timeout=30)


# ---------------------------------------------------------------- the request types
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_every_vllm_request_field_is_accepted_and_placed(kind: str) -> None:
    """Each field of vLLM 0.32's request model (recorded in tests/data) is a field of ours, and is
    consumed by the gateway, a sampling field or forwarded to the engine: none is refused."""
    ours = (ChatRequest if kind == "chat" else CompletionRequest).__struct_fields__
    theirs = FIELDS[kind]
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    assert not set(theirs) & set(UNSUPPORTED)
    body = {"model": "m", "messages": CHAT} if kind == "chat" else {"model": "m", "prompt": "x"}
    engine_only = [f for f in theirs if f not in CONSUMED and f not in SAMPLING_FIELDS]
    body.update({f: {"x": 1} for f in engine_only if f not in ("n", "priority")})
    parse = parse_chat if kind == "chat" else parse_completion
    sub = parse(json.dumps(body).encode(), {}, Defaults())
    assert set(sub.engine) == set(engine_only) - {"n", "priority"}
    assert not set(sub.engine) & OWNED  # what the router owns never travels as an engine field


FIELDS_SCRIPT = """
import json, vllm
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
print(json.dumps({"vllm": vllm.__version__, "chat": sorted(ChatCompletionRequest.model_fields),
                  "completions": sorted(CompletionRequest.model_fields)}))
"""


@pytest.mark.vllm
def test_recorded_field_lists_are_vllms(vllm_py: str) -> None:
    """tests/data/vllm_openai_request_fields.json is what the installed vLLM's request models hold."""
    out = subprocess.run([vllm_py, "-c", FIELDS_SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == FIELDS


def test_plain_requests_carry_no_engine_fields() -> None:
    sub = parse_chat(json.dumps({"model": "bear", "messages": CHAT, "temperature": 0.5, "user": "u",
                                 "request_id": "client-id"}).encode(), {}, Defaults())
    assert sub.engine == {} and sub.sampling == {"temperature": 0.5}


def test_values_msgpack_cannot_carry_are_a_400_not_a_500() -> None:
    """Found by schemathesis (`truncation_side: [..., 108971107152239214592]`): an integer past 64
    bits failed to pack the submission, a 500. Engine fields and tool calls are checked first."""
    assert check_engine({"x": [2**64 - 1, -(2**63)]}) == {"x": [2**64 - 1, -(2**63)]}
    for big in (2**64, -(2**63) - 1):
        with pytest.raises(BearError, match="integers"):
            check_engine({"x": {"y": [big]}})
    body = {"model": "bear", "prompt": "hi", "truncation_side": [{}, ["a", 108971107152239214592, False]]}
    with pytest.raises(ApiError) as e:
        parse_completion(json.dumps(body).encode(), {}, Defaults())
    assert e.value.status == 400 and e.value.param == "truncation_side"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "x": 2**70}
    msgs = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ApiError) as e:
        parse_chat(json.dumps({"model": "bear", "messages": msgs}).encode(), {}, Defaults())
    assert e.value.status == 400 and e.value.param == "messages[1].tool_calls"


def test_router_refuses_owned_and_bad_engine_fields() -> None:
    assert check_engine({"n": 2, "tools": [], "x": None}) == {"n": 2, "tools": []}
    for bad in ({"model": "m"}, {"stream": False}, {"n": 0}, {"n": True}, {"priority": 1.5},
                {"tools": float("nan")}, {"": 1}, [1]):
        with pytest.raises(BearError) as e:
            check_engine(bad)
        assert e.value.code == "bad_request"


# ---------------------------------------------------------------- merging streamed choices
def test_prompt_logprobs_as_vllm_derives_them() -> None:
    """vLLM's rule (protocol.py ``to_sampling_params``): prompt_logprobs, else with echo the chat
    request's top_logprobs (0 by default) or the completion request's logprobs; any of them set
    makes the engine skip reading its prefix cache; past 0 vLLM refuses them on a stream."""
    assert prompt_logprobs({}, chat=True) is None and not skips_prefix_cache({"logprobs": True}, chat=True)
    assert prompt_logprobs({"echo": True}, chat=True) == 0 and skips_prefix_cache({"echo": True}, chat=True)
    assert prompt_logprobs({"echo": True}, chat=False) is None
    assert prompt_logprobs({"echo": True, "logprobs": 2}, chat=False) == 2
    assert prompt_logprobs({"prompt_logprobs": 0, "echo": True, "top_logprobs": 3}, chat=True) == 0
    assert check_streamable({"prompt_logprobs": 0}, chat=False) and check_streamable({"echo": True}, chat=False)
    # a completion asking for them is sent unstreamed; a chat request is refused
    assert not check_streamable({"prompt_logprobs": -1}, chat=False)
    assert not check_streamable({"echo": True, "logprobs": 1}, chat=False)
    for engine in ({"prompt_logprobs": 1}, {"echo": True, "top_logprobs": 2}):
        with pytest.raises(BearError, match="prompt logprobs") as e:
            check_streamable(engine, chat=True)
        assert e.value.code == "bad_request"


def test_merge_choices_as_vllm_answers_without_streaming() -> None:
    chunks = [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call-1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": '{"ci'}}]},
          "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}, "finish_reason": None}],
        [{"index": 1, "delta": {"content": "hel"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]},
          "logprobs": {"content": [{"token": "b", "logprob": -2.0}]}, "finish_reason": "tool_calls"}],
        [{"index": 1, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "length"}],
    ]
    c0, c1 = merge_choices(True, chunks)
    assert c0["message"] == {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert c0["logprobs"] == {"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]}
    assert c0["finish_reason"] == "tool_calls" and c1["finish_reason"] == "length"
    assert c1["message"]["content"] == "hello" and "tool_calls" not in c1["message"]
    done = merge_choices(False, [[{"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "text_offset": [0]}}],
                                 [{"index": 0, "text": "b", "logprobs": {"tokens": ["b"], "text_offset": [1]},
                                   "finish_reason": "stop"}]])
    assert done == [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"], "text_offset": [0, 1]},
                     "finish_reason": "stop"}]


@pytest.mark.parametrize("schema", [
    WEATHER,
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 3}, "minItems": 2},
    {"$defs": {"p": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3}}}},
     "type": "object", "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/p"}}}},
    {"anyOf": [{"type": "null"}, {"type": "boolean"}]}, {"const": 7}, {"type": ["null", "string"]},
])
def test_sim_structured_output_is_schema_valid(schema) -> None:
    jsonschema.validate(json.loads(json.dumps(instance_of(schema))), schema)


# ---------------------------------------------------------------- end to end (sim engines)
async def test_forwarded_verbatim_to_the_engine(remote) -> None:
    msgs = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    extra = {"priority": 3, "structured_outputs": {"json": WEATHER}, "chat_template_kwargs": {"enable_thinking": False},
             "return_token_ids": True, "request_id": "client-chosen"}
    async with aclient(remote) as c:
        r = await c.chat.completions.create(model=RECORDER_MODEL, messages=msgs, tools=TOOLS, tool_choice="auto",
                                            n=2, logprobs=True, top_logprobs=3, parallel_tool_calls=False,
                                            max_tokens=4, extra_body=extra)
    body, headers = remote.recorder.requests[-1]
    for k, v in {"tools": TOOLS, "tool_choice": "auto", "n": 2, "logprobs": True, "top_logprobs": 3,
                 "parallel_tool_calls": False, "priority": 3, "structured_outputs": {"json": WEATHER},
                 "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}.items():
        assert body[k] == v, k
    assert body["messages"][1]["tool_calls"][0]["id"] == "c1" and body["messages"][2]["role"] == "tool"
    assert body["messages"][2]["tool_call_id"] == "c1" and body["messages"][1]["content"] is None
    rid = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    assert "request_id" not in body and rid.startswith("bear-"), headers  # the router names it
    assert body["stream"] is True and body["max_tokens"] == 4
    assert r.choices[0].message.content == "a b"
    rec = next(x for x in remote.records() if x.get("request_id") == rid)
    assert rec["tokens"] == "estimated"  # tools change the engine's prompt: not counted by the router


async def test_n_and_prompt_logprobs_reach_the_estimator(pool) -> None:
    """The dispatch the estimator learns from carries the engine's n (its replay queues the
    siblings) and that prompt logprobs skip the prefix cache (no hit); prompt logprobs past 0,
    which vLLM computes only unstreamed, are refused before a decision."""
    got: list[Dispatch] = []

    async def on(msg) -> None:
        got.append(decode(Dispatch, msg.data))

    sub = await pool.nc.subscribe(pool.router.subjects.dispatch_all, cb=on)
    try:
        async with aclient(pool) as c:
            await c.chat.completions.create(model=SIM_MODEL, messages=CHAT, n=3, max_tokens=2,
                                            extra_body={"prompt_logprobs": 0})
            await wait_until(lambda: len(got) == 1, what="the first dispatch")
            await c.completions.create(model=SIM_MODEL, prompt="Say hi", max_tokens=2)
            await wait_until(lambda: len(got) == 2, what="the second dispatch")
            for kw in ({"messages": CHAT, "extra_body": {"prompt_logprobs": 2}},
                       {"messages": CHAT, "extra_body": {"echo": True}, "logprobs": True, "top_logprobs": 1}):
                with pytest.raises(openai.BadRequestError, match="prompt logprobs"):
                    await c.chat.completions.create(model=SIM_MODEL, max_tokens=2, **kw)
    finally:
        await sub.unsubscribe()
    assert (got[0].sequences, got[0].skip_reading_prefix_cache, got[0].prefix_hit_tokens) == (3, True, 0)
    assert (got[1].sequences, got[1].skip_reading_prefix_cache) == (1, False)
    assert got[0].as_replay_request()["sequences"] == 3 and "sequences" not in got[1].as_replay_request()
    assert len(got) == 2  # the refused ones were never dispatched


async def test_n_choices_streamed_and_not(remote) -> None:
    async with aclient(remote) as c:
        r = await c.chat.completions.create(model=SIM_MODEL, messages=CHAT, n=3, max_tokens=5)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert all(len(ch.message.content.split()) == 5 and ch.finish_reason == "length" for ch in r.choices)
        assert r.usage.completion_tokens == 15
        stream = await c.chat.completions.create(model=SIM_MODEL, messages=CHAT, n=2, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True})
        texts, reasons, usage = {0: "", 1: ""}, {}, None
        async for ch in stream:
            for choice in ch.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
            usage = ch.usage or usage
        assert [len(t.split()) for t in texts.values()] == [4, 4] and reasons == {0: "length", 1: "length"}
        assert usage is not None and usage.completion_tokens == 8
        comp = await c.completions.create(model=SIM_MODEL, prompt="Say hi", n=2, max_tokens=3, logprobs=2)
    assert [ch.index for ch in comp.choices] == [0, 1]
    for ch in comp.choices:
        assert len(ch.logprobs.tokens) == 3 and len(ch.logprobs.top_logprobs[0]) == 2
        assert ch.logprobs.text_offset == [0, len(ch.logprobs.tokens[0]), sum(map(len, ch.logprobs.tokens[:2]))]


async def test_named_tool_choice_gives_a_schema_valid_call(remote) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with aclient(remote) as c:
        r = await c.chat.completions.create(model=SIM_MODEL, messages=CHAT, tools=TOOLS, tool_choice=named,
                                            max_tokens=200)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id and r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        stream = await c.chat.completions.create(model=SIM_MODEL, messages=CHAT, tools=TOOLS, tool_choice=named,
                                                 max_tokens=200, stream=True)
        name, args, reason = None, "", None
        async for ch in stream:
            for choice in ch.choices:
                for tc in choice.delta.tool_calls or []:
                    name = tc.function.name or name
                    args += tc.function.arguments or ""
                reason = choice.finish_reason or reason
    assert name == "get_weather" and reason == "tool_calls"
    assert json.loads(args) == json.loads(call.function.arguments)


async def test_json_schema_and_logprobs(remote) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    async with aclient(remote) as c:
        r = await c.chat.completions.create(model=SIM_MODEL, messages=CHAT, response_format=fmt, max_tokens=300,
                                            logprobs=True, top_logprobs=2)
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lp)
    assert "".join(t.token for t in lp) == r.choices[0].message.content
