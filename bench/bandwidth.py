"""The machine's streaming read bandwidth, measured in the bench run that reports against it.

Why: decode at one stream reads every weight once per token, so bytes per token ÷ this bandwidth
is the roofline a decode figure is judged by; a bandwidth quoted from another day is another
machine's. A float32 sum over a buffer far larger than any cache reads memory at close to the
rate the cores can stream it (torch's reduction is vectorized and split over its threads).

The buffer is read on ordinary pages and again on transparent huge pages where Linux gives
them (kernels/huge_pages.py), and the faster counts: the engine reads a GGUF's weights from
huge pages, and under a hypervisor the page walks of 4 KiB pages cost a fifth of the rate or
more (a KVM guest, Intel Xeon model 167, 2 threads: 23 GB/s on 4 KiB pages, 29 on 2 MiB).
"""

from __future__ import annotations

import time

import torch

from pagedq.kernels.huge_pages import Arena

BUFFER_BYTES = 512 * 2**20  # well past the last-level cache of any CPU we run on
REPEATS = 5


def stream_read_gbps(threads: int | None = None, buffer_bytes: int = BUFFER_BYTES) -> float:
    """GB/s (10^9 bytes): the best of :data:`REPEATS` full reads on each count of 1 to
    ``threads`` threads (default: torch's current count), on ordinary and on huge pages. Every
    count is tried because the best is not always the most threads (an AMD EPYC read 36 GB/s
    on one thread and 28 on two): the roofline is what the machine can stream, however an
    engine gets there."""
    best = _best_read_seconds(torch.ones(buffer_bytes // 4, dtype=torch.float32), threads)
    arena = Arena(buffer_bytes)
    if arena.enabled:
        data = arena.empty(buffer_bytes).view(torch.float32)
        data.fill_(1.0)
        best = min(best, _best_read_seconds(data, threads))
    return buffer_bytes / best / 1e9


def _best_read_seconds(data: torch.Tensor, threads: int | None) -> float:
    before = torch.get_num_threads()
    best = float("inf")
    try:
        for count in range(1, (threads or before) + 1):
            torch.set_num_threads(count)
            data.sum()  # fault the pages in and warm the threads
            for _ in range(REPEATS):
                start = time.perf_counter()
                data.sum()
                best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(before)
