"""``bear up``: the whole stack on this machine, until Ctrl-C or after one load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from bear.load.commands import run_load_cli
from bear.protocol.codec import json_safe


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
    gateway_port: int = typer.Option(8000, "--gateway-port", min=0, max=65535,
                                     help="Port of the OpenAI-compatible gateway (base URL http://127.0.0.1:PORT/v1); "
                                          "0: no gateway"),
    gateway_no_auth: bool = typer.Option(False, "--gateway-no-auth",
                                         help="Run the gateway without an API key (it listens on loopback only); "
                                              "default: a key generated into <workdir>/gateway-api-key"),
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

    from bear.stack.stack import Stack, StackConfig

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
        from bear.vllm_instance.launch import check_vllm_python, default_vllm_python

        try:  # before anything starts: a missing vLLM venv is a usage error, not a crash
            vllm_python = check_vllm_python(vllm_python) if vllm_python else default_vllm_python()
        except RuntimeError as exc:
            raise typer.BadParameter(str(exc)) from exc
    key = None
    key_file = workdir / "gateway-api-key"
    if gateway_port and not gateway_no_auth:
        from bear.gateway.auth import write_new_key

        key = write_new_key(key_file)
    cfg = StackConfig(workdir=workdir, nats_url=nats_url, estimator_workers=estimator_workers, routers=routers,
                      policy=policy, metrics_port=metrics_port, n_train=n_train, backend=backend,
                      vllm_python=vllm_python, vllm_model=vllm_model.resolve() if vllm_model else None,
                      vllm_instances=vllm_instances, vllm_args=list(vllm_arg) or None, gateway_port=gateway_port,
                      gateway_key_file=key_file if key else None)
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
    if stack.gateway_url:
        console.print(f"  [bold]OpenAI API[/bold]              {stack.gateway_url}  (model \"bear\": BEAR chooses; "
                      f"key: {key_file if key else 'none, --gateway-no-auth'})")
    console.print(f"\nTry:  bear submit \"Explain KV caching briefly\" --ttft-ms 500 --nats {stack.url}")
    console.print(f"      bear load --rate 8 --duration 30 --nats {stack.url}")
    if stack.gateway_url:
        auth = f" -H 'Authorization: Bearer {key}'" if key else ""
        console.print(f"      curl {stack.gateway_url}/chat/completions{auth} -H 'Content-Type: application/json' "
                      f"-H 'x-slo-ttft-ms: 500' -d '{{\"model\": \"bear\", \"messages\": [{{\"role\": \"user\", "
                      f"\"content\": \"Explain KV caching briefly\"}}]}}'", soft_wrap=True)
        console.print(f"      export OPENAI_BASE_URL={stack.gateway_url} OPENAI_API_KEY={key or 'none'}   "
                      "# then any OpenAI client, model \"bear\"", soft_wrap=True)
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



def bench_router(
    rate: float = typer.Option(200.0, "--rate", help="Queries per second (Poisson)"),
    duration: float = typer.Option(10.0, "--duration", help="Seconds of load"),
    routers: int = typer.Option(1, "--routers", min=1, help="Router processes (one queue group)"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """Decision overhead (submit received → dispatch sent) at a given rate, on a local stack."""
    from rich.console import Console

    from bear.stack.router_bench import run_bench

    res = run_bench(rate, duration, routers=routers)
    Console().print_json(json.dumps(json_safe(res)))
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def register(app: typer.Typer) -> None:
    app.command("up")(up_cmd)


def register_bench(bench: typer.Typer) -> None:
    bench.command("router")(bench_router)
