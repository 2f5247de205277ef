"""Batch input lines -> jobs, and results -> OpenAI's batch output and error lines.

Shared by the Batch API (batches.py) and ``pagedq batch`` (offline.py), so both write the
same lines. A line that cannot become a job fails alone: it gets an error line, its
neighbours run.

Input:  {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output: {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200,
         "request_id": "...", "body": {...}}, "error": null}
Error:  the same with the error body and its status code in "response" (a line the gateway
        refuses gets the status its HTTP route would answer: 400, 404 for an unserved model),
        or, for a line that never became a request (not JSON, no custom_id, another method or
        endpoint) and for a line the batch expired under, "response": null and
        "error": {"code", "message"}, as OpenAI writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pagedq.client import RequestCancelledError, RequestError, RequestFailedError, Result
from pagedq.client.request_errors import ResultTimeoutError, StreamGapError
from pagedq.gateway.api_errors import APIError, bad_request, from_job_error
from pagedq.gateway.openai import ChatCompletionRequest, CompletionRequest
from pagedq.gateway.render import response
from pagedq.gateway.tokens import TokenText
from pagedq.gateway.translate import (
    CHAT,
    ENDPOINTS,
    JobSpec,
    chat_spec,
    completion_spec,
)

BATCH_PRIORITY = -1  # pagedq's low level: interactive traffic on the same workers goes first
# Codes of a line that never became a request: no route would have answered it.
UNREQUESTED = frozenset({"invalid_json_line", "missing_custom_id", "invalid_method",
                         "mismatched_url"})


@dataclass
class Line:
    """One input line: a job spec, or the error that keeps it from becoming one."""

    number: int
    custom_id: str | None
    spec: JobSpec | None = None
    error: APIError | None = None


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param


def parse_line(raw: bytes | str, number: int, endpoint: str | None, request_id: str) -> Line:
    """Parse and translate line ``number``; its jobs get ids from ``request_id``.

    ``endpoint``: the batch's; None takes each line's own ``url`` (``pagedq batch``)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return Line(number, None, error=bad_request(f"line {number + 1} is not JSON: {exc}",
                                                    code="invalid_json_line"))
    if not isinstance(obj, dict):
        return Line(number, None, error=bad_request(f"line {number + 1} is not a JSON object",
                                                    code="invalid_json_line"))
    custom_id = obj.get("custom_id")
    line = Line(number, custom_id if isinstance(custom_id, str) else None)
    body = obj.get("body")
    if endpoint is None and obj.get("url") in ENDPOINTS:
        endpoint = obj["url"]
    if line.custom_id is None:
        line.error = bad_request("custom_id must be a string", "custom_id", "missing_custom_id")
    elif obj.get("method", "POST") != "POST":
        line.error = bad_request("method must be POST", "method", "invalid_method")
    elif endpoint is None or obj.get("url") != endpoint:
        line.error = bad_request(f"url must be {endpoint or ' or '.join(ENDPOINTS)}", "url",
                                 "mismatched_url")
    elif not isinstance(body, dict):
        line.error = bad_request("body must be a JSON object", "body", "invalid_body")
    else:
        try:
            line.spec = spec_for(endpoint, body, request_id)
        except APIError as exc:
            line.error = exc
    return line


def spec_for(endpoint: str, body: dict[str, Any], request_id: str) -> JobSpec:
    """A line's body as a low-priority, unstreamed job spec."""
    body = {**body, "stream": False}
    try:
        if ENDPOINTS[endpoint] == CHAT:
            return chat_spec(ChatCompletionRequest.model_validate(body), request_id,
                             BATCH_PRIORITY)
        return completion_spec(CompletionRequest.model_validate(body), request_id,
                               BATCH_PRIORITY)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise bad_request(message, param) from exc


def line_id(request_id: str) -> str:
    return "batch_req_" + request_id.replace("-", "_")


def output_line(line: Line, request_id: str, body: dict[str, Any], status: int = 200
                ) -> dict[str, Any]:
    return {"id": line_id(request_id), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def error_line(line: Line, request_id: str, err: APIError, requested: bool) -> dict[str, Any]:
    """``requested``: the line became a request (the error is its HTTP answer)."""
    if requested:
        return output_line(line, request_id, err.body(), err.status)
    return {"id": line_id(request_id), "custom_id": line.custom_id, "response": None,
            "error": {"code": err.code or err.type, "message": err.message}}


def refused_line(line: Line, request_id: str, err: APIError) -> dict[str, Any]:
    """The error line of a line refused before it became a job: the answer its HTTP route
    would give (``response.status_code`` 400, 404, ...), as OpenAI writes a line's bad
    params; ``"response": null`` only for a line that never was a request."""
    return error_line(line, request_id, err, err.code not in UNREQUESTED)


def result_line(line: Line, request_id: str, outcome: list[Result] | Exception,
                token_text: TokenText) -> tuple[bool, dict[str, Any] | None]:
    """(succeeded, its output or error line); None for a job cancelled with its batch."""
    if isinstance(outcome, RequestCancelledError):
        return False, None
    if isinstance(outcome, Exception):
        return False, error_line(line, request_id, job_error(outcome), True)
    assert line.spec is not None
    return True, output_line(line, request_id,
                             response(line.spec.view, request_id, outcome, token_text))


def job_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestFailedError):
        return from_job_error(exc.code, exc.reason)
    if isinstance(exc, (ResultTimeoutError, StreamGapError)):
        return APIError(500, f"the job's output is gone ({exc}); raise the worker --ttl",
                        "server_error", "output_expired")
    if isinstance(exc, RequestError):
        return APIError(500, str(exc), "server_error", "request_failed")
    return APIError(500, f"{type(exc).__name__}: {exc}", "server_error", "internal")


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
