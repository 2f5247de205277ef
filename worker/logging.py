"""The worker's name for the ground floor's structlog set-up (pagedq/logging.py), kept so
``from pagedq.worker.logging import get_logger`` still works everywhere; new code imports
``pagedq.logging``."""

from pagedq.logging import configure_logging, get_logger, redact_credentials

__all__ = ["configure_logging", "get_logger", "redact_credentials"]
