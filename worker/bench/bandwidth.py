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
    """GB/s (10^9 bytes) of the best of :data:`REPEATS` full reads on ``threads`` threads
    (default: torch's current count)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        data = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        data.sum()  # fault the pages in and warm the threads
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return buffer_bytes / best / 1e9
    finally:
        torch.set_num_threads(before)
