"""The asyncio SDK: the same API as ``Client``, with ``await`` and ``async for``.

Everything but the awaiting is shared with the blocking client (HandleBase, ResultBuilder,
the queries of pagedq.client.queue), so the two can never disagree about the protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import redis.asyncio as aredis

from pagedq.client.client import HandleBase, Result, build_requests, end_time, to_deadline
from pagedq.client.protocol import (
    DEFAULT_PREFIX,
    DEFAULT_QUEUE,
    DEFAULT_TTL_S,
    Event,
    Keys,
    build_request,
)
from pagedq.client.queue import (
    check_groups,
    create_groups,
    enqueue,
    queue_stats,
    stats_query,
    workers_query,
)
from pagedq.client.redis_url import resolve_redis_url
from pagedq.client.scripts import CANCEL, CANCEL_FLAGGED, cancel_call
from pagedq.params import SamplingParams


class AsyncRequestHandle(HandleBase):
    """Async twin of ``RequestHandle`` (same cursor semantics)."""

    client: AsyncClient

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Event]:
        end = end_time(timeout)
        while not self.builder.done:
            reply = await self.client.redis.xread(**self._xread_args(end, timeout))
            for ev in self._events(reply):
                yield ev

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
        self._cancel_script = self.redis.register_script(CANCEL)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def _run(self, query: Callable[..., None], *args: Any, raise_on_error: bool = True
                   ) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        query(pipe, *args)
        return await pipe.execute(raise_on_error=raise_on_error)

    async def _ensure_groups(self) -> None:
        if not self._groups_ready:
            check_groups(await self._run(create_groups, self.keys, raise_on_error=False))
            self._groups_ready = True

    async def submit(self, prompt: Any, params: SamplingParams | None = None, *,
                     deadline: Any = None, priority: int = 0,
                     metadata: dict[str, Any] | None = None,
                     request_id: str | None = None) -> AsyncRequestHandle:
        req = build_request(prompt, params, request_id=request_id, deadline=to_deadline(deadline),
                            priority=priority, metadata=metadata)
        await self._ensure_groups()
        await self._run(enqueue, self.keys, [req])
        return AsyncRequestHandle(self, req.id)

    async def submit_many(self, prompts: Sequence[Any], params: SamplingParams | None = None,
                          **kwargs: Any) -> list[AsyncRequestHandle]:
        reqs = build_requests(prompts, params, **kwargs)
        await self._ensure_groups()
        await self._run(enqueue, self.keys, reqs)
        return [AsyncRequestHandle(self, r.id) for r in reqs]

    def handle(self, request_id: str, after: str = "0-0") -> AsyncRequestHandle:
        return AsyncRequestHandle(self, request_id, after)

    async def generate(self, prompts: Sequence[Any], params: SamplingParams | None = None, *,
                       timeout: float | None = None, **kwargs: Any) -> list[Result]:
        handles = await self.submit_many(prompts, params, **kwargs)
        return list(await asyncio.gather(*(h.result(timeout=timeout) for h in handles)))

    async def _cancel(self, request_id: str) -> int:
        status = int(await self._cancel_script(**cancel_call(self.keys, request_id, self.ttl)))
        if status == CANCEL_FLAGGED:  # the hint makes its worker look now, not at its sweep
            await self.redis.incr(self.keys.cancels)
        return status

    async def stats(self) -> dict[str, Any]:
        await self._ensure_groups()
        first = await self._run(stats_query, self.keys)
        return queue_stats(self.keys, first, await self._run(workers_query, self.keys, first))
