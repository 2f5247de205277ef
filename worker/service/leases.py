"""Leases: which worker owns a job, for how long, and what happens when that ends.

A lease is the job's idle time in the consumer group's pending list: the owner resets it every
``reclaim_after / 3`` seconds (RENEW, only while its epoch still holds), and any worker may
XAUTOCLAIM a job idle for ``reclaim_after``: its owner died. Ownership itself is the epoch in
the job's state hash: every claim bumps it, and every write checks it (pagedq.client.scripts).

``Leases`` makes those calls; ``LeaseKeeper`` (lease_keeper.py) runs them for this worker's
jobs. Admission claims through ``Leases`` and the keeper admits reclaimed jobs through
Admission, so the two halves live apart: no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from pagedq.client.protocol import GROUP, Keys
from pagedq.client.scripts import CLAIM, CLAIMED, HANDBACK, RENEW, LuaScript
from pagedq.logging import get_logger
from pagedq.worker.service.job import LiveJob

log = get_logger("pagedq.worker.leases")


@dataclass
class Claim:
    """CLAIM's reply (pagedq.client.scripts): ``status`` first; the rest counts when CLAIMED."""

    status: int  # CLAIMED | CLAIM_ENDED | CLAIM_DUPLICATE | CLAIM_SUPERSEDED
    epoch: int = 0
    deliveries: int = 0
    seq: int = 0  # events already in the output stream (a previous owner's)
    cancel: bool = False
    solo: int = 0  # claims since the job became a suspect (deliveries > max deliveries)

    @property
    def owned(self) -> bool:
        return self.status == CLAIMED


@dataclass
class PollResult:
    job: LiveJob
    lost: bool  # another worker owns it now, or it is done
    cancel: bool


class Leases:
    """This worker's ownership calls: one script or pipeline each."""

    def __init__(self, r: Redis, keys: Keys, name: str, ttl: int, max_deliveries: int = 3):
        self.r = r
        self.keys = keys
        self.name = name
        self.ttl = ttl
        self.max_deliveries = max_deliveries
        self._claim = LuaScript(CLAIM)
        self._renew = LuaScript(RENEW)
        self._handback = LuaScript(HANDBACK)

    async def claim(self, request_id: str, stream: str, entry_id: str, digest: str = "") -> Claim:
        """Claim the job ``request_id`` carried by entry ``entry_id`` of ``stream``; ``digest``
        is its payload's (protocol.request_digest), "" when the payload did not decode."""
        reply = await self._claim(self.r, [self.keys.state(request_id), stream],
                                  [self.name, self.ttl, digest, entry_id, self.max_deliveries])
        status, epoch, deliveries, seq, cancel, solo = (int(x) for x in reply)
        return Claim(status, epoch, deliveries, seq, bool(cancel), solo)

    async def renew(self, jobs: list[LiveJob]) -> list[LiveJob]:
        """Reset the idle time of every job still ours; return those we no longer own."""
        if not jobs:
            return []
        keys: list[Any] = []
        args: list[Any] = [GROUP, self.name]
        for job in jobs:
            keys += [job.stream, self.keys.state(job.id)]
            args += [job.entry_id, job.epoch]
        lost = await self._renew(self.r, keys, args)
        return [jobs[int(i) - 1] for i in lost]

    async def poll(self, jobs: list[LiveJob]) -> list[PollResult]:
        """One round trip: is each job still ours, and did its client cancel it?"""
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.hmget(self.keys.state(job.id), "epoch", "done", "cancel")
        results = []
        for job, (epoch, done, cancel) in zip(jobs, await pipe.execute(), strict=True):
            lost = epoch is None or int(epoch) != job.epoch or done == b"1"
            results.append(PollResult(job, lost, cancel == b"1"))
        return results

    async def handback(self, job: LiveJob) -> bool:
        """Give the job back to the queue (re-added at its tail) and fence ourselves out."""
        args: list[Any] = [job.epoch, GROUP, job.entry_id, self.ttl]
        for k, v in job.fields.items():
            args += [k, v]
        return bool(await self._handback(self.r, [self.keys.state(job.id), job.stream], args))

    async def cancel_hint(self) -> bytes | None:
        """The queue's cancel counter: clients bump it after cancelling a running job."""
        return await self.r.get(self.keys.cancels)
