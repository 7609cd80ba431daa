"""The ``bear`` command: one typer app; each part of BEAR adds its own subcommands (from its module
in the CLI room ``bear.commands``), and every benchmark goes under ``bear bench <part>``.

Command modules are imported here, and only here, but keep their heavy imports (numpy, lightgbm,
vLLM) inside the command functions, so that ``bear --help`` stays fast.

``main()`` is the one error-reporting path of every command: an expected failure (bad option,
no stack, cannot connect, nothing answers, timeout, payload too large, port in use, a refused
query) ends as one line ``error: …`` on stderr and a non-zero exit code (docs/cli.md); the
traceback only with ``bear --debug`` (or ``BEAR_DEBUG=1``)."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import typer

from bear.protocol.errors import BearError, ErrorCode

EXIT_FAILED = 1  # the command ran and failed (an error reply, a refused query, a port in use, …)
EXIT_USAGE = 2  # a bad option or argument (click's code)
EXIT_UNREACHABLE = 3  # no stack found, NATS unreachable, nothing answered
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

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

_debug = [os.environ.get("BEAR_DEBUG", "") not in ("", "0")]


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", envvar="BEAR_DEBUG",
                                     help="Show the traceback of a failure (without it: one line).")) -> None:
    _debug[0] = _debug[0] or debug


# Each module exposes ``register(app)`` and, if it has benchmarks, ``register_bench(bench_app)``.
COMMAND_MODULES = [
    "bear.commands.stack",
    "bear.commands.nats",
    "bear.commands.client",
    "bear.commands.load",
    "bear.commands.router",
    "bear.commands.gateway",
    "bear.commands.predictor",
    "bear.commands.estimator",
    "bear.commands.calibrator",
    "bear.commands.snapshotter",
    "bear.commands.sim",
    "bear.commands.evaluation",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        mod = importlib.import_module(name)
        mod.register(app)
        if hasattr(mod, "register_bench"):
            mod.register_bench(bench_app)


_register_all()


def describe(exc: BaseException) -> tuple[str, int]:
    """The one line and the exit code of a failure."""
    try:
        import nats.errors as nerr
    except ImportError:  # pragma: no cover - nats-py is a dependency
        nerr = None
    if hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int):
        # click's (or typer's vendored click's) usage errors: bad option, missing argument, …
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None and exc.exit_code == EXIT_USAGE else ""
        return exc.format_message() + where, exc.exit_code
    if isinstance(exc, BearError):
        unreachable = exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED)
        return exc.message, EXIT_UNREACHABLE if unreachable else EXIT_FAILED
    if nerr is not None and isinstance(exc, nerr.Error):
        if isinstance(exc, nerr.MaxPayloadError):
            return f"message larger than the NATS server's max_payload: {exc}", EXIT_FAILED
        if isinstance(exc, nerr.NoRespondersError):
            return "nothing answers on NATS (is the stack running?)", EXIT_UNREACHABLE
        if isinstance(exc, nerr.TimeoutError):
            return "a NATS request timed out", EXIT_UNREACHABLE
        return f"NATS: {exc or type(exc).__name__}", EXIT_UNREACHABLE
    if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ == "Abort":  # click's Ctrl-C
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(exc, TimeoutError):  # an OSError too: first
        return f"timed out: {exc}", EXIT_FAILED
    if isinstance(exc, OSError):
        if exc.filename and exc.strerror:
            return f"{exc.strerror}: {exc.filename}", EXIT_FAILED
        return exc.strerror or str(exc), EXIT_FAILED
    return (f"internal error: {type(exc).__name__}: {exc} (run `bear --debug …` for the traceback)",
            EXIT_FAILED)


def fail(exc: BaseException) -> int:
    """Print ``exc`` as one line on stderr (the traceback first with --debug); its exit code."""
    line, code = describe(exc)
    if _debug[0]:
        traceback.print_exception(exc)
    line = " ".join(line.split())  # one line, whatever the message held
    print(f"error: {line}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> None:
    # Logs go to stderr from the start (services reconfigure with --log-format): stdout stays
    # clean for the JSON that `--json` commands print.
    from bear.runtime.logging import configure_logging
    from bear.runtime.process import prepare_process

    prepare_process()  # the open-file soft limit up to the hard one; an inherited ignored SIGINT back to default
    configure_logging("console", "info")
    try:
        rv = app(args=argv, standalone_mode=False)
    except BaseException as exc:  # the one place where failures become one line
        if isinstance(exc, SystemExit):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":  # `bear` or `bear bench` alone: the help
            exc.show()  # type: ignore[attr-defined]
            sys.exit(0)
        sys.exit(fail(exc))
    if rv == EXIT_INTERRUPTED:  # typer turns a Ctrl-C into exit code 130
        print("error: interrupted", file=sys.stderr, flush=True)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
