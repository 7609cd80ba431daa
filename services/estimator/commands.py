"""CLI commands of the estimator side: placeholder replaced below."""

import typer


def register(app: typer.Typer) -> None:
    pass
