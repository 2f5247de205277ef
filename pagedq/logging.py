"""structlog set-up: JSON lines for services, readable console lines for the CLI.

Library code only calls ``get_logger``; the entry point (``pagedq worker``, the CLI) calls
``configure_logging`` with the user's choice. A logger used before that gets the console
default, so importing pagedq never needs a set-up step.

Ground floor: it imports nothing of pagedq but ``pagedq.redact`` (no redis, no client), so the
kernels log through it too; ``pagedq.logging`` is the same module under its old name.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
import structlog.typing

from pagedq.redact import redact_url


def redact_credentials(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """A processor: the user and password of any Redis URL in a log line become ``***``, so a
    URL logged anywhere (an error message that quotes it) never leaks them."""
    for key, value in event.items():
        if isinstance(value, str) and "://" in value:
            event[key] = redact_url(value)
    return event

_configured = False


def configure_logging(json: bool = False, level: str = "INFO", file: Any = None) -> None:
    """Set the renderer (JSON or console), the level and the stream (default: stderr) for the
    whole process.

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
            redact_credentials,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=file or sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A structlog logger named ``name``; installs the console default if nothing has yet."""
    if not _configured:
        configure_logging()
    return structlog.get_logger(name)
