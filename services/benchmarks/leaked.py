"""``bear bench faults --faults leaked-service`` (issue 40, item 3): what a leaked predictor or
estimator credential gets, with 2 replicas of each, each its own identity (``predictor-0``,
``predictor-1``, ``estimator-0``, ``estimator-1``).

The attacker holds replica 0's credential. It first subscribes to the service's request subject
plainly (the way a rogue once saw 40 of 40 prompts): refused by the server. Then it joins the
service's queue group (which the credential may) and answers every request it is handed first,
with forged replies — ``in-bounds`` ones a real service could send (predictions: the 0.6B model
accuracy 1, the others 0; estimates: the 0.6B instance 50 ms, the others 20 s) or ``out-of-bounds``
ones no real service sends (accuracy 2; a negative TTFT), which the router refuses and counts
(``bear_router_replies_rejected_total``). Per run: prompts seen (distinct query ids in the
requests it was handed) of the queries sent, queries sent to the 0.6B instance against a run
without the attacker (same queries), and ``steered``: queries the attacker answered that went to
the 0.6B instance although the run without it sent them elsewhere. Last, the leaked identity is
revoked (``bear.runtime.nats_auth.revoke`` + a server reload): the attacker's connection is
closed, its reconnects refused, and the queries after it are served by replica 1. One more run
shows the share's limit: the leaked predictor holding ``MANY_SUBS`` queue subscriptions (NATS
hands a group's messages out per subscription, and config-file users have no per-user limit)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bear.runtime import aio

SMALL_MODEL, SMALL_INSTANCE = "Qwen3-0.6B", "qwen0-6b-0"
MODELS = ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B")  # the sim pool's (as bear.benchmarks.faults)
MODES = ("in-bounds", "out-of-bounds")
MANY_SUBS = 9  # what one leaked identity can hold: no per-user subscription limit in config-file auth


@dataclass
class Rogue:
    """A leaked replica credential: a plain subscription (refused), then a queue member that
    answers what it is handed with forged replies."""

    service: str  # predictor | estimator
    mode: str
    subs: int = 1  # queue subscriptions it holds (NATS hands a group's messages per subscription)
    plain_seen: int = 0
    plain_refused: bool = False
    seen: set[str] = field(default_factory=set)
    answered: int = 0
    nc: Any = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # its connection dropped (revoked)

    async def start(self, url: str, creds: Path) -> None:
        from bear.protocol.subjects import ESTIMATOR_QUEUE, PREDICTOR_QUEUE, Subjects
        from bear.runtime.service import connect

        s = Subjects()
        subject, group = (s.predict, PREDICTOR_QUEUE) if self.service == "predictor" else (s.estimate, ESTIMATOR_QUEUE)
        async def dropped() -> None:
            self.gone.set()

        self.nc = await connect(url, f"rogue-{self.service}", creds=creds, max_reconnect_attempts=-1,
                                disconnected_cb=dropped)

        async def plain(_msg: Any) -> None:
            self.plain_seen += 1

        await self.nc.subscribe(subject, cb=plain)
        await self.nc.flush()
        with contextlib.suppress(Exception):
            await self.nc.flush()  # the server's -ERR for the refused subscription has arrived by now
        self.plain_refused = "permissions violation" in str(self.nc.last_error or "").lower()
        for _ in range(self.subs):
            await self.nc.subscribe(subject, queue=group, cb=self._answer)
        await self.nc.flush()

    async def _answer(self, msg: Any) -> None:
        try:
            body = self._forge(msg.data)
        except Exception:
            return
        with contextlib.suppress(Exception):
            await msg.respond(body)
            self.answered += 1

    def _forge(self, data: bytes) -> bytes:
        from bear.protocol import schemas
        from bear.protocol.codec import pack
        from bear.protocol.messages import EstimateReply, EstimateRequest, EstimateRow, decode, encode
        from bear.protocol.predict import decode_predict

        wild = self.mode == "out-of-bounds"
        if self.service == "predictor":
            req = decode_predict(data, max_bytes=1 << 22)
            qid = req.id if isinstance(req.id, str) else ""
            self.seen.add(qid)
            pt = req.prompt_tokens if isinstance(req.prompt_tokens, int) else max(1, len(req.prompt) // 4)
            models = {m: {"acc": (2.0 if wild else 1.0) if m == SMALL_MODEL else 0.0,
                          "len": {"mean": 50.0, "p50": 50.0, "p90": 80.0}, "prompt_tokens": pt, "cost": 0.0}
                      for m in req.models}
            return pack({"v": schemas.PREDICTION, "id": qid, "by": "predictor-0", "models": models})
        ereq = decode(EstimateRequest, data)
        self.seen.add(ereq.query.id)
        self.seen.update(p.query.id for p in ereq.also)

        def rows(cands: list[Any]) -> list[EstimateRow]:
            return [EstimateRow(instance=c.instance, method="bea", status="ok", calibration="profiled", age_s=0.01,
                                ttft_s=0.05 if c.instance == SMALL_INSTANCE else (-1.0 if wild else 20.0))
                    for c in cands]

        return encode(EstimateReply(query_id=ereq.query.id, worker="estimator-0@rogue", at=time.time(),
                                    estimates=rows(ereq.candidates()), also=[rows(p.candidates()) for p in ereq.also]))

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()


def _index(query_id: str) -> int:
    return int(query_id.split("-")[2])  # load-<seed>-<i>-<ns> (bear.load.generator.make_queries)


async def _load(url: str, opts: dict[str, Any], n: int, rate: float, seed: int) -> dict[int, tuple[str, str]]:
    """``n`` queries at ``rate`` q/s (evenly spaced): per query index, (instance routed to, status)."""
    from bear.client.submit import submit
    from bear.load.generator import make_queries
    from bear.protocol.replies import Done, Error, Routed
    from bear.runtime.service import connect

    qs, _ = make_queries(n, seed, None, MODELS)
    out: dict[int, tuple[str, str]] = {}
    nc = await connect(url, "bear-bench-leaked", creds="", **opts)

    async def one(q: Any) -> None:
        inst, status = "", ""
        async for m in submit(nc, q.prompt, ttft_target_s=q.target_s, max_tokens=16, query_id=q.query_id,
                              accept_timeout_s=2.0, idle_timeout_s=15.0):
            if isinstance(m, Routed):
                inst = m.instance
            elif isinstance(m, Done):
                status = "done"
            elif isinstance(m, Error):
                status = m.code
        out[_index(q.query_id)] = (inst, status)

    try:
        tasks = []
        for q in qs:
            tasks.append(asyncio.create_task(one(q)))
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks)
    finally:
        await nc.close()
    return out


def _rejected(metrics_url: str) -> dict[str, float]:
    """``bear_router_replies_rejected_total`` by service from the router's /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^bear_router_replies_rejected_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        svc = re.search(r'service="([^"]+)"', m.group(1))
        if svc:
            out[svc.group(1)] = out.get(svc.group(1), 0.0) + float(m.group(2))
    return out


