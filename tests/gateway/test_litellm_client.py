"""LiteLLM through the gateway (issue 27), with both of its providers that reach an OpenAI-style
server — ``openai/`` and ``hosted_vllm/``: answers, streaming, and a context overflow raised as
LiteLLM's ``ContextWindowExceededError`` (what its context-window fallbacks act on)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
import litellm

from gateway_helpers import KEY

CHAT = [{"role": "user", "content": "Explain KV caching."}]
PROVIDERS = ["openai", "hosted_vllm"]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_litellm_answers_and_streams(remote, provider: str) -> None:
    kw = {"model": f"{provider}/bear", "api_base": remote.base_url, "api_key": KEY, "messages": CHAT}
    r = await litellm.acompletion(max_tokens=4, **kw)
    assert len(r.choices[0].message.content.split()) == 4 and r.usage.completion_tokens == 4
    stream = await litellm.acompletion(max_tokens=3, stream=True, **kw)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
    assert len(text.split()) == 3


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_litellm_context_overflow_is_context_window_exceeded(remote, provider: str) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(model=f"{provider}/bear", api_base=remote.base_url, api_key=KEY, messages=CHAT,
                                  max_tokens=100_000, num_retries=0)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_litellm_tool_calls_and_n(remote, provider: str) -> None:
    """An agent's call through LiteLLM: a named tool's call parsed into LiteLLM's objects (streamed
    and not), and n choices."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    kw = {"model": f"{provider}/Qwen/Qwen3-0.6B", "api_base": remote.base_url, "api_key": KEY, "messages": CHAT,
          "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 100}
    r = await litellm.acompletion(**kw)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "lorem"}
    args = ""
    async for ch in await litellm.acompletion(stream=True, **kw):
        for tc in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            args += tc.function.arguments or ""
    assert json.loads(args) == {"city": "lorem"}
    r = await litellm.acompletion(model=f"{provider}/Qwen/Qwen3-0.6B", api_base=remote.base_url, api_key=KEY,
                                  messages=CHAT, n=2, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_litellm_prompt_overflow_is_context_window_exceeded(remote, provider: str) -> None:
    """A prompt beyond the engine's context alone (no max_tokens): the engine refuses it, and the
    gateway words it as vLLM does, so that LiteLLM's matcher recognises the overflow."""
    long = [{"role": "user", "content": "word " * 60_000}]  # > 40,960 tokens however counted
    with pytest.raises(litellm.ContextWindowExceededError) as e:
        await litellm.acompletion(model=f"{provider}/Qwen/Qwen3-0.6B", api_base=remote.base_url, api_key=KEY,
                                  messages=long, max_tokens=1, num_retries=0)
    assert "maximum context length" in str(e.value)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_litellm_unknown_model_is_not_found(remote, provider: str) -> None:
    with pytest.raises(litellm.NotFoundError):
        await litellm.acompletion(model=f"{provider}/no-such-model", api_base=remote.base_url, api_key=KEY,
                                  messages=CHAT, max_tokens=1, num_retries=0)
