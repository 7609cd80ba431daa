"""One trace per request across gateway → router → predictor / estimator → engine: spans exported
over OTLP/HTTP to a collector (here a fake one that decodes the protobuf), every hop a child of the
one before, the client's own ``traceparent`` as the root; with tracing off nothing is exported and
the context is still passed on (test_openai_client checks the engine gets it)."""

from __future__ import annotations

import asyncio

import openai
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bear.runtime import tracing
from bear.runtime.nats_server import free_port

from gateway_helpers import KEY, ThreadedPool

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Collector:
    def __init__(self) -> None:
        self.spans: list = []
        self.services: set[str] = set()
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            self.services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return web.Response(status=200)


async def test_one_trace_from_the_client_to_the_engine(tmp_path) -> None:
    col = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", col.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", col.port).start()
    tracing.setup("bear-test", "otlp", f"http://127.0.0.1:{col.port}/v1/traces")
    try:
        with ThreadedPool(tmp_path) as pool:
            c = openai.AsyncOpenAI(base_url=pool.base_url, api_key=KEY, max_retries=0)
            r = await c.chat.completions.create(
                model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
            await c.close()
            assert r.choices[0].message.content
        await asyncio.to_thread(tracing.shutdown)  # flushes the batch
    finally:
        tracing.shutdown()
        await runner.cleanup()
    assert col.services == {"bear-test"}
    spans = {s.name: s for s in col.spans if s.trace_id.hex() == TRACE_ID}
    assert {"gateway /v1/chat/completions", "router.query", "router.predict", "router.estimate", "router.engine",
            "sim.generate"} <= set(spans)
    parent = {name: s.parent_span_id.hex() for name, s in spans.items()}
    sid = {name: s.span_id.hex() for name, s in spans.items()}
    assert parent["gateway /v1/chat/completions"] == CLIENT_SPAN
    assert parent["router.query"] == sid["gateway /v1/chat/completions"]
    for hop in ("router.predict", "router.estimate", "router.engine"):
        assert parent[hop] == sid["router.query"], hop
    assert parent["sim.generate"] == sid["router.engine"]
    events = {name: [e.name for e in s.events] for name, s in spans.items()}
    assert "routed" in events["gateway /v1/chat/completions"] and "first_byte" in events["gateway /v1/chat/completions"]
    assert "first_token" in events["router.engine"] and "first_token" in events["sim.generate"]
    attrs = {a.key: a.value for a in spans["router.engine"].attributes}
    assert attrs["instance"].string_value == "sim-small" and attrs["ttft_method"].string_value == "router-eq8"
    gw = spans["gateway /v1/chat/completions"]
    assert gw.start_time_unix_nano <= spans["router.query"].start_time_unix_nano
    assert spans["router.engine"].end_time_unix_nano <= gw.end_time_unix_nano
