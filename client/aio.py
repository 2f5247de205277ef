"""The asyncio SDK: the same API as ``Client``, with ``await`` and ``async for``.

Everything but the awaiting is shared with the blocking client (HandleBase, ResultBuilder,
the queries of pagedq.client.queue), so the two can never disagree about the protocol. Handles
are read through the client's StreamReader (reader.py): thousands of them in flight cost a few
connections, not one each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pagedq.client.client import (
    CANCEL_SCRIPT,
    SUBMIT_SCRIPT,
    HandleBase,
    Result,
    build_requests,
    check_submitted,
    end_time,
    submit_call,
    to_deadline,
)
from pagedq.client.connection import TLSFiles, aconnect, no_retry
from pagedq.client.protocol import (
    DEFAULT_LIMITS,
    DEFAULT_PREFIX,
    DEFAULT_QUEUE,
    DEFAULT_TTL_S,
    Event,
    Keys,
    Limits,
    Request,
    build_request,
)
from pagedq.client.queue import queue_stats, stats_query, workers_query
from pagedq.client.reader import StreamReader
from pagedq.client.scripts import CANCEL_ENDED, CANCEL_FLAGGED, cancel_call, run_calls
from pagedq.params import SamplingParams
from pagedq.redis_url import client_redis_url


class AsyncRequestHandle(HandleBase):
    """Async twin of ``RequestHandle`` (same cursor semantics). A second task reading the same
    handle while another reads it gets its own reader, which replays the stream."""

    client: AsyncClient

    def __init__(self, client: AsyncClient, request_id: str, after: str = "0-0",
                 request: Request | None = None):
        super().__init__(client, request_id, after, request)
        self._reading = False

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Event]:
        """Yield events as they arrive, ending with the terminal one; raises
        ResultTimeoutError after ``timeout`` seconds. Redis outages are waited out."""
        if self._reading:
            async for ev in self._clone().stream(timeout):
                yield ev
            return
        self._reading = True
        try:
            async for ev in self._follow(timeout):
                yield ev
        finally:
            self._reading = False

    async def _follow(self, timeout: float | None) -> AsyncIterator[Event]:
        if self.builder.done:
            return
        end = end_time(timeout)
        sub = (await self.client.reader()).subscribe(self.key, self.cursor)
        try:
            while not self.builder.done:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise self._timed_out(timeout)
                try:
                    entries = await sub.next(left)
                except TimeoutError:
                    raise self._timed_out(timeout) from None
                if sub.reconnected and self.request is not None:
                    sub.reconnected = False  # Redis was away: it may have lost the job
                    await self.client._submit([self.request])
                for ev in self._fold(entries):
                    yield ev
        finally:
            sub.close()

    async def result(self, timeout: float | None = 60) -> Result:
        if self._reading:
            return await self._clone().result(timeout)
        self._reading = True
        try:
            async for _ in self._follow(timeout):
                pass
        finally:
            self._reading = False
        return self.builder.result()

    async def cancel(self) -> bool:
        return await self.client._cancel(self.id) != CANCEL_ENDED


class AsyncClient:
    """Async client; create inside a running loop, ``await client.aclose()`` when done.

    The connection (standalone or cluster, detected) opens on first use.
    """

    def __init__(self, redis_url: str | None = None, queue: str = DEFAULT_QUEUE, *,
                 prefix: str = DEFAULT_PREFIX, ttl: int = DEFAULT_TTL_S,
                 connection: Any = None, tls: TLSFiles | None = None,
                 limits: Limits | None = None):
        self.url = client_redis_url(redis_url)
        self.tls = tls
        self.keys = Keys(queue, prefix)
        self.ttl = ttl
        self.limits = limits or DEFAULT_LIMITS
        self.redis = connection
        self._reads = connection
        self._connecting = asyncio.Lock()
        self._reader: StreamReader | None = None

    async def connection(self) -> Any:
        """The redis-py asyncio client, connected on first use."""
        if self.redis is None:
            async with self._connecting:
                if self.redis is None:
                    self.redis = await aconnect(self.url, self.tls)
        return self.redis

    async def read_connection(self) -> Any:
        """The client the stream reader uses: it never retries by itself, so the reader sees
        every outage (and its handles submit their jobs again after one)."""
        if self._reads is None:
            async with self._connecting:
                if self._reads is None:
                    self._reads = await aconnect(self.url, self.tls, retry=no_retry(aio=True))
        return self._reads

    async def reader(self) -> StreamReader:
        if self._reader is None:
            self._reader = StreamReader(self.keys, self.read_connection)
        return self._reader

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._reader is not None:
            await self._reader.close()
        for r in {id(x): x for x in (self.redis, self._reads) if x is not None}.values():
            await r.aclose()

    async def _run(self, query: Callable[..., None], *args: Any, raise_on_error: bool = True
                   ) -> list[Any]:
        pipe = (await self.connection()).pipeline(transaction=False)
        query(pipe, *args)
        return await pipe.execute(raise_on_error=raise_on_error)

    async def _submit(self, reqs: list[Request]) -> list[AsyncRequestHandle]:
        calls = [(SUBMIT_SCRIPT, *submit_call(self.keys, req, self.ttl)) for req in reqs]
        replies = await run_calls(await self.connection(), calls)
        for req, reply in zip(reqs, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            check_submitted(req, reply)
        return [AsyncRequestHandle(self, r.id, request=r) for r in reqs]

    async def submit(self, prompt: Any, params: SamplingParams | None = None, *,
                     deadline: Any = None, priority: int = 0,
                     metadata: dict[str, Any] | None = None,
                     request_id: str | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None) -> AsyncRequestHandle:
        """Enqueue one job (idempotent by ``request_id``, as ``Client.submit``)."""
        req = build_request(prompt, params, request_id=request_id, deadline=to_deadline(deadline),
                            priority=priority, metadata=metadata, limits=self.limits,
                            chat_template_kwargs=chat_template_kwargs)
        return (await self._submit([req]))[0]

    async def submit_many(self, prompts: Sequence[Any], params: SamplingParams | None = None,
                          **kwargs: Any) -> list[AsyncRequestHandle]:
        return await self._submit(build_requests(prompts, params, limits=self.limits, **kwargs))

    def handle(self, request_id: str, after: str = "0-0") -> AsyncRequestHandle:
        return AsyncRequestHandle(self, request_id, after)

    async def generate(self, prompts: Sequence[Any], params: SamplingParams | None = None, *,
                       timeout: float | None = None, **kwargs: Any) -> list[Result]:
        handles = await self.submit_many(prompts, params, **kwargs)
        return list(await asyncio.gather(*(h.result(timeout=timeout) for h in handles)))

    async def _cancel(self, request_id: str) -> int:
        r = await self.connection()
        status = int(await CANCEL_SCRIPT(r, *cancel_call(self.keys, request_id, self.ttl)))
        if status == CANCEL_FLAGGED:  # the hint makes its worker look now, not at its sweep
            await r.incr(self.keys.cancels)
        return status

    async def stats(self) -> dict[str, Any]:
        first = await self._run(stats_query, self.keys, raise_on_error=False)
        return queue_stats(self.keys, first, await self._run(workers_query, self.keys, first))
