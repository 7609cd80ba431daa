"""Run a real vLLM (CPU build) with the BEAR plugin, the snapshotter and a Poisson load; shared by
the tests in this folder. The vLLM process itself (BEAR_VLLM_PYTHON, a separate venv made by
.ci/install-vllm.sh; command line; tiny model) is ``bear.vllm_instance.launch``, which
``bear up --backend vllm`` uses too."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bear.runtime.nats_server import LocalNatsServer
from bear.vllm_instance.launch import VllmServer, make_tiny_model, vllm_python

from waiting import wait_until

__all__ = [
    "ChatSessions",
    "Collector",
    "Load",
    "Served",
    "VllmServer",
    "load_in_process",
    "make_tiny_model",
    "post",
    "retries",
    "run_chat_sessions",
    "run_load",
    "serve",
    "vllm_python",
]


@dataclass
class Load:
    """A Poisson stream of completions with random token-id prompts (ignore_eos: exact lengths).
    ``prefix_frac`` of the prompts start with one of two shared ``prefix``-token prefixes (prefix
    cache hits); ``abort_frac`` of the clients give up after 5–100 ms (vLLM aborts the request; at 0.05–0.6 s a
    fast host answered all but 0 to 2 of them first: the tiny model steps in about 1 ms)."""

    n: int
    rate: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    seed: int = 0
    prefix: int = 0
    prefix_frac: float = 0.0
    abort_frac: float = 0.0


# vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), httpx keeps one for 5 s
# too: a request written as the server closes it breaks (a run here: BrokenPipeError under
# ReadError('')). Connections go after 2 s, before the server closes them.
LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)


def _chain(exc: BaseException) -> str:
    """The error and its causes (httpx's ``ReadError('')`` says nothing of the reset under it)."""
    parts = []
    e: BaseException | None = exc
    while e is not None and len(parts) < 4:
        parts.append(repr(e))
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


async def post(client: httpx.AsyncClient, url: str, *, retried: list[str], **kw: Any) -> httpx.Response:
    """POST, again once on a fresh connection when the connection broke before any answer (as the
    OpenAI SDK retries a connection error): the engine's TCP server is not what these tests test,
    and a reset on a loaded host must not fail them. Each retry is noted in ``retried``, which
    the tests report and bound. Timeouts are not retried (the aborting clients expect them)."""
    try:
        return await client.post(url, **kw)
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ConnectError) as exc:
        retried.append(_chain(exc))
        return await client.post(url, **kw)


async def run_load(base_url: str, load: Load) -> list[dict[str, Any]]:
    rng = random.Random(load.seed)
    results: list[dict[str, Any]] = []

    prefixes = [[rng.randint(0, 255) for _ in range(load.prefix)] for _ in range(2)]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        n_prompt = rng.randint(*load.prompt)
        prompt = [rng.randint(0, 255) for _ in range(n_prompt)]
        if load.prefix and rng.random() < load.prefix_frac:
            prompt = rng.choice(prefixes) + prompt
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": rng.randint(*load.output),
            "ignore_eos": True,
            "temperature": 0.0,
        }
        timeout = rng.uniform(0.005, 0.1) if load.abort_frac and rng.random() < load.abort_frac else 600
        t0 = time.monotonic()
        retried: list[str] = []
        try:
            r = await post(client, f"{base_url}/completions", json=body, timeout=timeout, retried=retried)
            results.append({"i": i, "status": r.status_code, "latency": time.monotonic() - t0, "retried": retried})
        except httpx.HTTPError as exc:
            results.append({"i": i, "status": -1, "error": _chain(exc), "aborted": timeout < 600,
                            "retried": retried})

    async with httpx.AsyncClient(limits=LIMITS) as client:
        tasks = []
        for i in range(load.n):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(rng.expovariate(load.rate))  # sleep: Poisson arrivals (the workload)
        await asyncio.gather(*tasks)
    return results


@dataclass
class ChatSessions:
    """Multi-turn chat sessions through ``/chat/completions``: each turn resends the whole
    conversation (a shared system prompt, one of ``n_system``, then alternating user and
    assistant messages), so every turn after the first starts with the previous one's prompt.
    Lengths follow vLLM's multi-turn benchmark generator defaults (vllm-project/vllm
    ``benchmarks/multi_turn/generate_multi_turn.json``): 6–9 user turns of 120–160 tokens,
    answers of 80–120 tokens, a 500-token common prefix (here the system prompt). Sessions start
    as a Poisson stream; a turn follows the answer of the previous one after ``think_s``."""

    n_sessions: int
    session_rate: float
    turns: tuple[int, int] = (6, 9)
    user_tokens: tuple[int, int] = (120, 160)
    answer_tokens: tuple[int, int] = (80, 120)
    system_tokens: int = 500
    n_system: int = 2
    think_s: tuple[float, float] = (0.1, 0.8)
    seed: int = 0


