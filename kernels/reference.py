"""Plain, obviously-correct PyTorch paged attention and KV-cache write: every backend's oracle.

Why a separate module: the fast backends batch, gather and pad in clever ways; this one does the
textbook thing one sequence at a time (materialise K/V from the block table, causal mask with the
context offset, GQA by ``repeat_interleave``, fp32 softmax) so that a test failure always points
at the fast code. Never call it on a hot path.
"""

from __future__ import annotations

import math

import torch


def reference_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t``'s K/V into slot ``slot_mapping[t]`` = block * block_size + offset.

    Slot -1 marks a padding token, which is skipped.
    """
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t]
        v_cache[block, offset] = value[t]


def reference_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    Query token ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and sees the
    keys at positions ``0 .. that position``. Computed in fp32, returned in ``query.dtype``.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(query)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[i], cu[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
