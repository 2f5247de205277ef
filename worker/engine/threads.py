"""How many threads a step's forward pass runs on, chosen by measuring, step by step.

Why: a step is ~150 parallel regions (every projection, attention, norm) that each end in a
barrier. On a quiet machine two threads decode one stream ~1.6x faster than one; on a shared one
(the test suite beside a worker, other services on the box: a load of 4-10 on 2 cores) a region
waits for whichever of its threads the OS has descheduled, every time, and the same stream
decoded 5-35x *slower* on two threads than on one (measured on an AMD EPYC, 2 cores). No static
setting serves both, and the load comes and goes. So the :class:`ThreadGovernor` keeps the time
per step for each thread count it may use, per size of step (decode steps and prefill chunks
scale differently), runs the faster count, and every few steps tries another count once, so it
notices when the machine gets busy or quiet again.

It also caps the starting count at the CPU quota of the process's cgroup (a container given 1.5
CPUs of a 16-core host must not start 16 threads): :func:`usable_cpus`. On a hybrid Intel CPU
(Alder Lake and later: performance and efficient cores) the P-cores' count is a third candidate
(:func:`performance_cores`): every region splits its work evenly, so with the E-cores in it each
barrier waits for the slowest, and llama.cpp's advice there is one thread per P-core; which of
all, the P-cores or one is fastest is measured, as the rest.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")
EXPLORE_EVERY = 16  # steps of one size before another thread count is tried again
EXPLORE_AT_MOST = 512  # ... doubling after each try it lost, up to this many
SMOOTHING = 0.3  # weight of the newest step in a count's running mean
REACT = 2.0  # a chosen-count step this many times the other's mean: try the other at once


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``)
    or v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), rounded down, at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cpus, math.floor(quota))) if quota else cpus


def _cgroup_quota(root: Path) -> float | None:
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpu_list(text: str) -> set[int]:
    """Linux's CPU list format ("0-5,8,10-11") as a set of CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out


def performance_cores(sysfs: Path = Path("/sys"), allowed: set[int] | None = None) -> int | None:
    """Physical P-cores this process may use on a hybrid CPU, else None.

    Linux lists a hybrid Intel CPU's P-core and E-core logical CPUs in
    ``devices/cpu_core/cpus`` and ``devices/cpu_atom/cpus`` (one PMU each); a CPU of one kind has
    neither. ``allowed``: the logical CPUs the process may run on (default: its affinity); a
    core counts once however many of its hyperthreads are allowed."""
    try:
        p_cpus = cpu_list((sysfs / "devices" / "cpu_core" / "cpus").read_text())
        cpu_list((sysfs / "devices" / "cpu_atom" / "cpus").read_text())
    except (OSError, ValueError):
        return None
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else p_cpus
    cores: set[tuple[str, str]] = set()
    for cpu in p_cpus & allowed:
        topology = sysfs / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("", str(cpu)))
    return len(cores) or None


def size_class(tokens: int) -> int:
    """Steps of 1, 2-3, 4-7, ... tokens share their timings (their cost scales alike)."""
    return max(tokens, 1).bit_length()


@dataclass
class _Timings:
    mean: dict[int, float] = field(default_factory=dict)  # thread count -> seconds per step
    steps: int = 0
    chosen: int = 0  # the count that has been fastest (0: none yet)
    interval: int = EXPLORE_EVERY  # steps between two tries of another count
    next_try: int = EXPLORE_EVERY


class ThreadGovernor:
    """Runs each forward pass on the thread count that has been fastest for steps of its size.

    ``counts``: the thread counts to choose among (the configured count and 1); one count means
    no choice (the governor then only sets it).
    """

    def __init__(self, counts: tuple[int, ...], explore_every: int = EXPLORE_EVERY,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.counts = tuple(sorted(set(counts), reverse=True))
        self.explore_every = explore_every
        self.clock = clock
        self.by_size: dict[int, _Timings] = {}
        self.chosen = self.counts[0]  # the last step's fastest count (stats)

    def run(self, tokens: int, forward: Callable[[], T]) -> T:
        """``forward()`` on the thread count chosen for a step of ``tokens`` tokens, timed."""
        timings = self.by_size.setdefault(size_class(tokens), _Timings())
        threads = self.pick(timings)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        start = self.clock()
        result = forward()
        self.record(timings, threads, self.clock() - start)
        return result

    def pick(self, timings: _Timings) -> int:
        """An untried count first; then the fastest so far, and at ``next_try`` another one (a
        try that loses doubles the wait before the next, up to EXPLORE_AT_MOST steps: on a busy
        machine a try of two threads can cost as much as ten steps on one)."""
        timings.steps += 1
        for count in self.counts:
            if count not in timings.mean:
                return count
        if not timings.chosen:
            timings.chosen = min(self.counts, key=lambda c: timings.mean[c])
        self.chosen = timings.chosen
        if len(self.counts) > 1 and timings.steps >= timings.next_try:
            others = [c for c in self.counts if c != timings.chosen]
            return others[(timings.steps // EXPLORE_EVERY) % len(others)]
        return timings.chosen

    def record(self, timings: _Timings, threads: int, seconds: float) -> None:
        """The chosen count's mean follows its steps smoothly, and a step of it slower than REACT
        times another count's mean brings that count's next try forward (load arrives within a
        step; it must not wait out a back-off); a try of another count replaces that count's
        (stale) mean: it measures the machine as it is now."""
        old = timings.mean.get(threads)
        if old is None or threads != timings.chosen:
            timings.mean[threads] = seconds
        else:
            timings.mean[threads] = old + SMOOTHING * (seconds - old)
        if not timings.chosen:
            return
        if threads == timings.chosen:  # load arriving: a step far slower than the other count
            others = [m for c, m in timings.mean.items() if c != threads]
            if others and seconds > REACT * min(others):
                timings.next_try = min(timings.next_try, timings.steps + 1)
            return
        # a try of another count: it takes over if now faster, else waits twice as long
        if timings.mean[threads] < timings.mean[timings.chosen]:
            timings.chosen, timings.interval = threads, self.explore_every
        else:
            timings.interval = min(2 * timings.interval, EXPLORE_AT_MOST)
        timings.next_try = timings.steps + timings.interval

    def snapshot(self) -> dict[str, dict[int, float]]:
        """Mean seconds per step by size class and thread count (stats and the bench)."""
        return {str(size): dict(t.mean) for size, t in sorted(self.by_size.items())}