def _figures(name: str, got: dict[int, tuple[str, str]], base: dict[int, tuple[str, str]], rogue: Rogue | None,
             rejected: float) -> dict[str, Any]:
    n = len(got)
    answered_idx = {_index(q) for q in rogue.seen if q.startswith("load-")} if rogue is not None else set()
    small = {i for i, (inst, _) in got.items() if inst == SMALL_INSTANCE}
    base_small = {i for i, (inst, _) in base.items() if inst == SMALL_INSTANCE}
    codes: dict[str, int] = {}
    for _, st in got.values():
        if st != "done":
            codes[st or "no answer"] = codes.get(st or "no answer", 0) + 1
    return {
        "fault": f"leaked-{name}", "sent": n, "done": sum(st == "done" for _, st in got.values()),
        "coded_errors": codes, "lost": 0, "recovery_s": 0.0,
        "plain_seen": rogue.plain_seen if rogue else 0, "plain_refused": rogue.plain_refused if rogue else None,
        "prompts_seen": len(answered_idx), "forged_replies": rogue.answered if rogue else 0,
        "replies_refused": int(rejected),
        "to_small": len(small), "to_small_without": len(base_small),
        "steered": len((small - base_small) & answered_idx),
        "changed_not_seen": len((small ^ base_small) - answered_idx),  # the run-to-run noise: not the attacker's
    }


