"""KV-cache write in plain PyTorch: scatter each new token's K/V into its paged slot."""

from __future__ import annotations

import torch


def torch_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``cache[slot // block_size, slot % block_size] = kv[token]`` for every slot >= 0.

    Padding tokens (slot -1) are dropped first, so they never touch the cache. Writes go through
    the caches' own strides (``kv[0]`` views of a joint tensor are updated in place).
    """
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    num_blocks, block_size, heads, dim = k_cache.shape
    for cache, new in ((k_cache, key), (v_cache, value)):
        try:
            cache.view(num_blocks * block_size, heads, dim)[slots] = new.to(cache.dtype)
        except RuntimeError:
            cache[slots // block_size, slots % block_size] = new.to(cache.dtype)
