"""Job ownership: claim (bump the fencing epoch), renew, poll, hand back.

A lease is the job's idle time in the consumer group's pending list: the owner resets it every
``reclaim_after / 3`` seconds (RENEW, only while its epoch still holds), and any worker may
XAUTOCLAIM a job idle for ``reclaim_after``. Ownership itself is the epoch in the job's state
hash: every claim bumps it, and every write checks it (scripts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from pagedq.client.protocol import GROUP, Keys
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.scripts import CLAIM, HANDBACK, RENEW, LuaScript


@dataclass
class Claim:
    epoch: int
    deliveries: int
    seq: int  # events already in the output stream (a previous owner's)
    done: bool  # the terminal event exists already: just ack
    cancel: bool


@dataclass
class PollResult:
    job: LiveJob
    lost: bool  # another worker owns it now, or it is done
    cancel: bool


class Leases:
    def __init__(self, r: Redis, keys: Keys, name: str, ttl: int):
        self.r = r
        self.keys = keys
        self.name = name
        self.ttl = ttl
        self._claim = LuaScript(CLAIM)
        self._renew = LuaScript(RENEW)
        self._handback = LuaScript(HANDBACK)

    async def claim(self, request_id: str) -> Claim:
        epoch, deliveries, seq, done, cancel = await self._claim(
            self.r, [self.keys.state(request_id)], [self.name, self.ttl])
        return Claim(int(epoch), int(deliveries), int(seq), bool(done), bool(cancel))

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
