"""The outbox: engine reports in, fenced publications out, and what each outcome means.

The engine thread's reports queue here while the previous batch is being written, so compute
never waits on Redis: each publish takes everything queued, merges a job's steps, and writes
all jobs' events in one pipelined round trip (publisher.py). Each job's outcome then settles
it: finished and acked, lost to another worker (fenced), or cancelled by its client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pagedq.client.protocol import (
    CANCELLED,
    E_INTERNAL,
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_TOO_LONG,
    Event,
    engine_id,
)
from pagedq.errors import InvalidParamsError, InvalidRequestError, RequestTooLongError
from pagedq.logging import get_logger
from pagedq.worker.service.engine_loop import Report
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.publisher import (
    FENCED,
    OK,
    Outcome,
    Publication,
    Publisher,
    error_event,
    finished_event,
    merge,
    publication,
    token_events,
)
from pagedq.worker.service.shared import Part, Shared

log = get_logger("pagedq.worker.outbox")

ITL_SAMPLES_PER_EVENT = 64  # inter-token latency observations one event contributes at most


class Outbox(Part):
    """Queues engine reports and ready publications; publishes them in batches."""

    def __init__(self, shared: Shared, publisher: Publisher):
        super().__init__(shared)
        self.publisher = publisher
        self.name = publisher.worker
        self._queue: asyncio.Queue[Report | Publication] = asyncio.Queue()
        self._busy = False  # a batch is being written
        self._unsent: list[Publication] = []  # a batch whose write failed: sent first next time
        # what to do with a job whose stream is behind what this worker wrote (a Redis
        # failover lost writes): give it back, and its next owner resumes from the stream
        self.give_back: Callable[[LiveJob], Awaitable[None]] | None = None

    def put_report(self, report: Report) -> None:
        if report.outputs or report.rejected or report.step_error:
            self._queue.put_nowait(report)

    @property
    def empty(self) -> bool:
        """Nothing queued and nothing being written."""
        return not self._busy and self._queue.empty() and not self._unsent

    async def publish_once(self) -> None:
        """Wait for something to publish, then write everything queued by then.

        A batch whose write raised (Redis outages are waited out below this, so only a bug or
        a denied command) is kept and written first next time: events are never dropped.
        """
        pubs, self._unsent = self._unsent, []
        items = [] if pubs else [await self._queue.get()]
        self._busy = True
        try:
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            for item in items:
                pubs += [item] if isinstance(item, Publication) else self._publications(item)
            pubs = merge(pubs)
            if pubs:
                try:
                    outcomes = await self.publisher.send(pubs)
                except BaseException:
                    self._unsent = pubs
                    raise
                self.redis_full.succeeded()
                for pub, outcome in zip(pubs, outcomes, strict=True):
                    self._settle(pub, outcome)
        finally:
            self._busy = False

    # -- engine report -> publications ------------------------------------------------------
    def _publications(self, report: Report) -> list[Publication]:
        pubs = []
        by_job: dict[str, list[Any]] = {}
        for out in report.outputs:
            by_job.setdefault(out.request_id, []).append(out)
        now = time.time()
        for eid, outputs in by_job.items():
            job = self.jobs.get(eid)
            if job is None or job.closing:
                continue  # aborted, handed back or lost: its late outputs are dropped
            events = token_events(job, outputs, self.name)
            self._observe_tokens(job, events, now)
            if job.all_finished:
                events.append(finished_event(job, self.name))
                job.closing = True
            if events:
                pubs.append(publication(job, events, terminal=job.closing))
        for eid, exc in report.rejected:
            job = self.jobs.get(eid)
            if job is not None and not job.closing:
                pubs.append(self._fail(job, error_code(exc), str(exc)))
        if report.step_error is not None:  # the engine thread retries its requests
            self.metrics.inc("pagedq:engine_step_failures_total")
        return pubs

    def _observe_tokens(self, job: LiveJob, events: list[Event], now: float) -> None:
        n = sum(len(e.token_ids) for e in events)
        if not n:
            return
        self.metrics.generation_tokens += n
        if job.first_token is None:
            job.first_token = now
            self.metrics.ttft.observe(now - job.admitted)
        elif job.last_token is not None:
            gap = (now - job.last_token) / n
            for _ in range(min(n, ITL_SAMPLES_PER_EVENT)):
                self.metrics.itl.observe(gap)
        job.last_token = now

    # -- outcomes ---------------------------------------------------------------------------
    def _settle(self, pub: Publication, outcome: Outcome) -> None:
        """Act on a publish outcome: done, lost (fenced or out of sync) or cancel requested."""
        job = self.jobs.get(engine_id(pub.request_id, pub.epoch))
        if outcome.status == OK and pub.terminal:
            self.jobs.pop(engine_id(pub.request_id, pub.epoch), None)
            if job is not None:
                self._count_end(job, pub)
            return
        if outcome.status != OK:
            if outcome.status == FENCED:
                self.metrics.inc("pagedq:jobs_fenced_total")
                log.warning("lost a job to another worker; dropping it", request_id=pub.request_id)
                if job is not None:
                    self.drop(job)
            elif job is not None:
                log.error("output stream behind this worker's writes (a failover lost some?); "
                          "handing the job back to resume from the stream",
                          request_id=pub.request_id)
                if self.give_back is not None:
                    asyncio.ensure_future(self.give_back(job))
                else:
                    self.drop(job)
            return
        if job is not None:
            job.checked = time.monotonic()  # the script just read its epoch and cancel flag
        if outcome.cancel and job is not None and not job.closing:
            self.cancel(job)

    def _count_end(self, job: LiveJob, pub: Publication) -> None:
        last = pub.events[-1] if pub.events else None
        if last is not None and last.type == "finished":
            self.metrics.e2e.observe(time.time() - job.admitted)
            self.metrics.counters["vllm:prompt_tokens_total"] += job.prompt_tokens
            for reason in job.finished:
                key = reason or "stop"
                self.metrics.success[key] = self.metrics.success.get(key, 0) + 1

    # -- ending a running job ---------------------------------------------------------------
    def drop(self, job: LiveJob) -> None:
        """Forget a job this worker no longer owns: it writes nothing more for it."""
        self.jobs.pop(job.engine_id, None)
        job.closing = True
        self.engine_loop.abort(job.engine_id)

    def cancel(self, job: LiveJob) -> None:
        """Stop a job its client cancelled and queue its CANCELLED event."""
        log.info("cancelling a job", request_id=job.id)
        job.closing = True
        self.engine_loop.abort(job.engine_id)
        self.metrics.inc("pagedq:jobs_cancelled_total")
        self._queue.put_nowait(publication(
            job, [Event(type=CANCELLED, request_id=job.id, worker=self.name)], terminal=True))

    def _fail(self, job: LiveJob, code: str, message: str) -> Publication:
        """End ``job`` with an error event (returned for the caller's batch)."""
        job.closing = True
        self.engine_loop.abort(job.engine_id)
        self.metrics.count_failure(code)
        return publication(job, [error_event(job.id, code, message, self.name)], terminal=True)


def error_code(exc: Exception) -> str:
    """The protocol error code for an exception the engine raised on a request."""
    if isinstance(exc, RequestTooLongError):
        return E_TOO_LONG
    if isinstance(exc, InvalidParamsError):
        return E_INVALID_PARAMS
    if isinstance(exc, (InvalidRequestError, ValueError, TypeError)):
        return E_INVALID_REQUEST
    return E_INTERNAL
