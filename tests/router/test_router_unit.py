"""Router in-process: submit validation, SSE parsing, dedup through JetStream KV, fallbacks when
predictor and estimator are absent, rerouting when an instance is unreachable, exactly one
terminal message per query."""

from __future__ import annotations

import asyncio
import json
import math

import msgspec
import nats
import pytest
from aiohttp import web

from bear.client.submit import submit
from bear.instance.record import instance_record
from bear.protocol.codec import pack
from bear.protocol.errors import BearError
from bear.protocol.messages import encode
from bear.protocol.subjects import Subjects
from bear.router.dedup import Deduplicator
from bear.router.dispatch import parse_chunk
from bear.router.observations import HISTORY, RATE_WINDOW_S, Observations
from bear.router.query import parse_submit
from bear.router.service import RouterConfig, RouterService
from bear.runtime.kv import ensure_kv
from bear.runtime.nats_server import free_port

from waiting import wait_until

S = Subjects()


def test_the_query_prompt_length_is_declared_else_the_text_estimate() -> None:
    """Query.token_estimate, the query's one prompt length before any tokenizer (docs/contract.md,
    "Prompt length at each stage"): the client's count when declared, else UTF-8 bytes / 4."""
    cfg = RouterConfig()
    sub = {"v": "bear.submit/1", "query_id": "a", "ttft_target_s": 0.3}
    assert parse_submit(pack({**sub, "prompt": "x" * 9, "prompt_tokens": 1000}), cfg).token_estimate() == 1000
    assert parse_submit(pack({**sub, "prompt": "x" * 9}), cfg).token_estimate() == 3  # ⌈9 / 4⌉
    assert parse_submit(pack({**sub, "prompt": "é" * 6}), cfg).token_estimate() == 3  # 12 bytes, not 6 chars
    chat = parse_submit(pack({**sub, "messages": [{"role": "user", "content": "abcd"},
                                                  {"role": "assistant", "content": "efgh"}]}), cfg)
    assert chat.token_estimate() == 3  # "abcd\nefgh": the contents joined, 9 bytes


def test_parse_submit_validates() -> None:
    cfg = RouterConfig()
    q = parse_submit(pack({"v": "bear.submit/1", "query_id": "a", "prompt": "hi", "ttft_target_s": 0.3}), cfg)
    assert q.ttft_target_s == 0.3 and q.max_tokens == cfg.default_max_tokens and q.lam == cfg.lam
    assert q.token_estimate() == 1
    for bad in ({"query_id": "", "prompt": "x"}, {"query_id": "a"}, {"query_id": "a", "prompt": "x", "messages": []},
                {"query_id": "a", "prompt": "x", "ttft_target_s": -1}, {"query_id": "a", "prompt": 3},
                {"query_id": "a", "prompt": "x", "max_tokens": 0}, {"v": "other", "query_id": "a", "prompt": "x"}):
        with pytest.raises(BearError):
            parse_submit(pack(bad), cfg)
    with pytest.raises(BearError):
        parse_submit(b"\xc1", cfg)


def test_max_tokens_rest_is_the_rest_of_each_instance_context() -> None:
    cfg = RouterConfig()
    q = parse_submit(pack({"query_id": "a", "prompt": "hi", "max_tokens_rest": True}), cfg)
    assert q.rest_of_context and q.max_tokens_at(4096, 100) == 3996 and q.max_tokens_at(None, 100) is None
    assert q.max_tokens_at(50, 100) == 1  # a prompt that fills the context still asks one token
    capped = parse_submit(pack({"query_id": "b", "prompt": "hi", "max_tokens": 7}), cfg)
    assert not capped.rest_of_context and capped.max_tokens_at(4096, 100) == 7
    with pytest.raises(BearError) as e:
        parse_submit(pack({"query_id": "c", "prompt": "x", "max_tokens_rest": 1}), cfg)
    assert e.value.code == "bad_request"


