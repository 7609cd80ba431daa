"""``bear snapshotter`` (publish one vLLM instance's steps on NATS) and ``bear record`` (turn a
recorded run into replay cases + batch records)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bear.commands.options import (
    DEFAULT_METRICS_HOST,
    FIND_NATS,
    DeltasOpt,
    FullEveryOpt,
    LogFormatOpt,
    LogLevel,
    LogLevelOpt,
    MetricsHost,
    MetricsPort,
    NatsCreds,
    NatsUrl,
    Prefix,
)
from bear.runtime import aio
from bear.runtime.logging import LogFormat


def snapshotter(
    instance: Annotated[str, typer.Option(help="Instance id (a NATS subject token, e.g. 'vllm-a').")],
    shm: Annotated[
        str, typer.Option(help="Shared-memory region the plugin writes (BEAR_SNAPSHOT_SHM of vLLM).")
    ],
    nats: NatsUrl = FIND_NATS,
    nats_creds: NatsCreds = "",
    model: Annotated[str, typer.Option(help="Model name served by the instance (registry entry).")] = "",
    base_url: Annotated[
        str, typer.Option(help="OpenAI-compatible base URL of the instance (registry entry).")
    ] = "",
    gpu: Annotated[str, typer.Option(help="Accelerator description (registry entry).")] = "",
    price_input: Annotated[
        float, typer.Option(help="Price per million input tokens (registry entry).")
    ] = 0.0,
    price_output: Annotated[
        float, typer.Option(help="Price per million output tokens (registry entry).")
    ] = 0.0,
    prefix: Prefix = "bear",
    min_interval_ms: Annotated[
        float, typer.Option(help="Coalesce snapshots: publish at most one per interval (0 = every step).")
    ] = 0.0,
    deltas: DeltasOpt = True,
    full_every: FullEveryOpt = 256,
    batch_flush_ms: Annotated[
        float, typer.Option(help="How often buffered bear.batch/1 records are published.")
    ] = 200.0,
    heartbeat_ms: Annotated[float, typer.Option(help="Registry heartbeat period.")] = 500.0,
    stale_after_ms: Annotated[
        float, typer.Option(help="The engine is down when the plugin's heartbeat is older than this.")
    ] = 1000.0,
    on_down: Annotated[
        str, typer.Option(help="What to do with the registry entry when vLLM stops: mark|delete.")
    ] = "mark",
    record_to: Annotated[
        Path | None,
        typer.Option(help="Also append every step to this JSONL(.gz) log (input of `bear record`)."),
    ] = None,
    tokenizer_dir: Annotated[
        Path | None,
        typer.Option(help="Model directory with the engine's tokenizer.json (default: the path vLLM loaded); its "
                          "bundle goes to the bear_tokenizers object store and its id into the registry entry."),
    ] = None,
    register_tokenizer: Annotated[
        bool, typer.Option("--register-tokenizer/--no-register-tokenizer",
                           help="Register the engine's tokenizer (routers then count prompt tokens exactly).")
    ] = True,
    kv_events: Annotated[
        bool, typer.Option("--kv-events/--no-kv-events",
                           help="Mirror the engine's KV cache events (vLLM --kv-events-config) on bear.kv.<id>.")
    ] = True,
    describe_superseded_below_ms: Annotated[
        float, typer.Option(min=0.0, help="BEAR_SNAPSHOT_BLOCK_OPS=1: a step superseded by a newer one read in the "
                                          "same poll goes out without the pool's description while describing takes "
                                          "longer than this (median processor time of the last descriptions; large "
                                          "pools: never fall behind the engine); 0: once five are timed, only the "
                                          "newest step of each poll is described.")
    ] = 1.0,
    pool_deltas: Annotated[
        bool, typer.Option("--pool-deltas/--no-pool-deltas",
                           help="BEAR_SNAPSHOT_BLOCK_OPS=1: keep the block table step by step and send its change in "
                                "each step's delta, the whole table only in full snapshots (the default; issue 28; "
                                "`bear bench pool`); --no-pool-deltas: every step described in full and sent as a "
                                "full snapshot (O(pool) a step: too slow for GPU-sized pools).")
    ] = True,
    metrics_port: MetricsPort = 0,
    metrics_host: MetricsHost = DEFAULT_METRICS_HOST,
    log_format: LogFormatOpt = LogFormat.console,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Publish bear.delta/1, bear.snapshot/1 and bear.batch/1 of one vLLM instance and keep it registered."""
    import asyncio
    import signal

    from bear.runtime.logging import configure_logging
    from bear.snapshotter.metrics import SnapshotterMetrics
    from bear.snapshotter.service import Snapshotter, SnapshotterConfig

    if on_down not in ("mark", "delete"):
        raise typer.BadParameter("--on-down must be mark or delete")
    configure_logging(log_format, log_level)
    cfg = SnapshotterConfig(
        instance=instance, shm=shm, nats_url=nats, model=model, base_url=base_url, gpu=gpu,
        price_input_per_mtok=price_input, price_output_per_mtok=price_output, prefix=prefix,
        min_interval_s=min_interval_ms / 1e3, deltas=deltas, full_every=full_every, batch_flush_s=batch_flush_ms / 1e3, heartbeat_s=heartbeat_ms / 1e3,
        stale_after_s=stale_after_ms / 1e3, on_down=on_down, record_to=str(record_to) if record_to else None,
        tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None, register_tokenizer=register_tokenizer,
        kv_events=kv_events, describe_superseded_below_s=describe_superseded_below_ms / 1e3,
        pool_deltas=pool_deltas,
    )  # fmt: skip
    metrics = SnapshotterMetrics()
    from bear.runtime.metrics import start_metrics_server

    start_metrics_server(metrics_port, metrics_host, registry=metrics.registry)

    async def main() -> None:
        svc = Snapshotter(cfg, metrics)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, svc.stop)
        await svc.run()

    aio.run(main())


def record(
    step_logs: Annotated[
        list[Path], typer.Argument(help="Step logs written by `bear snapshotter --record-to`.")
    ],
    trace: Annotated[
        str, typer.Option(help="Trace name (the cases' `trace` field and batches_<trace> file).")
    ],
    out: Annotated[Path, typer.Option(help="Output folder for cases.jsonl.gz and batches_<trace>.jsonl.gz.")],
    prompts: Annotated[
        Path | None,
        typer.Option(help="JSONL of the run's prompts ({id: X-Request-Id, prompt_token_ids: [...]}): the cases' "
                          "prefix-cache hits become the mirror's (from the logged KV events) instead of the engine's."),
    ] = None,
) -> None:
    """Turn a recorded vLLM run into replay cases and batch records (format of vllm-cpu-traces)."""
    from bear.replay.recorded_run import read_prompts, record_run

    agreement: list[dict] = []
    cpath, bpath, nc, nb = record_run(step_logs, trace=trace, out_dir=out,
                                      prompts=read_prompts(prompts) if prompts else None, agreement=agreement)
    typer.echo(f"{nc} cases -> {cpath}\n{nb} batch records -> {bpath}")
    for a in agreement:
        rate = "-" if a["rate"] is None else f"{a['rate']:.4f}"
        typer.echo(f"mirror hit = engine num_cached_tokens: {a['equal']}/{a['admitted']} admitted requests ({rate})")


def register(app: typer.Typer) -> None:
    app.command("snapshotter")(snapshotter)
    app.command("record")(record)
