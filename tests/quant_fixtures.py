"""Packed weights for tests: random blocks of every format the kernels read."""

from __future__ import annotations

import torch

from pagedq.kernels.block_formats import FORMATS, QuantWeight, as_bf16, quantize_int8

INTEGER = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8")
ALL = INTEGER + ("bf16",)


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    """Random codes, bits and 6-bit scales (every byte pattern is a valid block) with fp16
    super-scales in a sane range, so every decoding branch sees varied input."""
    if fmt == "int8":
        return quantize_int8(torch.randn(n, k, generator=gen))
    if fmt == "bf16":
        return as_bf16(torch.randn(n, k, generator=gen))
    f = FORMATS[fmt]
    raw = torch.randint(0, 256, (n * k // f.block, f.nbytes), dtype=torch.uint8, generator=gen)

    def put(offset: int, lo: float, hi: float) -> None:
        values = torch.rand(raw.shape[0], 1, generator=gen) * (hi - lo) + lo
        raw[:, offset:offset + 2] = values.half().view(torch.uint8)

    if fmt == "q6_k":
        put(208, 0.001, 0.01)
    else:
        put(0, 0.01, 0.1)
        if fmt in ("q4_1", "q5_1"):
            put(2, -0.5, 0.5)
        if fmt in ("q4_k", "q5_k"):
            put(2, 0.001, 0.01)
    return QuantWeight(f, raw.reshape(n, -1), (n, k))
