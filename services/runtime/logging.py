"""structlog set-up shared by every service: console for humans, JSON for machines."""

from __future__ import annotations

import logging
import sys
from enum import StrEnum
from typing import Any

import structlog

DROPPED = [0]  # log lines not written (their file could not be written: a full disk), this process


class _SafePrintLogger(structlog.PrintLogger):
    """A log line that cannot be written (ENOSPC on a full disk, a closed pipe) is dropped and
    counted (``DROPPED``), never raised into the code that logs: a full disk must not turn every
    warning into a failed query (issue 40)."""

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (OSError, ValueError):
            DROPPED[0] += 1

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


class _SafePrintLoggerFactory(structlog.PrintLoggerFactory):
    def __call__(self, *args: Any) -> structlog.PrintLogger:
        return _SafePrintLogger(self._file)


class _SafeStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    def handleError(self, record: logging.LogRecord) -> None:
        DROPPED[0] += 1  # not the traceback on stderr the default prints (stderr is the full file)


class LogFormat(StrEnum):
    console = "console"
    json = "json"


def configure_logging(fmt: LogFormat | str = LogFormat.console, level: str = "info") -> None:
    """Route structlog (and stdlib logging) to stderr in the chosen format; a line that cannot be
    written is dropped and counted, not raised."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer: structlog.typing.Processor
    if str(fmt) == LogFormat.json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_SafePrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = _SafeStreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=lvl, handlers=[handler])
