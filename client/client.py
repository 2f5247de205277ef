"""The blocking SDK: submit jobs, stream their tokens, collect results, cancel, read stats.

``AsyncClient`` (aio.py) has the same API with ``async``; both share the logic here
(HandleBase, ResultBuilder) and in queue.py, so they can never disagree about what a stream
means.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from pagedq.client.errors import (
    DeadLetteredError,
    RequestCancelledError,
    RequestFailedError,
    ResultTimeoutError,
    StreamGapError,
)
from pagedq.client.protocol import (
    CANCELLED,
    DEFAULT_PREFIX,
    DEFAULT_QUEUE,
    DEFAULT_TTL_S,
    E_DEAD_LETTER,
    ERROR,
    FINISHED,
    TOKENS,
    Event,
    Keys,
    Request,
    build_request,
    decode_event,
)
from pagedq.client.queue import (
    check_groups,
    create_groups,
    enqueue,
    parse_entries,
    queue_stats,
    stats_query,
    workers_query,
)
from pagedq.client.redis_url import resolve_redis_url
from pagedq.client.scripts import CANCEL, CANCEL_FLAGGED, cancel_call
from pagedq.params import SamplingParams

READ_COUNT = 512
# XREAD blocks in slices: redis-py 8 defaults to a 5 s socket timeout, and a short block also
# lets a stream() with a timeout return on time.
BLOCK_MS = 1000


@dataclass
class CompletionResult:
    """One sample's complete output."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class Result:
    """A finished request. The top-level fields are sample 0's (the only one unless n > 1)."""

    request_id: str
    outputs: list[CompletionResult]
    usage: dict[str, int] = field(default_factory=dict)
    status: str = FINISHED  # FINISHED | ERROR | CANCELLED | "running" (partial)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None


class ResultBuilder:
    """Folds a request's events, in order, into a Result; detects gaps and duplicates.

    ``expect_seq`` is the next seq; None when reading started mid-stream (unknown).
    """

    def __init__(self, request_id: str, expect_seq: int | None = 1):
        self.request_id = request_id
        self.expect_seq = expect_seq
        self.samples: dict[int, CompletionResult] = {}
        # next expected position per sample; known from the start only when reading from seq 1
        self.positions: dict[int, int] = {}
        self.from_start = expect_seq == 1
        self.terminal: Event | None = None

    def feed(self, ev: Event) -> None:
        if self.expect_seq is not None and ev.seq != self.expect_seq:
            raise StreamGapError(
                f"request {self.request_id}: expected event seq {self.expect_seq}, got {ev.seq}; "
                "events were lost (expired keys?). Resubmit the request or raise the worker --ttl"
            )
        self.expect_seq = ev.seq + 1
        if ev.type == TOKENS:
            sample = self.samples.setdefault(ev.index, CompletionResult(ev.index))
            start = ev.position - len(ev.token_ids)
            known = self.positions.get(ev.index, 0 if self.from_start else None)
            if known is not None and start != known:
                raise StreamGapError(
                    f"request {self.request_id} sample {ev.index}: tokens at position {start} "
                    f"follow position {known}; the stream is not contiguous"
                )
            self.positions[ev.index] = ev.position
            sample.token_ids.extend(ev.token_ids)
            sample.text += ev.text
            if ev.logprobs:
                sample.logprobs = (sample.logprobs or []) + list(ev.logprobs)
            if ev.finish_reason is not None:
                sample.finish_reason = ev.finish_reason
        elif ev.terminal:
            self.terminal = ev
            for i, reason in enumerate(ev.finish_reasons or []):
                sample = self.samples.setdefault(i, CompletionResult(i))
                if sample.finish_reason is None:
                    sample.finish_reason = reason

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def partial(self) -> Result:
        outputs = [self.samples[i] for i in sorted(self.samples)] or [CompletionResult(0)]
        status = self.terminal.type if self.terminal else "running"
        usage = dict(self.terminal.usage or {}) if self.terminal else {}
        return Result(self.request_id, outputs, usage, status)

    def result(self) -> Result:
        """The Result, or the typed error the terminal event stands for."""
        res = self.partial()
        term = self.terminal
        if term is None:
            raise ResultTimeoutError(f"request {self.request_id} has not finished yet")
        if term.type == ERROR:
            cls = DeadLetteredError if term.error_code == E_DEAD_LETTER else RequestFailedError
            raise cls(term.error or "unknown error", self.request_id, term.error_code or "", res)
        if term.type == CANCELLED:
            raise RequestCancelledError(f"request {self.request_id} was cancelled",
                                        self.request_id, res)
        return res


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
    without losing or repeating an event.
    """

    def __init__(self, client: Any, request_id: str, after: str = "0-0"):
        self.client = client
        self.id = request_id
        self.cursor = after
        self.builder = ResultBuilder(request_id, 1 if after == "0-0" else None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def _xread_args(self, end: float | None, timeout: float | None) -> dict[str, Any]:
        """The next XREAD's arguments; raises ResultTimeoutError once ``end`` has passed."""
        if end is not None and time.monotonic() >= end:
            raise ResultTimeoutError(
                f"no terminal event for request {self.id} within {timeout}s; the job may "
                "still be queued or running: call result()/stream() again to keep waiting"
            )
        block = BLOCK_MS if end is None else int(min(BLOCK_MS, max(1, (end - time.monotonic())
                                                                   * 1000)))
        return {"streams": {self.client.keys.out(self.id): self.cursor}, "count": READ_COUNT,
                "block": block}

    def _events(self, reply: Any) -> Iterator[Event]:
        """The reply's events in order, each fed to the builder and the cursor moved past it as
        it is handed out; stops after the terminal event."""
        for entry_id, fields in parse_entries(reply):
            ev = decode_event(fields, entry_id)
            self.builder.feed(ev)
            self.cursor = entry_id
            yield ev
            if ev.terminal:
                return


