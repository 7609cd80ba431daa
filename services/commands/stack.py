"""``bear up``: the whole stack on this machine, until Ctrl-C or after one load.

It owns its children: they stop with it on Ctrl-C, SIGTERM or SIGHUP (routers first, so queries in
flight finish), and die with it if it is killed outright (bear.runtime.children). While it runs,
where it is — NATS URL, instance URLs, logs — is published for this directory
(bear.stack.discovery), so ``bear submit`` and ``bear load`` run here need no ``--nats``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from bear.commands.options import (
    DEFAULT_METRICS_HOST,
    MetricsHost,
    PolicyName,
    PolicyOpt,
    PolicyParamsOpt,
    policy_params,
    positive,
)
from bear.protocol.codec import json_safe
from bear.protocol.errors import BearError, ErrorCode
from bear.runtime.identity import CREDS_ENV

DEFAULT_METRICS_PORT = 9464


class Backend(StrEnum):
    sim = "sim"
    vllm = "vllm"


def bear_command() -> str:
    """How to run this ``bear`` from the current shell: ``bear`` when that is on PATH, else the
    path of this interpreter's ``bear`` (the README's ``.venv/bin/bear``)."""
    on_path = shutil.which("bear")
    local = Path(sys.executable).parent / "bear"
    if on_path and local.exists() and Path(on_path).resolve() == local.resolve():
        return "bear"
    if local.exists():
        try:
            return str(local.relative_to(Path.cwd()))
        except ValueError:
            return str(local)
    return f"{sys.executable} -m bear"


def metrics_ports(requested: int | None, routers: int, host: str) -> int:
    """The first router's metrics port: ``requested`` (0: off), else 9464 when it (and the next
    ``routers - 1``) are free, else a free range — so a second stack on this machine runs beside."""
    from bear.runtime.metrics import port_free
    from bear.runtime.nats_server import free_port

    if requested is not None:
        return requested
    base = DEFAULT_METRICS_PORT
    for _ in range(50):
        if base + routers <= 65536 and all(port_free(base + i, host) for i in range(routers)):
            return base
        base = free_port()
    raise OSError("no free port range for the router metrics: pass --metrics-port N or 0")


async def _reachable(url: str, creds: Path | str) -> None:
    from bear.runtime.service import connect

    nc = await connect(url, "bear-up-check", connect_within_s=3.0, creds=creds)
    await nc.close()


def up_cmd(
    nats_url: str | None = typer.Option(None, "--nats", help="Use this NATS cluster instead of starting a local "
                                                             "nats-server"),
    nats_auth: Path | None = typer.Option(
        None, "--nats-auth", file_okay=False,
        help="With --nats: the folder of identities `bear nats config` wrote for that server (one per service "
             "and instance); default: connect without credentials"),
    insecure: bool = typer.Option(
        False, "--insecure", help="No NATS authentication and no engine API keys: anyone on this machine can "
                                  "steer routing and read prompts (experiments only; default: one identity per "
                                  "service and per instance, generated per run)"),
    client: list[str] = typer.Option(
        [], "--client", help="One more client identity (repeatable): one per user or application, each its own "
                             "<run>/auth/<NAME>.json and private inbox (`client` and `gateway` always exist)"),
    backend: Backend = typer.Option(Backend.sim, "--backend",
                                    help="Instances: sim (three simulated H100 instances) or vllm (real vLLM)"),
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
    policy: PolicyOpt = PolicyName.bear,
    param: PolicyParamsOpt = [],  # noqa: B006 (typer reads the default)
    estimator_workers: int = typer.Option(1, "--estimator-workers", min=1, help="Estimator worker processes (≥ 1)"),
    snapshot_max_age: float = typer.Option(
        1.0, "--snapshot-max-age", min=0.001,
        help="Snapshots older than this (s, > 0) are estimated by the analytic fallback instead of the replay; "
             "raise it where an engine step can take longer (real vLLM on a busy CPU)"),
    routers: int = typer.Option(1, "--routers", min=1, max=64, help="Router processes (a queue group)"),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", min=0, max=65535, show_default=False,
        help=f"Router /metrics port (router i: +i); default {DEFAULT_METRICS_PORT}, or a free port when that is "
             "taken; 0: off"),
    metrics_host: MetricsHost = DEFAULT_METRICS_HOST,
    gateway_port: int = typer.Option(8000, "--gateway-port", min=0, max=65535,
                                     help="Port of the OpenAI-compatible gateway (base URL http://127.0.0.1:PORT/v1); "
                                          "0: no gateway"),
    gateway_no_auth: bool = typer.Option(False, "--gateway-no-auth",
                                         help="Run the gateway without an API key (it listens on loopback only); "
                                              "default: a key generated into WORKDIR/gateway-api-key"),
    workdir: Path = typer.Option(Path(".bear-up"), "--workdir",
                                 help="Each run's logs and outcome logs go to WORKDIR/runs/<run> (WORKDIR/latest)"),
    keep_runs: int = typer.Option(5, "--keep-runs", min=1, help="Run directories kept in WORKDIR/runs"),
    n_train: int = typer.Option(3000, "--train-queries", min=100,
                                help="Synthetic queries to train the predictor on (cached after the first run)"),
    load_rate: float = typer.Option(0.0, "--load-rate", min=0.0,
                                    help="Once up, drive a synthetic Poisson load at this rate (q/s), print its "
                                         "summary and stop the stack (0: no load, run until Ctrl-C)"),
    load_duration: float = typer.Option(30.0, "--load-duration", callback=positive,
                                        help="Seconds of arrivals of that load (> 0)"),
    load_out: Path | None = typer.Option(None, "--load-out",
                                         help="Write the load summary as JSON here (default: in the run directory)"),
) -> None:
    """Start the whole stack (NATS, instances, predictor, estimator, calibrator, router) until Ctrl-C,
    or, with --load-rate, run one load through it and stop. Instances: 3 sim engines, or with
    --backend vllm real vLLM processes (BEAR scheduler plugin + `bear snapshotter` each)."""
    from bear.stack.discovery import read_state

    if nats_auth is not None and not nats_url:
        raise typer.BadParameter("--nats-auth goes with --nats (the local server gets identities of its own)")
    if nats_auth is not None and insecure:
        raise typer.BadParameter("--nats-auth and --insecure: choose one")
    if client and (insecure or nats_url):
        raise typer.BadParameter("--client makes identities for the local nats-server (with --nats: `bear nats config "
                                 "--client`; --insecure has none)", param_hint="--client")
    from bear.runtime.identity import NAME

    for name in client:
        if not NAME.match(name) or name in ("admin", "router", "predictor", "estimator", "calibrator") \
                or name.startswith("instance-"):
            raise typer.BadParameter(f"{name!r}: 1-128 letters, digits, '-' or '_' (one subject token), not a "
                                     "service's or an instance's name", param_hint="--client")
    if backend == Backend.sim and (vllm_model is not None or vllm_arg or vllm_python):
        raise typer.BadParameter("--vllm-* options need --backend vllm")
    if vllm_instances < 1:
        raise typer.BadParameter("--vllm-instances must be ≥ 1")
    if vllm_model is not None and not vllm_model.is_dir():
        raise typer.BadParameter(f"--vllm-model {vllm_model} is not a folder")
    if backend == Backend.vllm:
        from bear.vllm_instance.launch import check_vllm_python, default_vllm_python

        try:  # before anything starts: a missing vLLM venv is a usage error, not a crash
            vllm_python = check_vllm_python(vllm_python) if vllm_python else default_vllm_python()
        except RuntimeError as exc:
            raise typer.BadParameter(str(exc)) from exc
    running = read_state(parents=False)
    if running is not None:
        raise BearError(ErrorCode.DUPLICATE, f"a BEAR stack is already running from this directory (bear up pid "
                                             f"{running['pid']}, NATS {running.get('nats_url')}): use it, stop it "
                                             f"(Ctrl-C in its terminal or kill {running['pid']}), or start another "
                                             "from a different directory")
    if nats_url:
        from bear.runtime import aio

        admin = nats_auth / "admin.json" if nats_auth is not None else ""
        aio.run(_reachable(nats_url, admin))  # a wrong URL fails here, in one line, before anything starts

    params = policy_params(str(policy), param)  # a wrong name or value fails here, before anything starts
    from bear.stack.stack import StackConfig

    key_file = None
    if gateway_port and not gateway_no_auth:
        from bear.gateway.auth import write_new_key

        key_file = workdir / "gateway-api-key"
        write_new_key(key_file)
    cfg = StackConfig(workdir=workdir, nats_url=nats_url, estimator_workers=estimator_workers, routers=routers,
                      snapshot_max_age_s=snapshot_max_age, policy=str(policy), router_args=[f"--param={k}={v:g}" for k, v in params.items()],
                      metrics_port=metrics_ports(metrics_port, routers, metrics_host),
                      metrics_host=metrics_host, runs_kept=keep_runs, n_train=n_train, backend=str(backend),
                      vllm_python=vllm_python, vllm_model=vllm_model.resolve() if vllm_model else None,
                      vllm_instances=vllm_instances, vllm_args=list(vllm_arg) or None, gateway_port=gateway_port,
                      gateway_key_file=key_file, insecure=insecure, clients=tuple(client),
                      auth_dir=nats_auth.resolve() if nats_auth is not None else None)
    raise typer.Exit(run_up(cfg, load_rate, load_duration, load_out))


def run_up(cfg: Any, load_rate: float, load_duration: float, load_out: Path | None) -> int:
    """Start the stack, publish where it is, serve (or run the load), stop; the exit code."""
    from rich.console import Console
    from rich.markup import escape

    from bear.commands.load import check_completed, run_load_cli
    from bear.stack.discovery import remove_state, write_state
    from bear.stack.stack import Stack

    console = Console(highlight=False)
    stack = Stack(cfg)
    received: list[int] = []

    def to_interrupt(signum: int, frame: Any) -> None:
        # SIGTERM and SIGHUP take the Ctrl-C path: the stack stops in order, exactly once. While an
        # event loop runs (the load), through its runner's SIGINT handler, which cancels the main
        # task and then raises KeyboardInterrupt where it is safe — raised here instead, it landed
        # inside a transport callback and left tracebacks in the log. Otherwise raised here, not by
        # re-raising SIGINT: a script's background job inherits SIGINT ignored (and Python then
        # installs no handler for it), so a re-raised SIGINT was dropped (issue 26)
        received.append(signum)
        on_sigint = signal.getsignal(signal.SIGINT)
        if callable(on_sigint) and on_sigint is not signal.default_int_handler:
            on_sigint(signal.SIGINT, frame)
            return
        raise KeyboardInterrupt

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, to_interrupt)
    serving = False
    rep: dict[str, Any] | None = None
    code = 0
    try:
        engines = "sim engines" if cfg.backend == "sim" else "vLLM (first start compiles: minutes) + snapshotters"
        with console.status(f"starting NATS, {engines}, predictor (trains on first run), estimator, router…"):
            stack.start()
        # up from here: with no load to run, a signal is the ordinary stop (exit 0). Set before the
        # state file that tells a caller the stack is up, so a signal sent on seeing it (while the
        # banner prints) is not taken for an interrupted start (CI, 4 Dec: exit 129 after SIGHUP)
        serving = load_rate <= 0
        write_state({**stack.describe(), "workdir": str(cfg.workdir.resolve()), "started": time.time()})
        _banner(console, stack, escape)
        if load_rate > 0:
            client = stack.creds("client")
            if client is not None:
                os.environ[CREDS_ENV] = str(client)  # the load connects as the stack's client
            rep = run_load_cli(stack.url, cfg.prefix, load_rate, "poisson", load_duration, "", 5e-4, 4096, 0, 3.0,
                               stack.load_context())
            out = load_out or stack.run_dir / "load-summary.json"
            out.write_text(json.dumps(json_safe(rep), indent=2))
            console.print(f"results: summary {escape(str(out))}  ·  outcome log {escape(str(stack.outcome_log(0)))}"
                          f"  ·  logs {escape(str(stack.log_dir))}", soft_wrap=True)
        else:
            console.print("Ctrl-C stops everything.")
            while True:
                time.sleep(0.5)
                for event in stack.supervise():  # a dead child is restarted, not the end of the stack
                    console.print(f"[yellow]{escape(event)}[/yellow]", soft_wrap=True)
    except KeyboardInterrupt:
        sig = received[-1] if received else signal.SIGINT
        if not serving:  # interrupted before the stack was up, or in the middle of its load
            code = 128 + sig
        # a fresh console: the signal may have cut a print of the old one short, and rich then keeps
        # everything printed later in a buffer that never flushes (CI, 7 Dec: no "stopped." in the log)
        console = Console(highlight=False)
        console.print("stopping…")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the stop below is bounded: let it finish
        try:
            stack.stop()
        finally:
            remove_state()
            for sig, handler in before.items():  # as they were (an inherited ignored SIGINT: default since start)
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    console.print("stopped.")
    if rep is not None:
        check_completed(rep)
    return code


def _banner(console: Any, stack: Any, escape: Any) -> None:
    bear = bear_command()
    console.print(f"[bold green]BEAR is up[/bold green] — NATS {stack.url} (commands run in this directory find "
                  "it without --nats)", soft_wrap=True)
    client = stack.creds("client")
    if client is not None:
        console.print(f"  NATS identities  {escape(str(stack.auth.directory))}/ (one per service and instance; "
                      f"clients use {escape(client.name)}; engines require API keys)", soft_wrap=True)
        from bear.runtime.nats_auth import shared_client_note

        console.print(f"  [yellow]shared identity[/yellow]  {escape(shared_client_note(stack.auth.directory))}",
                      soft_wrap=True)
    elif stack.cfg.insecure:
        console.print("  [bold red]--insecure[/bold red]: NATS without authentication, engines without API keys",
                      soft_wrap=True)
    for inst, port in stack.instances.items():
        served = f" (model {stack.served_model})" if stack.served_model else ""
        console.print(f"  instance {inst:<12} http://127.0.0.1:{port}/v1{escape(served)}")
    if stack.cfg.backend == "sim":
        console.print("  (simulated instances: they stream placeholder text — lorem ipsum — with the timing of "
                      "the real models)", soft_wrap=True)
    if stack.gateway_url:
        key = stack.cfg.gateway_key_file
        console.print(f"  OpenAI gateway   {stack.gateway_url} (model `bear`: BEAR chooses; API key "
                      f"{escape(str(key)) if key else 'none: --no-auth, loopback only'})", soft_wrap=True)
    for url in stack.describe()["metrics"]:
        console.print(f"  router metrics   {url}")
    console.print(f"  logs             {escape(str(stack.log_dir))}/ (one file per process)", soft_wrap=True)
    console.print(f"  outcome log      {escape(str(stack.outcome_log(0)))}", soft_wrap=True)
    console.print(f"\nTry:  {escape(bear)} submit \"Explain KV caching briefly\" --ttft-ms 500", soft_wrap=True)
    console.print(f"      {escape(bear)} load --rate 8 --duration 30", soft_wrap=True)
    if stack.gateway_url:
        key = stack.cfg.gateway_key_file
        auth = f' -H "Authorization: Bearer $(cat {key})"' if key else ""
        body = '{"model": "bear", "messages": [{"role": "user", "content": "Hi"}]}'
        curl = f"curl {stack.gateway_url}/chat/completions{auth} -H 'Content-Type: application/json' -d '{body}'"
        console.print(f"      {escape(curl)}", soft_wrap=True)


def bench_router(
    rate: float = typer.Option(200.0, "--rate", callback=positive, help="Queries per second (Poisson, > 0)"),
    duration: float = typer.Option(10.0, "--duration", callback=positive, help="Seconds of load (> 0)"),
    routers: int = typer.Option(1, "--routers", min=1, help="Router processes (one queue group)"),
    answer_tokens: int = typer.Option(1, "--answer-tokens", min=1,
                                      help="Tokens every answer streams (≥ 1): the routers' CPU per query then "
                                           "includes relaying them (router_cpu_us_per_token)"),
    coalesce: bool = typer.Option(True, "--coalesce/--no-coalesce",
                                  help="The routers' --coalesce/--no-coalesce (chunks of one read relayed as one "
                                       "message, or one message per chunk)"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """Decision overhead (submit received → dispatch sent) at a given rate, on a local stack, and
    the routers' CPU per query and per streamed token."""
    from rich.console import Console

    from bear.benchmarks.router import run_bench

    res = run_bench(rate, duration, routers=routers, answer_tokens=answer_tokens,
                    router_args=() if coalesce else ("--no-coalesce",))
    Console().print_json(json.dumps(json_safe(res)))
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def _fault_list(value: str) -> str:
    from bear.benchmarks.faults import FAULTS

    bad = [f for f in value.split(",") if f.strip() not in FAULTS]
    if bad:
        raise typer.BadParameter(f"unknown fault {', '.join(map(repr, bad))}; valid: {', '.join(FAULTS)}")
    return value


