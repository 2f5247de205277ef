"""Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` and the stream resume
``GET /v1/requests/{id}/stream``.

A request is admitted (a live worker, its model served, the queue not too deep), becomes
jobs, and is answered from their output streams. A streamed answer waits for the job's first
event before it sends headers, so a request the worker refuses at once (a prompt too long
for the model) still gets a plain 400 rather than a stream that fails.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response

from pagedq.client import AsyncRequestHandle, Event, RequestCancelledError, RequestFailedError
from pagedq.client.protocol import ERROR, ProtocolError, check_request_id
from pagedq.gateway.api_errors import (
    APIError,
    bad_request,
    from_job_error,
    not_found,
    too_many_prompts,
)
from pagedq.gateway.openai import ChatCompletionRequest, CompletionRequest
from pagedq.gateway.render import ChunkRenderer, response
from pagedq.gateway.sse import SSEResponse, StreamSession
from pagedq.gateway.state import Gateway, gateway, tenant
from pagedq.gateway.thinking import fit_tool_format
from pagedq.gateway.translate import JobSpec, chat_spec, completion_spec, submit

router = APIRouter()
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that went away (nobody receives it)
EVENT_ID_RE = re.compile(r"^[0-9]{1,18}$")  # ASCII digits only ("²".isdigit() is True)


class ClientGone(Exception):
    """The HTTP client disconnected while its answer was being prepared."""


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    gw = gateway(request)
    req.priority = clamp_priority(gw, req.priority)
    return await answer(gw, request, chat_spec(req))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    gw = gateway(request)
    req.priority = clamp_priority(gw, req.priority)
    return await answer(gw, request, completion_spec(req))


def clamp_priority(gw: Gateway, priority: int) -> int:
    """The client's (vLLM-sense) priority within the operator's --min/--max-priority."""
    return max(gw.config.min_priority, min(gw.config.max_priority, priority))


@router.get("/v1/requests/{request_id}/stream")
async def resume_stream(request_id: str, request: Request,
                        last_event_id: str | None = Header(default=None)) -> Response:
    """Replay a stream from after ``Last-Event-ID`` (from the start without one)."""
    gw = gateway(request)
    try:
        check_request_id(request_id)
    except ProtocolError as exc:
        raise not_found(str(exc)) from exc
    found = await gw.readers.view(request_id)
    if found is None or not tenant(request).sees(found[1]):  # another tenant's: no such stream
        raise not_found(f"no stream {request_id}: it never existed, was not streamed, or "
                        "expired", "stream_not_found")
    view = found[0]
    after = None
    if last_event_id is not None and last_event_id.strip():
        if EVENT_ID_RE.match(last_event_id.strip()) is None:
            raise bad_request("Last-Event-ID must be an event id this stream sent (an integer)",
                              "Last-Event-ID")
        after = int(last_event_id.strip())
    fleet = await gw.fleet.view()
    renderer = ChunkRenderer(view, request_id, gw.tokens.lookup(fleet.path_of(view.model)))
    await gw.readers.attach(request_id)
    return _sse(gw, StreamSession(gw.readers, gw.client.handle(request_id), renderer,
                                  gw.config.disconnect_grace, after))


async def answer(gw: Gateway, request: Request, spec: JobSpec) -> Response:
    began = time.perf_counter()
    model_path = await admit(gw, spec)
    await fit_tool_format(spec, model_path, gw.config.tool_call_format)
    text = gw.tokens.lookup(model_path)
    handles = await submit(gw.client, spec)
    if not spec.stream:
        try:
            results = await until_disconnect(request, asyncio.gather(
                *(h.result(timeout=None) for h in handles)))
        except ClientGone:
            await _cancel(handles)
            return Response(status_code=CLIENT_CLOSED)
        except RequestFailedError as exc:
            raise from_job_error(exc.code, exc.reason) from exc
        except RequestCancelledError as exc:
            raise APIError(500, str(exc), "server_error", "cancelled") from exc
        return JSONResponse(response(spec.view, spec.id, results, text))
    handle = handles[0]
    await gw.readers.save(spec.id, spec.view, tenant(request).owner)
    try:
        first = await until_disconnect(request, _first_event(handle))
    except ClientGone:
        await _cancel(handles)
        return Response(status_code=CLIENT_CLOSED)
    if first.type == ERROR:
        raise from_job_error(first.error_code or "internal", first.error or "the job failed")
    route = "/v1/chat/completions" if spec.view.kind == "chat" else "/v1/completions"
    gw.metrics.ttft.labels(route).observe(time.perf_counter() - began)
    await gw.readers.attach(spec.id)
    renderer = ChunkRenderer(spec.view, spec.id, text)
    return _sse(gw, StreamSession(gw.readers, handle, renderer,
                                  gw.config.disconnect_grace, prefetched=[first],
                                  on_abandon=gw.metrics.abandoned.inc))


def _sse(gw: Gateway, session: StreamSession) -> Response:
    gw.metrics.streams.inc()

    def spawn(coro: Any) -> None:
        gw.metrics.streams.dec()
        gw.spawn(coro)

    return SSEResponse(session, spawn)


async def served_path(gw: Gateway, model: str) -> tuple[Any, str]:
    """(the fleet's view, the path of ``model`` as its workers serve it); 503 with no live
    worker, 404 for a model nobody serves (admit, and /tokenize, which needs only the model)."""
    view = await gw.fleet.view()
    if not view.alive:
        raise APIError(503, f"no worker is serving queue {gw.config.queue!r} yet: one starting "
                       "is still loading its model (retry shortly); if none is, start one "
                       "(pagedq worker)", "server_error", "no_worker", headers={"Retry-After": "5"})
    path = view.path_of(model)
    if path is None:
        served = ", ".join(sorted(view.models)) or "none"
        raise not_found(f"The model `{model}` does not exist: live workers serve {served}",
                        "model_not_found", "model")
    return view, path


async def admit(gw: Gateway, spec: JobSpec) -> str:
    """The served model's path; 400 for more prompts than ``max_prompts``, 503 with no live
    worker, 404 for a model nobody serves, 429 when the request's interactive jobs would take
    the waiting ones past ``max_queue_depth`` (each prompt is a job, and the jobs admitted
    since the last reading of the queue count too)."""
    jobs = len(spec.prompts)
    if jobs > gw.config.max_prompts:
        raise too_many_prompts(jobs, gw.config.max_prompts)
    view, path = await served_path(gw, spec.view.model)
    limit = gw.config.max_queue_depth
    if limit is not None and spec.priority >= 0:  # low-priority jobs wait behind the rest
        if jobs > limit:
            raise bad_request(f"the request's {jobs} prompts are more jobs than the queue "
                              f"admits at once (--max-queue-depth {limit}): split it", "prompt",
                              "too_many_prompts")
        if view.interactive_depth + jobs > limit:
            raise APIError(429, f"the queue holds {view.interactive_depth} waiting requests "
                           f"(limit {limit}); retry later", "rate_limit_exceeded", "queue_full",
                           headers={"Retry-After": "1"})
        view.interactive_depth += jobs  # a burst sharing one reading counts itself
    return path


async def _first_event(handle: AsyncRequestHandle) -> Event:
    async for ev in handle.stream(timeout=None):
        return ev
    raise RuntimeError("the output stream ended without an event")


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """``await aw``, unless the client disconnects first (then ClientGone, ``aw`` cancelled)."""
    task = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel(handles: list[AsyncRequestHandle]) -> None:
    for h in handles:
        await h.cancel()
