"""The official ``openai`` package through gateway → router → sim engines: sync and async clients,
streaming and not, chat and completions, ``models.list()``, BEAR's decision in the headers,
per-request targets, model restriction, sampling pass-through, client disconnects and the error
mapping (400, 401, 404, 413, 429 with Retry-After, 503, 504)."""

from __future__ import annotations

import aiohttp
import httpx
import openai
import pytest

from bear.gateway.openai_types import Defaults
from bear.gateway.server import GatewayConfig
from bear.router.service import RouterConfig

from gateway_helpers import KEY, RECORDER_MODEL, ThreadedPool
from waiting import wait_until, wait_until_sync

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain KV caching."}]
SERVED = {"Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"}


def aclient(pool, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pool.base_url, api_key=key, max_retries=0, timeout=30)


def sclient(pool, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.base_url, api_key=key, max_retries=0, timeout=30)


# ---------------------------------------------------------------- the four ways of asking
async def test_async_chat_non_streaming_with_decision_headers(remote) -> None:
    async with aclient(remote) as c:
        raw = await c.chat.completions.with_raw_response.create(model="bear", messages=CHAT, max_tokens=5)
    r = raw.parse()
    assert r.object == "chat.completion" and r.model in SERVED and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].message.content.split()) == 5
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    h = raw.headers
    assert h["x-bear-instance"] in remote.sims and h["x-bear-model"] == r.model
    assert h["x-bear-ttft-method"] == "router-eq8" and float(h["x-bear-predicted-ttft-ms"]) > 0
    assert float(h["x-bear-ttft-ms"]) > 0 and h["x-bear-on-time"] in ("true", "false")
    assert h["x-bear-policy"] == "bear" and h["x-bear-attempt"] == "1"
    assert r.id == "chatcmpl-" + h["x-bear-query-id"]
    bear = r.model_extra["bear"]  # BEAR's decision and what came of it, also in the body
    assert bear["instance"] == h["x-bear-instance"] and bear["target_s"] == 1.0 and bear["ttft_s"] > 0
    rec = next(x for x in remote.records() if x["query_id"] == h["x-bear-query-id"])
    assert rec["status"] == "done" and rec["instance"] == h["x-bear-instance"]


async def test_async_chat_streaming_with_usage(remote) -> None:
    async with aclient(remote) as c:
        stream = await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 6
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(ch.usage is None for ch in chunks[:-1])
    assert finals[0].model_extra["bear"]["instance"] in remote.sims


async def test_async_completions_both_ways(remote) -> None:
    async with aclient(remote) as c:
        r = await c.completions.create(model="bear", prompt="Once upon a time", max_tokens=4)
        assert r.object == "text_completion" and len(r.choices[0].text.split()) == 4 and r.usage.completion_tokens == 4
        d = await c.completions.create(model="bear", prompt="Once upon a time")  # OpenAI's default length: 16
        assert d.usage.completion_tokens == 16
        stream = await c.completions.create(model="bear", prompt=["Once"], max_tokens=3, stream=True)
        chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in chunks).split() == r.choices[0].text.split()[:3]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_sync_client_chat_completions_and_models(remote) -> None:
    with sclient(remote) as c:
        chat = c.chat.completions.create(model="bear", messages=CHAT, max_tokens=3)
        streamed = c.chat.completions.create(model="bear", messages=CHAT, max_tokens=3, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
        comp = c.completions.create(model="Qwen/Qwen3-8B", prompt="hi", max_tokens=2)
        comp_stream = list(c.completions.create(model="bear", prompt="hi", max_tokens=2, stream=True))
        models = c.models.list()
        one = c.models.retrieve("Qwen/Qwen3-8B")
        alias = c.models.retrieve("bear")
    assert len(chat.choices[0].message.content.split()) == 3 and len(text.split()) == 3
    assert comp.model == "Qwen/Qwen3-8B" and len(comp_stream) == 3  # two tokens, then finish_reason
    ids = [m.id for m in models.data]
    assert ids[0] == "bear" and set(ids[1:]) == SERVED | {RECORDER_MODEL} and len(ids) == 4
    assert models.data[0].model_extra["bear"]["routing_alias"] is True
    assert one.id == "Qwen/Qwen3-8B" and one.model_extra["bear"]["instances"] == ["sim-big"]
    assert set(alias.model_extra["bear"]["instances"]) == {"sim-small", "sim-big", "recorder"}


# ---------------------------------------------------------------- what BEAR is told and tells
async def test_naming_a_model_restricts_the_candidates(remote) -> None:
    async with aclient(remote) as c:
        for name in ("Qwen/Qwen3-8B", "Qwen3-8B"):  # served name or the predictor's name
            raw = await c.chat.completions.with_raw_response.create(model=name, messages=CHAT, max_tokens=1)
            assert raw.headers["x-bear-instance"] == "sim-big" and raw.parse().model == "Qwen/Qwen3-8B"
        with pytest.raises(openai.NotFoundError) as e:
            await c.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=1)
        assert "no-such-model" in e.value.message and e.value.body["code"] == "model_not_found"  # OpenAI's code
        assert e.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("no-such-model")


