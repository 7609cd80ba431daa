"""The ``bear`` command: one typer app; each part of BEAR adds its own subcommands.

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

# Each module exposes ``register(app: typer.Typer) -> None``.
COMMAND_MODULES = [
    "bear.estimator.commands",
    "bear.estimator.service_commands",
    "bear.predictor.commands",
    "bear.snapshotter.commands",
    "bear.router.evaluation.commands",
    "bear.router.commands",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)


_register_all()


def main() -> None:
    # Logs go to stderr from the start (services reconfigure with --log-format): stdout stays
    # clean for the JSON that `--json` commands print.
    from bear.protocol.logging import configure_logging

    configure_logging("console", "info")
    app()


if __name__ == "__main__":
    main()
