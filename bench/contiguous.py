"""The counterfactual: the same trace served with a max-length KV reservation per request.

A "traditional" server reserves ``max_model_len`` KV slots per running request (it cannot know
how long the reply will be), so at a fixed KV memory it runs at most
``budget_tokens // max_model_len`` requests at once and most of each reservation stays empty.

This is a simulation, not a second engine: step by step, requests are admitted first come first
served while a reservation fits, prefill in their admission step (emitting their first token),
then emit one token per step and release their reservation when done. Time is counted in steps,
each weighted equally, because the reserved layout changes where KV lives, not how much compute
a step needs. Its figures are therefore compared with the paged engine's own per-step figures as
well as the time-weighted ones (both are reported).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedq.bench.workload import BenchRequest


@dataclass(frozen=True)
class ReservedStep:
    """State after one simulated step (completed requests already released)."""

    step: int
    running: int
    tokens_live: int
    slots_reserved: int


@dataclass
class ReservationRun:
    """The simulated run: per-step occupancy under max-length reservation."""

    budget_tokens: int
    max_model_len: int
    steps: list[ReservedStep] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.budget_tokens // self.max_model_len

    def busy(self) -> list[ReservedStep]:
        return [s for s in self.steps if s.running > 0]

    def kv_utilization(self) -> float | None:
        """Live tokens / reserved slots over busy steps (a ratio of sums, like the paged one)."""
        busy = self.busy()
        reserved = sum(s.slots_reserved for s in busy)
        return sum(s.tokens_live for s in busy) / reserved if reserved else None

    def peak_running(self) -> int:
        return max((s.running for s in self.steps), default=0)


@dataclass
class _Live:
    request: BenchRequest
    generated: int = 0

    @property
    def tokens(self) -> int:
        return self.request.prompt_len + self.generated


def simulate_reservation(
    requests: list[BenchRequest], budget_tokens: int, max_model_len: int
) -> ReservationRun:
    """Serve ``requests`` (all arrived at time 0, in order) under max-length reservation."""
    run = ReservationRun(budget_tokens=budget_tokens, max_model_len=max_model_len)
    if run.capacity < 1:
        return run  # not even one reservation fits: nothing can run
    waiting = deque(requests)
    running: list[_Live] = []
    step = 0
    while waiting or running:
        step += 1
        for live in running:  # one decode token each for those already prefilled
            live.generated += 1
        while waiting and len(running) < run.capacity:  # admit + prefill: first token
            running.append(_Live(waiting.popleft(), generated=1))
        # Sample before releasing: a finishing request still held its reservation this step.
        # (The paged side is sampled after its frees; the difference is one step per request.)
        run.steps.append(
            ReservedStep(
                step=step,
                running=len(running),
                tokens_live=sum(live.tokens for live in running),
                slots_reserved=len(running) * max_model_len,
            )
        )
        running = [live for live in running if live.generated < live.request.max_tokens]
    return run


def same_running_set_utilization(
    tokens_live: list[int], running: list[int], max_model_len: int
) -> float | None:
    """Derived variant: the paged engine's own running set, each given a max-length reservation.

    It ignores that such a set would not fit in the same memory (that is what the simulation
    models); it answers "how empty would these exact reservations be".
    """
    reserved = sum(r * max_model_len for r in running)
    return sum(tokens_live) / reserved if reserved else None
