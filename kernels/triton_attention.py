"""Paged attention as one Triton kernel per step, for any mix of prefill chunks and decodes.

Each program owns one sequence x one KV head x one block of ``BLOCK_Q`` query tokens, and all
``group = num_heads / num_kv_heads`` query heads sharing that KV head (GQA): its ``BLOCK_M``
rows are (token, head) pairs, so every K/V tile is loaded once for the whole group. It walks the
sequence's keys in tiles of ``BLOCK_N`` tokens through the block table (a tile may span several
cache blocks, so any block size works, also below tl.dot's minimum of 16), with an online
softmax in fp32 and a causal bound that skips tiles no query of the block can see.

Split-KV: with few sequences and long contexts a decode batch has too few programs to fill the
GPU, so the key range is cut into ``num_splits`` parts run in parallel; each writes a partial
output and its log-sum-exp, merged by a second small kernel.

Triton 3.9's CPU interpreter computes ``tl.dot`` on bf16 operands wrongly (numpy has no bf16),
so off CUDA bf16 tiles are upcast to fp32 before the dot (``DOT_IN_FP32``); on CUDA they are not.

Safety: every offset is int64 (caches of more than 2^31 elements); K/V lanes past ``seq_len``
are masked at load time (``other=0``), so uninitialised, even NaN, slots are never read; and a
row that sees no key in its split (causal mask, empty split) yields weight 0 and lse -inf
instead of 0/0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedq.kernels.plan import AttentionPlan

BLOCK_N = 32  # keys per tile
MAX_BLOCK_M = 64  # query rows (token x head) per program when there are prefill chunks
MIN_TILES_PER_SPLIT = 4  # below this, splitting costs more (merge) than it wins


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # [num_tokens, H, D], or the split partials [splits, num_tokens, H, D]
    lse_ptr,  # [splits, num_tokens, H] fp32 (unused without splits)
    block_table_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    qb_seq_ptr,  # per query block: its sequence
    qb_start_ptr,  # per query block: its first token within the sequence's new tokens
    scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_osplit,
    stride_bt,
    num_tokens,
    num_heads,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(qb_seq_ptr + qb)
    q_block_start = tl.load(qb_start_ptr + qb)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context + tok
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    token_idx = (q_start + tok).to(tl.int64)

    q_off = token_idx[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys this block's last query can see, and this split's share of their tiles.
    last_tok = tl.minimum(q_block_start + BLOCK_Q, q_len)
    kv_end = tl.minimum(seq_len, context + last_tok)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        page = tl.load(table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % block_size
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k_off = page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        if IEEE_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            v = v.to(tl.float32)
        if IEEE_FP32:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_off = token_idx[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    o_off += split.to(tl.int64) * stride_osplit
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        lse_off = (split * num_tokens + token_idx) * num_heads + head
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # fp32 [splits, num_tokens, H, D]
    lse_ptr,  # fp32 [splits, num_tokens, H]
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_tokens,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t, h] = sum_s exp(lse_s - lse) * partial_s, with lse the log-sum-exp over splits."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    row = token * num_heads + head
    lse_max = tl.full([1], float("-inf"), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(lse_ptr + s * num_tokens * num_heads + row))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        weight = tl.exp(tl.load(lse_ptr + s * num_tokens * num_heads + row) - lse_max)
        part_off = (s * num_tokens * num_heads + row) * head_dim + dims
        part = tl.load(partial_ptr + part_off, mask=dim_ok, other=0.0)
        acc += weight * part
        total += weight
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_off = token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass
class TritonPlan:
    """Grid layout of one step for one GQA group size."""

    qb_seq: torch.Tensor  # int32 [num_query_blocks]
    qb_start: torch.Tensor  # int32 [num_query_blocks]
    block_q: int
    block_m: int
    num_splits: int


def _tile_rows(group: int, max_q_len: int) -> tuple[int, int]:
    """(BLOCK_Q tokens, BLOCK_M rows) per program, BLOCK_Q * group <= BLOCK_M.

    Decode-only steps use the smallest tile tl.dot allows (16 rows): a decode program has just
    ``group`` useful rows. Steps with prefill chunks use up to 64 rows, so each K/V tile loaded
    from memory serves more query tokens.
    """
    block_m = max(16, triton.next_power_of_2(group))
    if max_q_len > 1:
        block_m = max(block_m, min(MAX_BLOCK_M, triton.next_power_of_2(max_q_len * group)))
    return block_m // group, block_m


def choose_num_splits(plan: AttentionPlan, num_kv_heads: int, device: torch.device) -> int:
    """Split the key range only when a decode batch leaves most SMs idle and contexts are long."""
    if plan.max_q_len != 1 or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = plan.num_seqs * num_kv_heads
    max_tiles = triton.cdiv(plan.max_seq_len, BLOCK_N)
    want = triton.cdiv(2 * sms, max(programs, 1))
    return int(max(1, min(want, max_tiles // MIN_TILES_PER_SPLIT, 32)))


def build_triton_plan(
    plan: AttentionPlan, group: int, num_kv_heads: int, num_splits: int | None
) -> TritonPlan:
    block_q, block_m = _tile_rows(group, plan.max_q_len)
    qb_seq, qb_start = [], []
    for seq, q_len in enumerate(plan.q_lens):
        for start in range(0, q_len, block_q):
            qb_seq.append(seq)
            qb_start.append(start)
    if num_splits is None:
        num_splits = choose_num_splits(plan, num_kv_heads, plan.device)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=plan.device)
    return TritonPlan(as_tensor(qb_seq), as_tensor(qb_start), block_q, block_m, num_splits)


def triton_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Run the step's attention as one kernel launch (two with split-KV)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    key = f"triton-{group}-{num_kv_heads}-{num_splits}"
    tplan = plan.derived(key, lambda p: build_triton_plan(p, group, num_kv_heads, num_splits))
    covered = sum(plan.q_lens)
    out = torch.zeros_like(query) if covered < num_tokens else torch.empty_like(query)
    num_qb = tplan.qb_seq.numel()
    if num_qb == 0:
        return out
    splits = tplan.num_splits
    if splits > 1:
        partial = torch.empty(splits, num_tokens, num_heads, head_dim, device=query.device)
        lse = torch.empty(splits, num_tokens, num_heads, device=query.device)
        target, split_stride = partial, partial.stride(0)
        target_strides = partial.stride()[1:]
    else:
        lse = out  # unused
        target, split_stride, target_strides = out, 0, out.stride()
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_attention_kernel[(num_qb, num_kv_heads, splits)](
        query,
        k_cache,
        v_cache,
        target,
        lse,
        plan.block_table,
        plan.seq_lens,
        plan.cu_seqlens_q,
        tplan.qb_seq,
        tplan.qb_start,
        scale,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *target_strides,
        split_stride,
        plan.block_table.stride(0),
        num_tokens,
        num_heads,
        head_dim,
        plan.block_size,
        GROUP=group,
        BLOCK_Q=tplan.block_q,
        BLOCK_M=tplan.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        IEEE_FP32=query.dtype == torch.float32,
        DOT_IN_FP32=query.dtype == torch.bfloat16 and not query.is_cuda,
    )
    if splits > 1:
        _merge_splits_kernel[(covered, num_heads)](
            partial,
            lse,
            out,
            *out.stride(),
            num_tokens,
            num_heads,
            head_dim,
            NUM_SPLITS=splits,
            BLOCK_D=block_d,
        )
    return out
