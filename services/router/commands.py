"""CLI of the router side: ``bear router``, ``bear submit``, ``bear load``, ``bear up`` and
``bear router-bench``. Heavy imports stay inside the command functions."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import typer

from bear.protocol import aio
from bear.protocol.codec import json_safe
from bear.protocol.logging import LogFormat, configure_logging

NATS_HELP = "NATS server URL, e.g. nats://127.0.0.1:4222"
PREFIX_HELP = "Subject prefix of the deployment"
LOG_FORMAT_HELP = "Log format: console (humans) or json (machines)"
LOG_LEVEL_HELP = "Log level: debug, info, warning, error"


def _params(raw: list[str]) -> dict[str, float]:
    out = {}
    for item in raw:
        k, _, v = item.partition("=")
        if not v:
            raise typer.BadParameter(f"--param expects NAME=VALUE, got {item!r}")
        out[k.strip()] = float(v)
    return out


def _aliases(raw: list[str]) -> dict[str, str]:
    out = {}
    for item in raw:
        k, _, v = item.partition("=")
        if not v:
            raise typer.BadParameter(f"--model-alias expects SERVED=PREDICTOR, got {item!r}")
        out[k.strip()] = v.strip()
    return out


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


def register(app: typer.Typer) -> None:
    @app.command("router")
    def router(
        nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", help=NATS_HELP),
        policy: str = typer.Option("bear", "--policy", help="Routing policy: bear, bear-lagrange or a baseline"),
        param: list[str] = typer.Option([], "--param", help="Policy parameter NAME=VALUE (e.g. delta=0.5); repeatable"),
        lam: float = typer.Option(5e-4, "--lambda", help="Default λ of U = acc − λ·cost (cost in micro-USD)"),
        predict_budget: float = typer.Option(0.2, "--predict-budget", help="Seconds the predictor may take (2 tries)"),
        estimate_budget: float = typer.Option(0.2, "--estimate-budget", help="Seconds the estimator may take (2 tries)"),
        default_output_tokens: int = typer.Option(
            256, "--default-output-tokens", help="Output length assumed when the predictor does not answer"),
        max_inflight: int = typer.Option(4096, "--max-inflight", help="Queries in progress before `overloaded`"),
        down_after: float = typer.Option(10.0, "--down-after", help="Registry heartbeat older than this (s): down"),
        model_alias: list[str] = typer.Option(
            [], "--model-alias", help="SERVED=PREDICTOR model name mapping (default: last path part); repeatable"),
        outcome_log: Path | None = typer.Option(None, "--outcome-log", help="JSONL file of every query's record"),
        metrics_port: int = typer.Option(0, "--metrics-port", help="Prometheus /metrics port; 0: off"),
        prefix: str = typer.Option("bear", "--prefix", help=PREFIX_HELP),
        log_format: LogFormat = typer.Option(LogFormat.console, "--log-format", help=LOG_FORMAT_HELP),
        log_level: str = typer.Option("info", "--log-level", help=LOG_LEVEL_HELP),
    ) -> None:
        """Route queries from bear.submit: predictor + estimator → policy → instance, streaming back."""
        configure_logging(log_format, log_level)
        from bear.router.outcomes import start_metrics_server
        from bear.router.service import RouterConfig, serve

        cfg = RouterConfig(policy=policy, policy_params=_params(param), lam=lam, predict_budget_s=predict_budget,
                           predict_try_s=predict_budget / 2, estimate_budget_s=estimate_budget,
                           estimate_try_s=estimate_budget / 2, default_output_tokens=default_output_tokens,
                           max_inflight=max_inflight, down_after_s=down_after, outcome_log=outcome_log,
                           aliases=_aliases(model_alias))
        start_metrics_server(metrics_port or None)
        aio.run(serve(nats_url, cfg, prefix))

    @app.command("submit")
    def submit_cmd(
        prompt: str = typer.Argument(..., help="The prompt text"),
        ttft_ms: float = typer.Option(500.0, "--ttft-ms", help="TTFT target in milliseconds"),
        max_tokens: int = typer.Option(256, "--max-tokens", help="Maximum output tokens"),
        lam: float | None = typer.Option(None, "--lambda", help="λ of U = acc − λ·cost (router default if unset)"),
        query_id: str | None = typer.Option(None, "--query-id", help="Idempotency key (default: random)"),
        nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", help=NATS_HELP),
        prefix: str = typer.Option("bear", "--prefix", help=PREFIX_HELP),
        as_json: bool = typer.Option(False, "--json", help="Print every message as a JSON line"),
    ) -> None:
        """Submit one query and stream the answer to the terminal."""
        from rich.console import Console

        err = Console(stderr=True)

        async def go() -> int:
            import nats

            from bear.protocol.subjects import Subjects
            from bear.router.client import submit

            nc = await nats.connect(nats_url, max_reconnect_attempts=3)
            code = 0
            try:
                async for m in submit(nc, prompt, ttft_target_s=ttft_ms / 1e3, max_tokens=max_tokens, lam=lam,
                                      query_id=query_id, subjects=Subjects(prefix)):
                    v = m.get("v")
                    if as_json:
                        print(json.dumps(json_safe(m)), flush=True)
                    elif v == "bear.routed/1":
                        pt = m.get("predicted_ttft_s")
                        err.print(f"[dim]→ {m['instance']} ({m['model']}), predicted TTFT "
                                  f"{'-' if pt is None else f'{pt * 1e3:.0f} ms'} [{m.get('ttft_method')}][/dim]")
                    elif v == "bear.chunk/1":
                        sys.stdout.write(m.get("text", ""))
                        sys.stdout.flush()
                    elif v == "bear.done/1":
                        ok = "[green]met[/green]" if m.get("on_time") else "[red]missed[/red]"
                        err.print(f"\n[dim]TTFT {m['ttft_s'] * 1e3:.0f} ms (target {ttft_ms:.0f} ms: {ok}), utility "
                                  f"{m.get('utility', 0):.4f}, usage {m.get('usage')}[/dim]")
                    elif v == "bear.error/1":
                        e = m.get("error", {})
                        err.print(f"\n[red]error {e.get('code')}: {e.get('message')}[/red]")
                        code = 1
            finally:
                await nc.close()
            return code

        raise typer.Exit(aio.run(go()))

    @app.command("load")
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
        nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", help=NATS_HELP),
        prefix: str = typer.Option("bear", "--prefix", help=PREFIX_HELP),
    ) -> None:
        """Drive a synthetic workload through the router and report OnTimeUtility and SLO attainment."""
        rep = run_load_cli(nats_url, prefix, rate, arrivals_kind, duration, tasks, lam, max_tokens, seed, burst_ratio)
        if out is not None:
            out.write_text(json.dumps(json_safe(rep), indent=2))

    @app.command("up")
    def up_cmd(
        nats_url: str | None = typer.Option(None, "--nats", help="Use this NATS cluster instead of a local server"),
        backend: str = typer.Option("sim", "--backend", help="sim (simulated H100 instances) or vllm"),
        vllm_model: Path | None = typer.Option(
            None, "--vllm-model", help="--backend vllm: local model folder (real weights, GPU); default: a tiny "
                                       "random Qwen3 on CPU"),
        vllm_instances: int = typer.Option(2, "--vllm-instances", help="--backend vllm: number of vLLM instances"),
        vllm_arg: list[str] = typer.Option(
            [], "--vllm-arg", help="--backend vllm: extra vLLM argument, e.g. --vllm-arg=--gpu-memory-utilization=0.4 "
                                   "(repeatable; replaces the tiny model's defaults)"),
        vllm_python: str | None = typer.Option(
            None, "--vllm-python", help="--backend vllm: vLLM's interpreter (default: $BEAR_VLLM_PYTHON, else "
                                        "~/.cache/bear/vllm-venv/bin/python)"),
        policy: str = typer.Option("bear", "--policy", help="Routing policy of the router"),
        estimator_workers: int = typer.Option(1, "--estimator-workers", help="Estimator worker processes"),
        routers: int = typer.Option(1, "--routers", help="Router processes (a queue group)"),
        metrics_port: int = typer.Option(9464, "--metrics-port", help="Router /metrics port (router i: +i); 0: off"),
        workdir: Path = typer.Option(Path(".bear-up"), "--workdir", help="Logs and outcome logs go here"),
        n_train: int = typer.Option(3000, "--train-queries", help="Synthetic queries to train the predictor on"),
        load_rate: float = typer.Option(0.0, "--load-rate",
                                        help="Once up, drive a synthetic Poisson load at this rate (q/s), print its "
                                             "summary and stop the stack (0: no load, run until Ctrl-C)"),
        load_duration: float = typer.Option(30.0, "--load-duration", help="Seconds of arrivals of that load"),
        load_out: Path | None = typer.Option(None, "--load-out", help="Write the load summary as JSON here"),
    ) -> None:
        """Start the whole stack (NATS, instances, predictor, estimator, calibrator, router) until Ctrl-C,
        or, with --load-rate, run one load through it and stop. Instances: 3 sim engines, or with
        --backend vllm real vLLM processes (BEAR scheduler plugin + `bear snapshotter` each)."""
        from rich.console import Console

        from bear.router.stack import Stack, StackConfig

        console = Console()
        if backend not in ("sim", "vllm"):
            raise typer.BadParameter("--backend must be sim or vllm")
        if backend == "sim" and (vllm_model is not None or vllm_arg or vllm_python):
            raise typer.BadParameter("--vllm-* options need --backend vllm")
        if vllm_instances < 1:
            raise typer.BadParameter("--vllm-instances must be ≥ 1")
        if vllm_model is not None and not vllm_model.is_dir():
            raise typer.BadParameter(f"--vllm-model {vllm_model} is not a folder")
        if backend == "vllm":
            from bear.snapshotter.vllm_instance import check_vllm_python, default_vllm_python

            try:  # before anything starts: a missing vLLM venv is a usage error, not a crash
                vllm_python = check_vllm_python(vllm_python) if vllm_python else default_vllm_python()
            except RuntimeError as exc:
                raise typer.BadParameter(str(exc)) from exc
        cfg = StackConfig(workdir=workdir, nats_url=nats_url, estimator_workers=estimator_workers, routers=routers,
                          policy=policy, metrics_port=metrics_port, n_train=n_train, backend=backend,
                          vllm_python=vllm_python, vllm_model=vllm_model.resolve() if vllm_model else None,
                          vllm_instances=vllm_instances, vllm_args=list(vllm_arg) or None)
        stack = Stack(cfg)
        engines = "sim engines" if backend == "sim" else "vLLM (first start compiles: minutes) + snapshotters"
        with console.status(f"starting NATS, {engines}, predictor (trains on first run), estimator, router…"):
            try:
                stack.start()
            except BaseException:
                stack.stop()
                raise
        console.print(f"[bold green]BEAR is up[/bold green] — NATS {stack.url}")
        for inst, port in stack.instances.items():
            served = f" (model {stack.served_model})" if stack.served_model else ""
            console.print(f"  instance {inst:<12} http://127.0.0.1:{port}/v1{served}")
        for name in stack.children:
            console.print(f"  {name:<22} log {stack.children[name].log_path}")
        if metrics_port:
            console.print(f"  router metrics          http://127.0.0.1:{metrics_port}/metrics")
        console.print(f"  outcome log             {stack.outcome_log(0)}")
        console.print(f"\nTry:  bear submit \"Explain KV caching briefly\" --ttft-ms 500 --nats {stack.url}")
        console.print(f"      bear load --rate 8 --duration 30 --nats {stack.url}")
        if load_rate > 0:
            try:
                rep = run_load_cli(stack.url, "bear", load_rate, "poisson", load_duration, "", 5e-4, 4096, 0, 3.0)
                if load_out is not None:
                    load_out.write_text(json.dumps(json_safe(rep), indent=2))
            finally:
                stack.stop()
            console.print("stopped.")
            return
        console.print("Ctrl-C stops everything.")
        try:
            while True:
                time.sleep(1.0)
                dead = stack.check_alive()
                if dead:
                    console.print(f"[red]exited: {dead}; stopping (see logs)[/red]")
                    break
        except KeyboardInterrupt:
            console.print("stopping…")
        finally:
            stack.stop()
        console.print("stopped.")

    @app.command("router-bench")
    def bench_cmd(
        rate: float = typer.Option(200.0, "--rate", help="Queries per second (Poisson)"),
        duration: float = typer.Option(10.0, "--duration", help="Seconds of load"),
        routers: int = typer.Option(1, "--routers", min=1, help="Router processes (one queue group)"),
        out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
    ) -> None:
        """Decision overhead (submit received → dispatch sent) at a given rate, on a local stack."""
        from rich.console import Console

        from bear.router.bench import run_bench

        res = run_bench(rate, duration, routers=routers)
        Console().print_json(json.dumps(json_safe(res)))
        if out is not None:
            out.write_text(json.dumps(json_safe(res), indent=2))


def run_load_cli(nats_url: str, prefix: str, rate: float, arrivals_kind: str, duration: float, tasks: str, lam: float,
                 max_tokens: int, seed: int, burst_ratio: float) -> dict[str, Any]:
    from rich.console import Console
    from rich.live import Live

    from bear.protocol.subjects import Subjects
    from bear.router.arrivals import arrivals
    from bear.router.load import LoadResult, make_queries, run_load

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
