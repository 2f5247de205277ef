"""The errors both sides of the queue raise: the ground floor the SDK and the engine stand on.

Every error pagedq raises on purpose derives from ``PagedQError``, so a caller can catch them
all at once; each message tells the user what to change. This module imports nothing, so the
torch-free SDK, the engine and the model code can all depend on it without a cycle.
"""

from __future__ import annotations

__all__ = [
    "PagedQError",
    "InvalidParamsError",
    "EngineError",
    "InvalidRequestError",
    "RequestTooLongError",
    "ModelNotFoundError",
]


class PagedQError(Exception):
    """Base class of every error pagedq raises on purpose."""


class InvalidParamsError(PagedQError, ValueError):
    """A sampling parameter is out of range; the message names the field and the valid range."""


class EngineError(PagedQError):
    """Base class of the engine's own errors (requests, configuration, models)."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (empty prompt, token id out of the vocabulary, ...)."""


class RequestTooLongError(InvalidRequestError):
    """The request can never fit: prompt + max_tokens exceed max_model_len or the whole KV cache."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model could not be resolved to local files (nothing is downloaded from a hub)."""
