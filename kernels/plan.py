"""AttentionPlan: the per-step metadata every layer's attention call shares.

Why: the engine calls ``paged_attention`` once per layer (30x per step for SmolLM2) with the same
block table, sequence lengths and query offsets. Host copies of the lengths, gather indices and
masks are built once per step here (and lazily per backend, on the first layer that needs them)
instead of once per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class KernelArgumentError(ValueError):
    """Inputs to paged_attention / write_kv have inconsistent shapes, dtypes or devices."""


@dataclass
class AttentionPlan:
    """Batch layout of one engine step, independent of the layer.

    ``q_lens``/``seq_lens_host`` are host copies (one device sync per step, not per layer).
    Backend-specific derived data (gather indices, masks, grid layouts) is cached in ``_derived``
    by :meth:`derived` so each backend pays for it once per step.
    """

    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    block_size: int
    num_tokens: int
    q_lens: list[int]
    seq_lens_host: list[int]
    _derived: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    def derived(self, key: str, build: Callable[[AttentionPlan], T]) -> T:
        """Return ``build(self)``, computed once per plan and cached under ``key``."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]


def mixed_ok(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """A cache may hold the query's dtype, or fp16/bf16 under fp32 queries (half the bytes)."""
    return cache_dtype == query_dtype or (
        query_dtype == torch.float32 and cache_dtype in (torch.float16, torch.bfloat16)
    )


def plan_attention(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_size: int,
    num_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> AttentionPlan:
    """Validate one step's batch layout and build its :class:`AttentionPlan`.

    ``num_tokens`` defaults to ``cu_seqlens_q[-1]``; pass it when the query tensor carries extra
    padding rows (e.g. CUDA-graph buckets): rows past ``cu_seqlens_q[-1]`` are left untouched.
    """
    device = torch.device(device) if device is not None else block_table.device
    block_table = block_table.to(device=device, dtype=torch.int32)
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    cu_seqlens_q = cu_seqlens_q.to(device=device, dtype=torch.int32)
    if block_table.dim() != 2 or seq_lens.dim() != 1 or cu_seqlens_q.dim() != 1:
        raise KernelArgumentError(
            "block_table must be 2-D [num_seqs, max_blocks], seq_lens and cu_seqlens_q 1-D; "
            f"got shapes {tuple(block_table.shape)}, {tuple(seq_lens.shape)}, "
            f"{tuple(cu_seqlens_q.shape)}"
        )
    num_seqs = seq_lens.shape[0]
    if block_table.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise KernelArgumentError(
            f"block_table has {block_table.shape[0]} rows, seq_lens {num_seqs} entries and "
            f"cu_seqlens_q {cu_seqlens_q.shape[0]} entries; expected num_seqs, num_seqs, "
            "num_seqs + 1"
        )
    cu = cu_seqlens_q.tolist()
    seq_lens_host = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    max_context = block_table.shape[1] * block_size
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens_host, strict=True)):
        if q_len < 0 or q_len > seq_len or seq_len > max_context:
            raise KernelArgumentError(
                f"sequence {i}: q_len={q_len}, seq_len={seq_len}; need 0 <= q_len <= seq_len <= "
                f"max_blocks * block_size = {max_context} (cu_seqlens_q must be non-decreasing "
                "and seq_lens count cached + new tokens)"
            )
    total = cu[-1] if cu else 0
    if cu and cu[0] != 0:
        raise KernelArgumentError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    num_tokens = total if num_tokens is None else int(num_tokens)
    if num_tokens < total:
        raise KernelArgumentError(f"num_tokens={num_tokens} is smaller than cu_seqlens_q[-1]={total}")
    return AttentionPlan(
        block_table=block_table,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        block_size=int(block_size),
        num_tokens=num_tokens,
        q_lens=q_lens,
        seq_lens_host=seq_lens_host,
    )