@pytest.mark.parametrize(("ctx", "prompt", "exact", "at", "body"), [
    (2048, 100, True, 500, 500),  # the cap fits the rest: the cap, sent
    (2048, 1800, True, 248, 248),  # the rest is shorter: fitted, sent (vLLM would refuse 500)
    (2048, 1800, False, 248, None),  # … with an estimated prompt: nothing sent, the engine's own rest
    (2048, 100, False, 500, 500),  # an estimated rest above the cap: the cap
    (2048, 2048, True, 1, 1),  # a full context still asks one token (the engine refuses the prompt)
    (None, 100, True, 500, 500),  # no registered context: the cap
])
def test_max_tokens_fitted_into_the_context(ctx: int | None, prompt: int, exact: bool, at: int,
                                            body: int | None) -> None:
    """``max_tokens_rest`` with ``max_tokens``: the cap fitted into each instance's context."""
    q = parse_submit(pack({"query_id": "f", "prompt": "x", "max_tokens_rest": True, "max_tokens": 500}), RouterConfig())
    assert q.rest_of_context and q.max_tokens_cap == 500 and q.max_tokens == 500
    assert q.max_tokens_at(ctx, prompt) == at
    assert q.body_max_tokens(ctx, prompt, exact) == body
    plain = parse_submit(pack({"query_id": "g", "prompt": "x", "max_tokens": 500}), RouterConfig())
    assert plain.max_tokens_at(ctx, prompt) == plain.body_max_tokens(ctx, prompt, exact) == 500


def test_instance_rate_window_and_ttft_percentiles() -> None:
    """The incremental completion rate and cached percentiles equal the direct computation."""
    import numpy as np

    info = Observations()
    ts = [100.0 + 0.5 * k for k in range(300)]  # 150 s of completions, 2 per second
    for t in ts:
        info.add_outcome(t, None, None, True)
    for now in (120.0, 180.0, 249.5, 260.0, 400.0):
        recent = [t for t in ts if now - t <= RATE_WINDOW_S]  # the former full scan
        want = 0.0 if len(recent) < 2 else len(recent) / max(now - recent[0], 1e-3)
        assert info.throughput_rps(now) == pytest.approx(want), now
    assert info.throughput_rps(400.0) == 0.0 and not info.completions
    info.add_outcome(500.0, None, None, True)
    info.add_outcome(499.0, None, None, True)  # another router's slightly earlier clock: kept in order
    assert list(info.completions) == [500.0, 500.0]
    assert info.percentiles() == (0.0, 0.0)
    rng = np.random.default_rng(0)
    for k in range(250):
        info.add_outcome(600.0, float(rng.exponential()), None, False)
        if k % 37 == 0:
            p50, p90 = info.percentiles()
            xs = np.asarray(info.observed)
            assert (p50, p90) == pytest.approx((np.percentile(xs, 50), np.percentile(xs, 90)))
    assert info.percentiles() == pytest.approx(tuple(np.percentile(np.asarray(info.observed), [50, 90])))
    # semantic-router's percentiles: TTFT p95 and TPOT p90, the mean below 3 observations, 0 without
    assert info.semantic_router_percentiles()[1] == 0.0
    info.add_outcome(601.0, None, 0.02, True)
    info.add_outcome(601.0, None, 0.04, True)
    assert info.semantic_router_percentiles()[1] == pytest.approx(0.03)
    for _ in range(1500):  # the window keeps the last HISTORY observations
        info.add_outcome(602.0, float(rng.exponential()), float(rng.uniform(0.01, 0.05)), True)
    assert len(info.observed) == len(info.tpots) == HISTORY
    want = (np.percentile(np.asarray(info.observed), 95), np.percentile(np.asarray(info.tpots), 90))
    assert info.semantic_router_percentiles() == pytest.approx(want)


