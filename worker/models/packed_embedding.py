"""A packed embedding table's rows, dequantized once per token id and kept.

Why: a decode step embeds one token per sequence, and dequantizing a packed row (a gather of
its grouped bytes, the format's decode, the scales) takes a dozen small tensor ops: ~0.04 ms
alone and ~0.09 ms inside a ~3 ms one-stream step of the bundled model (its caches cold after
the layers). Text repeats its tokens, so a token seen before costs a dict lookup. The rows are
exact (the same dequantization, done once), the cache is bounded in bytes and least recently
used rows leave first; long prefill chunks bypass it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedq.kernels.block_formats import QuantWeight, dequantize

CACHE_BYTES = 8 << 20  # the dequantized rows kept: 3,640 of SmolLM2's 576-wide rows in fp32
CACHED_BATCH = 64  # batches of up to this many tokens (decode steps) go through the cache


class PackedEmbedding:
    """``rows(ids)``: the float rows of ``ids`` from a packed ``weight``, in ``dtype``."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.weight = weight
        self.dtype = dtype
        self.capacity = max(1, cache_bytes // (weight.shape[1] * dtype.itemsize))
        self.cached: OrderedDict[int, torch.Tensor] = OrderedDict()

    def dequantized(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight.rows(ids)).to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if len(ids) > CACHED_BATCH or ids.device.type != "cpu":  # a device sync per step: no
            return self.dequantized(ids)
        keys = ids.tolist()
        cached = self.cached
        fresh: dict[int, torch.Tensor] = {}
        missing = [t for t in dict.fromkeys(keys) if t not in cached]
        if missing:
            rows = self.dequantized(torch.tensor(missing, dtype=torch.long))
            fresh = {t: row.clone() if len(missing) > 1 else row  # no view keeps the batch
                     for t, row in zip(missing, rows, strict=True)}
        out = torch.stack([fresh[t] if t in fresh else cached[t] for t in keys])
        for t in keys:  # most recently used last
            if t in fresh:
                cached[t] = fresh[t]
            cached.move_to_end(t)
        while len(cached) > self.capacity:
            cached.popitem(last=False)
        return out
