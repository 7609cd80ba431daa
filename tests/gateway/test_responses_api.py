"""OpenAI's Responses API through the gateway (bear.gateway.responses), with the official SDK's
``client.responses``: text and message input, instructions, streamed events in their order, function
tools (named and required) with their calls as output items, structured output, usage, and the
coded refusals of what a stateless gateway cannot serve."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from bear.gateway.openai_wire import ApiError
from bear.gateway.responses import to_chat

from gateway_helpers import KEY

SIM_MODEL = "Qwen/Qwen3-0.6B"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2},
                                            "celsius": {"type": "number"}}, "required": ["city", "celsius"]}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def aclient(pool) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pool.base_url, api_key=KEY, max_retries=0, timeout=30)


async def test_text_input_answer_usage_and_decision(remote) -> None:
    async with aclient(remote) as c:
        r = await c.responses.create(model="bear", input="Explain KV caching.", max_output_tokens=4)
    assert r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert len(r.output_text.split()) == 4 and r.usage.output_tokens == 4 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # it hit the cap
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.max_output_tokens == 4 and r.model_extra["bear"]["instance"]


async def test_instructions_and_message_items_reach_the_engine_as_chat(remote) -> None:
    body, _ = to_chat(json.dumps({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "no lists"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}]}).encode())
    assert json.loads(body)["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "system", "content": [{"type": "text", "text": "no lists"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    async with aclient(remote) as c:
        r = await c.responses.create(model="bear", instructions="Be brief.", max_output_tokens=3,
                                     input=[{"role": "user", "content": "Explain KV caching."}])
    assert len(r.output_text.split()) == 3


async def test_streamed_events_in_order_and_whole(remote) -> None:
    async with aclient(remote) as c:
        stream = await c.responses.create(model="bear", input="Explain KV caching.", max_output_tokens=5, stream=True)
        events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text and len(deltas.split()) == 5 and final.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_named_tool_comes_back_as_a_function_call_item(remote, stream: bool) -> None:
    kw = {"model": SIM_MODEL, "input": "What is the weather in Paris?", "tools": [TOOL],
          "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 100}
    async with aclient(remote) as c:
        if stream:
            events = [e async for e in await c.responses.create(stream=True, **kw)]
            r = events[-1].response
            done = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "lorem"}
        else:
            r = await c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "lorem"}
    assert calls[0].call_id and r.status == "completed"


async def test_structured_output_with_a_json_schema(remote) -> None:
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    async with aclient(remote) as c:
        r = await c.responses.create(model=SIM_MODEL, input="The weather in Paris?", text=fmt, max_output_tokens=300)
    jsonschema.validate(json.loads(r.output_text), WEATHER)


async def test_what_a_stateless_gateway_cannot_serve_is_a_coded_400(remote) -> None:
    async with aclient(remote) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(model="bear", input="hi", previous_response_id="resp_123")
        assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(model="bear", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://x/y.png"}]}])
        assert e.value.body["param"] == "input[0].content[0]"
        with pytest.raises(openai.NotFoundError):
            await c.responses.create(model="no-such-model", input="hi")


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"), ({"input": "x", "nonsense": 1}, "nonsense"), ({"input": "x", "background": True},
                                                                           "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role")])
def test_bad_requests_name_their_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        to_chat(json.dumps({"model": "m", **body}).encode())
    assert e.value.status == 400 and e.value.param == param
