"""Writing output events: each step's new tokens for all requests in ONE pipelined round trip.

Every job's events for the batch go in a single fenced PUBLISH script call
(pagedq.client.scripts), so a job's events stay in order, a worker that lost the job writes
nothing, and a retry after a dropped connection writes nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

from pagedq.client.protocol import (
    ERROR,
    FINISHED,
    GROUP,
    TOKENS,
    Event,
    Keys,
    encode_event,
)
from pagedq.client.scripts import PUBLISH, LuaScript, run_calls
from pagedq.logging import get_logger
from pagedq.worker.service.job import LiveJob

log = get_logger("pagedq.worker.publisher")

OK, FENCED, OUT_OF_SYNC = 1, 0, -1


@dataclass
class Publication:
    """Events for one job owned at ``epoch``; ``base_seq`` is the seq before the first."""

    request_id: str
    epoch: int
    stream: str
    entry_id: str
    base_seq: int
    events: list[Event] = field(default_factory=list)
    terminal: bool = False


@dataclass
class Outcome:
    status: int  # OK | FENCED | OUT_OF_SYNC
    cancel: bool = False


class Publisher:
    """Sends Publications for one queue; knows the key names, TTL and this worker's name."""

    def __init__(self, r: Redis, keys: Keys, ttl: int, worker: str):
        self.r = r
        self.keys = keys
        self.ttl = ttl
        self.worker = worker
        self.script = LuaScript(PUBLISH)

    async def send(self, pubs: list[Publication]) -> list[Outcome]:
        calls = []
        for p in pubs:
            keys = [self.keys.state(p.request_id), self.keys.out(p.request_id), p.stream]
            args: list[Any] = [p.epoch, self.ttl, GROUP, p.entry_id, int(p.terminal), p.base_seq]
            args += [encode_event(ev) for ev in p.events]
            calls.append((self.script, keys, args))
        replies = await run_calls(self.r, calls)
        for reply in replies:  # nothing was written: the caller keeps the batch for later
            if isinstance(reply, OutOfMemoryError):
                raise reply
        outcomes = []
        for p, reply in zip(pubs, replies, strict=True):
            if isinstance(reply, Exception):  # e.g. WRONGTYPE on a clobbered key
                log.error("publish failed", request_id=p.request_id, error=str(reply))
                outcomes.append(Outcome(OUT_OF_SYNC))
            else:
                outcomes.append(Outcome(int(reply[0]), bool(int(reply[1]))))
        return outcomes


def merge(pubs: Iterable[Publication]) -> list[Publication]:
    """Join a job's consecutive publications (several queued steps) into one script call."""
    by_job: dict[tuple[str, int], Publication] = {}
    for p in pubs:
        key = (p.request_id, p.epoch)
        prev = by_job.get(key)
        if prev is None:
            by_job[key] = p
        elif prev.terminal:
            log.warning("event after the terminal event dropped", request_id=p.request_id)
        else:
            prev.events += p.events
            prev.terminal = p.terminal
    return list(by_job.values())


def publication(job: LiveJob, events: list[Event], terminal: bool = False) -> Publication:
    """A Publication for ``job``'s next events; advances the job's seq."""
    pub = Publication(job.id, job.epoch, job.stream, job.entry_id, job.seq, events, terminal)
    job.seq += len(events)
    return pub


def token_events(job: LiveJob, outputs: list[Any], worker: str) -> list[Event]:
    """Stream events for the engine's StepOutputs of ``job``; updates its positions.

    Outputs for a sample that already finished (a resumed job) are dropped.
    """
    events = []
    for o in outputs:
        i = o.index
        if not 0 <= i < job.n or job.finished[i] is not None:
            continue
        start = job.generated[i]
        if o.num_generated - len(o.new_token_ids) != start:
            log.error("engine position disagrees with the stream", request_id=job.id, index=i,
                      engine=o.num_generated - len(o.new_token_ids), stream=start)
        job.generated[i] = start + len(o.new_token_ids)
        if o.usage.get("prompt_tokens"):
            job.prompt_tokens = o.usage["prompt_tokens"]
        if o.finished:
            job.finished[i] = o.finish_reason or "stop"
        events.append(Event(
            type=TOKENS, request_id=job.id, index=i, token_ids=list(o.new_token_ids),
            text=o.new_text or "", position=job.generated[i],
            finish_reason=job.finished[i] if o.finished else None,
            logprobs=o.new_logprobs, worker=worker,
            prompt_logprobs=o.prompt_logprobs,
        ))
    return events


def finished_event(job: LiveJob, worker: str) -> Event:
    return Event(type=FINISHED, request_id=job.id, finish_reasons=list(job.finished),
                 usage=job.usage, worker=worker)


def error_event(request_id: str, code: str, message: str, worker: str) -> Event:
    return Event(type=ERROR, request_id=request_id, error_code=code, error=message, worker=worker)
