"""``bear bench faults --faults stream-restarts``: NATS restarts while long answers stream (issue
40, item 1). On a local stack as ``bear up`` starts it (authentication on, three sim engines, two
routers), rounds of ``streams`` concurrent answers of ``tokens`` tokens; in each, once every answer
has streamed a tenth of its tokens, nats-server is restarted — SIGTERM in ``restarts`` rounds,
SIGKILL in as many. The load client reconnects ``client_reconnect_s`` apart (1 s: after the
routers, which come back in 0.1 s — their chunks buffered through the outage reach the new server
before the client has subscribed again: the loss the issue measured).

Per answer, what the caller of ``submit()`` saw: **whole** (``done``, every ``seq`` in order, as
many chunks as ``Done.chunks``, and as many words as ``usage.completion_tokens`` — the sim engine
writes one word per token), **resumed** (whole after a gap was asked for again: the client
library's ``RESUMED`` count), **coded error** (by code; ``incomplete``: a gap not sent again) and
**done with a gap** (``done`` with a chunk or a token missing: must be 0)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bear.runtime import aio

STREAMS, TOKENS, RESTARTS = 12, 800, 5


def restart_nats(stack: Any, how: signal.Signals) -> None:
    """nats-server stopped by ``how`` (SIGTERM: it shuts down; SIGKILL: it dies), then started."""
    srv = stack.nats
    if how == signal.SIGKILL and srv.proc is not None and srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()
        srv.proc = None
    else:
        srv.stop()
    srv.start()


class Answer:
    """One answer as its caller saw it."""

    __slots__ = ("chunks", "declared", "end", "message", "seqs", "tokens", "words")

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.chunks = 0
        self.words = 0
        self.end = ""  # done | an error code
        self.message = ""
        self.declared: int | None = None  # Done.chunks
        self.tokens: int | None = None  # usage.completion_tokens

    @property
    def gap(self) -> bool:
        """Ended ``done`` with a chunk or a token missing."""
        if self.end != "done":
            return False
        in_order = self.seqs == list(range(len(self.seqs)))
        return (not in_order or (self.declared is not None and self.declared != len(self.seqs))
                or (self.tokens is not None and self.tokens != self.words))


async def _round(nc: Any, stack: Any, how: signal.Signals, streams: int, tokens: int, k: int) -> list[Answer]:
    from bear.client.submit import submit
    from bear.protocol.replies import Chunk, Done, Error

    answers = [Answer() for _ in range(streams)]
    under_way = asyncio.Event()  # every answer has streamed a tenth of its tokens (or ended)
    counted: set[int] = set()

    def count(i: int) -> None:
        counted.add(i)
        if len(counted) == streams:
            under_way.set()

    async def one(i: int, a: Answer) -> None:
        try:
            await _one(i, a)
        finally:
            count(i)

    async def _one(i: int, a: Answer) -> None:
        async for m in submit(nc, f"round {k} answer {i}: tell a long story", max_tokens=tokens, ttft_target_s=5.0,
                              query_id=f"streams-{k}-{i}-{time.time_ns()}", idle_timeout_s=30.0):
            if isinstance(m, Chunk):
                a.seqs.append(m.seq)
                a.words += len((m.text or "").split())
                if a.words >= tokens // 10:
                    count(i)
            elif isinstance(m, Done):
                a.end, a.tokens = "done", int((m.usage or {}).get("completion_tokens", a.words))
                a.declared = None if not isinstance(m.chunks, int) else m.chunks
            elif isinstance(m, Error):
                a.end, a.message = m.code, m.message[:160]

    tasks = [asyncio.create_task(one(i, a)) for i, a in enumerate(answers)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(under_way.wait(), 120.0)
    await asyncio.to_thread(restart_nats, stack, how)
    await asyncio.gather(*tasks)
    return answers


async def _rounds(stack: Any, plan: list[signal.Signals], streams: int, tokens: int, client_reconnect_s: float,
                  log: Any) -> dict[str, Any]:
    from bear.client import submit as client
    from bear.runtime.service import connect
    from bear.stack.stack import wait_ready

    async def ready() -> None:  # routing resumed: a probe query answered to its end
        await wait_ready(stack.url, list(stack.instances), stack.cfg.prefix, 90.0, stack, creds=stack.creds("admin"))

    await ready()
    nc = await connect(stack.url, "bear-bench-streams", creds="", reconnect_time_wait=client_reconnect_s,
                       **stack.nats_options("client"))
    by_sig: dict[str, dict[str, Any]] = {}
    examples: list[str] = []
    try:
        for k, how in enumerate(plan):
            before = dict(client.RESUMED)
            answers = await _round(nc, stack, how, streams, tokens, k)
            resumed = client.RESUMED["answers"] - before["answers"]
            s = by_sig.setdefault(how.name, {"restarts": 0, "answers": 0, "whole": 0, "resumed": 0,
                                             "coded_errors": Counter(), "done_with_gap": 0, "chunks_resent": 0,
                                             "resend_requests": 0})
            done_ok = sum(a.end == "done" and not a.gap for a in answers)
            s["restarts"] += 1
            s["answers"] += len(answers)
            s["resumed"] += resumed
            s["whole"] += done_ok - resumed
            s["done_with_gap"] += sum(a.gap for a in answers)
            s["coded_errors"].update(a.end for a in answers if a.end != "done")
            s["chunks_resent"] += client.RESUMED["chunks"] - before["chunks"]
            s["resend_requests"] += client.RESUMED["requests"] - before["requests"]
            examples += [f"{how.name} round {k}: {a.end}: {a.message}" for a in answers if a.end != "done"][:3]
            log(f"  {how.name} restart {s['restarts']}: {done_ok} of {len(answers)} whole "
                f"({resumed} resumed), {sum(a.gap for a in answers)} done with a gap, "
                f"errors {dict(Counter(a.end for a in answers if a.end != 'done')) or '—'}")
            await ready()
    finally:
        await nc.close()
    for s in by_sig.values():
        s["coded_errors"] = dict(s["coded_errors"])
    total: dict[str, Any] = {key: sum(s[key] for s in by_sig.values())
                             for key in ("restarts", "answers", "whole", "resumed", "done_with_gap", "chunks_resent",
                                         "resend_requests")}
    errors: Counter[str] = Counter()
    for s in by_sig.values():
        errors.update(s["coded_errors"])
    return {**total, "coded_errors": dict(errors), "by_signal": by_sig, "errors": examples[:5]}


def stream_restarts(work: Path, *, restarts: int = RESTARTS, streams: int = STREAMS, tokens: int = TOKENS,
                    client_reconnect_s: float = 1.0, log: Any = print) -> dict[str, Any]:
    """The figures of ``restarts`` SIGTERM and ``restarts`` SIGKILL rounds (alternating), with the
    keys ``faults_table`` reads (sent = answers, done = whole or resumed, lost = done with a gap)."""
    from bear.stack.stack import Stack, StackConfig

    cfg = StackConfig(workdir=work, estimator_workers=2, routers=2, log_level="warning", restart_backoff_s=(0.5, 5.0))
    plan = [signal.SIGTERM, signal.SIGKILL] * restarts
    with Stack(cfg) as stack:
        figs = aio.run(_rounds(stack, plan, streams, tokens, client_reconnect_s, log))
    figs.update(fault="stream-restarts", sent=figs["answers"], done=figs["whole"] + figs["resumed"],
                lost=figs["done_with_gap"], recovery_s=0.0, tokens=tokens, streams=streams,
                client_reconnect_s=client_reconnect_s,
                note=f"{restarts} SIGTERM + {restarts} SIGKILL restarts of nats-server, {streams} answers of "
                     f"{tokens} tokens streaming in each; 'lost' = ended done with a chunk missing")
    return figs


def streams_table(r: dict[str, Any]) -> str:
    """The figures as a Markdown table (one row per signal, and all)."""
    rows = ["| restarts | answers | whole | resumed | coded error | done with a gap | chunks sent again | "
            "resend requests |", "|---|---|---|---|---|---|---|---|"]

    def row(name: str, s: dict[str, Any]) -> str:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(s["coded_errors"].items())) or "0"
        return (f"| {name} | {s['answers']} | {s['whole']} | {s['resumed']} | {errs} | {s['done_with_gap']} | "
                f"{s['chunks_resent']} | {s['resend_requests']} |")

    for sig, s in r["by_signal"].items():
        rows.append(row(f"{s['restarts']} × {sig}", s))
    rows.append(row(f"all {r['restarts']}", r))
    return "\n".join(rows)
