"""``bear bench relay``: what relaying a streamed answer costs a Python process, per token.

Issue 28 asks for at most 0.5 ms of router CPU per query with a 256-token answer, the relay
included. This bench measures the relay alone, three ways, on one engine and one bus:

* ``bear``: the router's own relay — ``stream_completion`` (the SSE parse, the coalescing) and
  ``ClientStream.send`` of a ``Chunk`` per piece, the terminal ``Done`` — without the decision;
* ``minimal``: aiohttp and nats-py with nothing between them — each SSE event, as read,
  published unparsed;
* ``raw``: no HTTP or NATS library at all — asyncio protocols on both sockets, each event found
  in the bytes read and written to the NATS socket as a ``PUB`` at once: one read and one write
  per token, the floor of any relay that handles each token in a Python process.

Each relay runs in a process of its own and reports its CPU (user + system,
``time.process_time``) over the measured answers; the engine (an aiohttp server streaming
vLLM's completions chunks: an engine step every ``step_s`` gives each running answer its next
token, ``tokens`` per answer) and the bench, which counts every relayed token at the bus
(nothing lost), run beside it. The figures are this host's; the ratios between the three are
what carries over."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from bear.protocol.errors import BearError, ErrorCode
from bear.runtime.children import die_with_parent

VARIANTS = ("raw", "minimal", "bear")
SINK = "bench.relay"
TOKEN = b" tok"  # every streamed token's text


def _chunk(i: int, last: bool) -> bytes:
    """One SSE event as vLLM's completions stream writes it."""
    body = {"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": "bench",
            "choices": [{"index": 0, "text": TOKEN.decode(), "logprobs": None, "finish_reason": "length" if last else None,
                         "stop_reason": None}], "usage": None}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def _engine(port: int, tokens: int, step_s: float) -> None:
    """Streams as an engine does: a step every ``step_s`` gives every running answer its next
    token at once (vLLM's API server then writes them one after the other)."""
    from aiohttp import web

    loop = asyncio.get_running_loop()
    step: list[asyncio.Future[None]] = [loop.create_future()]

    async def steps() -> None:
        while True:
            await asyncio.sleep(step_s)
            done, step[0] = step[0], loop.create_future()
            done.set_result(None)

    async def completions(req: web.Request) -> web.StreamResponse:
        await req.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for i in range(tokens):
            await step[0]
            await resp.write(_chunk(i, i == tokens - 1))
        usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": tokens + 4}
        await resp.write(b"data: " + json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 1,
                                                  "model": "bench", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    ticker = asyncio.create_task(steps())
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await ticker


class _RawNats(asyncio.Protocol):
    """A NATS connection reduced to what a relay writes: CONNECT, then PUBs; PINGs answered."""

    def __init__(self) -> None:
        self.pongs: list[asyncio.Future[None]] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(b'CONNECT {"verbose":false,"pedantic":false}\r\n')

    def data_received(self, data: bytes) -> None:
        if b"PING" in data:
            self.transport.write(b"PONG\r\n")
        for _ in range(data.count(b"PONG")):
            if self.pongs:
                self.pongs.pop(0).set_result(None)

    async def flush(self) -> None:
        """Until the server has read every PUB written before (its PONG comes after them)."""
        pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pongs.append(pong)
        self.transport.write(b"PING\r\n")
        await pong


class _RawEngine(asyncio.Protocol):
    """One streamed answer read off its socket: each SSE event's payload published as read."""

    def __init__(self, nats: _RawNats, subject: bytes, done: asyncio.Future[None]) -> None:
        self.nats, self.subject, self.done = nats, subject, done
        self.buf = b""
        self.head = True

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        body = b'{"model":"bench","prompt":"hi","stream":true}'
        transport.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.head:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            self.buf, self.head = self.buf[i + 4:], False
        while (i := self.buf.find(b"\n\n")) >= 0:  # the chunked framing's size lines come before "data: "
            event, self.buf = self.buf[:i], self.buf[i + 2:]
            j = event.find(b"data: ")
            if j < 0:
                continue
            payload = event[j + 6:]
            if payload == b"[DONE]":
                self.transport.close()
                return
            self.nats.transport.write(b"PUB %s %d\r\n%s\r\n" % (self.subject, len(payload), payload))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _relay(variant: str, engine_url: str, nats_url: str, answers: int, concurrency: int) -> dict[str, Any]:
    import nats

    from bear.protocol.replies import Chunk, Done
    from bear.router.client_stream import ClientStream
    from bear.router.dispatch import engine_session, request_body, stream_completion

    loop = asyncio.get_running_loop()
    nc = await nats.connect(nats_url)
    session = engine_session()
    host, port = nats_url.rsplit("/", 1)[1].split(":")
    _, raw_nats = await loop.create_connection(_RawNats, host, int(port))
    ehost, eport = engine_url.split("//", 1)[1].split("/", 1)[0].split(":")
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        subject = f"{SINK}.{i}"
        async with sem:
            if variant == "raw":
                done: asyncio.Future[None] = loop.create_future()
                await loop.create_connection(lambda: _RawEngine(raw_nats, subject.encode(), done), ehost, int(eport))
                await done
            elif variant == "minimal":
                async with session.post(engine_url + "/completions",
                                        json={"model": "bench", "prompt": "hi", "stream": True}) as resp:
                    buf = b""
                    async for data in resp.content.iter_any():
                        buf += data
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            if event != b"data: [DONE]":
                                await nc.publish(subject, event)
            else:
                out = ClientStream(nc, subject, f"bench-{i}", nonce="bench")
                path, body = request_body("bench", "hi", None, None)
                seq = 0
                async for piece in stream_completion(session, engine_url, f"bench-{i}", path, body):
                    if piece.text:
                        await out.send(Chunk(seq=seq, text=piece.text))
                        seq += 1
                await out.finish(Done(instance="bench"))

    try:
        await asyncio.gather(*(one(-1 - k) for k in range(min(2, answers))))  # warm: connections, first calls
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(answers)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        await nc.flush()
        await raw_nats.flush()
    finally:
        await session.close()
        await nc.drain()
        raw_nats.transport.close()
    return {"variant": variant, "answers": answers, "cpu_s": cpu, "wall_s": wall}


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    from bear.runtime.children import spawn

    return spawn([sys.executable, "-m", "bear.benchmarks.relay", *args], stdout=subprocess.PIPE)


def run_relay_bench(tokens: int = 256, answers: int = 64, concurrency: int = 16, step_s: float = 0.02,
                    repeat: int = 2, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Each variant ``repeat`` times, interleaved (raw, minimal, bear, raw, …: a host whose load
    drifts moves them alike); per variant the median µs of relay CPU per token."""
    import nats

    from bear.runtime import aio
    from bear.runtime.nats_server import LocalNatsServer
    from bear.runtime.ports import free_port

    port = free_port()
    engine = _spawn(["engine", str(port), str(tokens), str(step_s)])
    runs: list[dict[str, Any]] = []
    try:
        assert engine.stdout is not None
        if engine.stdout.readline().strip() != b"ready":
            raise BearError(ErrorCode.UNAVAILABLE, "the bench's engine process did not start: its error is above")
        with LocalNatsServer() as srv:
            for k in range(repeat):
                for variant in variants:
                    print(f"run {k + 1}/{repeat}: the {variant} relay, {answers} answers of {tokens} tokens …",
                          file=sys.stderr, flush=True)
                    counted = aio.run(_count_while(srv.url, nats, tokens, [
                        "relay", variant, f"http://127.0.0.1:{port}/v1", srv.url, str(answers), str(concurrency)]))
                    runs.append(counted)
    finally:
        engine.kill()
        engine.wait()
    out: dict[str, Any] = {"tokens": tokens, "answers": answers, "concurrency": concurrency, "step_s": step_s,
                           "repeat": repeat, "target_ms_per_answer": 0.5, "runs": runs, "variants": {}}
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        per_token = sorted(r["cpu_s"] / (answers * tokens) * 1e6 for r in mine)
        mid = per_token[len(per_token) // 2]
        out["variants"][variant] = {"cpu_us_per_token": mid, "cpu_ms_per_answer": mid * tokens / 1e3,
                                    "cpu_us_per_token_all": per_token,
                                    "lost": sum(r["lost"] for r in mine)}
    return out


async def _count_while(url: str, nats: Any, tokens: int, args: list[str]) -> dict[str, Any]:
    """Run one relay process; count the tokens that reach the bus meanwhile, per answer (each
    token's text, in the engine's JSON or in a ``Chunk``, whatever the messages held)."""
    nc = await nats.connect(url)
    seen: dict[str, int] = {}

    async def count(msg: Any) -> None:
        seen[msg.subject] = seen.get(msg.subject, 0) + msg.data.count(TOKEN)

    await nc.subscribe(f"{SINK}.>", cb=count)
    await nc.flush()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bear.benchmarks.relay", *args,
                                                stdout=asyncio.subprocess.PIPE, start_new_session=True,
                                                preexec_fn=die_with_parent())
    stdout, _ = await proc.communicate()
    if proc.returncode != 0:
        raise BearError(ErrorCode.UNAVAILABLE, f"the {args[1]} relay exited with {proc.returncode}: its error is above")
    res = json.loads(stdout.decode().strip().splitlines()[-1])
    await nc.flush()  # the relay flushed before it exited: every message is on its way here
    await nc.drain()  # … and drain hands each to ``count`` before it returns
    relayed = sum(n for s, n in seen.items() if not s.rsplit(".", 1)[1].startswith("-"))  # not the warm-up's
    res["tokens_relayed"] = relayed
    res["lost"] = int(res["answers"]) * tokens - relayed
    return res


def main(argv: list[str]) -> None:
    from bear.runtime.aio import run

    if argv[0] == "engine":
        run(_engine(int(argv[1]), int(argv[2]), float(argv[3])))
    elif argv[0] == "relay":
        res = run(_relay(argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])))
        print(json.dumps(res), flush=True)
    else:
        raise SystemExit(f"unknown role {argv[0]!r}")


def relay_table(res: dict[str, Any]) -> str:
    """The figures as a table for people."""
    rows = [f"{'relay':<8} {'CPU µs/token':>13} {'CPU ms per answer':>18} {'lost':>5}"]
    for name, v in res["variants"].items():
        rows.append(f"{name:<8} {v['cpu_us_per_token']:>13.1f} {v['cpu_ms_per_answer']:>18.2f} {v['lost']:>5}")
    rows.append(f"({res['answers']} answers of {res['tokens']} tokens, {res['concurrency']} at once, a token every "
                f"{res['step_s'] * 1e3:g} ms; issue 28's target: {res['target_ms_per_answer']} ms per answer, "
                "decision included)")
    return "\n".join(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
