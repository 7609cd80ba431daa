"""CLI of the instance-side services: ``bear estimator``, ``bear calibrator``,
``bear sim-engine`` and ``bear estimator-bench``. Heavy imports stay inside the commands."""

from __future__ import annotations

import typer

from bear.protocol import aio
from bear.protocol.logging import LogFormat, configure_logging

NATS_HELP = "NATS server URL, e.g. nats://127.0.0.1:4222"
PREFIX_HELP = "Subject prefix of the deployment"
LOG_FORMAT_HELP = "Log format: console (humans) or json (machines)"
LOG_LEVEL_HELP = "Log level: debug, info, warning, error"


def register(app: typer.Typer) -> None:
    @app.command("estimator")
    def estimator(
        nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", help=NATS_HELP),
        workers: int = typer.Option(1, "--workers", min=1, help="Worker processes to start (they share only NATS)"),
        max_age_s: float = typer.Option(1.0, "--max-age", help="Snapshots older than this (s) use the analytic fallback"),
        down_after_s: float = typer.Option(
            10.0, "--down-after", help="No snapshot and no registry heartbeat for this long (s): instance is down"
        ),
        default_output_tokens: int = typer.Option(
            256, "--default-output-tokens", help="Predicted total output tokens of residents never announced on dispatch"
        ),
        overrun_fraction: float = typer.Option(
            0.5, "--overrun-fraction", help="A resident past its prediction gets this fraction of it again"
        ),
        compensate_staleness: bool = typer.Option(
            True, "--compensate-staleness/--no-compensate-staleness",
            help="Run residents through each snapshot's age before inserting the query (assumes NTP-synchronised "
                 "clocks between instances and workers)"
        ),
        with_calibrator: bool = typer.Option(
            False, "--with-calibrator", help="Also run the online β calibrator in this process (single worker only)"
        ),
        prefix: str = typer.Option("bear", "--prefix", help=PREFIX_HELP),
        metrics_port: int = typer.Option(0, "--metrics-port", help="Prometheus port (worker i uses port+i); 0: off"),
        log_format: LogFormat = typer.Option(LogFormat.console, "--log-format", help=LOG_FORMAT_HELP),
        log_level: str = typer.Option("info", "--log-level", help=LOG_LEVEL_HELP),
    ) -> None:
        """Serve bear.estimate: BEA TTFT per candidate instance from the newest snapshots."""
        if workers > 1:
            from bear.estimator.service import run_forked

            argv = ["--nats", nats_url, "--max-age", str(max_age_s), "--down-after", str(down_after_s),
                    "--default-output-tokens", str(default_output_tokens), "--overrun-fraction", str(overrun_fraction),
                    "--prefix", prefix, "--log-format", str(log_format), "--log-level", log_level]
            argv.append("--compensate-staleness" if compensate_staleness else "--no-compensate-staleness")
            raise typer.Exit(run_forked(argv, workers, metrics_port or None))
        configure_logging(log_format, log_level)
        from bear.estimator.metrics import start_metrics_server
        from bear.estimator.service import run_worker
        from bear.estimator.worker import EstimatorConfig

        start_metrics_server(metrics_port or None)
        cfg = EstimatorConfig(max_age_s=max_age_s, down_after_s=down_after_s, default_output_tokens=default_output_tokens,
                              overrun_fraction=overrun_fraction, compensate_staleness=compensate_staleness)
        aio.run(run_worker(nats_url, cfg, prefix, with_calibrator))

    @app.command("calibrator")
    def calibrator(
        nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", help=NATS_HELP),
        window: int = typer.Option(2000, "--window", min=10, help="Batch records kept per instance (sliding window)"),
        min_records: int = typer.Option(50, "--min-records", min=4, help="Records needed before the first fit"),
        refit_s: float = typer.Option(5.0, "--refit-every", help="Seconds between refits"),
        prefix: str = typer.Option("bear", "--prefix", help=PREFIX_HELP),
        metrics_port: int = typer.Option(0, "--metrics-port", help="Prometheus port; 0: off"),
        log_format: LogFormat = typer.Option(LogFormat.console, "--log-format", help=LOG_FORMAT_HELP),
        log_level: str = typer.Option("info", "--log-level", help=LOG_LEVEL_HELP),
    ) -> None:
        """Fit β per instance online from bear.batches.* and publish it to bear_calibration."""
        configure_logging(log_format, log_level)
        from bear.estimator.metrics import start_metrics_server
        from bear.estimator.service import run_calibrator

        start_metrics_server(metrics_port or None)
        aio.run(run_calibrator(nats_url, prefix, window=window, min_records=min_records, refit_s=refit_s))

    @app.command("sim-engine")
    def sim_engine(
        profile: str = typer.Option(..., "--profile", help="Profile name (qwen3-0.6b-h100, qwen3-8b-h100, "
                                    "qwen3-32b-2xh100-tp2) or path of a profile JSON file"),
        port: int = typer.Option(8000, "--port", help="HTTP port of the OpenAI-compatible API"),
        instance: str = typer.Option(..., "--instance", help="Instance id (the last token of its NATS subjects)"),
        nats_url: str = typer.Option("nats://127.0.0.1:4222", "--nats", help=NATS_HELP),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on"),
        base_url: str = typer.Option("", "--base-url", help="URL to advertise in bear_instances (default: from host/port)"),
        seed: int = typer.Option(-1, "--seed", help="Seed of the batch-time noise; -1: random"),
        heartbeat_s: float = typer.Option(0.5, "--heartbeat", help="Idle snapshot re-publication period (s)"),
        min_interval_s: float = typer.Option(0.0, "--snapshot-interval", help="Minimum seconds between snapshots; 0: every step"),
        prefix: str = typer.Option("bear", "--prefix", help=PREFIX_HELP),
        log_format: LogFormat = typer.Option(LogFormat.console, "--log-format", help=LOG_FORMAT_HELP),
        log_level: str = typer.Option("info", "--log-level", help=LOG_LEVEL_HELP),
    ) -> None:
        """Run a simulated vLLM instance (roofline-timed, vLLM V1 scheduling) with the OpenAI API."""
        configure_logging(log_format, log_level)
        from bear.estimator.sim.run import serve

        aio.run(serve(profile, port, instance, nats_url, host=host, prefix=prefix,
                          seed=None if seed < 0 else seed, base_url=base_url or None,
                          heartbeat_s=heartbeat_s, min_interval_s=min_interval_s))

    @app.command("estimator-bench")
    def estimator_bench(
        nats_url: str = typer.Option("", "--nats", help="Use this NATS and its running workers; "
                                     "default: start a local NATS and one worker process"),
        seconds: float = typer.Option(5.0, "--seconds", help="Measurement duration"),
        concurrency: int = typer.Option(32, "--concurrency", min=1, help="Requests in flight"),
        instances: int = typer.Option(3, "--instances", min=1, help="Candidate instances per query"),
        residents: int = typer.Option(64, "--residents", min=0, help="Resident requests per instance snapshot"),
        clients: int = typer.Option(2, "--clients", min=1, help="Client processes generating load"),
        latency_seconds: float = typer.Option(2.0, "--latency-seconds", help="Unloaded-latency phase (one in flight)"),
        log_format: LogFormat = typer.Option(LogFormat.console, "--log-format", help=LOG_FORMAT_HELP),
    ) -> None:
        """Measure estimate throughput and service time of one worker process over NATS."""
        configure_logging(log_format, "warning")
        from bear.estimator.service_bench import run_bench

        res = run_bench(nats_url or None, seconds=seconds, concurrency=concurrency, n_instances=instances,
                        residents=residents, clients=clients,
                        latency_seconds=latency_seconds)
        from rich import print as rprint

        rprint(res)

    @app.command("sim-accuracy")
    def sim_accuracy(
        profile: str = typer.Option("qwen3-8b-h100", "--profile", help="Sim profile name or file"),
        qps: float = typer.Option(4.0, "--qps", help="Poisson arrival rate (queries/s)"),
        seconds: float = typer.Option(15.0, "--seconds", help="Measured duration after the warm-up"),
        warmup_s: float = typer.Option(4.0, "--warmup", help="Warm-up (first calibration) not measured"),
        length_noise: float = typer.Option(0.3, "--length-noise", help="σ of the log-normal error of predicted lengths"),
        compensate: bool = typer.Option(False, "--compensate", help="Use staleness compensation"),
        seed: int = typer.Option(0, "--seed", help="Workload and noise seed"),
        nats_url: str = typer.Option("", "--nats", help="NATS URL; default: start a local one"),
    ) -> None:
        """BEA's TTFT MAPE against the TTFTs a simulated instance actually produced under load."""
        configure_logging(LogFormat.console, "warning")
        from rich import print as rprint

        from bear.estimator.sim.accuracy import run

        rprint(run(nats_url or None, profile=profile, qps=qps, seconds=seconds, warmup_s=warmup_s, seed=seed,
                   length_noise=length_noise, compensate=compensate))