def test_parse_chunk_completion_and_chat() -> None:
    p = parse_chunk({"choices": [{"text": "ab", "finish_reason": None}]})
    assert p is not None and p.text == "ab"
    p = parse_chunk({"choices": [{"delta": {"content": "cd"}, "finish_reason": "stop"}]})
    assert p is not None and p.text == "cd" and p.finish_reason == "stop"
    p = parse_chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    assert p is not None and p.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert parse_chunk({"choices": [{"delta": {"role": "assistant"}}]}) is None


def test_parse_chunk_raw_keeps_choices_and_tells_output_from_role() -> None:
    """A query with engine fields: every chunk's choices verbatim; the first token is the first
    chunk with output — text, a tool call's piece or log-probabilities — not the role chunk."""
    role = parse_chunk({"choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}}]}, raw=True)
    assert role is not None and role.choices == [{"index": 1, "delta": {"role": "assistant", "content": ""}}]
    assert not role.produced
    call = {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}
    p = parse_chunk({"choices": [call]}, raw=True)
    assert p is not None and p.produced and p.choices == [call] and p.text == ""
    p = parse_chunk({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": [""]}}]}, raw=True)
    assert p is not None and p.produced


def test_engine_fields_of_a_submission() -> None:
    cfg = RouterConfig()
    q = parse_submit(pack({"query_id": "a", "messages": [{"role": "user", "content": "x"}],
                           "engine": {"n": 3, "tools": [{"type": "function"}], "priority": -1}}), cfg)
    assert q.engine == {"n": 3, "tools": [{"type": "function"}], "priority": -1}
    for bad in ({"stream": False}, {"n": 0}, {"x": float("inf")}, "tools"):
        with pytest.raises(BearError) as e:
            parse_submit(pack({"query_id": "b", "prompt": "x", "engine": bad}), cfg)
        assert e.value.code == "bad_request"


def test_each_sequence_of_n_is_paid_for() -> None:
    """``n`` answers cost the prompt once and the predicted output n times."""
    from bear.router.candidates import ModelPrediction, build_candidates
    from bear.router.registry import InstanceInfo

    inst = InstanceInfo("i", model="m", base_url="http://127.0.0.1:1/v1", price_in=0.1, price_out=0.4,
                        predictor_model="m")
    pred = {inst.predictor_model: ModelPrediction(acc=0.5, out_len=100.0, out_p90=150.0, prompt_tokens=20,
                                                  cost_usd=(20 * 0.1 + 100 * 0.4) / 1e6)}
    one, _ = build_candidates(20, [inst], pred, None, 0.0, default_output_tokens=256)
    three, _ = build_candidates(20, [inst], pred, None, 0.0, default_output_tokens=256, sequences=3)
    assert three[0].cost - one[0].cost == pytest.approx(2 * 100 * 0.4)


async def test_dedup_create_only_across_routers(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        a = Deduplicator(nc, "bear_queries", timeout_s=1.0)
        b = Deduplicator(nc, "bear_queries", timeout_s=1.0)  # a second, stateless router
        assert await a.claim("q/1 with spaces", "a")
        assert not await b.claim("q/1 with spaces", "b")
        assert not await a.claim("q/1 with spaces", "a")
        assert await b.claim("q2", "b")
        assert a.fallbacks == 0 and b.fallbacks == 0
    finally:
        await nc.close()


class FakeInstance:
    """A minimal OpenAI streaming server that records request ids; with ``refuse`` (status,
    message) it answers every request with that vLLM-style error instead."""

    def __init__(self, tokens: int = 3, refuse: tuple[int, str] | None = None) -> None:
        self.tokens = tokens
        self.refuse = refuse
        self.request_ids: list[str] = []
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        if self.refuse is not None:
            status, message = self.refuse
            return web.json_response({"object": "error", "message": message, "type": "BadRequestError",
                                      "param": None, "code": status}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(self.tokens):
            await resp.write(f"data: {json.dumps({'choices': [{'text': f't{k} ', 'finish_reason': None}]})}\n\n".encode())
        usage = {"prompt_tokens": 4, "completion_tokens": self.tokens, "total_tokens": 4 + self.tokens}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage, 'model': body['model']})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def register(nc, inst: str, model: str, port: int, price_out: float, config: dict | None = None) -> None:
    import time

    kv = await ensure_kv(nc.jetstream(), S.instances_bucket)
    rec = instance_record(inst, model, f"http://127.0.0.1:{port}/v1", price_input_per_mtok=0.1,
                          price_output_per_mtok=price_out, backend="vllm", config=config)
    await kv.put(inst, encode(msgspec.structs.replace(rec, heartbeat=time.time())))


async def started_router(nc, log_path, instances: set[str], **cfg) -> RouterService:
    """A router with short predictor and estimator budgets (nobody answers them here), once it
    sees ``instances`` healthy."""
    router = RouterService(nc, RouterConfig(predict_budget_s=0.05, predict_try_s=0.025, estimate_budget_s=0.05,
                                            estimate_try_s=0.025, outcome_log=log_path, **cfg))
    await router.start()
    await wait_until(lambda: {i.id for i in router.registry.healthy()} == instances, what="registered")
    return router


async def collect(nc, **kw) -> list[dict]:
    return [m async for m in submit(nc, "hello there", **kw)]


@pytest.fixture
async def router_env(nats_server, tmp_path):
    nc = await nats.connect(nats_server.url)
    good = FakeInstance()
    await good.start()
    dead_port = free_port()  # nothing listens there
    # The unreachable instance is the cheapest: with no predictor the fallback utility prefers it.
    await register(nc, "dead", "m/cheap", dead_port, 0.01)
    await register(nc, "good", "m/pricey", good.port, 10.0)
    cfg = RouterConfig(policy="bear", predict_budget_s=0.05, predict_try_s=0.025, estimate_budget_s=0.05,
                       estimate_try_s=0.025, outcome_log=tmp_path / "out.jsonl", connect_timeout_s=0.5)
    router = RouterService(nc, cfg)
    await router.start()
    await wait_until(lambda: {i.id for i in router.registry.healthy()} == {"dead", "good"}, what="both registered")
    yield nc, router, good, tmp_path / "out.jsonl"
    await router.stop()
    await good.stop()
    await nc.close()


async def test_fallbacks_and_reroute_when_instance_unreachable(router_env) -> None:
    nc, router, good, log_path = router_env
    msgs = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id="u1")
    kinds = [m["v"] for m in msgs]
    assert kinds.count("bear.done/1") == 1 and "bear.error/1" not in kinds and kinds[-1] == "bear.done/1"
    routed = [m for m in msgs if m["v"] == "bear.routed/1"]
    # First choice: the cheap instance (fallback utility = −λ·cost), refused → rerouted to "good".
    assert [r["instance"] for r in routed] == ["dead", "good"] and routed[1]["attempt"] == 2
    assert routed[0]["ttft_method"] == "router-eq8"
    text = "".join(m["text"] for m in msgs if m["v"] == "bear.chunk/1")
    assert text == "t0 t1 t2 "
    done = msgs[-1]
    assert done["instance"] == "good" and done["usage"]["completion_tokens"] == 3 and math.isfinite(done["ttft_s"])
    assert len(good.request_ids) == 1 and good.request_ids[0].startswith("bear-")
    router.outcomes.flush()
    rec = json.loads(log_path.read_text().splitlines()[-1])
    assert rec["fallbacks"] == ["predictor", "estimator"] and rec["instance"] == "good" and rec["attempt"] == 2
    # The dead instance is avoided for a while: the next query goes straight to "good".
    msgs = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id="u2")
    assert [m["instance"] for m in msgs if m["v"] == "bear.routed/1"] == ["good"]


@pytest.mark.parametrize(("status", "message", "code"), [
    (400, "This model's maximum context length is 40960 tokens. However, you requested 50000 tokens",
     "context_length_exceeded"),
    (413, "request entity too large", "too_large"),
    (400, "temperature must be non-negative", "bad_request"),
    (422, "field required: model", "bad_request"),
])
async def test_engine_refusal_reaches_the_client_and_is_not_retried(nats_server, tmp_path, status, message,
                                                                    code) -> None:
    """HTTP 400/413/422 is the request's fault: one error with the engine's reason, no second
    instance tried, the refusing instance not avoided afterwards; a 5xx still reroutes."""
    nc = await nats.connect(nats_server.url)
    picky, good = FakeInstance(refuse=(status, message)), FakeInstance()
    await picky.start()
    await good.start()
    await register(nc, "picky", "m/cheap", picky.port, 0.01)  # the fallback utility prefers the cheap one
    await register(nc, "good", "m/pricey", good.port, 10.0)
    log_path = tmp_path / "out.jsonl"
    router = await started_router(nc, log_path, {"picky", "good"})
    try:
        for k in range(2):
            msgs = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id=f"refused-{k}")
            assert [m["instance"] for m in msgs if m["v"] == "bear.routed/1"] == ["picky"]  # not avoided next time
            assert msgs[-1]["v"] == "bear.error/1" and msgs[-1]["error"]["code"] == code
            assert message in msgs[-1]["error"]["message"] and "picky" in msgs[-1]["error"]["message"]
        assert good.request_ids == [] and len(picky.request_ids) == 2
        router.outcomes.flush()
        rec = json.loads(log_path.read_text().splitlines()[-1])
        assert rec["status"] == code and rec["http_status"] == status and rec["reason"] == message
        picky.refuse = (503, "engine overloaded")  # the instance's fault: the router tries another
        msgs = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id="overloaded")
        assert [m["instance"] for m in msgs if m["v"] == "bear.routed/1"] == ["picky", "good"]
        assert msgs[-1]["v"] == "bear.done/1"
    finally:
        await router.stop()
        await picky.stop()
        await good.stop()
        await nc.close()


