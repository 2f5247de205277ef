"""Drive the engine through its step API and record what it did, step by step.

The step API (rather than ``Engine.generate``) lets the harness stamp every token with the wall
time of the step that produced it, inject requests mid-run (the ITL scenario) and read the
engine's own KV accounting (``engine.stats()``) after every step, which is what the KV
utilization figures are computed from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np

from pagedq.bench.timeline import Timeline
from pagedq.bench.workload import BenchRequest


@dataclass(frozen=True)
class KvSample:
    """The engine's KV state right after one step, and how long that step took."""

    t: float  # seconds since the run started, at the end of the step
    dt: float  # the step's wall time: the weight of this sample in time averages
    blocks_used: int
    blocks_total: int
    tokens_live: int
    running: int
    waiting: int


@dataclass
class EngineRun:
    """Everything measured while one engine served one trace."""

    timeline: Timeline
    samples: list[KvSample] = field(default_factory=list)
    block_size: int = 16
    steps: int = 0
    stats_after: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> token ids

    def busy(self) -> list[KvSample]:
        """Samples taken while the engine held at least one running sequence."""
        return [s for s in self.samples if s.running > 0 and s.blocks_used > 0]

    def kv_utilization(self) -> float | None:
        """Live-token slots / allocated slots, time-weighted over busy steps.

        A ratio of time integrals (sum live*dt / sum allocated*dt): each moment counts by how
        long it lasted, and a nearly empty engine cannot swing the average.
        """
        busy = self.busy()
        allocated = sum(s.blocks_used * self.block_size * s.dt for s in busy)
        if allocated <= 0:
            return None
        return sum(s.tokens_live * s.dt for s in busy) / allocated

    def kv_utilization_per_step(self) -> float | None:
        """The same ratio with every busy step weighted equally (comparable to the simulator)."""
        busy = self.busy()
        allocated = sum(s.blocks_used * self.block_size for s in busy)
        return sum(s.tokens_live for s in busy) / allocated if allocated > 0 else None

    def peak_running(self) -> int:
        return max((s.running for s in self.samples), default=0)


def _stat(stats: dict[str, Any], key: str, default: int = 0) -> int:
    value = stats.get(key, default)
    return int(value) if value is not None else default


class EngineDriver:
    """Feeds requests to an Engine and steps it, recording tokens and KV state per step.

    Not thread-safe, like the engine itself: one driver per engine, one thread.
    """

    def __init__(self, engine: Any, *, record_kv: bool = True, keep_outputs: bool = False):
        self.engine = engine
        self.record_kv = record_kv
        self.keep_outputs = keep_outputs
        stats = engine.stats() if record_kv else {}
        self.run = EngineRun(
            timeline=Timeline(start=perf_counter()),
            block_size=_stat(stats, "block_size", 16),
        )

    def add(self, requests: list[BenchRequest]) -> None:
        """Submit requests now; their TTFT counts from this moment."""
        for req in requests:
            self.run.timeline.arrive(req.request_id, perf_counter())
            self.engine.add_request(req.request_id, list(req.prompt_token_ids), req.params())
            if self.keep_outputs:
                self.run.outputs[req.request_id] = []

    def step(self) -> None:
        """One engine step: stamp its tokens with the step's end time, sample KV state."""
        began = perf_counter()
        outputs = self.engine.step()
        ended = perf_counter()
        self.run.steps += 1
        for out in outputs:
            if out.new_token_ids and out.index == 0:
                self.run.timeline.tokens(out.request_id, ended, len(out.new_token_ids))
                if self.keep_outputs:
                    self.run.outputs[out.request_id].extend(out.new_token_ids)
        if self.record_kv:
            self._sample(ended, ended - began)

    def run_until(self, done: Callable[[], bool] | None = None) -> EngineRun:
        """Step until ``done()`` holds or nothing is left unfinished, whichever comes first."""
        while self.engine.has_unfinished_requests() and not (done and done()):
            self.step()
        self.run.timeline.end = perf_counter()
        self.run.stats_after = dict(self.engine.stats())
        return self.run

    def _sample(self, ended: float, dt: float) -> None:
        stats = self.engine.stats()
        self.run.samples.append(
            KvSample(
                t=ended - self.run.timeline.start,
                dt=dt,
                blocks_used=_stat(stats, "kv_blocks_used"),
                blocks_total=_stat(stats, "kv_blocks_total"),
                tokens_live=_stat(stats, "kv_tokens_live"),
                running=_stat(stats, "running"),
                waiting=_stat(stats, "waiting"),
            )
        )


def serve(engine: Any, requests: list[BenchRequest], **kwargs: Any) -> EngineRun:
    """Submit a whole trace at once (an offline batch) and serve it to the end."""
    driver = EngineDriver(engine, **kwargs)
    driver.add(requests)
    return driver.run_until()


def warm_up(engine: Any, space_low: int, prompt_len: int = 16, max_tokens: int = 4) -> None:
    """A throwaway request: first-call costs (allocations, kernel builds) stay out of timings."""
    ids = (np.arange(prompt_len) + space_low).tolist()
    req = BenchRequest("warmup", ids, max_tokens)
    serve(engine, [req], record_kv=False)
