"""The machine's streaming read bandwidth, measured in the bench run that reports against it.

Why: decode at one stream reads every weight once per token, so bytes per token ÷ this bandwidth
is the roofline a decode figure is judged by; a bandwidth quoted from another day is another
machine's. A float32 sum over a buffer far larger than any cache reads memory at close to the
rate the cores can stream it (torch's reduction is vectorized and split over its threads).
"""

from __future__ import annotations

import time

import torch

BUFFER_BYTES = 512 * 2**20  # well past the last-level cache of any CPU we run on
REPEATS = 5


def stream_read_gbps(threads: int | None = None, buffer_bytes: int = BUFFER_BYTES) -> float:
    """GB/s (10^9 bytes): the best of :data:`REPEATS` full reads on each count of 1 to
    ``threads`` threads (default: torch's current count). Every count is tried because the best
    is not always the most threads (an AMD EPYC read 36 GB/s on one thread and 28 on two): the
    roofline is what the machine can stream, however an engine gets there."""
    before = torch.get_num_threads()
    data = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    best = float("inf")
    try:
        for count in range(1, (threads or before) + 1):
            torch.set_num_threads(count)
            data.sum()  # fault the pages in and warm the threads
            for _ in range(REPEATS):
                start = time.perf_counter()
                data.sum()
                best = min(best, time.perf_counter() - start)
        return buffer_bytes / best / 1e9
    finally:
        torch.set_num_threads(before)