async def test_targets_per_request_header_then_body(remote) -> None:
    async with aclient(remote) as c:
        r = await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=1,
                                            extra_headers={"x-slo-ttft-ms": "250", "x-bear-lambda": "0.002"})
        assert r.model_extra["bear"]["target_s"] == pytest.approx(0.25)
        rec = next(x for x in remote.records() if x["query_id"] == r.id.removeprefix("chatcmpl-"))
        assert rec["lam"] == pytest.approx(0.002) and rec["target_s"] == pytest.approx(0.25)
        r = await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=1,
                                            extra_headers={"x-slo-ttft-ms": "250"},
                                            extra_body={"bear": {"ttft_ms": 400, "lambda": 0}})
        assert r.model_extra["bear"]["target_s"] == pytest.approx(0.4)
        for bad in ({"x-slo-ttft-ms": "soon"}, {"x-slo-ttft-ms": "0"}, {"x-bear-lambda": "-1"}):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=1, extra_headers=bad)
            assert e.value.body["param"] in bad


async def test_a_list_of_prompts_is_a_query_each_merged_as_vllm_answers(remote) -> None:
    """Three prompts: three choices (index = the prompt's), the usage summed, a decision per prompt;
    streamed, every index finishes; token ids reach the engine as ids; prompt logprobs go unstreamed."""
    prompts = ["one two", "three four five", "six"]
    async with aclient(remote) as c:
        r = await c.completions.create(model="bear", prompt=prompts, max_tokens=3)
        assert [ch.index for ch in r.choices] == [0, 1, 2] and all(ch.finish_reason for ch in r.choices)
        assert all(ch.text for ch in r.choices)
        decisions = r.model_extra["bear"]["prompts"]
        assert len(decisions) == 3 and all(d["instance"] for d in decisions)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.completion_tokens == sum(d["ttft_s"] is not None for d in decisions) * 3
        finished: dict[int, str] = {}
        texts: dict[int, str] = {}
        async for chunk in await c.completions.create(model="bear", prompt=prompts, max_tokens=3, stream=True,
                                                      stream_options={"include_usage": True}):
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
                if ch.finish_reason:
                    assert ch.index not in finished
                    finished[ch.index] = ch.finish_reason
        assert sorted(finished) == [0, 1, 2] and all(texts.values())
        before = len(remote.recorder.requests)
        one = await c.completions.create(model=RECORDER_MODEL, prompt=[5, 6, 7], max_tokens=2)
        assert one.choices[0].text == "a b" and remote.recorder.requests[before][0]["prompt"] == [5, 6, 7]
        assert one.model_extra["bear"]["instance"] == "recorder"  # one prompt: its decision as for a string
        two = await c.completions.create(model=RECORDER_MODEL, prompt=[[1, 2], [3]], max_tokens=2)
        assert [ch.index for ch in two.choices] == [0, 1] and [ch.text for ch in two.choices] == ["a b", "a b"]
        sent = sorted(b["prompt"] for b, _ in remote.recorder.requests[before + 1:])
        assert sent == [[1, 2], [3]] and two.usage.prompt_tokens == 10  # the recorder's 5 each
        scored = await c.completions.create(model=RECORDER_MODEL, prompt="a b", max_tokens=2, echo=True, logprobs=1)
        body, _ = remote.recorder.requests[-1]
        assert body["stream"] is False and body["echo"] is True and "stream_options" not in body
        ch = scored.choices[0]
        assert ch.model_extra["prompt_logprobs"] == [None, {"7": {"logprob": -1.5}}]
        assert ch.logprobs.token_logprobs == [-0.5, -0.25] and ch.finish_reason == "length"
        assert scored.usage.prompt_tokens == 2
        with pytest.raises(openai.BadRequestError) as e:  # a chat request's prompt logprobs: refused
            await c.chat.completions.create(model=RECORDER_MODEL, messages=CHAT, extra_body={"prompt_logprobs": 1})
        assert "prompt logprobs" in e.value.message