def build_requests(prompts: Sequence[Any], params: SamplingParams | None, *,
                   deadline: Any = None, priority: int = 0,
                   metadata: dict[str, Any] | None = None) -> list[Request]:
    """``submit_many``'s requests: one per prompt, all with the same params and options."""
    return [build_request(p, params, deadline=to_deadline(deadline), priority=priority,
                          metadata=metadata) for p in prompts]


def end_time(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class RequestHandle(HandleBase):
    """A submitted request: stream its events, wait for its result, cancel it."""

    client: Client

    def stream(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield events as they arrive, ending with the terminal one.

        Raises ResultTimeoutError if ``timeout`` seconds pass before the terminal event.
        """
        end = end_time(timeout)
        while not self.builder.done:
            reply = self.client.redis.xread(**self._xread_args(end, timeout))
            yield from self._events(reply)

    def result(self, timeout: float | None = 60) -> Result:
        """Wait for the terminal event; return the Result or raise its typed error."""
        for _ in self.stream(timeout=timeout):
            pass
        return self.builder.result()

    def cancel(self) -> bool:
        """Ask for cancellation; False if the request had already ended.

        A queued job is cancelled at once; a running one by its worker within a moment.
        """
        return self.client._cancel(self.id) != 0


class Client:
    """Blocking client. ``Client(url, queue)`` then ``submit``/``generate``/``stats``."""

    def __init__(self, redis_url: str | None = None, queue: str = DEFAULT_QUEUE, *,
                 prefix: str = DEFAULT_PREFIX, ttl: int = DEFAULT_TTL_S,
                 connection: redis.Redis | None = None):
        self.redis = connection or redis.Redis.from_url(resolve_redis_url(redis_url))
        self.keys = Keys(queue, prefix)
        self.ttl = ttl
        self._groups_ready = False
        self._cancel_script = self.redis.register_script(CANCEL)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.redis.close()

    def _run(self, query: Callable[..., None], *args: Any, raise_on_error: bool = True
             ) -> list[Any]:
        """One round trip: ``query(pipe, *args)`` (from pagedq.client.queue) queues, we execute."""
        pipe = self.redis.pipeline(transaction=False)
        query(pipe, *args)
        return pipe.execute(raise_on_error=raise_on_error)

    def _ensure_groups(self) -> None:
        if not self._groups_ready:
            check_groups(self._run(create_groups, self.keys, raise_on_error=False))
            self._groups_ready = True

    def submit(self, prompt: str | list[int] | list[dict[str, str]],
               params: SamplingParams | None = None, *, deadline: Any = None,
               priority: int = 0, metadata: dict[str, Any] | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Enqueue one job; returns at once with its handle."""
        req = build_request(prompt, params, request_id=request_id, deadline=to_deadline(deadline),
                            priority=priority, metadata=metadata)
        self._ensure_groups()
        self._run(enqueue, self.keys, [req])
        return RequestHandle(self, req.id)

    def submit_many(self, prompts: Sequence[Any], params: SamplingParams | None = None,
                    **kwargs: Any) -> list[RequestHandle]:
        """Enqueue many jobs in one round trip."""
        reqs = build_requests(prompts, params, **kwargs)
        self._ensure_groups()
        self._run(enqueue, self.keys, reqs)
        return [RequestHandle(self, r.id) for r in reqs]

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
        status = int(self._cancel_script(**cancel_call(self.keys, request_id, self.ttl)))
        if status == CANCEL_FLAGGED:  # the hint makes its worker look now, not at its sweep
            self.redis.incr(self.keys.cancels)
        return status

    def stats(self) -> dict[str, Any]:
        """Queue depth per priority level, dead letters, and each live worker's checkpoint."""
        self._ensure_groups()
        first = self._run(stats_query, self.keys)
        return queue_stats(self.keys, first, self._run(workers_query, self.keys, first))
