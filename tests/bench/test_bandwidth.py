"""The streaming read the bench's rooflines divide by: a real read of a real buffer."""

from __future__ import annotations

import math

import torch

from pagedq.bench.bandwidth import stream_read_gbps


def test_the_streaming_read_is_a_finite_rate_and_restores_the_threads():
    before = torch.get_num_threads()
    gbps = stream_read_gbps(threads=1, buffer_bytes=16 * 2**20)
    assert math.isfinite(gbps) and gbps > 0.1
    assert torch.get_num_threads() == before
