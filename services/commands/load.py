"""``bear load``: a synthetic workload through the router, with a live counter and a summary that
explains each of its figures."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from bear.commands.options import FIND_NATS, ClientNatsCreds, NatsUrl, Prefix, positive
from bear.predictor.tasks import TASKS
from bear.protocol.codec import json_safe
from bear.protocol.errors import BearError, ErrorCode
from bear.runtime import aio


class Arrivals(StrEnum):
    poisson = "poisson"
    mmpp = "mmpp"


# What each figure of the summary means, one line each (printed under the tables).
EXPLAIN = {
    "OnTimeUtility": "mean over every query sent of its utility (quality − λ·cost) if its first token met its "
                     "TTFT target, else 0 (paper eq. 6; errors count 0). Quality is the synthetic task mix's "
                     "0–1 score, so 1 is the ceiling; the README's evaluation table gives every router's value on "
                     "this pool at 5–8.9 q/s",
    "SLO attainment": "share of the queries sent whose first token arrived within their TTFT target",
    "mean TTFT": "time to first token (router receives the query → first text), over the completed queries",
    "decision": "router's time from receiving a query to dispatching it (predictor, estimator, policy)",
    "TTFT prediction MAPE": "mean |predicted − observed| / observed TTFT of the chosen instance",
    "routing composition": "share: fraction of the completed queries routed to each instance; on time: "
                           "fraction of those that met their target",
}


def _tasks(value: str) -> str:
    names = [t.strip() for t in value.split(",") if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad:
        raise typer.BadParameter(f"unknown task {', '.join(map(repr, bad))}; valid: {', '.join(TASKS)}")
    return ",".join(names)


def print_report(console: Any, rep: dict[str, Any], title: str = "BEAR load") -> None:
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("queries sent / done", f"{rep['sent']} / {rep['done']}")
    t.add_row("errors", ", ".join(f"{k}: {v}" for k, v in rep["errors"].items()) or "0")
    t.add_row("OnTimeUtility", f"{rep['on_time_utility']:.4f}")
    t.add_row("SLO attainment", f"{rep['slo_attainment']:.1%}")
    t.add_row("mean TTFT", f"{rep['mean_ttft_s'] * 1e3:.0f} ms" if math.isfinite(rep["mean_ttft_s"]) else "-")
    if "decision_ms" in rep:
        t.add_row("decision p50 / p99", f"{rep['decision_ms']['p50']:.2f} / {rep['decision_ms']['p99']:.2f} ms")
    tp = rep.get("ttft_prediction", {})
    if tp.get("n"):
        t.add_row("TTFT prediction MAPE", f"{tp['mape']:.1%} (n={tp['n']})")
    console.print(t)
    c = Table(title="routing composition")
    c.add_column("instance")
    c.add_column("share", justify="right")
    c.add_column("on time", justify="right")
    for inst, v in rep["composition"].items():
        c.add_row(inst, f"{v['share']:.1%}", f"{v['on_time_share']:.1%}")
    console.print(c)
    shown = {"OnTimeUtility", "SLO attainment", "mean TTFT", "routing composition"}
    shown |= {"decision"} if "decision_ms" in rep else set()
    shown |= {"TTFT prediction MAPE"} if tp.get("n") else set()
    for name, meaning in EXPLAIN.items():
        if name in shown:
            console.print(f"[bold]{name}[/bold]: {meaning}", highlight=False)


def load_cmd(
    rate: float = typer.Option(4.0, "--rate", callback=positive, help="Mean arrival rate (queries/s, > 0)"),
    arrivals_kind: Arrivals = typer.Option(Arrivals.poisson, "--arrivals",
                                           help="Arrival process: poisson, or mmpp (MMPP-2 bursts, paper App. B)"),
    duration: float = typer.Option(30.0, "--duration", callback=positive, help="Seconds of arrivals (> 0)"),
    tasks: str = typer.Option("", "--tasks", callback=_tasks,
                              help=f"Comma-separated task families of the synthetic mix: {', '.join(TASKS)} "
                                   "(default: all four)"),
    lam: float = typer.Option(5e-4, "--lambda", min=0.0, help="λ ≥ 0 of U = acc − λ·cost"),
    max_tokens: int = typer.Option(
        4096, "--max-tokens", min=1,
        help="max_tokens of every query (≥ 1), fitted into the rest of the chosen engine's context"),
    context: int | None = typer.Option(
        None, "--context", min=2, show_default=False,
        help="Engines' context in tokens (≥ 2): prompts that may not fit are left out of the draw (their UTF-8 "
             "bytes bound the tokens); default: what the `bear up` stack found runs (its vLLM --max-model-len; sim engines: no bound)"),
    seed: int = typer.Option(0, "--seed", help="Seed of prompts, arrivals and targets"),
    burst_ratio: float = typer.Option(3.0, "--burst-ratio", min=1.0, help="MMPP-2 high/low rate ratio (≥ 1)"),
    out: Path | None = typer.Option(None, "--out", help="Write the summary as JSON here"),
    nats_url: NatsUrl = FIND_NATS,
    nats_creds: ClientNatsCreds = "",
    prefix: Prefix = "bear",
) -> None:
    """Drive a synthetic workload through the router and report OnTimeUtility and SLO attainment.
    Exit code 0 when at least one query completed (docs/cli.md)."""
    rep = run_load_cli(nats_url, prefix, rate, str(arrivals_kind), duration, tasks, lam, max_tokens, seed,
                       burst_ratio, context if context is not None else stack_context(nats_url))
    if out is not None:
        out.write_text(json.dumps(json_safe(rep), indent=2))
    check_completed(rep)


def check_completed(rep: dict[str, Any]) -> None:
    """A load in which no query completed is a failure: one line naming the errors."""
    if rep["done"] > 0:
        return
    errors = Counter(rep["errors"])
    top = errors.most_common(1)[0][0] if errors else "unavailable"
    code = ErrorCode(top) if top in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
    what = ", ".join(f"{k}: {v}" for k, v in errors.most_common())
    hint = " (no router answered: is the stack running?)" if top == "unavailable" else ""
    raise BearError(code, f"no query completed — errors {what or 'none'}{hint}")



def stack_context(nats_url: str) -> int | None:
    """The context the `bear up` stack at ``nats_url`` (found from this directory) fits loads into
    (``Stack.load_context``; None: no bound)."""
    from bear.stack.discovery import read_state

    state = read_state()
    if state is None or state.get("nats_url") != nats_url:
        return None
    ctx = state.get("load_context")
    return ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx >= 2 else None


def run_load_cli(nats_url: str, prefix: str, rate: float, arrivals_kind: str, duration: float, tasks: str, lam: float,
                 max_tokens: int, seed: int, burst_ratio: float, context: int | None = None) -> dict[str, Any]:
    """``context``: the engines' context in tokens, which every prompt drawn must fit (None: no bound)."""
    from rich.console import Console
    from rich.live import Live

    from bear.load.arrivals import arrivals
    from bear.load.generator import DoesNotFit, LoadResult, make_queries, run_load
    from bear.protocol.subjects import Subjects

    console = Console()
    n = max(1, round(rate * duration))
    task_list = tuple(t.strip() for t in tasks.split(",") if t.strip()) or None
    try:
        queries, left_out = make_queries(n, seed, task_list, ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B"), context)
    except DoesNotFit as exc:  # before anything is sent: one line
        raise BearError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, str(exc)) from None
    if left_out:
        console.print(f"{left_out} drawn prompts left out: longer than a {context}-token context may hold")
    times = arrivals(arrivals_kind, rate, n, seed=seed, ratio=burst_ratio)

    def line(res: LoadResult) -> str:
        done = len(res.outcomes)
        on_time = sum(o.on_time for o in res.outcomes)
        err = sum(res.errors.values())
        # in flight from the same counts as done and errors, so the three always add up to sent
        on = f"{on_time}/{done} ({on_time / done:.0%})" if done else "-"
        return (f"sent {res.sent}/{n}  done {done}  errors {err}  in flight {max(0, res.sent - done - err)}  "
                f"on time {on}")

    async def go() -> LoadResult:
        from bear.runtime.service import connect

        nc = await connect(nats_url, "bear-load", connect_within_s=2.0)
        try:
            with Live(console=console, refresh_per_second=4, transient=False) as live:
                last = [0.0]

                def on_event(_: str, res: LoadResult) -> None:
                    now = time.monotonic()
                    if now - last[0] > 0.25:
                        live.update(line(res))
                        last[0] = now

                res = await run_load(nc, queries, times, lam=lam, max_tokens=max_tokens, on_event=on_event,
                                     subjects=Subjects(prefix))
                live.update(line(res))
            return res
        finally:
            await nc.close()

    res = aio.run(go())
    console.print()
    rep = res.report()
    rep.update(rate=rate, arrivals=arrivals_kind, duration_s=duration, seed=seed, context=context,
               prompts_left_out=left_out)
    print_report(console, rep)
    return rep


def register(app: typer.Typer) -> None:
    app.command("load")(load_cmd)
