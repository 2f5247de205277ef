"""The lease keeper: runs ``Leases`` (leases.py) for this worker's jobs while it serves.

It renews them, notices jobs lost to another worker or cancelled by their client, takes over
jobs whose owner died (admitting them through Admission, which itself claims through
``Leases``), and hands jobs back to the queue when the worker drains.
"""

from __future__ import annotations

import asyncio
import time

from pagedq.logging import get_logger
from pagedq.worker.service.admission import Admission
from pagedq.worker.service.consumer import Consumer
from pagedq.worker.service.job import LiveJob, owned
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.outbox import Outbox
from pagedq.worker.service.shared import Part, Shared

log = get_logger("pagedq.worker.leases")

MAX_RECLAIM_INTERVAL_S = 5.0
REAP_IDLE_FACTOR = 2  # consumers idle for this many --reclaim-after are removed once empty
# A drain must end even while Redis is away (calls wait for it forever): a hand-back that
# cannot finish in this long is left to --reclaim-after.
HAND_BACK_TIMEOUT_S = 2.0


class LeaseKeeper(Part):
    """Keeps this worker's leases while it serves, and hands its jobs back when it drains."""

    def __init__(self, shared: Shared, leases: Leases, consumer: Consumer, admission: Admission,
                 outbox: Outbox):
        super().__init__(shared)
        self.leases = leases
        self.consumer = consumer
        self.admission = admission
        self.outbox = outbox
        self._cancel_hint: bytes | None = None  # the cancel counter's value at the last poll
        self._last_reap = time.monotonic()

    async def renew_once(self) -> None:
        await asyncio.sleep(max(0.05, self.config.reclaim_after / 3))
        # closing jobs too: their terminal event is queued, and they stay ours until it is out
        for job in await self.leases.renew(list(self.jobs.values())):
            if self.jobs.get(job.engine_id) is job and not job.closing:
                log.warning("lease lost; dropping the job", request_id=job.id)
                self.metrics.inc("pagedq:jobs_fenced_total")
                self.outbox.drop(job)

    async def poll_once(self) -> None:
        """Cancellations and lost ownership, without asking Redis about every job each time.

        Each tick reads one key, the queue's cancel hint (clients bump it after cancelling a
        running job): if it moved, every job is checked now. Otherwise only jobs whose state
        nothing has read for ``ownership_check_interval`` are: a successful publish reads the
        epoch and the cancel flag anyway, and the sweep still catches a cancel whose hint was
        lost (a client that died in between, or one on another queue name).
        """
        await asyncio.sleep(self.config.poll_interval)
        jobs = owned(self.jobs)
        if not jobs:
            return
        hint = await self.leases.cancel_hint()
        now = time.monotonic()
        if hint != self._cancel_hint:
            self._cancel_hint = hint
        else:
            jobs = [j for j in jobs if now - j.checked >= self.config.ownership_check_interval]
        if not jobs:
            return
        for job in jobs:
            job.checked = now
        for res in await self.leases.poll(jobs):
            if res.job.closing or self.jobs.get(res.job.engine_id) is not res.job:
                continue
            if res.lost:
                log.warning("job owned elsewhere now; dropping it", request_id=res.job.id)
                self.metrics.inc("pagedq:jobs_fenced_total")
                self.outbox.drop(res.job)
            elif res.cancel:
                self.outbox.cancel(res.job)

    async def reclaim_once(self) -> None:
        """Take over jobs whose owner stopped renewing them, as many as the engine can start."""
        interval = max(0.1, min(self.config.reclaim_after / 4, MAX_RECLAIM_INTERVAL_S))
        try:
            await asyncio.wait_for(self.stopping.wait(), interval)
            return
        except TimeoutError:
            pass
        free = 0 if self.redis_full.full else self.admission.capacity.free()
        if free <= 0:
            return
        entries = await self.consumer.reclaim(free, int(self.config.reclaim_after * 1000))
        if entries:
            log.info("reclaimed jobs from a silent worker", count=len(entries))
            self.metrics.inc("pagedq:jobs_reclaimed_total", len(entries))
        await self.admission.admit_all(entries)
        if time.monotonic() - self._last_reap >= self.config.reclaim_after:
            self._last_reap = time.monotonic()
            # a consumer idle this long, holding nothing, with no live worker behind its name
            await self.consumer.reap(int(REAP_IDLE_FACTOR * self.config.reclaim_after * 1000))

    async def hand_back(self, job: LiveJob) -> None:
        """Stop ``job`` here and give it back to the queue for another worker (a drain)."""
        job.closing = True
        self.engine_loop.abort(job.engine_id)
        self.jobs.pop(job.engine_id, None)
        try:
            ok = await asyncio.wait_for(self.leases.handback(job), HAND_BACK_TIMEOUT_S)
        except Exception as exc:  # Redis away for the whole timeout, or a bug
            log.warning("hand-back failed; the job is reclaimed after --reclaim-after",
                        request_id=job.id, error=repr(exc))
            return
        if ok:
            self.metrics.inc("pagedq:jobs_handed_back_total")
            log.info("handed a job back to the queue", request_id=job.id,
                     tokens=sum(job.generated))
