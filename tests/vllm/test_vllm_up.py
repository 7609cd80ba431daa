"""``bear up --backend vllm`` as a user runs it: two tiny-model CPU vLLM instances (plugin +
snapshotter each), predictor, estimator, calibrator and router as child processes on a given NATS;
queries through the client are answered by real vLLM with BEA estimates; through the gateway, the
engine fields vLLM serves come back whole (a named tool_choice's schema-valid call, n = 2,
logprobs, json_schema: guided decoding keeps even the random model's output valid); Ctrl-C stops
every child, vLLM included."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import nats
import openai
import pytest

from bear.client.submit import submit
from bear.runtime.nats_server import LocalNatsServer
from bear.vllm_instance.launch import healthy

# `bear up` with its default ports (the gateway's 8000): one such module at a time (docs/testing.md)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("bear_up_ports")]


def _read_until(proc: subprocess.Popen[str], lines: list[str], marker: str, timeout_s: float) -> None:
    """Collect the process's stdout lines until ``marker`` appears (or fail after timeout_s)."""
    done = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + timeout_s
    while not done.wait(1.0):
        assert time.monotonic() < end, f"`bear up` not up after {timeout_s} s:\n{''.join(lines)[-3000:]}"
    assert any(marker in ln for ln in lines), f"`bear up` exited ({proc.poll()}):\n{''.join(lines)[-3000:]}"


def _stack_rings() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("bear-vllm-[0-9]*-*")}


async def _queries(url: str, n: int) -> list[list[dict]]:
    nc = await nats.connect(url)
    try:
        async def one(i: int) -> list[dict]:
            return [m async for m in submit(nc, f"up {i}: " + "word " * (10 + 7 * i), ttft_target_s=5.0,
                                            max_tokens=8, query_id=f"up-{i}", idle_timeout_s=60.0,
                                            accept_timeout_s=30.0)]  # hang-sized (a starved host's deadline)

        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await nc.close()


# enum values: guided decoding can only write these, so the random model's JSON ends in a few dozen tokens
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _engine_fields(base_url: str, key: str) -> None:
    """What vLLM serves beyond text, through the gateway (seeded: each answer is reproducible)."""
    c = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="bear", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=1500, seed=7)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather", r
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    args, name = "", None
    for ch in c.chat.completions.create(model="bear", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=1500,
                                        seed=7, stream=True):
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER)
    r = c.chat.completions.create(model="bear", messages=ASK, n=2, max_tokens=4, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 8, r
    r = c.chat.completions.create(model="bear", messages=ASK, max_tokens=4, logprobs=True, top_logprobs=2, seed=7)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens == 4 and all(len(t.top_logprobs) == 2 for t in lp), r
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    r = c.chat.completions.create(model="bear", messages=ASK, response_format=fmt, max_tokens=1500, seed=7)
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    # the Responses API over the same engines (bear.gateway.responses): text, streamed, a tool, a schema
    # the prompt and seed of the logprobs request above, which gave 4 tokens: the same 4 here
    rr = c.responses.create(model="bear", input="What is the weather in Paris?", max_output_tokens=4,
                            extra_body={"seed": 7})
    assert rr.usage.output_tokens == 4 and rr.output[0].type == "message", rr
    events = list(c.responses.create(model="bear", input="What is the weather?", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    rr = c.responses.create(model="bear", input="What is the weather in Paris?", tools=[tool],
                            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=1500)
    call = next(o for o in rr.output if o.type == "function_call")
    assert call.name == "get_weather", rr
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    rr = c.responses.create(model="bear", input="The weather in Paris?", max_output_tokens=1500,
                            text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}})
    jsonschema.validate(json.loads(rr.output_text), WEATHER)
    c.close()


def _choices(r: Any) -> list[tuple[int, str, str | None]]:
    return [(c.index, c.text, c.finish_reason) for c in r.choices]


def _prompt_forms(base_url: str, key: str, vllm_url: str, vllm_key: str) -> None:
    """Completions beyond one string prompt, field by field against the same request sent to vLLM
    itself (greedy, one request at a time: an idle engine computes the same tokens for both): a list
    of prompts (each its own query, merged as vLLM merges it), token ids, a list of token-id lists,
    and echo + logprobs (sent unstreamed, the prompt's logprobs relayed whole)."""
    g = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)
    v = openai.OpenAI(base_url=vllm_url, api_key=vllm_key, max_retries=0, timeout=300)
    direct = v.models.list().data[0].id
    cases: list[dict[str, Any]] = [
        {"model": "bear", "prompt": ["The sky is", "Two plus two is", "Once upon"], "max_tokens": 4},
        {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4},
        {"model": "tiny", "prompt": [[11, 12, 13], [14, 15]], "max_tokens": 3},
        {"model": "tiny", "prompt": "Hello there", "max_tokens": 2, "echo": True, "logprobs": 1},
        {"model": "tiny", "prompt": [[21, 22], [23]], "max_tokens": 2, "logprobs": 2},
    ]
    for kw in cases:
        a = g.completions.create(temperature=0, **kw)
        b = v.completions.create(temperature=0, **{**kw, "model": direct})
        assert _choices(a) == _choices(b), (kw, a, b)
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        if kw.get("logprobs"):
            for ca, cb in zip(a.choices, b.choices, strict=True):
                assert ca.logprobs.tokens == cb.logprobs.tokens and ca.logprobs.text_offset == cb.logprobs.text_offset
                assert [x is None for x in ca.logprobs.token_logprobs] == [x is None for x in cb.logprobs.token_logprobs]
                assert [x for x in ca.logprobs.token_logprobs if x is not None] == pytest.approx(
                    [x for x in cb.logprobs.token_logprobs if x is not None], abs=1e-3)
        # streamed: each index's text adds up to the unstreamed answer's, and each finishes once
        if not kw.get("echo"):
            texts: dict[int, str] = {}
            ends: dict[int, int] = {}
            for ch in g.completions.create(temperature=0, stream=True, **kw):
                for c in ch.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    ends[c.index] = ends.get(c.index, 0) + (c.finish_reason is not None)
            assert [(i, texts[i]) for i in sorted(texts)] == [(c.index, c.text) for c in b.choices], (kw, texts)
            assert set(ends.values()) == {1}, ends
    g.close()
    v.close()


