"""structlog set-up shared by every service: console for humans, JSON for machines."""

from __future__ import annotations

import logging
import sys
from enum import StrEnum

import structlog


class LogFormat(StrEnum):
    console = "console"
    json = "json"


def configure_logging(fmt: LogFormat | str = LogFormat.console, level: str = "info") -> None:
    """Route structlog (and stdlib logging) to stderr in the chosen format."""
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