def leaked_service(work: Path | None = None, *, n: int = 40, rate: float = 4.0, seed: int = 0,
                   log: Any = print) -> list[dict[str, Any]]:
    from bear.runtime.metrics import LOOPBACK
    from bear.runtime.nats_auth import revoke
    from bear.runtime.nats_server import free_port
    from bear.stack.stack import Stack, StackConfig

    work = work or Path(tempfile.mkdtemp(prefix="bear-leaked-"))
    port = free_port()
    cfg = StackConfig(workdir=work, estimator_workers=2, predictors=2, routers=1, log_level="warning",
                      metrics_port=port)
    results: list[dict[str, Any]] = []
    metrics_url = f"http://{LOOPBACK}:{port}/metrics"
    with Stack(cfg) as stack:
        opts = stack.nats_options("client")
        base = aio.run(_load(stack.url, opts, n, rate, seed))
        results.append(_figures("none", base, base, None, 0))
        log(str(results[-1]))
        for service in ("predictor", "estimator"):
            creds = stack.creds(f"{service}-0")
            assert creds is not None
            for mode in MODES:
                before = _rejected(metrics_url).get(service, 0.0)

                async def attacked(svc: str = service, m: str = mode, c: Path = creds,
                                   subs: int = 1) -> tuple[Any, Rogue]:
                    rogue = Rogue(svc, m, subs)
                    await rogue.start(stack.url, c)
                    try:
                        return await _load(stack.url, opts, n, rate, seed), rogue
                    finally:
                        await rogue.close()

                got, rogue = aio.run(attacked())
                results.append(_figures(f"{service} {mode}", got, base, rogue,
                                        _rejected(metrics_url).get(service, 0.0) - before))
                log(str(results[-1]))
                if service == "predictor" and mode == "in-bounds":  # the limit of the share: subscriptions
                    got, rogue = aio.run(attacked(subs=MANY_SUBS))
                    results.append(_figures(f"{service} {mode}, {MANY_SUBS} subscriptions", got, base, rogue, 0))
                    log(str(results[-1]))

        # revoke the leaked predictor replica: its connections end, its credential is refused
        creds = stack.creds("predictor-0")
        assert creds is not None and stack.auth is not None and stack.nats is not None
        held = work / "leaked-predictor-0.json"  # what the attacker keeps
        held.write_bytes(creds.read_bytes())

        async def revoked() -> tuple[Any, Rogue, bool, bool]:
            rogue = Rogue("predictor", "in-bounds")
            await rogue.start(stack.url, held)
            revoke(stack.auth, ["predictor-0"])
            stack.nats.reload()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rogue.gone.wait(), 10.0)
            closed = not rogue.nc.is_connected
            try:
                got = await _load(stack.url, opts, n, rate, seed)
            finally:
                reconnected = rogue.nc.is_connected
                await rogue.close()
            return got, rogue, closed, reconnected

        before = _rejected(metrics_url).get("predictor", 0.0)
        got, rogue, closed, reconnected = aio.run(revoked())
        figs = _figures("predictor revoked", got, base, rogue, _rejected(metrics_url).get("predictor", 0.0) - before)
        figs.update(rogue_closed=closed, rogue_reconnected=reconnected)
        results.append(figs)
        log(str(results[-1]))
    return results


def leaked_table(results: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table."""
    rows = ["| run | sent | done | plain subscription | prompts seen | forged replies | refused by the router "
            "| to the 0.6B (without the attacker) | steered |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        plain = "—" if r["plain_refused"] is None else (
            f"refused, {r['plain_seen']} seen" if r["plain_refused"] else f"{r['plain_seen']} seen")
        rows.append(f"| {r['fault']} | {r['sent']} | {r['done']} | {plain} | {r['prompts_seen']} of {r['sent']} "
                    f"| {r['forged_replies']} | {r['replies_refused']} | {r['to_small']} ({r['to_small_without']}) "
                    f"| {r['steered']} |")
    return "\n".join(rows)
