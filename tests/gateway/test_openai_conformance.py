"""What OpenAI's and vLLM's clients expect of the front beyond the basics (issue 27): a context
overflow is 400 ``context_length_exceeded`` (the SDK's BadRequestError), vLLM's
``continuous_usage_stats``, ``x-request-id`` on every response, ``refusal: null``, vLLM's model
card fields, ``/ping`` and ``/version``, the OpenAPI document, 405 with ``Allow``, and OpenAI
error objects for what aiohttp's HTTP parser or the body's encoding rejects."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import msgspec
import openai
import pytest

from bear.gateway.openai_types import ChatRequest, CompletionRequest

from gateway_helpers import KEY, RECORDER_MAX_MODEL_LEN, RECORDER_MODEL

CHAT = [{"role": "user", "content": "Explain KV caching."}]
AUTH = {"Authorization": f"Bearer {KEY}"}


def aclient(pool) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pool.base_url, api_key=KEY, max_retries=0, timeout=30)


async def test_context_overflow_is_a_bad_request_named_context_length_exceeded(remote) -> None:
    async with aclient(remote) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=100_000)
        assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
        assert e.value.body["param"] == "messages" and "maximum context length" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="bear", prompt="hi", max_tokens=100_000, stream=True)
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"


async def test_continuous_usage_stats_on_every_chunk(remote) -> None:
    async with aclient(remote) as c:
        stream = await c.chat.completions.create(
            model="bear", messages=CHAT, max_tokens=5, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
        chunks = [ch async for ch in stream]
        plain = await c.chat.completions.create(model="bear", messages=CHAT, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True})
        plain_chunks = [ch async for ch in plain]
    assert all(ch.usage is not None for ch in chunks)
    done = [ch.usage.completion_tokens for ch in chunks]
    assert done == sorted(done) and done[-1] == 5 and chunks[-1].choices == []
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)
    assert all(ch.usage.prompt_tokens > 0 for ch in chunks)
    assert [ch.usage is None for ch in plain_chunks] == [True] * (len(plain_chunks) - 1) + [False]


async def test_request_id_on_every_response(remote) -> None:
    base = remote.base_url
    async with aiohttp.ClientSession(headers=AUTH) as s:
        body = {"model": "bear", "messages": CHAT, "max_tokens": 2}
        async with s.post(base + "/chat/completions", json=body, headers={"x-request-id": "client-id-1"}) as r:
            assert r.status == 200 and r.headers["x-request-id"] == "client-id-1"
        async with s.post(base + "/chat/completions", json={**body, "stream": True},
                          headers={"x-request-id": "client-id-2"}) as r:
            assert r.headers["x-request-id"] == "client-id-2"
            await r.read()
        async with s.post(base + "/chat/completions", json=body) as r:
            made = r.headers["x-request-id"]
            assert len(made) == 32 and int(made, 16) >= 0
        async with s.post(base + "/chat/completions", json=body, headers={"x-request-id": "has a space"}) as r:
            assert r.headers["x-request-id"] != "has a space" and len(r.headers["x-request-id"]) == 32
        for path, kw in (("/no/such/path", {}), ("/chat/completions", {"headers": {"Authorization": "Bearer x"}})):
            async with s.get(base + path, **kw) as r:  # type: ignore[arg-type]
                assert r.status >= 400 and r.headers["x-request-id"]


async def test_chat_message_has_refusal_null(remote) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as s, \
            s.post(remote.base_url + "/chat/completions", json={"model": "bear", "messages": CHAT, "max_tokens": 2}) as r:
        msg = (await r.json())["choices"][0]["message"]
    assert "refusal" in msg and msg["refusal"] is None and msg["role"] == "assistant"


async def test_model_cards_carry_vllm_fields(remote) -> None:
    async with aclient(remote) as c:
        models = (await c.models.list()).data
    by_id = {m.id: m.model_extra for m in models}
    sims = {s.model_name: s.max_model_len for s in remote.sims.values()}
    for name, mml in sims.items():
        assert by_id[name]["root"] == name and by_id[name]["parent"] is None and by_id[name]["max_model_len"] == mml
    assert by_id["bear"]["max_model_len"] == max(sims.values())


async def test_ping_version_and_openapi_need_no_key(remote) -> None:
    root = remote.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            async with s.request(method, root + "/ping") as r:
                assert r.status == 200 and await r.json() == {}
        async with s.get(root + "/version") as r:
            assert r.status == 200 and isinstance((await r.json())["version"], str)
        async with s.get(root + "/openapi.json") as r:
            doc = await r.json()
    assert doc["openapi"].startswith("3.") and {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    # the document is made from the types that decode the bodies: every accepted field is in it
    for kind in (ChatRequest, CompletionRequest):
        assert set(schemas[kind.__name__]["properties"]) == {f.encode_name for f in msgspec.structs.fields(kind)}
    assert "continuous_usage_stats" in schemas["StreamOptions"]["properties"]


async def test_405_names_the_allowed_methods(remote) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as s, s.get(remote.base_url + "/chat/completions") as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]
        assert (await r.json())["error"]["code"] == "method_not_allowed"


async def test_a_body_that_is_not_its_encoding_is_a_400(remote) -> None:
    not_gzip = b"not gzip at all"
    status, body = await _raw_http(remote.gateway.cfg.port, (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
        b"\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(not_gzip)
        + not_gzip))  # the connection closes after the error (the answer is read to its end)
    err = json.loads(body)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and "gzip" in err["message"]
    raw = b'{"model": "bear", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}'
    async with aiohttp.ClientSession(headers=AUTH) as s, s.post(
            remote.base_url + "/chat/completions", data=gzip.compress(raw),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()


async def _raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 30)  # the server closes after an error
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
], ids=["header-folding", "content-length-and-chunked", "20k-header"])
async def test_what_the_http_parser_rejects_is_an_openai_error(remote, request_bytes: bytes) -> None:
    status, body = await _raw_http(remote.gateway.cfg.port, request_bytes)
    assert 400 <= status < 500
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("malformed HTTP request")


async def test_chat_without_max_tokens_gets_the_rest_of_the_context(remote) -> None:
    """As vLLM and OpenAI: no cap of the client's is no cap of BEAR's (it was 256, cutting long
    answers silently); the engine gets no max_tokens and applies its own rest of the context."""
    async with aclient(remote) as c:
        raw = await c.chat.completions.with_raw_response.create(model=RECORDER_MODEL, messages=CHAT)
    body, _ = remote.recorder.requests[-1]
    assert "max_tokens" not in body and "max_completion_tokens" not in body
    qid = raw.headers["x-bear-query-id"]
    rec = next(x for x in remote.records() if x["query_id"] == qid)
    assert rec["max_tokens_rest"] is True
    assert rec["max_tokens"] == RECORDER_MAX_MODEL_LEN - rec["instance_prompt_tokens"] > 0


async def test_tokenize_and_detokenize_are_the_engines_ids(remote, tmp_path) -> None:
    """vLLM's /tokenize: the ids the routed request gets (the instance's registered tokenizer,
    chat through its template), equal to encoding them here; /detokenize inverts them."""
    from bear.tokenizer.bundle import from_model_dir
    from bear.tokenizer.cache import load
    from bear.vllm_instance.tiny_model import write_tokenizer

    (tmp_path / "tok").mkdir()
    write_tokenizer(tmp_path / "tok")
    here = load(from_model_dir(tmp_path / "tok"))
    root = remote.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.post(root + "/tokenize", json={"model": RECORDER_MODEL, "prompt": "hello world"}) as r:
            got = await r.json()
            assert r.status == 200, got
        assert got["tokens"] == here.encode("hello world", None) and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == RECORDER_MAX_MODEL_LEN and got["token_strs"] is None
        async with s.post(root + "/tokenize", json={"model": RECORDER_MODEL, "messages": CHAT,
                                                    "return_token_strs": True}) as r:
            chat = await r.json()
        assert chat["tokens"] == here.encode(None, CHAT) and len(chat["token_strs"]) == chat["count"]
        async with s.post(root + "/detokenize", json={"model": RECORDER_MODEL, "tokens": got["tokens"]}) as r:
            assert r.status == 200 and "hello world" in (await r.json())["prompt"]
        # the sim engines registered no tokenizer; an unknown model; a body with neither input
        for body, status in (({"model": "Qwen/Qwen3-8B", "prompt": "x"}, 404), ({"model": "nope", "prompt": "x"}, 404),
                             ({"model": RECORDER_MODEL}, 400),
                             ({"model": RECORDER_MODEL, "prompt": "x", "add_special_tokens": False}, 400)):
            async with s.post(root + "/tokenize", json=body) as r:
                assert r.status == status and (await r.json())["error"]["message"], body
        async with s.post(root + "/detokenize", json={"model": RECORDER_MODEL, "tokens": [10**9]}) as r:
            assert r.status == 400
    async with aiohttp.ClientSession() as s, s.post(root + "/tokenize", json={"prompt": "x"}) as r:
        assert r.status == 401  # the pool's tokenizer is behind the API key, as /v1 is


async def test_docs_page_renders_from_its_own_origin_only(remote) -> None:
    """``/docs`` (no key): one HTML page that loads nothing from anywhere else — every src and
    href relative, its script fetching only ``openapi.json`` — and a CSP that allows only its own
    origin, so it renders offline and behind a firewall."""
    from html.parser import HTMLParser

    root = remote.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession() as s, s.get(root + "/docs") as r:
        assert r.status == 200 and r.content_type == "text/html"
        csp = r.headers["Content-Security-Policy"]
        page = await r.text()
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp

    class Refs(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.refs: list[str] = []
            self.scripts = 0

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.scripts += tag == "script"
            self.refs += [v or "" for k, v in attrs if k in ("src", "href")]

    p = Refs()
    p.feed(page)
    assert p.refs == ["openapi.json"] and p.scripts == 1  # the inline script; no external one
    assert "://" not in page and 'fetch("openapi.json")' in page
