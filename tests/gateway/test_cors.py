"""Browsers' cross-origin calls (bear.gateway.cors): a preflight with the headers a browser sends
succeeds from an allowed origin and is refused from another, the actual request's answer (an
error, a JSON body, an SSE stream) carries the headers a page needs to read it, and with no
origins configured nothing of CORS is sent at all."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from bear.gateway.cors import CorsPolicy
from bear.gateway.openai_types import Defaults
from bear.gateway.server import GatewayConfig

from gateway_helpers import KEY, make_pool, stop_pool
from waiting import HANG_S

APP = "https://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type",
             "Sec-Fetch-Mode": "cors", "Referer": APP + "/chat", "User-Agent": "Mozilla/5.0"}  # what Chrome sends
BODY = {"model": "bear", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _pool_with(cors: CorsPolicy) -> Any:
    @pytest.fixture
    async def pool(nats_server, tmp_path):
        p = await make_pool(nats_server.url, tmp_path, recorder=False,
                            gateway_cfg=GatewayConfig(defaults=Defaults(ttft_s=1.0), cors=cors))
        yield p
        await stop_pool(p)
    return pool


pool_one = _pool_with(CorsPolicy.of([APP]))
pool_any = _pool_with(CorsPolicy.of(["*"]))
pool_off = _pool_with(CorsPolicy())
pool_strict = _pool_with(CorsPolicy.of([APP], methods=["POST"], headers=["authorization"], credentials=True))


async def _options(p: Any, origin: str, headers: dict[str, str] = PREFLIGHT) -> aiohttp.ClientResponse:
    async with aiohttp.ClientSession() as s:
        async with s.options(p.base_url + "/chat/completions", headers={"Origin": origin, **headers},
                             timeout=aiohttp.ClientTimeout(total=HANG_S)) as resp:
            await resp.read()
            return resp


async def _post(p: Any, origin: str, key: str = KEY, **extra: Any) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(p.base_url + "/chat/completions", json={**BODY, **extra},
                          headers={"Origin": origin, "Authorization": f"Bearer {key}"},
                          timeout=aiohttp.ClientTimeout(total=HANG_S)) as resp:
            return resp, await resp.read()


async def test_a_preflight_from_the_allowed_origin_succeeds_without_a_key(pool_one) -> None:
    resp = await _options(pool_one, APP)
    assert resp.status == 200
    h = resp.headers
    assert h["Access-Control-Allow-Origin"] == APP and "Origin" in h["Vary"]
    assert "POST" in h["Access-Control-Allow-Methods"]
    assert set(h["Access-Control-Allow-Headers"].replace(" ", "").split(",")) == {"authorization", "content-type"}
    assert int(h["Access-Control-Max-Age"]) > 0 and "Access-Control-Allow-Credentials" not in h


async def test_a_preflight_from_another_origin_is_refused(pool_one) -> None:
    resp = await _options(pool_one, "https://evil.example")
    assert resp.status == 400 and "Access-Control-Allow-Origin" not in resp.headers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_answer_to_an_allowed_origin_can_be_read_by_its_page(pool_one, stream: bool) -> None:
    resp, body = await _post(pool_one, APP, stream=stream)
    assert resp.status == 200, body
    assert resp.headers["Access-Control-Allow-Origin"] == APP
    exposed = {x.strip() for x in resp.headers["Access-Control-Expose-Headers"].split(",")}
    assert {"x-request-id", "x-bear-instance"} <= exposed
    resp, body = await _post(pool_one, APP, key="wrong")  # the error a page must be able to read
    assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == APP
    resp, _ = await _post(pool_one, "https://evil.example")  # served (the key decides), unreadable to that page
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_any_origin_gets_the_wildcard(pool_any) -> None:
    resp = await _options(pool_any, "https://anything.example")
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"
    resp, _ = await _post(pool_any, "https://anything.example")
    assert resp.headers["Access-Control-Allow-Origin"] == "*"


async def test_methods_headers_and_credentials_as_configured(pool_strict) -> None:
    resp = await _options(pool_strict, APP, {"Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "Authorization, Content-Type"})
    assert resp.status == 200  # content-type is a header browsers may always send
    assert resp.headers["Access-Control-Allow-Credentials"] == "true" and resp.headers["Access-Control-Allow-Origin"] == APP
    assert (await _options(pool_strict, APP, {"Access-Control-Request-Method": "DELETE"})).status == 400
    assert (await _options(pool_strict, APP, {"Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "x-custom"})).status == 400


async def test_off_by_default_nothing_of_cors_is_sent(pool_off) -> None:
    resp = await _options(pool_off, APP)
    assert resp.status == 405 and not any(k.lower().startswith("access-control") for k in resp.headers)
    resp, _ = await _post(pool_off, APP)
    assert resp.status == 200 and not any(k.lower().startswith("access-control") for k in resp.headers)