def bench_faults(
    faults: str = typer.Option("worker-kill,worker-hang,predictor-kill,engine-kill,nats-restart,node-kill,overload",
                               "--faults", callback=_fault_list,
                               help="Comma-separated faults: worker-kill, worker-hang, predictor-kill, engine-kill, "
                                    "nats-restart, node-kill (3-node NATS cluster), overload, stream-restarts "
                                    "(5 SIGTERM + 5 SIGKILL NATS restarts during 12 answers of 800 tokens each), "
                                    "disk-full (needs root: a tmpfs under the stack filled, then freed), flood (one "
                                    "identity at 60 q/s beside another at 2 q/s), leaked-service (a leaked predictor "
                                    "or estimator replica credential among 2: prompts seen, queries steered)"),
    rate: float = typer.Option(8.0, "--rate", callback=positive, help="Poisson load during each fault (q/s, > 0)"),
    duration: float = typer.Option(12.0, "--duration", callback=positive, help="Seconds of load per fault (> 0)"),
    at: float = typer.Option(3.0, "--at", min=0.0, help="The fault is injected this many seconds into the load"),
    overload_rate: float = typer.Option(300.0, "--overload-rate", callback=positive,
                                        help="Offered rate of the overload fault (q/s)"),
    out: Path | None = typer.Option(None, "--out", help="Write the figures as JSON here"),
    flood_router_arg: list[str] = typer.Option(
        [], "--flood-router-arg", help="An option of the flood fault's router (repeatable, each word its own: "
                                       "--flood-router-arg=--identity-limit --flood-router-arg='*=24')"),
    client_reconnect: float = typer.Option(0.1, "--client-reconnect", callback=positive,
                                           help="The load client's wait between NATS reconnect attempts (s; "
                                                "nats-py's default is 2: such a client comes back after the routers)"),
) -> None:
    """Inject faults under load into a local stack (authentication on, children supervised) and
    print per fault: queries sent / done / coded errors / lost, the recovery time, and the client's
    first-token p50/p99 before the fault and in the 10 s after it, with the seconds until the p99
    is back within 2× of before."""
    from rich.console import Console

    from bear.benchmarks.faults import faults_table, run_faults

    err = Console(stderr=True, highlight=False)
    res = run_faults(tuple(f.strip() for f in faults.split(",")), rate=rate, duration=duration, at=at,
                     overload_rate=overload_rate, client_reconnect_s=client_reconnect,
                     flood_router_args=tuple(flood_router_arg), log=lambda line: err.print(line, soft_wrap=True, markup=False))
    print(faults_table(res))
    for r in res:
        if r.get("fault") == "stream-restarts":  # answers whole / resumed / coded error / done with a gap
            from bear.benchmarks.answers import streams_table

            print(streams_table(r))
    leaked = [r for r in res if str(r.get("fault", "")).startswith("leaked-")]
    if leaked:  # prompts seen, forged replies refused, queries steered (bear.benchmarks.leaked)
        from bear.benchmarks.leaked import leaked_table

        print(leaked_table(leaked))
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def bench_prefix(
    rate: float = typer.Option(4.0, "--rate", callback=positive, help="Queries per second (Poisson, > 0)"),
    duration: float = typer.Option(60.0, "--duration", callback=positive, help="Seconds of load (> 0)"),
    prompt_tokens: int = typer.Option(8192, "--prompt-tokens", min=64, help="Tokens per prompt"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
    repeat: int = typer.Option(1, "--repeat", min=1, max=20, help="Load windows on the one stack, each with "
                               "documents of its own (1–20); the CPU figures are their median"),
    micro: bool = typer.Option(False, "--micro", help="Only the in-process micro-benchmark (no stack): block "
                               "hashing Python vs libbea, token ids as ints vs packed, hit lookup, chunked encoding"),
) -> None:
    """Cost of exact tokens + prefix-hit lookup on the decision: a tokenising and a --no-tokenize
    router side by side on one stack, at long prompts over shared documents (the micro-benchmark's
    figures are included)."""
    from rich.console import Console

    from bear.benchmarks.prefix import run_prefix_bench
    from bear.benchmarks.prefix_micro import run_micro

    res = run_micro(prompt_tokens) if micro else {**run_prefix_bench(rate, duration, prompt_tokens=prompt_tokens,
                                                                     repeat=repeat),
                                                  "micro": run_micro(prompt_tokens, tokenizer=False)}
    Console().print_json(json.dumps(json_safe(res)))
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def _sizes(value: str) -> str:
    try:
        sizes = [int(x) for x in value.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of block counts (e.g. 1000,10000)") from None
    if not sizes or min(sizes) < 16:
        raise typer.BadParameter("every pool needs at least 16 blocks")
    return value


def bench_pool(
    sizes: str = typer.Option("1000,10000,50000", "--sizes", callback=_sizes,
                              help="Comma-separated pool sizes in KV blocks (each >= 16)"),
    reps: int = typer.Option(20, "--reps", min=1, help="Runs per size (medians and p99 are over these)"),
    steps: int = typer.Option(200, "--steps", min=2, help="Steps per size for the table kept step by step"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """What describing the block pool (BEAR_SNAPSHOT_BLOCK_OPS=1) costs the snapshotter per
    published step, and the bytes it adds to the snapshot, at growing pool sizes (synthetic busy
    pools: 80 % of the blocks cached, 64 running requests): described in full every step (before
    issue 28), and kept step by step (``deltas``: the snapshotter's per-step cost, the change's
    bytes, the worker's ingest of the step's delta)."""
    from rich.console import Console

    from bear.benchmarks.pool import run_pool_bench

    res = run_pool_bench(tuple(int(x) for x in sizes.split(",")), reps=reps, steps=steps)
    Console().print_json(json.dumps(json_safe(res)))
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def bench_relay(
    tokens: int = typer.Option(256, "--tokens", min=1, max=65_536, help="Tokens every answer streams (1–65536)"),
    answers: int = typer.Option(64, "--answers", min=1, max=100_000, help="Answers relayed per run (1–100000)"),
    concurrency: int = typer.Option(16, "--concurrency", min=1, max=4096, help="Answers streaming at once (1–4096)"),
    step_ms: float = typer.Option(20.0, "--step-ms", callback=positive,
                                  help="The engine's time between two tokens of an answer (ms, > 0)"),
    repeat: int = typer.Option(2, "--repeat", min=1, max=20, help="Runs per relay, interleaved (1–20); the figure "
                               "is their median"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """CPU per relayed token of three relays on one engine and bus, each in a process of its
    own: the router's (bear), aiohttp + nats-py forwarding events unparsed (minimal), asyncio
    protocols on both sockets (raw: the floor of a Python relay); and what reached the bus."""
    from bear.benchmarks.relay import relay_table, run_relay_bench

    res = run_relay_bench(tokens, answers, concurrency, step_ms / 1e3, repeat)
    print(relay_table(res))
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def _burst_configs(value: str) -> str:
    from bear.benchmarks.burst import CONFIGS

    bad = [c for c in value.split(",") if c.strip() not in CONFIGS]
    if bad:
        raise typer.BadParameter(f"unknown configuration {', '.join(map(repr, bad))}; valid: {', '.join(CONFIGS)}")
    return value


def _router_counts(value: str) -> str:
    try:
        counts = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--routers expects whole numbers separated by commas, got {value!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 8:
        raise typer.BadParameter("--routers: each count in 1-8")
    return value


def bench_burst(
    n: int = typer.Option(200, "--n", min=1, max=2000, help="Requests per run (1-2000)"),
    spacing_ms: float = typer.Option(10.0, "--spacing-ms", min=0.1, max=1000.0,
                                     help="Milliseconds between requests in the spread-out run (0.1-1000)"),
    configs: str = typer.Option("bear,bear-blind,round-robin", "--configs", callback=_burst_configs,
                                help="Routing configurations, comma-separated: bear (decisions in order, shipped), "
                                     "bear-blind (--no-sequence: each decision blind to those beside it), "
                                     "bear-chain-63 (in order, a fresh ask covering 63 waiting queries), round-robin"),
    routers: str = typer.Option("1,2", "--routers", callback=_router_counts,
                                help="Router processes per stack, comma-separated counts (each 1-8)"),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Tokens per answer (≥ 1)"),
    target_ms: float = typer.Option(500.0, "--ttft-ms", min=1.0, help="Every request's TTFT target (ms, ≥ 1)"),
    repeat: int = typer.Option(1, "--repeat", min=1, max=10, help="Runs of each pattern per stack (1-10)"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """A burst through the gateway: N requests at once, then the same N spread out, per routing
    configuration and router count, each on a fresh local stack; on-time shares, predicted-vs-observed
    TTFT, instance shares, decision times, and how long dispatches take to reach the estimators."""

    from rich.console import Console

    from bear.benchmarks.burst import print_table, run_bench

    def progress(r: dict[str, Any]) -> None:
        print(f"  {r['config']} × {r['routers']} router(s), {r['pattern']}: on time {100 * r['on_time']:.1f}%, "
              f"instances {r['shares']}", file=sys.stderr, flush=True)

    res = run_bench([c.strip() for c in configs.split(",") if c.strip()],
                    [int(x) for x in routers.split(",") if x.strip()], n, spacing_ms, max_tokens, target_ms,
                    repeat=repeat, progress=progress)
    print_table(res, Console())
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def bench_live_accuracy(
    backend: str = typer.Option("sim,vllm", "--backend",
                                help="Stacks, comma-separated: sim, vllm (vllm skipped without a vLLM interpreter)"),
    rate: float = typer.Option(8.0, "--rate", min=0.1, help="Load arrivals per second (the README's: 8)"),
    duration: float = typer.Option(60.0, "--duration", min=5.0, help="Seconds of arrivals"),
    vllm_arg: list[str] = typer.Option([], "--vllm-arg", help="Extra argument to bear up --backend vllm"),
    workdir: Path | None = typer.Option(None, "--workdir", help="Where the stacks run (default: a temp dir)"),
    out: Path | None = typer.Option(None, "--out", help="Write the result JSON here"),
) -> None:
    """Live TTFT accuracy: bear up with a load, then per instance the estimate's MAPE and median
    signed error before and after the calibrator's path term, and the error by source."""
    from bear.benchmarks.live_accuracy import run_bench
    from bear.commands.calibrator import print_decomposition

    res = run_bench([b.strip() for b in backend.split(",") if b.strip()], rate, duration, vllm_arg, workdir)
    for name, parts in res.items():
        print(f"== {name}: {parts.get('outcome_log') or parts.get('skipped')}")
        for label, table in parts.items():
            if isinstance(table, dict):
                print(f"-- {label}")
                print_decomposition(table)
    if out is not None:
        out.write_text(json.dumps(json_safe(res), indent=2))


def register(app: typer.Typer) -> None:
    app.command("up")(up_cmd)


def register_bench(bench: typer.Typer) -> None:
    bench.command("router")(bench_router)
    bench.command("faults")(bench_faults)
    bench.command("prefix")(bench_prefix)
    bench.command("pool")(bench_pool)
    bench.command("relay")(bench_relay)
    bench.command("burst")(bench_burst)
    bench.command("live-accuracy")(bench_live_accuracy)