async def test_resubmitted_query_id_runs_once(router_env) -> None:
    nc, _router, good, _ = router_env
    first = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id="same")
    second = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id="same", accept_timeout_s=30.0)
    assert first[-1]["v"] == "bear.done/1"
    assert second[-1]["v"] == "bear.error/1" and second[-1]["error"]["code"] == "duplicate"
    assert len(good.request_ids) == 1


async def test_no_instance_gives_one_clear_error(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    router = RouterService(nc, RouterConfig(predict_budget_s=0.05, estimate_budget_s=0.05))
    await router.start()
    try:
        msgs = await collect(nc, ttft_target_s=1.0, query_id="none")
        assert len(msgs) == 1 and msgs[0]["error"]["code"] == "unavailable"
        bad = [m async for m in submit(nc, None, messages="not a list", query_id="bad")]  # type: ignore[arg-type]
        assert len(bad) == 1 and bad[0]["error"]["code"] == "bad_request"
    finally:
        await router.stop()
        await nc.close()


async def test_a_policy_that_reads_no_estimate_asks_the_estimator_nothing(nats_server, tmp_path) -> None:
    """Round robin is decided without the estimator (its requests are counted on the subject);
    BEAR asks it for every query."""
    nc = await nats.connect(nats_server.url)
    good = FakeInstance()
    await good.start()
    await register(nc, "good", "m/one", good.port, 1.0)
    asked: list[str] = []

    async def count(msg) -> None:
        asked.append(msg.subject)

    sub = await nc.subscribe(S.estimate_shard(0, 1), cb=count)  # nobody answers: BEAR falls back after asking
    try:
        for n, (policy, asks) in enumerate((("round-robin", False), ("latency-agnostic", False), ("bear", True))):
            log_path = tmp_path / f"{policy}.jsonl"
            router = await started_router(nc, log_path, {"good"}, policy=policy)
            before = len(asked)
            msgs = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id=f"est-{n}")
            await router.stop()
            await nc.flush()
            assert msgs[-1]["v"] == "bear.done/1"
            assert (len(asked) > before) == asks, policy
            rec = json.loads(log_path.read_text().splitlines()[-1])
            # not asking is no fallback; asking and getting no answer is
            assert rec["fallbacks"] == (["predictor", "estimator"] if asks else ["predictor"]), policy
    finally:
        await sub.unsubscribe()
        await good.stop()
        await nc.close()


