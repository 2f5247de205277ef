"""The asyncio SDK: the same API as ``Client``, with ``await`` and ``async for``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from pagedq.client.client import (
    BLOCK_MS,
    READ_COUNT,
    Result,
    ResultBuilder,
    parse_entries,
    parse_worker_hash,
    queue_stats,
    resolve_redis_url,
    to_deadline,
)
from pagedq.client.errors import ResultTimeoutError
from pagedq.client.protocol import (
    CANCEL_SCRIPT,
    CANCELLED,
    DEFAULT_PREFIX,
    DEFAULT_QUEUE,
    DEFAULT_TTL_S,
    GROUP,
    LEVELS,
    Event,
    Keys,
    build_request,
    decode_event,
    encode_event,
    job_fields,
)
from pagedq.params import SamplingParams


class AsyncRequestHandle:
    """Async twin of ``RequestHandle`` (same cursor semantics)."""

    def __init__(self, client: AsyncClient, request_id: str, after: str = "0-0"):
        self.client = client
        self.id = request_id
        self.cursor = after
        self.builder = ResultBuilder(request_id, 1 if after == "0-0" else None)

    def __repr__(self) -> str:
        return f"AsyncRequestHandle({self.id!r})"

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Event]:
        end = None if timeout is None else time.monotonic() + timeout
        key = self.client.keys.out(self.id)
        while not self.builder.done:
            if end is not None and time.monotonic() >= end:
                raise ResultTimeoutError(
                    f"no terminal event for request {self.id} within {timeout}s; the job may "
                    "still be queued or running: call result()/stream() again to keep waiting"
                )
            block = BLOCK_MS if end is None else int(min(BLOCK_MS, max(1, (end - time.monotonic()) * 1000)))
            reply = await self.client.redis.xread({key: self.cursor}, count=READ_COUNT,
                                                  block=block)
            for entry_id, fields in parse_entries(reply):
                ev = decode_event(fields, entry_id)
                self.builder.feed(ev)
                self.cursor = entry_id
                yield ev
                if ev.terminal:
                    return

    async def result(self, timeout: float | None = 60) -> Result:
        async for _ in self.stream(timeout=timeout):
            pass
        return self.builder.result()

    async def cancel(self) -> bool:
        return await self.client._cancel(self.id) != 0


class AsyncClient:
    """Async client; create inside a running loop, ``await client.aclose()`` when done."""

    def __init__(self, redis_url: str | None = None, queue: str = DEFAULT_QUEUE, *,
                 prefix: str = DEFAULT_PREFIX, ttl: int = DEFAULT_TTL_S,
                 connection: aredis.Redis | None = None):
        self.redis = connection or aredis.Redis.from_url(resolve_redis_url(redis_url))
        self.keys = Keys(queue, prefix)
        self.ttl = ttl
        self._groups_ready = False
        self._cancel_script = self.redis.register_script(CANCEL_SCRIPT)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def _ensure_groups(self) -> None:
        if self._groups_ready:
            return
        for key in self.keys.all_jobs():
            try:
                await self.redis.xgroup_create(key, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    async def submit(self, prompt: Any, params: SamplingParams | None = None, *,
                     deadline: Any = None, priority: int = 0,
                     metadata: dict[str, Any] | None = None,
                     request_id: str | None = None) -> AsyncRequestHandle:
        req = build_request(prompt, params, request_id=request_id, deadline=to_deadline(deadline),
                            priority=priority, metadata=metadata)
        await self._ensure_groups()
        await self.redis.xadd(self.keys.jobs(req.level), job_fields(req))
        return AsyncRequestHandle(self, req.id)

    async def submit_many(self, prompts: Sequence[Any], params: SamplingParams | None = None,
                          **kwargs: Any) -> list[AsyncRequestHandle]:
        reqs = [
            build_request(p, params, deadline=to_deadline(kwargs.get("deadline")),
                          priority=kwargs.get("priority", 0), metadata=kwargs.get("metadata"))
            for p in prompts
        ]
        await self._ensure_groups()
        pipe = self.redis.pipeline(transaction=False)
        for req in reqs:
            pipe.xadd(self.keys.jobs(req.level), job_fields(req))
        await pipe.execute()
        return [AsyncRequestHandle(self, r.id) for r in reqs]

    def handle(self, request_id: str, after: str = "0-0") -> AsyncRequestHandle:
        return AsyncRequestHandle(self, request_id, after)

    async def generate(self, prompts: Sequence[Any], params: SamplingParams | None = None, *,
                       timeout: float | None = None, **kwargs: Any) -> list[Result]:
        handles = await self.submit_many(prompts, params, **kwargs)
        return list(await asyncio.gather(*(h.result(timeout=timeout) for h in handles)))

    async def _cancel(self, request_id: str) -> int:
        ev = encode_event(Event(type=CANCELLED, request_id=request_id))
        keys = [self.keys.state(request_id), self.keys.out(request_id)]
        status = int(await self._cancel_script(keys=keys, args=[self.ttl, ev]))
        if status == 1:  # a worker holds it: the hint makes it look now, not at its next sweep
            await self.redis.incr(self.keys.cancels)
        return status

    async def stats(self) -> dict[str, Any]:
        await self._ensure_groups()
        pipe = self.redis.pipeline(transaction=False)
        for key in self.keys.all_jobs():
            pipe.xlen(key)
        for key in self.keys.all_jobs():
            pipe.xpending(key, GROUP)
        pipe.xlen(self.keys.dead)
        pipe.zrange(self.keys.workers, 0, -1)
        *vals, dead, names = await pipe.execute()
        n = len(LEVELS)
        names = [x.decode() for x in names]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.worker(name))
        raws = await pipe.execute()
        workers = [parse_worker_hash(nm, raw) for nm, raw in zip(names, raws, strict=True) if raw]
        return queue_stats(self.keys, vals[:n], vals[n:], dead, workers)
