"""Paged attention with torch's SDPA: the "sdpa" backend, and the "cpp" backend's host.

Layout of the work (few, large calls: each torch call has a fixed cost that small CPU steps feel):

* Decode rows (``q_len == 1``) are batched in a few groups of similar context length: one
  block-wise gather of the group's K/V from the paged cache into ``[n, max_len, kv_heads,
  head_dim]`` and one fused ``scaled_dot_product_attention`` call (GQA without copying K/V,
  length mask, fp32 accumulation).
* Prefill chunks (``q_len > 1``) are few per step and long, so each one runs on its own through
  ``scaled_dot_product_attention`` (fused, memory-efficient) with an offset-causal mask.

With the "cpp" backend (a ``kernel`` passed in) the decode rows and the short chunks
:func:`~pagedq.kernels.cpu_attention.kernel_takes` picks go to the C++ kernel instead, which
reads K/V in place through the block table (no gather copy); longer chunks keep SDPA.

Uninitialised (even NaN) cache slots never leak through ``0 * NaN``: see :class:`DecodeGroup`.
Gather indices and masks live in a :class:`TorchPlan` built once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from pagedq.kernels.cpu_attention import KernelRows, kernel_rows, kernel_takes, run_kernel
from pagedq.kernels.plan import AttentionPlan

MAX_DECODE_GROUPS = 4
MIN_GROUP_SPREAD = 1.25


@dataclass
class PrefillChunk:
    """One sequence with more than one new token."""

    q_start: int
    q_end: int
    seq_len: int
    blocks: torch.Tensor  # int64 [ceil(seq_len / block_size)]: physical blocks in order
    mask: torch.Tensor | None  # bool [q_len, seq_len], True = visible; None = square causal


@dataclass
class DecodeGroup:
    """Sequences with exactly one new token and similar context lengths, padded to the longest.

    Block-table padding points at the sequence's first block; gathered positions that hold an
    unwritten slot (the tail of the last, partial block, and of the first block's copies when
    the sequence is shorter than a block) are zeroed after the gather (``stale``), so neither
    stale nor NaN cache contents reach the output through ``0 * NaN``.
    """

    rows: torch.Tensor | None  # int64 [n]: packed query rows; None when rows == arange(n)
    blocks: torch.Tensor  # int64 [n, num_blocks]
    mask: torch.Tensor  # bool [n, 1, 1, num_blocks * block_size], True = visible
    stale: torch.Tensor | None  # int64: flat gathered positions holding unwritten slots


@dataclass
class TorchPlan:
    decodes: list[DecodeGroup]
    chunks: list[PrefillChunk]
    kernel: KernelRows | None = None  # rows for the C++ CPU kernel (decodes and short chunks)


def _length_groups(ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Split ``ids`` (decode sequences) into at most MAX_DECODE_GROUPS runs of similar length.

    Padding every decode to the batch's longest context wastes up to (max / min - 1) of the
    gather and matmul work; groups whose longest is at most ``spread`` x their shortest bound
    that waste while keeping the number of (fixed-overhead) batched calls small.
    """
    order = sorted(ids, key=lambda i: lengths[i], reverse=True)
    longest, shortest = lengths[order[0]], max(lengths[order[-1]], 1)
    spread = max(MIN_GROUP_SPREAD, (longest / shortest) ** (1 / MAX_DECODE_GROUPS) + 1e-9)
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] <= spread * max(lengths[i], 1):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_group(plan: AttentionPlan, ids: list[int]) -> DecodeGroup:
    device, bs = plan.device, plan.block_size
    idx = torch.tensor(ids, device=device, dtype=torch.long)
    seq_lens = plan.seq_lens.long()[idx]
    max_len = max(plan.seq_lens_host[i] for i in ids)
    num_blocks = -(-max_len // bs)
    used = torch.arange(num_blocks, device=device)[None, :] * bs < seq_lens[:, None]
    table = plan.block_table.long()[idx, :num_blocks]
    blocks = torch.where(used, table, table[:, :1])
    pos = torch.arange(num_blocks * bs, device=device)[None, :]
    mask = pos < seq_lens[:, None]
    # Which of the sequence's positions each gathered position holds a copy of: itself inside
    # the used blocks, its offset within the first block in the padding blocks.
    source = torch.where(pos < (seq_lens[:, None] + bs - 1) // bs * bs, pos, pos % bs)
    stale = (source >= seq_lens[:, None]).flatten().nonzero().flatten()
    identity = ids == list(range(plan.num_seqs)) and len(ids) == plan.num_tokens
    return DecodeGroup(
        rows=None if identity else plan.cu_seqlens_q.long()[idx],
        blocks=blocks,
        mask=mask[:, None, None, :],
        stale=stale if stale.numel() else None,
    )


def build_torch_plan(plan: AttentionPlan, kernel_kv_heads: int = 0) -> TorchPlan:
    """Split the step into length-grouped batched decodes and per-sequence prefill chunks.

    With ``kernel_kv_heads`` (the cache's KV heads, when the C++ CPU kernel runs this step),
    decodes and the short chunks :func:`kernel_takes` picks become kernel rows instead.
    """
    device, bs = plan.device, plan.block_size
    kernel_ids = ([i for i, q in enumerate(plan.q_lens) if kernel_takes(q, plan.seq_lens_host[i])]
                  if kernel_kv_heads else [])
    kernel = kernel_rows(plan, kernel_ids, kernel_kv_heads) if kernel_ids else None
    decode_ids = [i for i, q in enumerate(plan.q_lens) if q == 1 and not kernel_kv_heads]
    groups = _length_groups(decode_ids, plan.seq_lens_host) if decode_ids else []
    decodes = [_decode_group(plan, sorted(g)) for g in groups]
    chunks = []
    cu = plan.cu_seqlens_q.tolist()
    in_kernel = set(kernel_ids)
    for i, q_len in enumerate(plan.q_lens):
        if q_len <= 1 or i in in_kernel:
            continue
        seq_len = plan.seq_lens_host[i]
        blocks = plan.block_table[i, : -(-seq_len // bs)].long()
        mask = None
        if q_len != seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        chunks.append(PrefillChunk(cu[i], cu[i + 1], seq_len, blocks, mask))
    return TorchPlan(decodes=decodes, chunks=chunks, kernel=kernel)


def derive_torch_plan(plan: AttentionPlan, kernel_kv_heads: int = 0) -> TorchPlan:
    """The step's TorchPlan for one path (C++ kernel or not), built once per step and reused."""
    if kernel_kv_heads:
        return plan.derived("cpp", partial(build_torch_plan, kernel_kv_heads=kernel_kv_heads))
    return plan.derived("sdpa", build_torch_plan)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks ``cache[blocks]`` -> ``[*blocks.shape, block_size, H, D]``.

    ``index_select`` on the block axis copies block_size * H * D contiguous elements at a time
    (several times faster on CPU than a per-slot gather) and honours any strides of the cache,
    e.g. ``kv[0]`` or ``kv[:, 0]`` views of a joint KV tensor.
    """
    out = cache.index_select(0, blocks.reshape(-1))
    return out.view(*blocks.shape, *cache.shape[1:])


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:
    """Batched single-token attention over one length group; returns ``[n, H, D]``."""
    n, num_blocks = group.blocks.shape
    q = query if group.rows is None else query[group.rows]
    kv = []
    for cache in (k_cache, v_cache):
        gathered = _gather_blocks(cache, group.blocks).to(query.dtype)  # fp16 cache: fp32 math
        gathered = gathered.view(n * num_blocks * cache.shape[1], -1)
        if group.stale is not None:
            gathered.index_fill_(0, group.stale, 0)
        kv.append(gathered.view(n, -1, *cache.shape[2:]).transpose(1, 2))  # [n, Hkv, L, D]
    # GQA as rows: the ``group`` query heads of a KV head are ``group`` query rows of one
    # (sequence, KV head) attention, so each K/V row is streamed once per KV head, not once
    # per query head as SDPA's enable_gqa does.
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=group.mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def _prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk through fused SDPA; returns ``[q_len, num_heads, head_dim]``."""
    q = query[chunk.q_start : chunk.q_end].transpose(0, 1)  # [H, q, D]
    k, v = (
        _gather_blocks(cache, chunk.blocks).flatten(0, 1)[: chunk.seq_len].to(q.dtype).transpose(0, 1)
        for cache in (k_cache, v_cache)
    )  # [Hkv, L, D]
    out = F.scaled_dot_product_attention(
        q[None],
        k[None],
        v[None],
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out[0].transpose(0, 1)


def torch_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    kernel: Callable | None = None,
) -> torch.Tensor:
    """Paged attention for a packed batch of prefill chunks and decodes (see module docstring);
    ``kernel``: the C++ ``paged_attention_rows`` op for the rows it takes (the caller checked
    that these tensors fit it), or None for SDPA throughout."""
    tplan = derive_torch_plan(plan, k_cache.shape[2] if kernel is not None else 0)
    decodes = tplan.decodes
    if len(decodes) == 1 and decodes[0].rows is None and query.shape[0] == plan.num_tokens:
        return _decode(query, k_cache, v_cache, decodes[0], scale)
    covered = sum(plan.q_lens)
    out = torch.zeros_like(query) if covered < query.shape[0] else torch.empty_like(query)
    if tplan.kernel is not None:
        run_kernel(kernel, out, query, k_cache, v_cache, tplan.kernel, scale)
    for group in decodes:
        rows = group.rows if group.rows is not None else slice(0, plan.num_tokens)
        out[rows] = _decode(query[: plan.num_tokens], k_cache, v_cache, group, scale)
    for chunk in tplan.chunks:
        out[chunk.q_start : chunk.q_end] = _prefill(query, k_cache, v_cache, chunk, scale)
    return out