def _text(rng: random.Random, n: int) -> str:
    """About ``n`` byte-level tokens of lower-case words."""
    words = []
    size = 0
    while size < n:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n]


async def run_chat_sessions(base_url: str, load: ChatSessions, encode: Any) -> list[dict[str, Any]]:
    """Run the sessions; per request ``{id, session, turn, status, usage, prompt_token_ids}`` where
    the ids are ``encode(messages)`` (BEAR's tokenisation of what was sent); with ``encode`` None,
    ``messages`` instead (the caller tokenises: ``load_in_process``)."""
    rng = random.Random(load.seed)
    systems = [_text(rng, load.system_tokens) for _ in range(load.n_system)]
    out: list[dict[str, Any]] = []

    async def session(client: httpx.AsyncClient, s: int, srng: random.Random) -> None:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": srng.choice(systems)}]
        for t in range(srng.randint(*load.turns)):
            msgs.append({"role": "user", "content": _text(srng, srng.randint(*load.user_tokens))})
            rid = f"s{s}-t{t}"
            body = {"model": "tiny", "messages": msgs, "max_tokens": srng.randint(*load.answer_tokens),
                    "ignore_eos": True, "temperature": 0.0}
            ids = encode(msgs) if encode is not None else None
            retried: list[str] = []
            r = await post(client, f"{base_url}/chat/completions", json=body, headers={"X-Request-Id": rid},
                           timeout=600, retried=retried)
            rec: dict[str, Any] = {"id": rid, "session": s, "turn": t, "status": r.status_code,
                                   "retried": retried}
            rec.update({"prompt_token_ids": ids} if ids is not None else {"messages": list(msgs)})
            if r.status_code != 200:
                out.append(rec)
                return
            data = r.json()
            rec["usage"] = data.get("usage")
            out.append(rec)
            msgs.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})
            await asyncio.sleep(srng.uniform(*load.think_s))  # sleep: the user's think time (the workload)

    async with httpx.AsyncClient(limits=LIMITS) as client:
        tasks = []
        for s in range(load.n_sessions):
            tasks.append(asyncio.create_task(session(client, s, random.Random(rng.random()))))
            await asyncio.sleep(rng.expovariate(load.session_rate))  # sleep: Poisson session starts (the workload)
        await asyncio.gather(*tasks)
    return out


def retries(results: list[dict[str, Any]]) -> list[str]:
    """The connection errors retried over a run (each one's error chain); tests allow a few."""
    return [e for r in results for e in r.get("retried", ())]


def _write_spec(work_dir: Path, base_url: str, load: Load | ChatSessions) -> tuple[Path, Path]:
    work_dir.mkdir(parents=True, exist_ok=True)
    spec, out = work_dir / "load-spec.json", work_dir / "load-results.json"
    kind = "chat" if isinstance(load, ChatSessions) else "load"
    spec.write_text(json.dumps({"base_url": base_url, "kind": kind, "params": dataclasses.asdict(load)}))
    return spec, out


def _read_results(out: Path, rc: int) -> list[dict[str, Any]]:
    if rc != 0 or not out.exists():
        raise RuntimeError(f"the load process exited with {rc} (its output is above)")
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


async def load_in_process(base_url: str, load: Load | ChatSessions, work_dir: Path,
                          encode: Any = None) -> list[dict[str, Any]]:
    """Run ``load`` against ``base_url`` from its own process (``load_process.py``: the snapshotter
    in the test's process keeps its event loop) and return its per-request results; chat
    requests get ``prompt_token_ids = encode(messages)`` here. Cancelling kills the process."""
    spec, out = _write_spec(work_dir, base_url, load)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__).with_name("load_process.py")),
                                                str(spec), str(out))
    try:
        rc = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
    results = _read_results(out, rc)
    if encode is not None:
        for r in results:
            if "messages" in r:
                r["prompt_token_ids"] = encode(r.pop("messages"))
    return results


class Collector:
    """Subscribe to ``subjects`` from a process of its own (``collect_process.py``) so that a
    snapshotter's bursts cannot make the test's subscriber a slow consumer; ``finish(last_seq)``
    returns each subject's messages, in arrival order, once every subject delivered that seq
    (``any_subject``: once one did — a state goes out either in full or as a delta)."""

    def __init__(self, url: str, subjects: list[str], work_dir: Path, *, any_subject: bool = False) -> None:
        self.url, self.subjects, self.work_dir, self.any_subject = url, subjects, work_dir, any_subject
        self.proc: asyncio.subprocess.Process | None = None
        self.events: list[dict[str, Any]] = []  # its connection's disconnects, reconnects, errors

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).with_name("collect_process.py")), self.url, str(self.work_dir),
            *(["--any"] if self.any_subject else []), *self.subjects, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the collector did not start (exit {await self.proc.wait()})")

    async def finish(self, last_seq: int) -> list[list[bytes]]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{last_seq}\n".encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        rc = await self.proc.wait()
        if line.strip() != b"done" or rc != 0:
            raise RuntimeError(f"the collector failed (exit {rc}) waiting for seq {last_seq}")
        self.events = json.loads((self.work_dir / "events.json").read_text())
        return [_read_frames(self.work_dir / f"{n}.bin") for n in range(len(self.subjects))]

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()


