"""bear.predict over a real NATS server: replies, coded errors, deadlines, overload, queue group,
the process main and its SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from bear.predictor.runtime import Predictor
from bear.predictor.service import REPLY_SCHEMA, REQUEST_SCHEMA, PredictorService, ServiceLimits, serve
from bear.predictor.synth import generate
from bear.predictor.train import TrainConfig, train
from bear.protocol.codec import pack, unpack
from bear.protocol.errors import is_error
from bear.protocol.subjects import Subjects
from bear.runtime.nats_server import LocalNatsServer

from waiting import HANG_S, wait_until

MODELS = ["Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B"]


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> Predictor:
    out: Path = tmp_path_factory.mktemp("svc-model")
    train(list(generate(300, seed=2)), out, cfg=TrainConfig(rounds=40, test_fraction=0.0))
    return Predictor(out)


@pytest.fixture
async def client(nats_server: LocalNatsServer, predictor: Predictor) -> AsyncIterator[tuple[object, PredictorService]]:
    nc = await nats.connect(nats_server.url)
    svc = PredictorService(predictor, limits=ServiceLimits(max_prompt_bytes=100_000, inline_max_bytes=2000))
    await svc.start(nc)
    await nc.flush()
    yield nc, svc
    await svc.stop()
    await nc.close()


async def ask(nc: object, req: dict | bytes) -> dict:
    data = req if isinstance(req, bytes) else pack(req)
    msg = await nc.request(Subjects().predict, data, timeout=HANG_S)  # type: ignore[attr-defined]
    return unpack(msg.data)


def req(prompt: str, models: list[str] = MODELS, **kw: object) -> dict:
    return {"v": REQUEST_SCHEMA, "prompt": prompt, "models": models, "deadline": time.time() + HANG_S, **kw}


async def test_reply_has_every_model(client: tuple) -> None:
    nc, _ = client
    rep = await ask(nc, req("List five facts about enzymes.", id="q1"))
    assert rep["v"] == REPLY_SCHEMA and rep["id"] == "q1"
    assert list(rep["models"]) == MODELS
    for m in MODELS:
        r = rep["models"][m]
        assert 0 <= r["acc"] <= 1 and r["cost"] > 0 and r["prompt_tokens"] == 6  # pieces: List five facts about enzymes .
        assert 1 <= r["len"]["p50"] <= r["len"]["p90"] and r["len"]["mean"] >= 1
    assert rep["models"]["Qwen3-32B"]["acc"] > rep["models"]["Qwen3-0.6B"]["acc"]


async def test_long_prompt_goes_through_the_pool(client: tuple) -> None:
    nc, _ = client
    long = "Government report:\n\n" + "the budget deficit was audited. " * 1500 + "\n\nSummarize the report above."
    rep = await ask(nc, req(long, prompt_tokens={"Qwen3-8B": 9000}))
    assert not is_error(rep)
    assert rep["models"]["Qwen3-8B"]["prompt_tokens"] == 9000
    assert rep["models"]["Qwen3-0.6B"]["prompt_tokens"] > 7000


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\xc1\xc1 not msgpack", "bad_request"),
        (pack([1, 2, 3]), "bad_request"),
        (pack({"v": "bear.predict/0", "prompt": "x", "models": MODELS}), "bad_request"),
        (pack({"v": REQUEST_SCHEMA, "prompt": 3, "models": MODELS}), "bad_request"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": []}), "bad_request"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": ["Qwen3-8B", "Qwen3-8B"]}), "bad_request"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": MODELS, "prompt_tokens": -1}), "bad_request"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": MODELS, "deadline": "soon"}), "bad_request"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x" * 100_001, "models": MODELS}), "too_large"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": ["m"] * 65}), "too_large"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": ["gpt-9"]}), "not_found"),
        (pack({"v": REQUEST_SCHEMA, "prompt": "x", "models": MODELS, "deadline": time.time() - 1}),
         "deadline_exceeded"),
    ],
    ids=["garbage", "not-a-map", "wrong-v", "prompt-type", "no-models", "dup-models", "neg-tokens",
         "deadline-type", "big-prompt", "many-models", "unknown-model", "expired"],
)
async def test_coded_errors(client: tuple, payload: bytes, code: str) -> None:
    nc, _ = client
    rep = await ask(nc, payload)
    assert is_error(rep) and rep["error"]["code"] == code, rep


async def test_inline_up_to_the_request_size_bound_then_the_pool(client: tuple) -> None:
    nc, svc = client  # inline_max_bytes=2000 (msgpack bytes of the whole request)
    paths: list[str] = []
    orig_inline, orig_work = svc._inline, svc._work

    async def inline(*a: object) -> None:
        paths.append("inline")
        await orig_inline(*a)

    async def work(*a: object) -> None:
        paths.append("pool")
        await orig_work(*a)

    svc._inline, svc._work = inline, work  # type: ignore[method-assign]
    short = req("Summarize this. " * 100)
    assert len(pack(short)) <= 2000
    long = req("Summarize this. " * 130)
    assert len(pack(long)) > 2000
    assert not is_error(await ask(nc, short)) and not is_error(await ask(nc, long))
    assert paths == ["inline", "pool"]
    # The same reply either way.
    svc.limits = ServiceLimits(max_prompt_bytes=100_000, inline_max_bytes=0)
    a = await ask(nc, req("Explain why the sky is blue."))
    svc.limits = ServiceLimits(max_prompt_bytes=100_000, inline_max_bytes=1 << 20)
    b = await ask(nc, req("Explain why the sky is blue."))
    assert a == b and paths[2:] == ["pool", "inline"]


async def test_internal_error_inline_is_a_coded_reply(client: tuple) -> None:
    nc, svc = client

    def boom(_req: dict) -> dict:
        raise RuntimeError("boom")

    svc._compute = boom  # type: ignore[method-assign]
    rep = await ask(nc, req("hello"))
    assert is_error(rep) and rep["error"]["code"] == "internal"


async def test_deadline_passing_during_work(client: tuple) -> None:
    nc, svc = client
    # The work in the pool starts (parsing succeeded before the deadline) and cannot finish before
    # the deadline: it waits until the reply has come (a held compute, so the outcome does not
    # depend on the host's speed; the 1 s deadline only has to outlast the parsing).
    compute = svc._compute
    started, release = threading.Event(), threading.Event()

    def held(r: dict) -> dict:
        started.set()
        release.wait(HANG_S)
        return compute(r)

    svc._compute = held  # type: ignore[method-assign]
    svc.limits = ServiceLimits(inline_max_bytes=0)
    try:
        rep = await ask(nc, req("word " * 5000, deadline=time.time() + 1.0))
    finally:
        release.set()
    assert started.is_set() and is_error(rep) and rep["error"]["code"] == "deadline_exceeded", rep


async def test_overloaded_when_inflight_limit_reached(client: tuple) -> None:
    nc, svc = client
    svc._inflight = svc.limits.max_inflight
    try:
        rep = await ask(nc, req("hello"))
    finally:
        svc._inflight = 0
    assert is_error(rep) and rep["error"]["code"] == "overloaded"
    assert not is_error(await ask(nc, req("hello")))


async def test_queue_group_spreads_requests(nats_server: LocalNatsServer, predictor: Predictor) -> None:
    ncs = [await nats.connect(nats_server.url) for _ in range(3)]
    svcs = [PredictorService(predictor) for _ in range(2)]
    for nc, svc in zip(ncs, svcs, strict=False):
        await svc.start(nc)
        await nc.flush()  # the server has both subscriptions before the first request
    try:
        seen = []
        for s in svcs:
            orig = s._compute

            def spy(r: dict, _orig=orig, _s=s) -> dict:
                seen.append(id(_s))
                return _orig(r)

            s._compute = spy  # type: ignore[method-assign]
        reps = await asyncio.gather(*(ask(ncs[2], req(f"Explain topic {i}.")) for i in range(60)))
        assert not any(is_error(r) for r in reps)
        assert len(set(seen)) == 2  # each request answered once, by either process
        assert len(seen) == 60
        info = await ncs[2].request("$SRV.PING.bear-predictor", b"", timeout=HANG_S)
        assert b"bear-predictor" in info.data
    finally:
        for s in svcs:
            await s.stop()
        for nc in ncs:
            await nc.close()


async def test_serve_answers_and_stops_on_sigterm(nats_server: LocalNatsServer, predictor: Predictor) -> None:
    """The process main (the shared harness: bear.runtime.service.connect / stop_event): it serves
    until SIGTERM, then stops the service and closes its connection."""
    task = asyncio.create_task(serve(nats_server.url, predictor, ServiceLimits()))
    nc = await nats.connect(nats_server.url)
    try:
        async def answered() -> dict | None:
            try:
                return await ask(nc, req("List five facts about enzymes."))
            except nats.errors.NoRespondersError:  # not subscribed yet
                return None

        rep = await wait_until(answered, what="the served predictor")
        assert not is_error(rep) and list(rep["models"]) == MODELS
        os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler, installed before the service started
        await asyncio.wait_for(task, timeout=HANG_S)
        with pytest.raises(nats.errors.NoRespondersError):
            await ask(nc, req("hello"))
    finally:
        gc.unfreeze()  # serve froze the test process's heap out of the cyclic GC
        task.cancel()
        await nc.close()


@pytest.mark.slow
def test_bench_command_end_to_end(predictor: Predictor, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    model_dir = Path(predictor.model_dir)
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [sys.executable, "-m", "bear", "bench", "predictor", "--model-dir", str(model_dir), "--n", "40",
         "--queries", "8", "--concurrency", "4", "--out", str(out), "--log-format", "json"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    d = json.loads(out.read_text())
    for phase in ("sequential", "throughput"):
        assert d[phase]["n"] == 40 and d[phase]["errors"] == 0
        assert 0 < d[phase]["p50_ms"] <= d[phase]["p99_ms"]
        assert set(d[phase]["per_task_p50_ms"]) == {"alpaca", "govreport", "hotpotqa", "writingprompts"}
