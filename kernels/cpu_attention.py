"""Routing to the C++ paged-attention kernel: which query rows it takes, and their layout.

The kernel (``csrc/attention.cpp``, op ``paged_attention_rows`` of :mod:`pagedq.kernels.cpu_ops`)
walks the block table in place and reads each K/V row once per KV head, where gather + SDPA reads
the cache, writes a padded copy and reads the copy again. It takes every decode and short prefill
chunks (``q_len <= MAX_KERNEL_CHUNK`` over at most ``MAX_KERNEL_CHUNK_KEYS`` query-key pairs, see
:func:`kernel_takes`); longer chunks keep SDPA, whose matrix multiplies win once many query rows
share each K/V row. This is the "cpp" attention of :mod:`pagedq.kernels.backend`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from pagedq.kernels.plan import AttentionPlan, mixed_ok

MAX_KERNEL_CHUNK = 32  # prefill chunks up to this many tokens beat gather + SDPA in the kernel
# ... while their query rows x visible keys stay under this: the kernel reads every K/V row once
# per query row, SDPA once per chunk, so SDPA wins for long chunks over long contexts; the two
# cost the same near 32 query rows over ~430 keys.
MAX_KERNEL_CHUNK_KEYS = 16384
# (key, KV head) pairs: less work than this does not pay a thread wake-up. Measured on 2 cores:
# one decode row of SmolLM2 (3 KV heads) over 128 keys ran 1.17x faster split over both threads
# (11.7 vs 13.6 us with the wake-up), over 700 keys 1.36x.
MIN_WORK_PER_THREAD = 256
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class KernelRows:
    """Query rows the C++ kernel computes in one call, built once per step.

    ``rows[i] = (query row, sequence, visible keys)``. Work items are (row, range of
    ``heads_per_item`` KV heads); ``grain`` is the fewest items a thread gets, so small steps
    stay on one thread.
    """

    rows: torch.Tensor  # int64 [num_rows, 3], contiguous
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks], contiguous rows
    heads_per_item: int
    grain: int


def kernel_takes(q_len: int, seq_len: int) -> bool:
    """Whether a sequence's ``q_len`` query rows (seeing up to ``seq_len`` keys) are cheaper in
    the kernel than in gather + SDPA: every decode, and short chunks over short contexts."""
    return q_len == 1 or (0 < q_len <= MAX_KERNEL_CHUNK and q_len * seq_len <= MAX_KERNEL_CHUNK_KEYS)


def kernel_takes_step(plan: AttentionPlan) -> bool:
    """Whether the kernel takes every query row of the step (what the fused C++ layer needs)."""
    return bool(plan.q_lens) and all(
        kernel_takes(q, s) for q, s in zip(plan.q_lens, plan.seq_lens_host, strict=True))


def unsupported(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int | None) -> str:
    """Why the kernel cannot take queries of ``dtype`` over a ``kv_dtype`` cache ("" when it can)."""
    if dtype not in KERNEL_DTYPES:
        return f"the C++ attention kernel takes float32/float16/bfloat16 queries, not {dtype}"
    if not mixed_ok(dtype, kv_dtype):
        return f"the C++ attention kernel does not read a {kv_dtype} cache under {dtype} queries"
    if head_dim is not None and head_dim % 8:
        return f"the C++ attention kernel needs head_dim % 8 == 0, the model has {head_dim}"
    return ""


def kernel_fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, fp32/fp16/bf16, an fp16/bf16 cache under
    fp32 queries, head_dim % 8, unit strides)."""
    return (
        query.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype
        and not unsupported(query.dtype, k_cache.dtype, query.shape[-1])
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def items_heads(rows: int, num_kv_heads: int, threads: int) -> int:
    """KV heads a work item takes: a row's heads lie side by side in a cache block, so whole
    rows (all heads) read contiguous memory; fewer rows than two per thread split each row's
    heads into runs of neighbours, about two items per thread.

    Why runs, not single heads: a single head's keys lie a whole token row apart (4 KiB in a
    32-head fp16 cache), one 128-byte piece per page, so one decode row of a 32-head model spent
    64-67 us a layer in attention with an item per head, 30-31 us with runs of 8 (SmolLM2-1.7B's
    shape, 64-96 keys, fp16 cache, AMD EPYC Zen 5 capped at avx2, 2 threads): the one-stream
    step 30.4-31.8 -> 28.9 ms.
    """
    if rows >= 2 * threads:
        return num_kv_heads
    return max(1, -(-num_kv_heads // (2 * threads)))


def kernel_rows(plan: AttentionPlan, ids: list[int], num_kv_heads: int) -> KernelRows:
    """Kernel rows of the sequences ``ids`` (all their query tokens), built on Python lists.

    Token ``j`` of a ``q_len``-token chunk sits at position ``seq_len - q_len + j`` and so sees
    ``seq_len - q_len + j + 1`` keys; a decode token sees all ``seq_len``. Why lists: a decode
    step's few rows took ~15 small tensor ops here, once per step (~0.04-0.09 ms of a one-stream
    step); the rows the kernel takes are decodes and short chunks (kernel_takes).
    """
    firsts = list(accumulate(plan.q_lens, initial=0))
    query_rows: list[int] = []  # the three columns, a range (or a run) per sequence
    seqs: list[int] = []
    visible: list[int] = []
    work = 0
    for i in ids:
        q_len, seq_len = plan.q_lens[i], plan.seq_lens_host[i]
        first, seen = firsts[i], seq_len - q_len + 1
        query_rows.extend(range(first, first + q_len))
        seqs.extend([i] * q_len)
        visible.extend(range(seen, seen + q_len))
        work += q_len * seen + q_len * (q_len - 1) // 2
    total = len(query_rows)
    rows = torch.tensor([query_rows, seqs, visible], dtype=torch.long).T.contiguous()
    threads = torch.get_num_threads()
    heads_per_item = items_heads(total, num_kv_heads, threads)
    items = total * -(-num_kv_heads // heads_per_item)
    grain = max(1, math.ceil(items * MIN_WORK_PER_THREAD / (max(work, 1) * num_kv_heads)))
    return KernelRows(
        rows=rows,
        block_table=plan.block_table.cpu().contiguous(),
        heads_per_item=heads_per_item,
        grain=grain,
    )


def run_kernel(
    op: Callable,
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: KernelRows,
    scale: float,
) -> None:
    """Write the attention of ``rows`` into ``out`` (other rows untouched)."""
    op(out, query, k_cache, v_cache, rows.block_table, rows.rows, scale, rows.heads_per_item, rows.grain)