async def test_filters_refuse_with_their_coded_errors_and_record_why(nats_server, tmp_path) -> None:
    """Model, health and context filters before anything is asked: each refusal is the coded
    error the client library and the gateway know, and the outcome log says which filter dropped
    which instance; a query that fits somewhere goes there."""
    nc = await nats.connect(nats_server.url)
    good = FakeInstance()
    await good.start()
    await register(nc, "short", "m/one", good.port, 1.0, config={"max_model_len": 100})
    await register(nc, "long", "m/one", good.port, 1.0, config={"max_model_len": 1000})
    await register(nc, "other", "m/two", good.port, 1.0)
    log_path = tmp_path / "out.jsonl"
    router = await started_router(nc, log_path, {"short", "long", "other"})
    try:
        msgs = await collect(nc, max_tokens=3, model="m/none", query_id="f-model")
        assert (msgs[-1].code, msgs[-1].message) == ("not_found", "no instance serves model 'm/none'")
        msgs = await collect(nc, max_tokens=2000, model="m/one", query_id="f-context")
        assert msgs[-1]["error"]["code"] == "context_length_exceeded"
        assert msgs[-1]["error"]["message"].startswith(
            "This model's maximum context length is 1000 tokens. However, you requested 2000 tokens")
        msgs = await collect(nc, max_tokens=500, model="m/one", query_id="f-fits")
        assert [m["instance"] for m in msgs if m["v"] == "bear.routed/1"] == ["long"]
        assert msgs[-1]["v"] == "bear.done/1"
        router.outcomes.flush()
        recs = {r["query_id"]: r for r in map(json.loads, log_path.read_text().splitlines())}
        assert recs["f-model"]["status"] == "not_found" and recs["f-model"]["filter"] == "model"
        assert set(recs["f-model"]["dropped"]) == {"short", "long", "other"}
        assert recs["f-context"]["status"] == "context_length_exceeded" and recs["f-context"]["filter"] == "context"
        assert {k: v.split(":")[0] for k, v in recs["f-context"]["dropped"].items()} == {
            "other": "model", "short": "context", "long": "context"}
        assert {k: v.split(":")[0] for k, v in recs["f-fits"]["dropped"].items()} == {
            "other": "model", "short": "context"}
        assert set(recs["f-fits"]["candidates"]) == {"long"}  # the dropped ones were not estimated
    finally:
        await router.stop()
        await good.stop()
        await nc.close()


