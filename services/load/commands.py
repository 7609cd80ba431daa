"""``bear load``: a synthetic workload through the router, with a live counter and a summary."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import typer

from bear.options import DEFAULT_NATS, NatsUrl, Prefix
from bear.protocol.codec import json_safe
from bear.runtime import aio


def print_report(console: Any, rep: dict[str, Any], title: str = "BEAR load") -> None:
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("queries sent / done", f"{rep['sent']} / {rep['done']}")
    t.add_row("errors", ", ".join(f"{k}: {v}" for k, v in rep["errors"].items()) or "0")
    t.add_row("OnTimeUtility (eq. 6)", f"{rep['on_time_utility']:.4f}")
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


def load_cmd(
    rate: float = typer.Option(4.0, "--rate", help="Mean arrival rate (queries/s)"),
    arrivals_kind: str = typer.Option("poisson", "--arrivals", help="Arrival process: poisson or mmpp"),
    duration: float = typer.Option(30.0, "--duration", help="Seconds of arrivals"),
    tasks: str = typer.Option("", "--tasks", help="Comma-separated task families (default: all four)"),
    lam: float = typer.Option(5e-4, "--lambda", help="λ of U = acc − λ·cost"),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="max_tokens of every query"),
    seed: int = typer.Option(0, "--seed", help="Seed of prompts, arrivals and targets"),
    burst_ratio: float = typer.Option(3.0, "--burst-ratio", help="MMPP-2 high/low rate ratio"),
    out: Path | None = typer.Option(None, "--out", help="Write the summary as JSON here"),
    nats_url: NatsUrl = DEFAULT_NATS,
    prefix: Prefix = "bear",
) -> None:
    """Drive a synthetic workload through the router and report OnTimeUtility and SLO attainment."""
    rep = run_load_cli(nats_url, prefix, rate, arrivals_kind, duration, tasks, lam, max_tokens, seed, burst_ratio)
    if out is not None:
        out.write_text(json.dumps(json_safe(rep), indent=2))



def run_load_cli(nats_url: str, prefix: str, rate: float, arrivals_kind: str, duration: float, tasks: str, lam: float,
                 max_tokens: int, seed: int, burst_ratio: float) -> dict[str, Any]:
    from rich.console import Console
    from rich.live import Live

    from bear.load.arrivals import arrivals
    from bear.load.generator import LoadResult, make_queries, run_load
    from bear.protocol.subjects import Subjects

    console = Console()
    n = max(1, round(rate * duration))
    task_list = tuple(t.strip() for t in tasks.split(",") if t.strip()) or None
    queries = make_queries(n, seed, task_list, ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B"))
    times = arrivals(arrivals_kind, rate, n, seed=seed, ratio=burst_ratio)

    def line(res: LoadResult) -> str:
        done = len(res.outcomes)
        on_time = sum(o.on_time for o in res.outcomes)
        err = sum(res.errors.values())
        return (f"sent {res.sent}/{n}  done {done}  errors {err}  in flight {res.sent - res.terminal}  "
                f"on time {on_time}/{done or 1} ({on_time / (done or 1):.0%})")

    async def go() -> LoadResult:
        import nats

        nc = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
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
    rep.update(rate=rate, arrivals=arrivals_kind, duration_s=duration, seed=seed)
    print_report(console, rep)
    return rep


def register(app: typer.Typer) -> None:
    app.command("load")(load_cmd)
