"""KV-cache write as one Triton kernel: one program per new token copies its K and V heads.

Why a kernel and not ``cache[slots] = key``: advanced-index assignment on CUDA launches several
kernels and syncs on the ``slot >= 0`` filter; this is one launch with no host sync, safe inside
CUDA graphs. Padding tokens (slot -1) are masked off in the store, so they write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # The slot is loaded broadcast over the head dims: Triton's interpreter rejects masks that
    # combine a scalar comparison with a tensor one.
    slot = tl.load(slot_ptr + token + dims * 0).to(tl.int64)
    mask = (heads < num_kv_heads) & (dims < head_dim) & (slot >= 0)
    block = slot // block_size
    offset = slot % block_size
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + heads * stride_ch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch
    tl.store(k_dst + dims * stride_cd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + dims * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` [num_tokens, num_kv_heads, head_dim] at their slots, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