async def test_client_gives_terminal_error_without_router(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        msgs = await collect(nc, query_id="lonely", accept_timeout_s=0.2, resubmits=1)
        assert len(msgs) == 1 and msgs[0]["v"] == "bear.error/1" and msgs[0]["client"] is True
    finally:
        await nc.close()


async def _connections_opened(gaps_s: list[float]) -> int:
    """Queries through the router's engine session to one instance, ``gaps_s`` apart: how many
    TCP connections they opened."""
    import aiohttp

    from bear.router.dispatch import engine_session, request_body, stream_completion

    inst = FakeInstance(tokens=2)
    await inst.start()
    opened = 0

    async def on_create(*_: object) -> None:
        nonlocal opened
        opened += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_create)
    try:
        async with engine_session(trace_configs=[trace]) as session:
            for k, gap in enumerate([0.0, *gaps_s]):
                if gap:  # sleep: the idle pause itself is what a keep-alive expiry is about
                    await asyncio.sleep(gap)
                path, body = request_body("m", "hi", None, 2)
                pieces = [p async for p in stream_completion(session, f"http://127.0.0.1:{inst.port}/v1",
                                                             f"r{k}", path, body)]
                assert "".join(p.text for p in pieces) == "t0 t1 "
        return opened
    finally:
        await inst.stop()


