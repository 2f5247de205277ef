"""Typed engine errors. Each message tells the caller what to change."""

from __future__ import annotations

from pagedq.client.params import InvalidParamsError

__all__ = [
    "EngineError",
    "InvalidParamsError",
    "InvalidRequestError",
    "RequestTooLongError",
    "ModelNotFoundError",
]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (empty prompt, token id out of the vocabulary, ...)."""


class RequestTooLongError(InvalidRequestError):
    """The request can never fit: prompt + max_tokens exceed max_model_len or the whole KV cache."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model could not be resolved to local files (nothing is downloaded from a hub)."""
