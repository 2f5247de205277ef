"""What every part of one worker shares, in one object, so each part's signature names only
what is its own.

The parts (admission, outbox, lease keeper, checkpoints) all read the worker's settings, act
on the same job table, send to the same engine thread, count into the same metrics, and stop
on the same signal. Each part subclasses ``Part``, which gives it those under one set of names.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.engine_loop import EngineLoop
from pagedq.worker.service.job import Jobs
from pagedq.worker.service.metrics import Metrics


@dataclass
class Shared:
    """The parts' common ground; the Worker builds one and hands it to each part."""

    config: WorkerConfig
    engine_loop: EngineLoop
    metrics: Metrics
    jobs: Jobs = field(default_factory=dict)  # engine id -> the job, for every job we own
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set when the drain begins


class Part:
    """Base of the worker's parts: the shared objects as attributes of the part."""

    def __init__(self, shared: Shared):
        self.config = shared.config
        self.engine_loop = shared.engine_loop
        self.metrics = shared.metrics
        self.jobs = shared.jobs
        self.stopping = shared.stopping