async def test_streamed_answers_reuse_one_keep_alive_connection() -> None:
    """Reading each answer to the end of its body (not just to ``[DONE]``) keeps the connection in
    the pool: 20 queries to one instance open one TCP connection, not 20."""
    assert await _connections_opened([0.0] * 19) == 1


async def test_idle_engine_connections_go_before_the_engine_closes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a query sent on it at
    that instant is reset and the instance counted unavailable. The router drops idle connections
    first (``ENGINE_KEEPALIVE_S``, here shortened to 0.5 s): a query after a longer pause opens a
    new connection, one sent at once reuses the last (no pause: the reuse does not depend on how
    fast the host is, the expiry only on the pause being longer)."""
    from bear.router import dispatch

    assert dispatch.ENGINE_KEEPALIVE_S < 5.0
    monkeypatch.setattr(dispatch, "ENGINE_KEEPALIVE_S", 0.5)
    assert await _connections_opened([0.0, 1.0, 0.0]) == 2


async def test_requests_are_on_the_wire_before_the_router_tokenises(router_env, monkeypatch) -> None:
    """The claim and predictor requests reach the socket before the (inline, loop-blocking)
    tokenisation starts, so the predictor works while the router tokenises."""
    import dataclasses

    _nc, router, _good, _log = router_env
    q = parse_submit(pack({"v": "bear.submit/1", "query_id": "w1", "prompt": "hello there"}), router.cfg)
    insts = [dataclasses.replace(i, tokenizer="tok-x") for i in router.registry.healthy()]
    seen: list[int] = []

    async def encode(ids, prompt, messages):
        seen.append(router.nc.pending_data_size)
        return {}

    monkeypatch.setattr(router.tokenizers, "want", lambda ids: None)
    monkeypatch.setattr(router.tokenizers, "encode", encode)
    before = router.nc.stats["out_msgs"]
    await router._ask(q, insts, 2)
    assert seen == [0] and router.nc.stats["out_msgs"] - before >= 2  # claim and predictor, written


class _Reads:
    """A fake engine response whose body arrives in the given reads (``iter_any``'s blocks)."""

    def __init__(self, reads: list[bytes]) -> None:
        self.status = 200
        self.reads = reads
        self.content = self

    async def iter_any(self):  # type: ignore[no-untyped-def]
        for r in self.reads:
            yield r

    async def __aenter__(self) -> _Reads:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Session:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    def post(self, *_: object, **__: object) -> _Reads:
        return _Reads(self.reads)


def _sse(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    d: dict = {"choices": [{"index": 0, "text": text or "", "finish_reason": finish}] if text is not None else []}
    if usage is not None:
        d["usage"] = usage
    return b"data: " + json.dumps(d).encode() + b"\n\n"


@pytest.mark.parametrize("coalesce", [True, False])
async def test_chunks_of_one_read_are_relayed_as_one_piece(coalesce: bool) -> None:
    """With ``coalesce`` the text chunks that arrived in one read come out as one piece (the texts
    joined in order, the usage and finish reason of the last); an event split across two reads is
    still parsed whole; nothing is lost or reordered, and without ``coalesce`` every chunk is its
    own piece."""
    from bear.router.dispatch import stream_completion

    first = _sse("a")
    tail = _sse("d", "stop") + _sse(usage={"prompt_tokens": 3, "completion_tokens": 4}) + b"data: [DONE]\n\n"
    reads = [first, _sse("b") + _sse("c") + tail[:7], tail[7:]]
    pieces = [p async for p in stream_completion(_Session(reads), "http://x/v1", "r", "/completions", {},
                                                 coalesce=coalesce)]
    assert "".join(p.text for p in pieces) == "abcd"
    assert [p.usage for p in pieces if p.usage] == [{"prompt_tokens": 3, "completion_tokens": 4}]
    assert [p.finish_reason for p in pieces if p.finish_reason] == ["stop"]
    if coalesce:
        assert [p.text for p in pieces] == ["a", "bc", "d"]  # one piece per read that completed events
    else:
        assert [p.text for p in pieces] == ["a", "b", "c", "d", ""]


async def test_raw_chunks_are_never_joined() -> None:
    """Answers relayed verbatim (engine fields: choices, tool calls) keep one piece per chunk."""
    from bear.router.dispatch import stream_completion

    reads = [_sse("a") + _sse("b") + b"data: [DONE]\n\n"]
    pieces = [p async for p in stream_completion(_Session(reads), "http://x/v1", "r", "/completions", {}, raw=True)]
    assert [p.choices[0]["text"] for p in pieces] == ["a", "b"]


@pytest.mark.parametrize("event", [
    {"object": "text_completion", "choices": [{"index": 0, "text": " w", "logprobs": None, "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 3}}},
    {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": None}},
    {"choices": [{"text": 3}]},  # not vLLM's shape: decoded by the generic path
    {"choices": "x"},
    {"usage": [1]},
    {},
])
def test_text_event_parse_equals_the_generic_parse(event: dict) -> None:
    """The typed decode of text chunks reads every chunk as ``json.loads`` + ``parse_chunk`` does
    (same piece, or the same exception type)."""
    from bear.router.dispatch import parse_chunk, parse_text_event

    payload = json.dumps(event).encode()

    def run(f):  # type: ignore[no-untyped-def]
        try:
            return f()
        except Exception as exc:  # the exception's type is what is compared
            return type(exc)

    assert run(lambda: parse_text_event(payload)) == run(lambda: parse_chunk(json.loads(payload)))


@pytest.mark.parametrize("event", [{"object": "error", "message": "boom"}, {"error": {"message": "x"}},
                                   {"error": None}, {"object": "error"}])
def test_text_event_errors_break_the_stream_alike(event: dict) -> None:
    from bear.router.dispatch import StreamBroken, parse_chunk, parse_text_event

    payload = json.dumps(event).encode()
    with pytest.raises(StreamBroken) as a:
        parse_text_event(payload)
    with pytest.raises(StreamBroken) as b:
        parse_chunk(json.loads(payload))
    assert str(a.value) == str(b.value)


def test_malformed_text_event_raises_value_error() -> None:
    from bear.router.dispatch import parse_text_event

    with pytest.raises(ValueError):
        parse_text_event(b"{not json")


async def test_selection_asks_the_estimator_about_the_k_chosen_and_records_the_stage(nats_server, tmp_path) -> None:
    """With ``selection_k_max`` a model of more instances has only k of them estimated and
    considered by the policy; the outcome record says which stage decided. Off (the default),
    every instance is a candidate and the record says so (None)."""
    nc = await nats.connect(nats_server.url)
    good = FakeInstance()
    await good.start()
    names = {f"i{k}" for k in range(5)}
    for name in sorted(names):
        await register(nc, name, "m/one", good.port, 1.0)
    try:
        for n, k_max in enumerate((2, 0)):
            log_path = tmp_path / f"sel-{k_max}.jsonl"
            router = await started_router(nc, log_path, names, policy="bear", selection_k_max=k_max,
                                          selection_k_min=1)
            msgs = await collect(nc, ttft_target_s=1.0, max_tokens=3, query_id=f"sel-{n}")
            await router.stop()
            assert msgs[-1]["v"] == "bear.done/1"
            rec = json.loads(log_path.read_text().splitlines()[-1])
            if k_max:  # no load known anywhere: the bounds tie, so k is k_max
                assert rec["selection"]["stage"] == "selected"
                assert rec["selection"]["considered"] == 5 and rec["selection"]["replayed"] == 2
                assert len(rec["candidates"]) == 2 and rec["instance"] in rec["candidates"]
            else:
                assert rec["selection"] is None and set(rec["candidates"]) == names
    finally:
        await good.stop()
        await nc.close()