def _read_frames(path: Path) -> list[bytes]:
    data = path.read_bytes()
    out, k = [], 0
    while k < len(data):
        (n,) = struct.unpack_from(">I", data, k)
        out.append(data[k + 4:k + 4 + n])
        k += 4 + n
    return out


@dataclass
class Served:
    """What ``serve`` saw: the load's per-request results, the records the engine wrote, the newest
    state the snapshotter published, and (with a collector) each subject's messages."""

    results: list[dict[str, Any]]
    written: int
    last_seq: int
    collected: list[list[bytes]]
    subscriber_events: list[dict[str, Any]] = dataclasses.field(default_factory=list)


async def serve(svc: Any, base_url: str, load: Load | ChatSessions, work_dir: Path, *, encode: Any = None,
                collector: Collector | None = None) -> Served:
    """Run ``load`` (from its own process) while the snapshotter ``svc`` runs, then wait — on events,
    each with a deadline that only bounds a hang — until it has read every record the engine wrote
    and published every state, and ``collector`` has received the newest one (an idle engine's
    state is re-sent in full, so it reaches the full-snapshot subject too); ``svc`` is left
    running (the caller stops it)."""
    await wait_until(lambda: svc.publisher.nc is not None and svc._reader is not None, timeout=120,
                     what="the snapshotter attached to the engine and connected")
    results = await load_in_process(base_url, load, work_dir / "load", encode=encode)
    reader = await wait_until(lambda: svc._reader if svc._reader.next_index >= svc._reader.count else None,
                              timeout=120, what="the snapshotter caught up with the ring")
    written = reader.count
    await wait_until(lambda: svc.publisher.pending == 0 and svc.publisher.stream.last is not None, timeout=60,
                     what="every state published")
    last = int(svc.publisher.stream.last["seq"])
    collected: list[list[bytes]] = []
    if collector is not None:
        try:
            collected = await asyncio.wait_for(collector.finish(last), 120)
        except TimeoutError:
            raise AssertionError(f"seq {last} never reached the subscriber: states lost on NATS") from None
    return Served(results, written, last, collected, collector.events if collector is not None else [])


# Core NATS delivers at most once: the server closes a subscriber that falls behind (by default
# 64 MiB pending or a write blocked 10 s) and what it sent meanwhile is gone, which is the
# subscriber's loss, not the publisher's. The tests that check every published state give their
# collector this much room (a CI run lost one state of 11,789 under KV pressure, 2 Dec 2026).
ROOMY_NATS = "max_pending: 1073741824\nwrite_deadline: \"120s\"\nmax_payload: 8388608\n"


def roomy_nats_server(work_dir: Path) -> LocalNatsServer:
    """A nats-server whose slow-consumer limits a test's collector on a loaded host stays inside;
    its log (``work_dir/nats.log``) says whether it closed one anyway."""
    work_dir.mkdir(parents=True, exist_ok=True)
    conf = work_dir / "nats.conf"
    conf.write_text(ROOMY_NATS)
    return LocalNatsServer(log_path=work_dir / "nats.log", config=conf)


def check_published_once(seqs: list[int], logged: list[int], served: Served, nats_log: Path) -> bool:
    """Every logged state reached the test's subscriber once; True when it did. Where the
    subscriber's own connection broke (a slow-consumer close on a loaded host: NATS core drops
    what it sent meanwhile), only no repeats can be checked, and False says so; a state missing
    or repeated or out of order with the subscriber's connection whole fails. (A full state once
    arrived late on a loaded host: the snapshotter's reader and its publisher loop both sent
    states, and one yielded inside ``nc.publish``; they take turns now, docs/snapshotter.md.)"""
    if not served.subscriber_events:
        closed = [ln for ln in nats_log.read_text(errors="replace").splitlines() if "Slow Consumer" in ln][:3] \
            if nats_log.exists() else []
        assert sorted(seqs) == logged, f"states missing or repeated on NATS (server: {closed})"
        assert seqs == logged, "states out of order on NATS"
        return True
    assert len(seqs) == len(set(seqs)) and set(seqs) <= set(logged), "states repeated on NATS"
    return False
