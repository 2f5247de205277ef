"""structlog set-up: JSON lines for services, readable console lines for the CLI.

Library code only calls ``get_logger``; the entry point (``pagedq worker``, the CLI) calls
``configure_logging`` with the user's choice. A logger used before that gets the console
default, so importing pagedq never needs a set-up step.
"""

from __future__ import annotations

import logging
import sys

import structlog
import structlog.typing

_configured = False


def configure_logging(json: bool = False, level: str = "INFO") -> None:
    """Set the renderer (JSON or console) and the level for the whole process.

    Every call replaces the previous configuration, so an entry point's choice wins over the
    console default a library logger may have installed first. Loggers are not cached, so
    loggers created before the call follow it too.
    """
    global _configured
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(
        colors=False
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A structlog logger named ``name``; installs the console default if nothing has yet."""
    if not _configured:
        configure_logging()
    return structlog.get_logger(name)
