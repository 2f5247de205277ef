"""Paged attention in plain PyTorch: the engine's CPU path (and a fallback anywhere).

Layout of the work, chosen for a 2-core CPU:

* Decode rows (``q_len == 1``) of all sequences are done together: one gather of every sequence's
  K/V from the paged cache into ``[num_decodes, max_len, kv_heads, head_dim]``, then two batched
  matmuls with GQA by reshaping the query to ``[num_decodes, kv_heads, group, head_dim]`` (no
  ``repeat_interleave`` copy of K/V), a length mask and an fp32 softmax.
* Prefill chunks (``q_len > 1``) are few per step and long, so each one runs on its own through
  ``scaled_dot_product_attention`` (fused, memory-efficient) with an offset-causal mask.

Padding positions of the gather point at the sequence's own first token, which is always written,
so uninitialised (even NaN) cache slots are never read and never leak through ``0 * NaN``.
Gather indices and masks live in a :class:`TorchPlan` built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedq.kernels.plan import AttentionPlan


@dataclass
class PrefillChunk:
    """One sequence with more than one new token."""

    q_start: int
    q_end: int
    slots: torch.Tensor  # int64 [seq_len]: flat cache slot of each context position
    mask: torch.Tensor | None  # bool [q_len, seq_len], True = visible; None = square causal


@dataclass
class DecodeBatch:
    """All sequences with exactly one new token, padded to the longest context among them."""

    rows: torch.Tensor | None  # int64 [n]: packed query rows; None when rows == arange(n)
    slots: torch.Tensor  # int64 [n, max_len]; padding points at the sequence's first slot
    mask: torch.Tensor  # bool [n, 1, 1, max_len], True = visible


@dataclass
class TorchPlan:
    decode: DecodeBatch | None
    chunks: list[PrefillChunk]


def _slot_matrix(
    block_table: torch.Tensor, seq_lens: torch.Tensor, length: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot index of positions ``0 .. length-1`` for each row, and the validity mask."""
    pos = torch.arange(length, device=block_table.device)
    blocks = block_table.long()[:, pos // block_size]
    slots = blocks * block_size + pos % block_size
    valid = pos[None, :] < seq_lens.long()[:, None]
    return torch.where(valid, slots, slots[:, :1]), valid


def build_torch_plan(plan: AttentionPlan) -> TorchPlan:
    """Split the step into one batched decode group and per-sequence prefill chunks."""
    device = plan.device
    decode_ids = [i for i, q in enumerate(plan.q_lens) if q == 1]
    decode = None
    if decode_ids:
        ids = torch.tensor(decode_ids, device=device, dtype=torch.long)
        max_len = max(plan.seq_lens_host[i] for i in decode_ids)
        slots, valid = _slot_matrix(
            plan.block_table[ids], plan.seq_lens[ids], max_len, plan.block_size
        )
        starts = plan.cu_seqlens_q.long()[ids]
        identity = len(decode_ids) == plan.num_tokens and decode_ids == list(range(plan.num_seqs))
        decode = DecodeBatch(
            rows=None if identity else starts, slots=slots, mask=valid[:, None, None]
        )
    chunks = []
    cu = plan.cu_seqlens_q.tolist()
    for i, q_len in enumerate(plan.q_lens):
        if q_len <= 1:
            continue
        seq_len = plan.seq_lens_host[i]
        slots, _ = _slot_matrix(
            plan.block_table[i : i + 1], plan.seq_lens[i : i + 1], seq_len, plan.block_size
        )
        mask = None
        if q_len != seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        chunks.append(PrefillChunk(cu[i], cu[i + 1], slots[0], mask))
    return TorchPlan(decode=decode, chunks=chunks)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slot // block_size, slot % block_size]`` for every slot, without copying the cache.

    A flat ``[num_blocks * block_size, H, D]`` view is used when the strides allow it (also for
    ``kv[0]`` views of a joint KV tensor); otherwise two-index advanced indexing.
    """
    num_blocks, block_size, heads, dim = cache.shape
    try:
        return cache.view(num_blocks * block_size, heads, dim)[slots]
    except RuntimeError:
        return cache[slots // block_size, slots % block_size]


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
) -> torch.Tensor:
    """Batched single-token attention; returns ``[n, num_heads, head_dim]``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    q = query if batch.rows is None else query[batch.rows]
    n = q.shape[0]
    q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k = _gather(k_cache, batch.slots)  # [n, L, Hkv, D]
    v = _gather(v_cache, batch.slots)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale  # [n, Hkv, G, L]
    scores.masked_fill_(~batch.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [n, Hkv, G, D]
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
    k = _gather(k_cache, chunk.slots).transpose(0, 1)  # [Hkv, L, D]
    v = _gather(v_cache, chunk.slots).transpose(0, 1)
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
) -> torch.Tensor:
    """Paged attention for a packed batch of prefill chunks and decodes (see module docstring)."""
    tplan = plan.derived("torch", build_torch_plan)
    decode = tplan.decode
    if decode is not None and decode.rows is None and query.shape[0] == plan.num_tokens:
        return _decode(query, k_cache, v_cache, decode, scale)
    covered = sum(plan.q_lens)
    out = torch.zeros_like(query) if covered < query.shape[0] else torch.empty_like(query)
    if decode is not None:
        rows = decode.rows if decode.rows is not None else slice(0, plan.num_tokens)
        out[rows] = _decode(query[: plan.num_tokens], k_cache, v_cache, decode, scale)
    for chunk in tplan.chunks:
        out[chunk.q_start : chunk.q_end] = _prefill(query, k_cache, v_cache, chunk, scale)
    return out
