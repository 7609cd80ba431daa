"""``bear load``: an open-loop workload through the client — the synthetic task mix of the
predictor (``bear.predictor.synth``), Poisson or MMPP-2 arrivals (``bear.load.arrivals``), TTFT
targets of paper Appendix A.2 (``bear.load.targets``) — then OnTimeUtility, SLO attainment and
the routing composition per instance (``bear.load.metrics``).

The synthetic generator gives every query its true quality on every model; the realised utility
of a query is its true quality on the chosen model minus λ·cost of the tokens the engine really
used (micro-USD, the registry's prices) — what paper eq. 6 averages. How long each answer is, is
the engine's business (a sim engine's own length model, or the real model)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bear.load.metrics import Outcome, summary
from bear.runtime.shutdown import cancel_all

PRICES = {  # USD per million tokens (paper Table 1), by predictor model name
    "Qwen3-0.6B": (0.044, 0.173), "Qwen3-8B": (0.072, 0.287), "Qwen3-32B": (0.287, 0.640)}


@dataclass
class LoadQuery:
    query_id: str
    task: str
    prompt: str
    prompt_tokens: int
    quality: dict[str, float]
    target_s: float


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    terminal: int = 0
    duplicates_terminal: int = 0  # queries that got more than one terminal message (must stay 0)
    elapsed_s: float = 0.0
    decision_s: list[float] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        s = summary(self.outcomes)
        n_all = self.sent or 1
        done = len(self.outcomes)
        # Errors count as missed queries: OnTimeUtility and SLO attainment over everything sent.
        s["on_time_utility"] = s["on_time_utility"] * done / n_all
        s["slo_attainment"] = s["slo_attainment"] * done / n_all
        s.update(sent=self.sent, done=done, errors=dict(self.errors), elapsed_s=self.elapsed_s,
                 achieved_rate=self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0)
        if self.decision_s:
            d = np.array(self.decision_s)
            s["decision_ms"] = {"p50": float(np.percentile(d, 50) * 1e3), "p99": float(np.percentile(d, 99) * 1e3)}
        return s


PROMPT_SPECIAL_TOKENS = 16  # tokens a prompt may gain beyond its bytes (BOS and the like) where a context binds
DRAW_ROUNDS = 50  # rounds of n draws before a load in a small context gives up


class DoesNotFit(ValueError):
    """No (or too few) prompts of the task mix fit the context the load is bound to."""


def fits(prompt: str, context: int | None) -> bool:
    """Whether the prompt surely fits ``context`` tokens with one output token: its UTF-8 bytes
    bound its length under any byte-level tokenizer (merges only shorten), plus a few special
    tokens; the text alone says nothing more without the engine's tokenizer."""
    return context is None or len(prompt.encode()) + PROMPT_SPECIAL_TOKENS < context


def make_queries(n: int, seed: int, tasks: tuple[str, ...] | None, models: tuple[str, ...],
                 context: int | None = None) -> tuple[list[LoadQuery], int]:
    """``n`` queries of the synthetic mix and how many draws were left out as too long for a
    ``context``-token engine (None: no bound). ``DoesNotFit`` when fewer than ``n`` fit in
    ``DRAW_ROUNDS`` rounds of draws."""
    from bear.load.targets import ttft_target_s
    from bear.predictor.synth import TASKS, generate

    rng = np.random.default_rng(seed + 1)
    out: list[LoadQuery] = []
    m = len(models)
    left_out = 0
    for r in range(DRAW_ROUNDS):
        recs = list(generate(n, seed=seed + 7919 * r, models=models, tasks=tasks or TASKS))
        for i in range(n):
            group = recs[i * m:(i + 1) * m]
            r0 = group[0]
            if not fits(r0.prompt, context):
                left_out += 1
                continue
            ptoks = int(r0.prompt_tokens or 1)
            out.append(LoadQuery(query_id=f"load-{seed}-{len(out)}-{time.time_ns() % 10**9}", task=r0.task,
                                 prompt=r0.prompt, prompt_tokens=ptoks, quality={r.model: r.quality for r in group},
                                 target_s=float(ttft_target_s(ptoks, rng)[0])))
            if len(out) == n:
                return out, left_out
    shortest = min(len(q.prompt.encode()) for q in out) if out else None
    raise DoesNotFit(f"only {len(out)} of {n} prompts of the task mix fit a {context}-token context in "
                     f"{DRAW_ROUNDS * n} draws{f' (shortest {shortest} bytes)' if shortest else ''}: choose tasks "
                     "with shorter prompts (--tasks) or engines with a longer context")


async def run_load(nc: Any, queries: list[LoadQuery], times: np.ndarray, *, lam: float = 5e-4, max_tokens: int = 4096,
                   fit_context: bool = True, on_event: Callable[[str, LoadResult], None] | None = None, subjects: Any = None,
                   accept_timeout_s: float = 2.0, idle_timeout_s: float = 30.0) -> LoadResult:
    from bear.client.submit import submit
    from bear.protocol.replies import Done, Error

    res = LoadResult()
    t_start = time.monotonic()

    async def one(q: LoadQuery) -> None:
        terminal = 0
        async for msg in submit(nc, q.prompt, ttft_target_s=q.target_s, max_tokens=max_tokens, lam=lam,
                                query_id=q.query_id, subjects=subjects, accept_timeout_s=accept_timeout_s, idle_timeout_s=idle_timeout_s,
                                fit_context=fit_context):
            if isinstance(msg, Done):
                terminal += 1
                model = str(msg.predictor_model or msg.model).rsplit("/", 1)[-1]
                usage = msg.usage or {}
                pin, pout = PRICES.get(model, (0.0, 0.0))
                cost = int(usage.get("prompt_tokens", q.prompt_tokens)) * pin + int(usage.get("completion_tokens", 0)) * pout
                quality = q.quality.get(model, 0.0)
                ttft = math.inf if msg.ttft_s is None else float(msg.ttft_s)
                pred = msg.predicted_ttft_s
                res.outcomes.append(Outcome(query_id=q.query_id, task=q.task, instance=str(msg.instance),
                                            model=model, target_s=q.target_s, ttft_s=ttft,
                                            utility=quality - lam * cost,
                                            predicted_ttft_s=float(pred) if pred is not None else math.nan))
                if isinstance(msg.decision_s, float):
                    res.decision_s.append(msg.decision_s)
                if on_event:
                    on_event("done", res)
            elif isinstance(msg, Error):
                terminal += 1
                res.errors[msg.code or "?"] += 1
                if on_event:
                    on_event("error", res)
        res.terminal += 1
        if terminal != 1:
            res.duplicates_terminal += 1

    tasks: list[asyncio.Task[None]] = []
    try:
        for q, t in zip(queries, times, strict=True):
            delay = float(t) - (time.monotonic() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(q)))
            res.sent += 1
            if on_event:
                on_event("sent", res)
        await asyncio.gather(*tasks)
    finally:  # cancelled (Ctrl-C) or failed: the queries in flight stop here, not at loop shutdown
        await cancel_all([t for t in tasks if not t.done()])  # type: ignore[misc]
    res.elapsed_s = time.monotonic() - t_start
    return res