async def test_sampling_fields_and_trace_context_reach_the_engine(remote) -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with aclient(remote) as c:
        r = await c.chat.completions.create(
            model=RECORDER_MODEL, messages=[{"role": "developer", "content": "x"},
                                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
            max_completion_tokens=7, temperature=0.3, top_p=0.9, seed=7, stop=["\n\n"], presence_penalty=0.5,
            frequency_penalty=-0.5, logit_bias={"42": -100}, user="u1",
            extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True},
            extra_headers={"traceparent": tp})
    assert r.choices[0].message.content == "a b"
    body, headers = remote.recorder.requests[-1]
    assert body["messages"] == [{"role": "system", "content": "x"}, {"role": "user", "content": "a\nb"}]
    want = {"temperature": 0.3, "top_p": 0.9, "seed": 7, "stop": ["\n\n"], "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"42": -100.0}, "top_k": 5, "min_p": 0.05,
            "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True, "max_tokens": 7, "stream": True,
            "model": RECORDER_MODEL}
    assert {k: body[k] for k in want} == want and "user" not in body
    assert headers["traceparent"] == tp  # tracing off here: the client's context is passed on unchanged
    async with aclient(remote) as c:  # the engine refusing the request is the client's 400, not a 503
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model=RECORDER_MODEL, messages=CHAT, max_tokens=1, temperature=99.0)
        assert "temperature too high" in e.value.message
        r = await c.chat.completions.create(model=RECORDER_MODEL, messages=CHAT, max_tokens=1)  # not banned
        assert r.choices[0].message.content == "a b"


async def test_client_disconnect_cancels_the_generation(remote) -> None:
    async with aclient(remote) as c:
        stream = await c.chat.completions.create(model="Qwen/Qwen3-0.6B", messages=CHAT, max_tokens=20_000,
                                                 stream=True)
        k = 0
        async for _ in stream:
            k += 1
            if k == 3:
                break
        assert remote.live_requests() == 1
        aborted = sum(s.stats.aborted for s in remote.sims.values())
        await stream.close()  # the connection goes away mid-answer
    await wait_until(lambda: remote.live_requests() == 0, what="the engine to drop the request")
    assert sum(s.stats.aborted for s in remote.sims.values()) == aborted + 1  # cancelled, not run to its end


