"""What every part of one worker shares, in one object, so each part's signature names only
what is its own.

The parts (admission, outbox, lease keeper, checkpoints) all read the worker's settings, act
on the same job table, send to the same engine thread, count into the same metrics, and stop
on the same signal. Each part subclasses ``Part``, which gives it those under one set of names.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagedq.logging import get_logger
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.engine_loop import EngineLoop
from pagedq.worker.service.job import Jobs
from pagedq.worker.service.metrics_server import Metrics

log = get_logger("pagedq.worker")


class RedisFull:
    """Whether Redis refuses writes for lack of memory (maxmemory with noeviction).

    Nothing is lost meanwhile: the outbox keeps its events, and admission reads nothing new
    for ``RETRY_S`` after each refusal, then tries again (an idle worker has nothing to publish,
    so a write of its own must find out that Redis has room). Each change is logged once.
    """

    RETRY_S = 1.0

    def __init__(self) -> None:
        self.since: float | None = None  # the outage began
        self.last: float | None = None  # the latest refusal

    @property
    def full(self) -> bool:
        return self.last is not None and time.monotonic() - self.last < self.RETRY_S

    def failed(self, error: Exception) -> None:
        self.last = time.monotonic()
        if self.since is None:
            self.since = self.last
            log.warning("Redis is out of memory (maxmemory, noeviction): writes wait until it "
                        "has room; raise maxmemory or free memory", error=str(error))

    def succeeded(self) -> None:
        if self.since is not None:
            log.info("Redis has room again", full_s=round(time.monotonic() - self.since, 2))
        self.since = self.last = None


@dataclass
class Shared:
    """The parts' common ground; the Worker builds one and hands it to each part."""

    config: WorkerConfig
    engine_loop: EngineLoop
    metrics: Metrics
    jobs: Jobs = field(default_factory=dict)  # engine id -> the job, for every job we own
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set when the drain begins
    redis_full: RedisFull = field(default_factory=RedisFull)


class Part:
    """Base of the worker's parts: the shared objects as attributes of the part."""

    def __init__(self, shared: Shared):
        self.config = shared.config
        self.engine_loop = shared.engine_loop
        self.metrics = shared.metrics
        self.jobs = shared.jobs
        self.stopping = shared.stopping
        self.redis_full = shared.redis_full
