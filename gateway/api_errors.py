"""OpenAI-shaped HTTP errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a route reports is an ``APIError``; the app turns it into that JSON with its
status code, so clients written for OpenAI (the ``openai`` SDKs) raise their usual typed errors.
"""

from __future__ import annotations

import re
from typing import Any

from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from pagedq.client.protocol import (
    E_BAD_PAYLOAD,
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_TOO_LONG,
    E_UNSUPPORTED_VERSION,
    ProtocolError,
)
from pagedq.errors import InvalidParamsError

# Worker error codes that mean the request itself was bad (the client must change it).
CLIENT_CODES = frozenset({E_BAD_PAYLOAD, E_INVALID_PARAMS, E_INVALID_REQUEST, E_TOO_LONG,
                          E_UNSUPPORTED_VERSION})
MAX_MESSAGE = 400  # characters of an error message (they may quote what a client sent)
_PARAM_RE = re.compile(r"SamplingParams\.(\w+)\s*[=:]")
# SamplingParams field -> the OpenAI request field a user set it through
_OPENAI_NAMES = {"max_tokens": "max_tokens", "logprobs": "logprobs", "n": "n"}


class APIError(Exception):
    """An HTTP error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        if len(message) > MAX_MESSAGE:  # never echo a huge input back
            message = message[:MAX_MESSAGE] + f"... ({len(message)} characters in all)"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def too_many_prompts(count: int, limit: int) -> APIError:
    return bad_request(f"the request has {count} prompts; at most {limit} (--max-prompts): "
                       "split it", "prompt", "too_many_prompts")


def not_found(message: str, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", code, param)


def invalid_params(exc: Exception) -> APIError:
    """A SamplingParams validation message, with the field it names as ``param``."""
    m = _PARAM_RE.search(str(exc))
    param = _OPENAI_NAMES.get(m.group(1), m.group(1)) if m else None
    return bad_request(str(exc), param, E_INVALID_PARAMS)


def from_job_error(code: str, message: str) -> APIError:
    """The HTTP error for a job's error event: 400 for a bad request, 500 otherwise."""
    if code in CLIENT_CODES:
        return bad_request(message, code=code)
    return APIError(500, message, "server_error", code)


def unexpected(exc: BaseException) -> APIError:
    """An exception no check foresaw, as an answer. Bad input that slipped past the checks
    (text that is not Unicode, nesting past the interpreter's limit) is still the client's 400;
    anything else is a 500 that echoes nothing of the exception (the log has it)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ProtocolError):
        return bad_request(str(exc), code=exc.code)
    if isinstance(exc, InvalidParamsError):
        return invalid_params(exc)
    if isinstance(exc, UnicodeError):
        return bad_request("the request holds text that is not valid Unicode (a lone UTF-16 "
                           "surrogate such as \\ud800?): send UTF-8 text", code=E_INVALID_REQUEST)
    if isinstance(exc, RecursionError):
        return bad_request("the request nests objects or arrays too deeply", code=E_INVALID_REQUEST)
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and _oom(exc)):
        return APIError(503, "the queue's Redis is full (maxmemory): retry later", "server_error",
                        "storage_full", headers={"Retry-After": "10"})
    if isinstance(exc, RedisError):
        return APIError(503, "the queue's Redis did not answer: retry later", "server_error",
                        "redis_unavailable", headers={"Retry-After": "1"})
    return APIError(500, "internal error: the gateway's log has the details", "server_error",
                    "internal")


def _oom(exc: ResponseError) -> bool:
    """Redis's OOM refusal that redis-py did not type as OutOfMemoryError: an older redis-py
    keeps the "OOM" prefix, and a write refused inside a Lua script (submitting a job) arrives
    as "Error running script ...: -OOM command not allowed when used memory > 'maxmemory'"."""
    text = str(exc)
    return text.startswith("OOM") or "OOM command not allowed" in text


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over the gateway's limit of {limit} bytes "
                    "(--max-body-bytes / --max-file-bytes)", "invalid_request_error",
                    "request_too_large")