# ---------------------------------------------------------------- errors
async def test_errors_400_401_404(remote) -> None:
    async with aclient(remote, key="wrong-key-0123456789") as c:
        with pytest.raises(openai.AuthenticationError) as e:
            await c.chat.completions.create(model="bear", messages=CHAT)
        assert e.value.body["message"] == "invalid API key"
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()
    async with aclient(remote) as c:
        cases = [({"n": 0}, "n"), ({"n": 129}, "n"), ({"extra_body": {"priority": 1.5}}, "priority"),
                 ({"functions": [{"name": "f"}]}, "functions"),
                 ({"temperature": "hot"}, "temperature"), ({"extra_body": {"guided_json": {}}}, "guided_json"),
                 ({"max_tokens": 0}, "max_tokens"), ({"messages": []}, "messages"),
                 ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
                 ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                  "messages[0].content[0]"), ({"stream_options": {"include_usage": True}}, "stream_options")]
        for kw, param in cases:
            kw = {"model": "bear", "messages": CHAT, **kw}
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(**kw)
            assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="bear", prompt=[[1, 2, 3]])  # ids need their model named
        assert e.value.body["param"] == "model"
        for prompt, param in (([], "prompt"), ([["a"]], "prompt[0]"), (["a", 3], "prompt[1]"), ([1, -1], "prompt"),
                              ([[1], []], "prompt[1]"), (["x"] * 129, "prompt"),
                              (["a", [1, 2]], "prompt[1]"), ([[1, 2], "a"], "prompt[1]")):
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="bear", prompt=prompt)
            assert e.value.body["param"] == param, (prompt, e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="bear", prompt="x", best_of=2)
        assert e.value.body["param"] == "best_of"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        base = remote.base_url
        async with s.post(base + "/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(base + "/chat/completions", data=b"x" * (2 << 20)) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "too_large"
        async with s.get(base + "/no/such/path") as r:
            assert r.status == 404 and "error" in await r.json()
        async with s.get(base + "/chat/completions") as r:
            assert r.status == 405 and "error" in await r.json()
        async with s.post(base + "/chat/completions", json={"model": "bear", "messages": CHAT},
                          headers={"Authorization": "Basic abc"}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"


def test_errors_429_503_504(tmp_path) -> None:
    with ThreadedPool(tmp_path / "a", gateway_cfg=GatewayConfig(max_inflight=0)) as p, sclient(p) as c:
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model="bear", messages=CHAT)
        assert e.value.response.headers["retry-after"] == "1"
    with ThreadedPool(tmp_path / "b", router_cfg=RouterConfig(max_inflight=0)) as p, sclient(p) as c:
        with pytest.raises(openai.RateLimitError) as e:  # the router is full: also 429
            c.chat.completions.create(model="bear", messages=CHAT)
        assert e.value.body["code"] == "overloaded" and e.value.response.headers["retry-after"] == "1"
    with ThreadedPool(tmp_path / "c", profiles={}, recorder=False) as p, sclient(p) as c:
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="bear", messages=CHAT)
        assert e.value.status_code == 503 and "no healthy instance" in e.value.message
        assert c.models.list().data[0].id == "bear" and len(c.models.list().data) == 1
    cfg = GatewayConfig(accept_timeout_s=0.2, defaults=Defaults())
    with ThreadedPool(tmp_path / "d", gateway_cfg=cfg, router=False) as p, sclient(p) as c:
        with pytest.raises(openai.InternalServerError) as e:  # no router at all
            c.chat.completions.create(model="bear", messages=CHAT)
        assert e.value.status_code == 503 and "no router answered" in e.value.message
    cfg = GatewayConfig(request_timeout_s=0.5)
    with ThreadedPool(tmp_path / "e", gateway_cfg=cfg) as p, sclient(p) as c:
        big = p.sims["sim-big"]
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="Qwen/Qwen3-8B", messages=CHAT, max_tokens=20_000)
        assert e.value.status_code == 504
        # the timed-out generation is cancelled, not left running
        wait_until_sync(lambda: big.stats.aborted == 1, what="the abort")
        with pytest.raises(openai.APIError) as e:  # timing out mid-stream: an error event, then the end
            for _ in c.chat.completions.create(model="Qwen/Qwen3-8B", messages=CHAT, max_tokens=20_000, stream=True):
                pass
        assert "no complete answer" in e.value.message
        wait_until_sync(lambda: big.stats.aborted == 2 and p.live_requests() == 0, what="the second abort")


async def test_health_and_metrics(remote) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(remote.base_url.removesuffix("/v1") + "/health") as r:
            h = await r.json()
            assert r.status == 200 and h["status"] == "ok" and h["healthy_instances"] == 3
        async with aclient(remote) as c:
            await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=1)
        async with s.get(remote.base_url.removesuffix("/v1") + "/metrics") as r:
            text = await r.text()
    assert r.status == 200
    assert 'bear_gateway_requests_total{endpoint="chat",status="200"}' in text
    assert "bear_gateway_ttfb_seconds_count" in text and "bear_gateway_overhead_seconds_count" in text


def test_nats_down_is_503_and_unhealthy(tmp_path) -> None:
    tp = ThreadedPool(tmp_path, gateway_cfg=GatewayConfig(accept_timeout_s=0.3))
    try:
        health = tp.pool.base_url.removesuffix("/v1") + "/health"
        assert httpx.get(health).status_code == 200
        tp.nats.stop()
        wait_until_sync(lambda: httpx.get(health).status_code == 503, what="/health 503")
        with sclient(tp.pool) as c, pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="bear", messages=CHAT, max_tokens=1)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        tp.nats.start()  # back: the gateway reconnects and answers again
        wait_until_sync(lambda: httpx.get(health).status_code == 200, what="/health 200 again")
        with sclient(tp.pool) as c:
            r = c.chat.completions.create(model="bear", messages=CHAT, max_tokens=1)
        assert r.usage.completion_tokens == 1
    finally:
        tp.close()
