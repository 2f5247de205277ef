"""Admission: take from the queue only what the engine can start, claim it, start it.

The reader asks XREADGROUP for at most ``Capacity.free()`` entries, so jobs this worker could
not start stay in the stream for idle workers. Each entry read (or reclaimed) is claimed, which
bumps its fencing epoch, and then either started in the engine, resumed after a previous
owner's events, or ended at once: undecodable, over the limits, already done, cancelled, past
its deadline, a duplicate, or a proven poison.

Poison: a job delivered more than ``max_deliveries`` times is only a suspect, since a worker
killed under it (an OOM elsewhere, a redeploy) looks the same as one it killed. A suspect runs
on a worker alone; only when such lone runs die ``solo_deaths`` times is it dead-lettered, so
healthy jobs caught in a crash loop are never lost.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, replace

from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

from pagedq.client.protocol import (
    CANCELLED,
    E_BAD_PAYLOAD,
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
    implicit_seed,
    request_digest,
)
from pagedq.client.scripts import CLAIM_DUPLICATE, CLAIM_ENDED
from pagedq.logging import get_logger
from pagedq.worker.service.consumer import Consumer, Entry
from pagedq.worker.service.engine_loop import AddCmd, Report
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.leases import Claim, Leases
from pagedq.worker.service.outbox import error_code
from pagedq.worker.service.publisher import (
    Publication,
    Publisher,
    error_event,
    finished_event,
    publication,
)
from pagedq.worker.service.shared import Part, Shared
from pagedq.worker.service.tokenizer_thread import Intake

log = get_logger("pagedq.worker.admission")

FULL_WAIT_S = 0.5  # a full engine's reader looks again after this long without a report
RESTORE_PAGE = 1000  # output stream entries read per XRANGE when resuming a job


@dataclass
class Capacity:
    """How many more jobs the engine can start now.

    The engine reports its free capacity from its own thread, a step late; adds sent since
    then and entries still being claimed would fill it too, so they are subtracted. While a
    suspect waits to run alone, or runs alone, there is no room for anything else.
    """

    engine_free: int = 0  # engine.free_capacity() at the engine thread's last report
    adds_sent: int = 0  # AddCmds sent to the engine thread
    adds_done: int = 0  # AddCmds it had processed (accepted or rejected) at its last report
    reserved: int = 0  # entries read from Redis and still being claimed
    alone: bool = False  # a suspect job waits for the engine to itself, or has it

    def free(self) -> int:
        if self.alone:
            return 0
        return self.engine_free - (self.adds_sent - self.adds_done) - self.reserved

    def update(self, report: Report) -> None:
        self.engine_free = report.capacity
        self.adds_done = report.adds_done


@dataclass
class Suspect:
    """A job that may kill its workers, held until it can run with nothing beside it."""

    job: LiveJob
    cmd: AddCmd


class Admission(Part):
    """Reads the queue within the engine's capacity and starts or ends each entry."""

    def __init__(self, shared: Shared, r: Redis, keys: Keys, consumer: Consumer, leases: Leases,
                 publisher: Publisher, intake: Intake | None = None):
        super().__init__(shared)
        self.r = r
        self.keys = keys
        self.consumer = consumer
        self.leases = leases
        self.publisher = publisher
        self.intake = intake or Intake(None)
        self.limits = shared.config.limits
        self.name = consumer.name
        self.capacity = Capacity()
        self.capacity_changed = asyncio.Event()  # an engine report arrived, or the drain began
        self.suspects: deque[Suspect] = deque()
        self.alone: LiveJob | None = None  # the suspect running alone now

    def on_report(self, report: Report) -> None:
        self.capacity.update(report)
        self._next_alone()
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
        free = 0 if self.redis_full.full else self.capacity.free()
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
            self.redis_full.succeeded()  # a claim is a write: Redis has room
        except OutOfMemoryError as exc:  # left pending: reclaimed once Redis has room
            self.redis_full.failed(exc)
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
                                 hint.decode(errors="replace") if hint else None, self.limits)
        except ProtocolError as exc:
            await self._reject(entry, exc)
            return
        claim = await self.leases.claim(req.id, entry.stream, entry.entry_id,
                                        request_digest(req))
        if not claim.owned:
            await self._not_this_job(entry, req.id, claim)
            return
        job = LiveJob(req, entry.stream, entry.entry_id, entry.fields, claim.epoch, claim.seq,
                      [0] * req.params.n, [None] * req.params.n)
        suspect = claim.deliveries > self.config.max_deliveries
        if suspect and claim.solo - 1 >= self.config.solo_deaths:
            await self._dead_letter(job, entry, claim)
        elif claim.cancel:
            await self._end_now(job, Event(type=CANCELLED, request_id=req.id, worker=self.name))
            self.metrics.inc("pagedq:jobs_cancelled_total")
        elif req.deadline is not None and req.deadline <= time.time():
            job.finished = ["deadline"] * job.n
            await self._end_now(job, finished_event(job, self.name))
        else:
            await self._start(job, req, alone=suspect)

    async def _start(self, job: LiveJob, req: Request, alone: bool = False) -> None:
        """Hand the job to the engine, after the tokens a previous owner already published."""
        resume = await self._restore(job) if job.seq > 0 else None
        if job.all_finished:
            await self._end_now(job, finished_event(job, self.name))
            return
        try:
            ids = await self.intake.prompt_ids(req)
        except Exception as exc:  # no tokenizer, a bad chat, too long
            await self._end_now(job, error_event(job.id, error_code(exc), str(exc), self.name))
            self.metrics.count_failure(error_code(exc))
            return
        params = req.params
        if params.seed is None and not params.greedy:  # resumable like any seeded job
            params = replace(params, seed=implicit_seed(req.id))
        cmd = AddCmd(job.engine_id, params, ids, prompt=req.prompt, priority=req.priority,
                     resume=resume, deadline=req.deadline)
        self.metrics.queue_time.observe(max(0.0, time.time() - (req.created or time.time())))
        self.jobs[job.engine_id] = job
        if alone:
            log.warning("running a suspect job alone: its workers kept dying", request_id=job.id)
            self.suspects.append(Suspect(job, cmd))
            self.capacity.alone = True
            self._next_alone()
        else:
            self._send(cmd)

    def _send(self, cmd: AddCmd) -> None:
        self.capacity.adds_sent += 1
        self.engine_loop.send(cmd)

    def _next_alone(self) -> None:
        """Start the next suspect once nothing else runs; clear the way when none is left."""
        if self.alone is not None and self.jobs.get(self.alone.engine_id) is self.alone:
            return
        self.alone = None
        while self.suspects and self.jobs.get(self.suspects[0].job.engine_id) is not \
                self.suspects[0].job:
            self.suspects.popleft()  # cancelled, lost or handed back while it waited
        if not self.suspects:
            self.capacity.alone = False
            return
        if len(self.jobs) == len(self.suspects):  # only suspects left: the engine is free
            suspect = self.suspects.popleft()
            self.alone = suspect.job
            self._send(suspect.cmd)

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
        """An entry that does not decode or is over the limits: tell its client when it names
        a usable id; keep undecodable ones in the dead-letter stream for inspection."""
        log.warning("bad job entry", stream=entry.stream, entry_id=entry.entry_id,
                    code=exc.code, error=str(exc)[:500], request_id=exc.request_id)
        reason = f"{exc.code}: {exc}"
        if exc.request_id is None:
            await self.consumer.dead_letter(entry, reason)
            self.metrics.inc("pagedq:jobs_dead_lettered_total")
            return
        claim = await self.leases.claim(exc.request_id, entry.stream, entry.entry_id)
        if not claim.owned:
            await self._not_this_job(entry, exc.request_id, claim)
            return
        if exc.code == E_BAD_PAYLOAD:
            await self.consumer.dead_letter(entry, reason, ack=False)  # the publish acks
        await self.publisher.send([Publication(
            exc.request_id, claim.epoch, entry.stream, entry.entry_id, claim.seq,
            [error_event(exc.request_id, exc.code, str(exc), self.name)], terminal=True)])
        self.metrics.count_failure(exc.code)

    async def _not_this_job(self, entry: Entry, request_id: str, claim: Claim) -> None:
        """The entry's id belongs to a job that ended, to another payload, or to another live
        entry of the same job: drop the entry and leave that job untouched."""
        if claim.status == CLAIM_DUPLICATE:
            reason = (f"duplicate_id: request id {request_id} belongs to another payload; "
                      "submit under a new id")
            log.warning("entry reuses another job's id", request_id=request_id,
                        entry_id=entry.entry_id)
            await self.consumer.dead_letter(entry, reason)
            self.metrics.count_failure("duplicate_id")
            return
        if claim.status != CLAIM_ENDED:
            log.info("dropping a second entry of a live job", request_id=request_id,
                     entry_id=entry.entry_id)
        await self.consumer.ack_delete(entry.stream, entry.entry_id)

    async def _dead_letter(self, job: LiveJob, entry: Entry, claim: Claim) -> None:
        reason = (f"delivered {claim.deliveries} times (max {self.config.max_deliveries}); its "
                  f"worker also died in {claim.solo - 1} run(s) with no other job beside it")
        log.error("dead-lettering a job", request_id=job.id, deliveries=claim.deliveries)
        await self.consumer.dead_letter(entry, reason, ack=False)  # the terminal publish acks
        self.metrics.inc("pagedq:jobs_dead_lettered_total")
        await self._end_now(job, error_event(job.id, E_DEAD_LETTER,
                                             reason + "; see the queue's dead-letter stream",
                                             self.name))

    async def _end_now(self, job: LiveJob, event: Event) -> None:
        """Write the terminal event of a job that never reached the engine (it acks the job)."""
        await self.publisher.send([publication(job, [event], terminal=True)])
