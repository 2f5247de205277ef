"""Admission: take from the queue only what the engine can start, claim it, start it.

The reader asks XREADGROUP for at most ``Capacity.free()`` entries, so jobs this worker could
not start stay in the stream for idle workers. Each entry read (or reclaimed) is claimed, which
bumps its fencing epoch, and then either started in the engine, resumed after a previous
owner's events, or ended at once: undecodable, already done, cancelled, past its deadline, or
delivered too often.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from pagedq.client.protocol import (
    CANCELLED,
    E_DEAD_LETTER,
    F_ID,
    F_PAYLOAD,
    TOKENS,
    Event,
    Keys,
    ProtocolError,
    Request,
    decode_event,
    decode_request,
)
from pagedq.worker.logging import get_logger
from pagedq.worker.service.consumer import Consumer, Entry
from pagedq.worker.service.engine_loop import AddCmd, Report
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.publisher import (
    Publication,
    Publisher,
    error_event,
    finished_event,
    publication,
)
from pagedq.worker.service.shared import Part, Shared

log = get_logger("pagedq.worker.admission")

FULL_WAIT_S = 0.5  # a full engine's reader looks again after this long without a report
RESTORE_PAGE = 1000  # output stream entries read per XRANGE when resuming a job


@dataclass
class Capacity:
    """How many more jobs the engine can start now.

    The engine reports its free capacity from its own thread, a step late; adds sent since
    then and entries still being claimed would fill it too, so they are subtracted.
    """

    engine_free: int = 0  # engine.free_capacity() at the engine thread's last report
    adds_sent: int = 0  # AddCmds sent to the engine thread
    adds_done: int = 0  # AddCmds it had processed (accepted or rejected) at its last report
    reserved: int = 0  # entries read from Redis and still being claimed

    def free(self) -> int:
        return self.engine_free - (self.adds_sent - self.adds_done) - self.reserved

    def update(self, report: Report) -> None:
        self.engine_free = report.capacity
        self.adds_done = report.adds_done


class Admission(Part):
    """Reads the queue within the engine's capacity and starts or ends each entry."""

    def __init__(self, shared: Shared, r: Redis, keys: Keys, consumer: Consumer, leases: Leases,
                 publisher: Publisher):
        super().__init__(shared)
        self.r = r
        self.keys = keys
        self.consumer = consumer
        self.leases = leases
        self.publisher = publisher
        self.name = consumer.name
        self.capacity = Capacity()
        self.capacity_changed = asyncio.Event()  # an engine report arrived, or the drain began

    def on_report(self, report: Report) -> None:
        self.capacity.update(report)
        self.capacity_changed.set()

    async def admit_own_pending(self) -> None:
        """Start this consumer name's unacked entries: a restart under the same name resumes
        its jobs at once instead of after --reclaim-after."""
        try:
            await self.admit_all(await self.consumer.own_pending())
        except Exception:
            log.exception("re-reading own pending jobs failed; they are reclaimed after "
                          "--reclaim-after")

    async def read_once(self) -> None:
        """Read as many new entries as fit (waiting for room when none does) and admit them."""
        free = self.capacity.free()
        if free <= 0:
            self.capacity_changed.clear()
            try:
                await asyncio.wait_for(self.capacity_changed.wait(), FULL_WAIT_S)
            except TimeoutError:
                pass
            return
        await self.admit_all(await self.consumer.read(free, self.config.read_block_ms))

    async def admit_all(self, entries: list[Entry]) -> None:
        self.capacity.reserved += len(entries)
        await asyncio.gather(*(self._admit(e) for e in entries))

    async def _admit(self, entry: Entry) -> None:
        """Claim one entry and start it, or end it at once (bad, done, cancelled, expired...)."""
        try:
            await self._claim_and_start(entry)
        except Exception:
            # Left pending: it is reclaimed after --reclaim-after and dead-lettered if it keeps
            # failing, so one poisonous job can never wedge the worker.
            log.exception("admitting a job failed", stream=entry.stream, entry_id=entry.entry_id)
        finally:
            self.capacity.reserved -= 1

    async def _claim_and_start(self, entry: Entry) -> None:
        if entry.fields is None:  # deleted while pending: nothing to run
            await self.consumer.ack_delete(entry.stream, entry.entry_id)
            return
        hint = entry.fields.get(F_ID)
        try:
            req = decode_request(entry.fields.get(F_PAYLOAD),
                                 hint.decode(errors="replace") if hint else None)
        except ProtocolError as exc:
            await self._reject(entry, exc)
            return
        claim = await self.leases.claim(req.id)
        if claim.done:
            await self.consumer.ack_delete(entry.stream, entry.entry_id)
            return
        job = LiveJob(req, entry.stream, entry.entry_id, entry.fields, claim.epoch, claim.seq,
                      [0] * req.params.n, [None] * req.params.n)
        if claim.deliveries > self.config.max_deliveries:
            await self._dead_letter(job, entry, claim.deliveries)
        elif claim.cancel:
            await self._end_now(job, Event(type=CANCELLED, request_id=req.id, worker=self.name))
            self.metrics.inc("pagedq:jobs_cancelled_total")
        elif req.deadline is not None and req.deadline <= time.time():
            job.finished = ["deadline"] * job.n
            await self._end_now(job, finished_event(job, self.name))
        else:
            await self._start(job, req)

    async def _start(self, job: LiveJob, req: Request) -> None:
        """Hand the job to the engine, after the tokens a previous owner already published."""
        resume = await self._restore(job) if job.seq > 0 else None
        if job.all_finished:
            await self._end_now(job, finished_event(job, self.name))
            return
        self.metrics.queue_time.observe(max(0.0, time.time() - (req.created or time.time())))
        self.jobs[job.engine_id] = job
        self.capacity.adds_sent += 1
        self.engine_loop.send(AddCmd(
            job.engine_id, req.params, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            messages=req.messages, priority=req.priority, resume=resume, deadline=req.deadline))

    async def _restore(self, job: LiveJob) -> list[list[int]] | None:
        """A previous owner wrote events: recover each sample's tokens to resume after them.

        The claim bumped the epoch first, so the stream read here is final.
        """
        tokens: list[list[int]] = [[] for _ in range(job.n)]
        last = "-"
        while True:
            entries = await self.r.xrange(self.keys.out(job.id), min=last, count=RESTORE_PAGE)
            if last != "-":
                entries = entries[1:]
            if not entries:
                break
            for entry_id, fields in entries:
                ev = decode_event(fields, entry_id)
                if ev.type == TOKENS and 0 <= ev.index < job.n:
                    tokens[ev.index] += ev.token_ids
                    if ev.finish_reason is not None:
                        job.finished[ev.index] = ev.finish_reason
                last = ev.entry_id or last
        job.generated = [len(t) for t in tokens]
        job.resumed_tokens = sum(job.generated)
        log.info("resuming a job", request_id=job.id, epoch=job.epoch, tokens=job.generated)
        return tokens if job.resumed_tokens or any(job.finished) else None

    async def _reject(self, entry: Entry, exc: ProtocolError) -> None:
        """An entry that does not decode: tell its client when it names a usable id, else keep
        it in the dead-letter stream for inspection."""
        log.warning("bad job entry", stream=entry.stream, entry_id=entry.entry_id,
                    code=exc.code, error=str(exc), request_id=exc.request_id)
        if exc.request_id is None:
            await self.consumer.dead_letter(entry, f"{exc.code}: {exc}")
            self.metrics.inc("pagedq:jobs_dead_lettered_total")
            return
        claim = await self.leases.claim(exc.request_id)
        if claim.done:
            await self.consumer.ack_delete(entry.stream, entry.entry_id)
            return
        await self.publisher.send([Publication(
            exc.request_id, claim.epoch, entry.stream, entry.entry_id, claim.seq,
            [error_event(exc.request_id, exc.code, str(exc), self.name)], terminal=True)])
        self.metrics.count_failure(exc.code)

    async def _dead_letter(self, job: LiveJob, entry: Entry, deliveries: int) -> None:
        reason = (f"delivered {deliveries} times (max {self.config.max_deliveries}): the "
                  "workers running it kept dying")
        log.error("dead-lettering a job", request_id=job.id, deliveries=deliveries)
        await self.consumer.dead_letter(entry, reason, ack=False)  # the terminal publish acks
        self.metrics.inc("pagedq:jobs_dead_lettered_total")
        await self._end_now(job, error_event(job.id, E_DEAD_LETTER,
                                             reason + "; see the queue's dead-letter stream",
                                             self.name))

    async def _end_now(self, job: LiveJob, event: Event) -> None:
        """Write the terminal event of a job that never reached the engine (it acks the job)."""
        await self.publisher.send([publication(job, [event], terminal=True)])
