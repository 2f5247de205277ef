"""The blocking SDK: submit jobs, stream their tokens, collect results, cancel, read stats.

``AsyncClient`` (aio.py) has the same API with ``async``; both share the logic here
(HandleBase, ResultBuilder) and in queue.py, so they can never disagree about what a stream
means.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pagedq.client.connection import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    TRANSIENT,
    TLSFiles,
    connect,
    no_retry,
)
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
    decode_event,
    job_fields,
    request_digest,
)
from pagedq.client.queue import parse_entries, queue_stats, stats_query, workers_query
from pagedq.client.request_errors import DuplicateRequestError, ResultTimeoutError
from pagedq.client.result import Result
from pagedq.client.result_builder import ResultBuilder
from pagedq.client.scripts import (
    CANCEL,
    CANCEL_ENDED,
    CANCEL_FLAGGED,
    SUBMIT,
    SUBMIT_DUPLICATE,
    LuaScript,
    cancel_call,
    run_calls_blocking,
)
from pagedq.params import SamplingParams
from pagedq.redis_url import client_redis_url

SUBMIT_SCRIPT = LuaScript(SUBMIT)
CANCEL_SCRIPT = LuaScript(CANCEL)
READ_COUNT = 512
# XREAD blocks in slices: redis-py 8 defaults to a 5 s socket timeout, and a short block also
# lets a stream() with a timeout return on time.
BLOCK_MS = 1000


def to_deadline(deadline: float | _dt.datetime | _dt.timedelta | None) -> float | None:
    """Accept unix seconds, an aware/naive datetime (local time) or a timedelta from now."""
    if deadline is None:
        return None
    if isinstance(deadline, _dt.timedelta):
        return time.time() + deadline.total_seconds()
    if isinstance(deadline, _dt.datetime):
        return deadline.timestamp()
    return float(deadline)


class HandleBase:
    """What both handles (blocking and asyncio) share: the request id, its read cursor and its
    ResultBuilder.

    The cursor is the last entry id handed to the caller, so ``stream()`` after a dropped
    connection, or ``result()`` after a partial ``stream()``, continues where it stopped
    without losing or repeating an event. One reader at a time owns the cursor; a second one
    reading the same handle concurrently (another thread or task) gets its own reader, which
    replays the stream from its start.
    """

    def __init__(self, client: Any, request_id: str, after: str = "0-0",
                 request: Request | None = None):
        self.client = client
        self.id = request_id
        self.key = client.keys.out(request_id)
        self.cursor = after
        self.builder = ResultBuilder(request_id, 1 if after == "0-0" else None)
        # the submitted job, when this handle submitted it: submitted again (idempotent) after
        # a Redis outage, in case Redis lost it with its last writes
        self.request = request

    def _clone(self) -> Any:
        """A second reader of the same request (another thread or task is reading this one)."""
        return type(self)(self.client, self.id, request=self.request)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def _timed_out(self, timeout: float | None) -> ResultTimeoutError:
        return ResultTimeoutError(
            f"no terminal event for request {self.id} within {timeout}s; the job may "
            "still be queued or running: call result()/stream() again to keep waiting")

    def _xread_args(self, end: float | None, timeout: float | None) -> dict[str, Any]:
        """The next XREAD's arguments; raises ResultTimeoutError once ``end`` has passed."""
        if end is not None and time.monotonic() >= end:
            raise self._timed_out(timeout)
        block = BLOCK_MS if end is None else int(min(BLOCK_MS, max(1, (end - time.monotonic())
                                                                   * 1000)))
        return {"streams": {self.key: self.cursor}, "count": READ_COUNT, "block": block}

    def _events(self, reply: Any) -> Iterator[Event]:
        """XREAD's reply as events (see ``_fold``)."""
        return self._fold(parse_entries(reply))

    def _fold(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> Iterator[Event]:
        """The entries' events in order, each fed to the builder and the cursor moved past it
        as it is handed out; stops after the terminal event."""
        for entry_id, fields in entries:
            ev = decode_event(fields, entry_id)
            fresh = self.builder.feed(ev)
            self.cursor = entry_id
            if fresh:
                yield ev
            if ev.terminal and fresh:
                return


def build_requests(prompts: Sequence[Any], params: SamplingParams | None, *,
                   deadline: Any = None, priority: int = 0,
                   metadata: dict[str, Any] | None = None,
                   limits: Limits | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> list[Request]:
    """``submit_many``'s requests: one per prompt, all with the same params and options."""
    return [build_request(p, params, deadline=to_deadline(deadline), priority=priority,
                          metadata=metadata, limits=limits,
                          chat_template_kwargs=chat_template_kwargs) for p in prompts]


def end_time(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def submit_call(keys: Keys, req: Request, ttl: int) -> tuple[list[Any], list[Any]]:
    """SUBMIT's keys and args for ``req``."""
    args: list[Any] = [request_digest(req), ttl]
    for k, v in job_fields(req).items():
        args += [k, v]
    return [keys.state(req.id), keys.jobs(req.level)], args


def check_submitted(req: Request, reply: Any) -> None:
    """Raise DuplicateRequestError when SUBMIT says the id belongs to another payload."""
    if int(reply[0]) == SUBMIT_DUPLICATE:
        raise DuplicateRequestError(
            f"request id {req.id} is taken by a job with another prompt or other params (for "
            f"the worker's --ttl after it ends): use a new id; the first job is untouched",
            req.id)


class Backoff:
    """Waits between reads while Redis is away: 50 ms doubling to 2 s, within a deadline."""

    def __init__(self) -> None:
        self.delay = BACKOFF_BASE_S

    def next_wait(self, end: float | None) -> float:
        """Seconds to sleep before the next try; 0 once ``end`` has passed."""
        wait = self.delay if end is None else max(0.0, min(self.delay, end - time.monotonic()))
        self.delay = min(BACKOFF_CAP_S, self.delay * 2)
        return wait

    def reset(self) -> None:
        self.delay = BACKOFF_BASE_S


class RequestHandle(HandleBase):
    """A submitted request: stream its events, wait for its result, cancel it.

    Safe to read from several threads: one reader owns the handle's cursor, others replay the
    stream on their own (each sees every event).
    """

    client: Client

    def __init__(self, client: Client, request_id: str, after: str = "0-0",
                 request: Request | None = None):
        super().__init__(client, request_id, after, request)
        self._lock = threading.Lock()

    @contextmanager
    def _reader(self) -> Iterator[RequestHandle]:
        if not self._lock.acquire(blocking=False):
            yield self._clone()  # another thread reads this handle
            return
        try:
            yield self
        finally:
            self._lock.release()

    def stream(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield events as they arrive, ending with the terminal one.

        Raises ResultTimeoutError if ``timeout`` seconds pass before the terminal event. A Redis
        restart or a dropped connection is waited out (reconnecting with backoff), the job is
        submitted again (idempotent: a no-op unless Redis lost it), and reading continues after
        the last event handed out.
        """
        with self._reader() as reader:
            yield from reader._follow(timeout)

    def _follow(self, timeout: float | None) -> Iterator[Event]:
        end = end_time(timeout)
        backoff = Backoff()
        outage = False
        while not self.builder.done:
            args = self._xread_args(end, timeout)
            try:
                reply = self.client.reads.xread(**args)
                if outage and self.request is not None:
                    self.client._submit([self.request])
                outage = False
            except TRANSIENT:
                outage = True
                time.sleep(backoff.next_wait(end))
                continue
            backoff.reset()
            yield from self._events(reply)

    def result(self, timeout: float | None = 60) -> Result:
        """Wait for the terminal event; return the Result or raise its typed error."""
        with self._reader() as reader:
            for _ in reader._follow(timeout):
                pass
            return reader.builder.result()

    def cancel(self) -> bool:
        """Ask for cancellation; False if the request had already ended.

        A queued job is cancelled at once; a running one by its worker within a moment.
        """
        return self.client._cancel(self.id) != CANCEL_ENDED


class Client:
    """Blocking client. ``Client(url, queue)`` then ``submit``/``generate``/``stats``.

    ``redis_url`` names a standalone Redis or any node of a Redis Cluster (default:
    ``$REDIS_URL``, else the embedded Redis a ``pagedq worker`` on this machine started, else
    localhost's default port); ``tls`` adds a CA and a client certificate for
    ``rediss://``. ``limits`` are checked before a job is enqueued (default: what a worker
    accepts unless started with higher limits). Thread-safe.
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
        self._redis = connection
        self._reads = connection
        self._connect_lock = threading.Lock()

    @property
    def redis(self) -> Any:
        """The redis-py client, connected on first use (a cluster is detected then); its
        commands wait out a short outage."""
        if self._redis is None:
            with self._connect_lock:
                if self._redis is None:
                    self._redis = connect(self.url, self.tls)
        return self._redis

    @property
    def reads(self) -> Any:
        """The client handles read streams with: it never retries by itself, so a handle sees
        every outage (and submits its job again after one, in case Redis lost it)."""
        if self._reads is None:
            with self._connect_lock:
                if self._reads is None:
                    self._reads = connect(self.url, self.tls, retry=no_retry())
        return self._reads

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for r in {id(x): x for x in (self._redis, self._reads) if x is not None}.values():
            r.close()

    def _run(self, query: Callable[..., None], *args: Any, raise_on_error: bool = True
             ) -> list[Any]:
        """One round trip: ``query(pipe, *args)`` (from pagedq.client.queue) queues, we execute."""
        pipe = self.redis.pipeline(transaction=False)
        query(pipe, *args)
        return pipe.execute(raise_on_error=raise_on_error)

    def _submit(self, reqs: list[Request]) -> list[RequestHandle]:
        """SUBMIT each request in one round trip; idempotent, so a retry is safe."""
        calls = [(SUBMIT_SCRIPT, *submit_call(self.keys, req, self.ttl)) for req in reqs]
        for req, reply in zip(reqs, run_calls_blocking(self.redis, calls), strict=True):
            if isinstance(reply, Exception):
                raise reply
            check_submitted(req, reply)
        return [RequestHandle(self, r.id, request=r) for r in reqs]

    def submit(self, prompt: str | list[int] | list[dict[str, str]],
               params: SamplingParams | None = None, *, deadline: Any = None,
               priority: int = 0, metadata: dict[str, Any] | None = None,
               request_id: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> RequestHandle:
        """Enqueue one job; returns at once with its handle. ``chat_template_kwargs``: extra
        variables for the worker's chat template (chat messages only; vLLM's field, e.g.
        ``{"enable_thinking": False}`` for Qwen3).

        Idempotent by ``request_id``: submitting an id again with the same prompt and params
        joins the first job (or returns its result, once it ended); with another prompt or
        params it raises DuplicateRequestError and leaves the first job untouched.
        """
        req = build_request(prompt, params, request_id=request_id, deadline=to_deadline(deadline),
                            priority=priority, metadata=metadata, limits=self.limits,
                            chat_template_kwargs=chat_template_kwargs)
        return self._submit([req])[0]

    def submit_many(self, prompts: Sequence[Any], params: SamplingParams | None = None,
                    **kwargs: Any) -> list[RequestHandle]:
        """Enqueue many jobs in one round trip."""
        return self._submit(build_requests(prompts, params, limits=self.limits, **kwargs))

    def handle(self, request_id: str, after: str = "0-0") -> RequestHandle:
        """Attach to an existing request (a late reader, or one resuming after ``after``)."""
        return RequestHandle(self, request_id, after)

    def generate(self, prompts: Sequence[Any], params: SamplingParams | None = None, *,
                 timeout: float | None = None, **kwargs: Any) -> list[Result]:
        """Submit all prompts at once, then wait for every result (in prompt order)."""
        handles = self.submit_many(prompts, params, **kwargs)
        end = None if timeout is None else time.monotonic() + timeout
        results = []
        for h in handles:
            left = None if end is None else max(0.001, end - time.monotonic())
            results.append(h.result(timeout=left))
        return results

    def _cancel(self, request_id: str) -> int:
        status = int(CANCEL_SCRIPT.call(self.redis, *cancel_call(self.keys, request_id, self.ttl)))
        if status == CANCEL_FLAGGED:  # the hint makes its worker look now, not at its sweep
            self.redis.incr(self.keys.cancels)
        return status

    def stats(self) -> dict[str, Any]:
        """Queue depth per priority level, dead letters, and each live worker's checkpoint."""
        first = self._run(stats_query, self.keys, raise_on_error=False)
        return queue_stats(self.keys, first, self._run(workers_query, self.keys, first))