def test_bear_up_backend_vllm(vllm_py: str, tmp_path: Path) -> None:
    work = tmp_path / "up"
    rings_before = _stack_rings()
    with LocalNatsServer() as nats_srv:
        env = {**os.environ, "BEAR_VLLM_PYTHON": vllm_py, "COLUMNS": "250", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "bear", "up", "--backend", "vllm", "--nats", nats_srv.url, "--workdir", str(work),
             "--metrics-port", "0",
             # a CPU engine on CI's starved host went > 1 s without a step (7 Dec): by design that snapshot is
             # estimated analytically; what is tested is that the real engines' snapshots reach the estimator
             "--snapshot-max-age", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        lines: list[str] = []
        try:
            _read_until(proc, lines, "Ctrl-C stops everything", 1200.0)
            ports = {m[1]: int(m[2]) for m in re.finditer(r"instance (vllm-\d+)\s+http://127\.0\.0\.1:(\d+)/v1",
                                                          "".join(lines))}  # fmt: skip
            assert set(ports) == {"vllm-0", "vllm-1"}, "".join(lines)
            assert all(healthy(p) for p in ports.values())
            results = asyncio.run(_queries(nats_srv.url, 8))
            for msgs in results:
                assert msgs[-1]["v"] == "bear.done/1", msgs[-1]
                assert msgs[-1]["instance"] in ports and msgs[-1]["usage"]["completion_tokens"] >= 1
                routed = [m for m in msgs if m["v"] == "bear.routed/1"]
                assert routed[-1]["ttft_method"] == "bea", routed[-1]  # the real engines' snapshots were used
                assert routed[-1]["model"] == "tiny"
            recs = [json.loads(ln) for ln in (work / "latest" / "outcomes-router-0.jsonl").read_text().splitlines()]
            assert {r["query_id"] for r in recs if r["status"] == "done"} >= {f"up-{i}" for i in range(8)}
            key = (work / "gateway-api-key").read_text().strip()
            _engine_fields("http://127.0.0.1:8000/v1", key)
            engine_key = json.loads((work / "latest" / "auth" / "engine-keys.json").read_text())["vllm-0"]
            _prompt_forms("http://127.0.0.1:8000/v1", key, f"http://127.0.0.1:{ports['vllm-0']}/v1", engine_key)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        assert rc == 0, "".join(lines)[-3000:]
        assert "stopped." in "".join(lines)
        # every vLLM (API server + engine core) is gone with the stack
        assert not any(healthy(p) for p in ports.values())
        assert _stack_rings() <= rings_before  # the plugin rings were removed
