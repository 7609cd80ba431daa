"""Bad input never crashes the gateway and always gets a coded HTTP error: a fuzz over the OpenAPI
shapes of the two endpoints (every field valid, wrongly typed or random JSON, unknown fields,
missing required ones, non-object bodies, malformed bytes), then huge bodies, slow-loris bodies
and oversized headers on a raw socket. Every answer comes (the clients' timeouts only bound a
hang); how long each took is printed, not asserted: the gateway's own timeouts are what bound it,
and the test checks their effect (408 while a body still trickles in, 504 past the request
timeout)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterable

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bear.gateway.openai_types import ChatRequest, CompletionRequest, Defaults
from bear.gateway.server import GatewayConfig

from gateway_helpers import KEY, ThreadedPool
from waiting import HANG_S

BODY_TIMEOUT_S = 0.5
TOOK: list[float] = []  # seconds to each fuzzed answer (printed by test_gateway_survives_and_still_answers)
OK = {200, 400, 404, 413, 504}  # 504: a valid request asking for more tokens than the request timeout allows

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
tokens = st.integers(1, 6) | st.integers(-3, 0) | st.integers(1, 10**7)
number = st.floats(-5, 5, allow_nan=False) | st.floats(allow_nan=False, allow_infinity=False) | st.integers(-3, 3)
texts = st.text(max_size=40)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", ""]), "text": texts})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "", "x"])},
    optional={"content": texts | st.lists(part, max_size=3) | json_values, "name": texts | json_values,
              "tool_calls": json_values, "tool_call_id": json_values, "refusal": json_values})
VALID = {  # a plausible value of each field (which may still be refused: n=2, tools …)
    "model": st.sampled_from(["bear", "Qwen/Qwen3-0.6B", "Qwen3-8B", "no-such-model", ""]),
    "messages": st.lists(message, max_size=4),
    "prompt": texts | st.lists(texts, max_size=2) | st.lists(st.integers(0, 100), max_size=4),
    "max_tokens": tokens, "max_completion_tokens": tokens,
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "temperature": number, "top_p": number, "top_k": st.integers(-3, 50), "min_p": number,
    "presence_penalty": number, "frequency_penalty": number, "repetition_penalty": number,
    "seed": st.integers(-(2**64), 2**64), "stop": texts | st.lists(texts, max_size=20),
    "stop_token_ids": st.lists(st.integers(-2, 10), max_size=3), "min_tokens": st.integers(-1, 4),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "42", "x", "-1"]), number, max_size=3),
    "ignore_eos": st.booleans(), "n": st.integers(0, 3), "logprobs": st.booleans() | st.integers(0, 5),
    "user": texts, "bear": st.fixed_dictionaries({}, optional={"ttft_ms": number, "lambda": number}),
    "tools": st.lists(json_values, max_size=2), "tool_choice": st.sampled_from(["none", "auto"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "service_tier": st.sampled_from(["auto", "default", "flex"]), "echo": st.booleans(), "best_of": st.integers(0, 3),
}


STRICT = {  # values the gateway accepts: the valid bodies the mutations start from
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": texts | st.lists(texts, max_size=4), "max_tokens": st.integers(1, 6), "user": texts,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "42"]), st.floats(-100, 100), max_size=2),
    "min_tokens": st.integers(0, 2), "ignore_eos": st.booleans(), "n": st.just(1), "logprobs": st.just(False),
    "bear": st.fixed_dictionaries({}, optional={"ttft_ms": st.floats(1, 5000), "lambda": st.floats(0, 0.01)}),
}
good_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                      "content": texts | st.lists(st.fixed_dictionaries(
                                          {"type": st.just("text"), "text": texts}), min_size=1, max_size=2)})


def body_for(fields: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    chat = "messages" in fields
    required = {"model": st.sampled_from(["bear", "Qwen/Qwen3-0.6B"]),
                **({"messages": st.lists(good_message, min_size=1, max_size=3)} if chat else {"prompt": texts})}
    valid = st.builds(lambda req, opt, stream: {**req, **opt, **stream},
                      st.fixed_dictionaries(required),
                      st.fixed_dictionaries({}, optional={f: v for f, v in STRICT.items() if f in fields}),
                      st.sampled_from([{}, {"stream": False}, {"stream": True},
                                       {"stream": True, "stream_options": {"include_usage": True}}]))
    known = st.fixed_dictionaries({}, optional={f: VALID.get(f, json_values) | json_values for f in fields})
    mutated = st.builds(lambda d, f, v: {**d, f: v}, valid, st.sampled_from(fields), VALID["model"] | json_values)
    unknown = st.builds(lambda d, k, v: {**d, k: v}, valid, st.text(max_size=10), json_values)
    dropped = st.builds(lambda d, f: {k: v for k, v in d.items() if k != f}, valid, st.sampled_from(sorted(required)))
    objects = st.one_of(valid, valid, mutated, unknown, dropped, known)

    def encode(o: object) -> bytes:
        return json.dumps(o).encode()

    return st.one_of(objects.map(encode), objects.map(encode), json_values.map(encode), st.binary(max_size=64),
                     objects.map(encode).flatmap(lambda b: st.integers(0, len(b)).map(lambda k: b[:k])))


@pytest.fixture(scope="module")
def fuzz_pool(tmp_path_factory):
    cfg = GatewayConfig(request_timeout_s=2.0, body_timeout_s=BODY_TIMEOUT_S, max_body_bytes=64 * 1024,
                        defaults=Defaults(max_tokens=4))
    tp = ThreadedPool(tmp_path_factory.mktemp("fuzz"), gateway_cfg=cfg, profiles={"sim-small": "qwen3-0.6b-h100"})
    with httpx.Client(base_url=tp.pool.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=HANG_S) as c:
        yield tp.pool, c
    tp.close()


def check(resp: httpx.Response, took: float) -> None:
    TOOK.append(took)
    assert resp.status_code in OK, (resp.status_code, resp.text[:300])
    if resp.status_code != 200:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["code"], str)
        assert err["type"] in ("invalid_request_error", "timeout_error")
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in resp.text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        last = events[-1][6:]
        assert last == "[DONE]" or "error" in json.loads(last)
    else:
        d = resp.json()
        assert d["object"] in ("chat.completion", "text_completion") and len(d["choices"]) == 1


def post(c: httpx.Client, path: str, body: bytes) -> None:
    t = time.monotonic()
    resp = c.post(path, content=body, headers={"Content-Type": "application/json"})
    check(resp, time.monotonic() - t)


FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@FUZZ
@given(body=body_for(ChatRequest.__struct_fields__))
def test_fuzz_chat_completions(fuzz_pool, body: bytes) -> None:
    post(fuzz_pool[1], "/chat/completions", body)


@FUZZ
@given(body=body_for(CompletionRequest.__struct_fields__))
def test_fuzz_completions(fuzz_pool, body: bytes) -> None:
    post(fuzz_pool[1], "/completions", body)


def test_gateway_survives_and_still_answers(fuzz_pool) -> None:
    pool, c = fuzz_pool
    r = c.post("/chat/completions", json={"model": "bear", "messages": [{"role": "user", "content": "ok?"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert c.get(pool.base_url.removesuffix("/v1") + "/health").json()["status"] == "ok"
    assert not any(x["status"] == "internal" for x in pool.records())
    if TOOK:
        print(f"fuzz: {len(TOOK)} answers, slowest {max(TOOK):.2f} s, median {sorted(TOOK)[len(TOOK) // 2]:.3f} s")


# ---------------------------------------------------------------- raw-socket abuse
async def raw(pool, head: bytes, body_pieces: Iterable[bytes] = (), gap_s: float = 0.0) -> tuple[int, float, bool]:
    """Send a request head and body pieces (``gap_s`` apart); (status, seconds to the answer, whether
    the answer came while pieces were still to be sent)."""
    port = pool.gateway.cfg.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t = time.monotonic()
    writer.write(head)
    await writer.drain()

    async def trickle() -> None:
        for p in body_pieces:
            if gap_s:  # sleep: a slow client — the time between its body bytes is what is tested
                await asyncio.sleep(gap_s)
            writer.write(p)
            await writer.drain()

    task = asyncio.create_task(trickle())
    try:
        line = await asyncio.wait_for(reader.readline(), HANG_S)
        still_sending = not task.done()
    finally:
        task.cancel()
        writer.close()
    return int(line.split()[1]), time.monotonic() - t, still_sending


def head(extra: str) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


async def test_slow_loris_huge_and_oversized(fuzz_pool) -> None:
    pool, _ = fuzz_pool
    took = {}
    # a body that trickles in, a byte at a time and never all of it: 408 once the body timeout has
    # passed, though bytes keep coming (the timeout is on the whole body, not on a silence)
    status, took["trickle"], sending = await raw(pool, head("Content-Length: 60000\r\n"),
                                                 itertools.repeat(b"{"), gap_s=0.05)
    assert status == 408 and sending and took["trickle"] >= BODY_TIMEOUT_S
    status, took["chunked trickle"], sending = await raw(pool, head("Transfer-Encoding: chunked\r\n"),
                                                         itertools.repeat(b"1\r\n{\r\n"), gap_s=0.05)
    assert status == 408 and sending and took["chunked trickle"] >= BODY_TIMEOUT_S
    # a body that never comes
    status, took["no body"], _ = await raw(pool, head("Content-Length: 10\r\n"))
    assert status == 408 and took["no body"] >= BODY_TIMEOUT_S
    # a huge declared body: refused before any of it is read (none is sent)
    status, took["huge declared"], _ = await raw(pool, head(f"Content-Length: {10**10}\r\n"))
    assert status == 413
    # a chunked body that grows past the limit (20 × 8 KiB > 64 KiB)
    chunk = b"%x\r\n" % 8192 + b"x" * 8192 + b"\r\n"
    status, took["chunked too large"], _ = await raw(pool, head("Transfer-Encoding: chunked\r\n"), [chunk] * 20)
    assert status == 413
    # a header line longer than aiohttp's limit: its own 400/431
    status, _, _ = await raw(pool, head("X-Long: " + "a" * 20000 + "\r\n"))
    assert status in (400, 431)
    # the gateway is still there
    status, _, _ = await raw(pool, head("Content-Length: 2\r\n") + b"{}")
    assert status == 400
    print("raw-socket answers (s):", {k: round(v, 3) for k, v in took.items()})
