"""Typed errors a request ends with, as the SDK raises them (re-exported by pagedq.client, the
path to import them from). Each message says what happened and what to do about it. The base
classes every side raises (PagedQError, InvalidParamsError, ...) are pagedq.errors."""

from __future__ import annotations

from pagedq.client.protocol import ProtocolError
from pagedq.client.result import Result
from pagedq.errors import InvalidParamsError, PagedQError

__all__ = [
    "PagedQError",
    "InvalidParamsError",
    "ProtocolError",
    "RequestError",
    "RequestFailedError",
    "DeadLetteredError",
    "RequestCancelledError",
    "DuplicateRequestError",
    "ResultTimeoutError",
    "StreamGapError",
]


class RequestError(PagedQError):
    """A request ended without a normal result. ``partial`` holds what was generated."""

    def __init__(self, message: str, request_id: str, partial: Result | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.partial = partial


class RequestFailedError(RequestError):
    """The worker rejected or failed the request; ``code`` is the protocol error code."""

    def __init__(self, message: str, request_id: str, code: str, partial: Result | None = None):
        super().__init__(f"request {request_id} failed ({code}): {message}", request_id, partial)
        self.code = code
        self.reason = message


class DeadLetteredError(RequestFailedError):
    """The job was delivered too many times (workers kept dying on it) and was dead-lettered.

    Inspect the queue's dead-letter stream (``Keys.dead``) before resubmitting it.
    """


class DuplicateRequestError(RequestError):
    """The request id belongs to another job (another prompt or other params): the protocol's
    ``duplicate_id``. The first job is untouched; submit under a new id."""

    code = "duplicate_id"


class RequestCancelledError(RequestError):
    """The request was cancelled (``handle.cancel()``) before it finished."""


class ResultTimeoutError(PagedQError, TimeoutError):
    """No terminal event arrived in time. The job keeps running; call ``result()`` again."""


class StreamGapError(PagedQError):
    """The output stream skipped events (e.g. its keys expired: raise the worker's --ttl)."""
