"""The ``bear`` command: one typer app; each part of BEAR adds its own subcommands, and every
benchmark goes under ``bear bench <part>``.

Command modules are imported here but keep their heavy imports (numpy, lightgbm, vLLM) inside
the command functions, so that ``bear --help`` stays fast.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="bear",
    help="BEAR: route LLM queries across heterogeneous vLLM instances by predicted TTFT and utility.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks that print numbers (medians, p99, throughput, memory).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# Each module exposes ``register(app)`` and, if it has benchmarks, ``register_bench(bench_app)``.
COMMAND_MODULES = [
    "bear.stack.commands",
    "bear.client.commands",
    "bear.load.commands",
    "bear.router.commands",
    "bear.gateway.commands",
    "bear.predictor.commands",
    "bear.estimator.commands",
    "bear.calibrator.commands",
    "bear.snapshotter.commands",
    "bear.sim.commands",
    "bear.evaluation.commands",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        mod = importlib.import_module(name)
        mod.register(app)
        if hasattr(mod, "register_bench"):
            mod.register_bench(bench_app)


_register_all()


def main() -> None:
    # Logs go to stderr from the start (services reconfigure with --log-format): stdout stays
    # clean for the JSON that `--json` commands print.
    from bear.runtime.logging import configure_logging

    configure_logging("console", "info")
    app()


if __name__ == "__main__":
    main()
