"""``python -m pagedq.bench.quant_kernels``'s shapes and byte counts (no timings)."""

from __future__ import annotations

import pytest
import torch

from pagedq.bench import quant_kernels
from pagedq.bench.memory_bound import SHAPE


def test_the_memory_shapes_are_the_memory_scenarios_model():
    shapes = quant_kernels.model_shapes("memory")
    h, i, layers = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["layers"]
    assert len(shapes) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the LM head
    weights = sum(n * k for n, k in shapes)
    assert weights == layers * (3 * h * h + h * h + 2 * i * h + h * i) + quant_kernels.VOCAB * h
    assert all(k % 256 == 0 for _, k in shapes)  # the K-quants run every matrix


def test_memory_shapes_take_packed_paths_only():
    with pytest.raises(SystemExit):
        quant_kernels.main(["--shapes", "memory", "--paths", "fp32", "--rows", "1"])


def test_a_packed_call_knows_the_bytes_it_reads():
    gen = torch.Generator().manual_seed(0)
    (call,) = quant_kernels.build_path("gemv-q8_0", [(64, 256)], gen)
    assert call.nbytes == 64 * (256 // 32) * 34  # Q8_0: 34 bytes a block of 32
    call({256: torch.randn(1, 256, generator=gen)})  # runs on one activation row
