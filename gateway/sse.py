"""Server-sent event streams that survive a dropped connection.

Each SSE event carries ``id:`` = the seq of the output-stream event it renders (1, 2, 3, ...;
0 for the opening chunks), so ``GET /v1/requests/{id}/stream`` with ``Last-Event-ID: N``
replays exactly what follows event N. When an event renders to several chunks only the last
one carries the id: a connection dropped between them resumes before the whole event.

Who is reading a stream lives in Redis (``P:{Q}:req:ID:gw``: the stream's View, a reader count,
the last drop's token), so any gateway can resume a stream another one began, and the one
that saw the drop cancels the job only if nobody came back within the grace period.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedq.client import AsyncRequestHandle, Event, ResultTimeoutError
from pagedq.client.protocol import CANCELLED, ERROR, Keys
from pagedq.gateway.api_errors import from_job_error
from pagedq.gateway.render import ChunkRenderer
from pagedq.gateway.translate import View
from pagedq.logging import get_logger

log = get_logger("pagedq.gateway.sse")

KEEPALIVE_S = 5.0  # a comment line this often keeps proxies from closing a quiet stream
# A comment line with no blank line after it: the openai SDKs dispatch an empty event (and fail
# to parse it) at a blank line once an id was seen, even when only a comment preceded it.
KEEPALIVE = b": keep-alive\n"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any], event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def error_chunk(ev: Event) -> dict[str, Any]:
    if ev.type == CANCELLED:
        return {"error": {"message": f"request {ev.request_id} was cancelled",
                          "type": "server_error", "param": None, "code": "cancelled"}}
    return from_job_error(ev.error_code or "internal", ev.error or "the job failed").body()


class Readers:
    """The Redis record of a stream's View and readers (``P:{Q}:req:ID:gw``, in the queue's
    slot like the job's own keys)."""

    def __init__(self, r: Redis, keys: Keys, ttl: int):
        self.r = r
        self.keys = keys
        self.ttl = ttl

    def key(self, request_id: str) -> str:
        return f"{self.keys.base}:req:{request_id}:gw"

    async def save(self, request_id: str, view: View, owner: str = "") -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.key(request_id),
                  mapping={"view": view.to_json(), "readers": 0, "owner": owner})
        pipe.expire(self.key(request_id), self.ttl)
        await pipe.execute()

    async def view(self, request_id: str) -> tuple[View, str] | None:
        """The stream's View and the tenant that made it; None if there is no such stream."""
        raw, owner = await self.r.hmget(self.key(request_id), ["view", "owner"])
        return (View.from_json(raw), (owner or b"").decode()) if raw else None

    async def attach(self, request_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(self.key(request_id), "readers", 1)
        pipe.expire(self.key(request_id), self.ttl)  # never a key without a TTL
        await pipe.execute()

    async def detach(self, request_id: str, dropped: bool) -> str:
        token = uuid.uuid4().hex
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(self.key(request_id), "readers", -1)
        if dropped:
            pipe.hset(self.key(request_id), "dropped", token)
        pipe.expire(self.key(request_id), self.ttl)  # the key may have expired meanwhile
        await pipe.execute()
        return token

    async def abandoned(self, request_id: str, token: str) -> bool:
        """No reader now, and no reader came and went since this drop."""
        readers, dropped = await self.r.hmget(self.key(request_id), ["readers", "dropped"])
        return int(readers or 0) <= 0 and dropped is not None and dropped.decode() == token


@dataclass
class StreamSession:
    """One HTTP connection's view of a job's stream; ``after`` = the Last-Event-ID, if any."""

    readers: Readers
    handle: AsyncRequestHandle
    renderer: ChunkRenderer
    grace: float
    after: int | None = None
    prefetched: list[Event] = field(default_factory=list)
    on_abandon: Callable[[], None] | None = None
    done: bool = False

    async def body(self) -> AsyncIterator[bytes]:
        after = -1 if self.after is None else self.after
        opening = self.renderer.opening()
        if after < 0:
            for j, chunk in enumerate(opening):
                yield sse(chunk, 0 if j == len(opening) - 1 else None)
        for ev in self.prefetched:
            for piece in self._render(ev, after):
                yield piece
            if ev.terminal:
                return
        quiet_since = time.monotonic()
        while not self.done:
            try:  # stream() gives up after the timeout; the handle's cursor keeps our place
                async for ev in self.handle.stream(timeout=KEEPALIVE_S):
                    for piece in self._render(ev, after):
                        quiet_since = time.monotonic()
                        yield piece
            except ResultTimeoutError:
                if time.monotonic() - quiet_since >= KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield KEEPALIVE

    def _render(self, ev: Event, after: int) -> list[bytes]:
        if ev.type in (ERROR, CANCELLED):
            chunks = [error_chunk(ev)]
        else:
            chunks = self.renderer.on_event(ev)
        out = [sse(c, ev.seq if j == len(chunks) - 1 else None) for j, c in enumerate(chunks)]
        if ev.terminal:
            self.done = True
            out.append(DONE)
        return out if ev.seq > after else ([DONE] if ev.terminal else [])

    def closed(self, spawn: Callable[[Any], None]) -> None:
        """The connection ended (cleanly or dropped): leave, and on a drop start the grace."""
        spawn(self._leave(dropped=not self.done))

    async def _leave(self, dropped: bool) -> None:
        rid = self.handle.id
        try:
            token = await self.readers.detach(rid, dropped)
            if not dropped:
                return
            await asyncio.sleep(self.grace)
            if await self.readers.abandoned(rid, token) and await self.handle.cancel():
                log.info("stream abandoned: job cancelled", request_id=rid, grace_s=self.grace)
                if self.on_abandon is not None:
                    self.on_abandon()
        except Exception:
            log.exception("could not settle a dropped stream", request_id=rid)


class SSEResponse(StreamingResponse):
    """An event stream that tells its session when the connection ends, however it ends."""

    def __init__(self, session: StreamSession, spawn: Callable[[Any], None]):
        super().__init__(session.body(), media_type="text/event-stream", headers=SSE_HEADERS)
        self.session = session
        self.spawn = spawn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            except Exception:  # a generator cancelled mid-await is already closed
                pass
            self.session.closed(self.spawn)
